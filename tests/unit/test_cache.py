"""The operator's object cache (operator/cache.py): the later resourceVersion wins, a deletion removes only the
object it names, and a service's children and pods are found by its label."""
from __future__ import annotations

from metronome.operator.cache import LABEL_SERVICE, ObjectCache


def obj(name: str, rv: str, uid: str = "u1", service: str | None = "chat") -> dict:
    labels = {LABEL_SERVICE: service} if service else {}
    return {"metadata": {"name": name, "namespace": "ml", "resourceVersion": rv, "uid": uid, "labels": labels}}


def test_an_older_version_never_replaces_a_newer_one():
    cache = ObjectCache()
    assert cache.put("Pod", obj("a", "12"))
    assert not cache.put("Pod", obj("a", "11"))  # a watch event that arrives after the write's answer
    assert cache.get("Pod", "ml", "a")["metadata"]["resourceVersion"] == "12"
    assert cache.put("Pod", obj("a", "13"))


def test_a_deletion_removes_only_the_object_it_names():
    cache = ObjectCache()
    cache.put("Pod", obj("a", "20", uid="new"))
    cache.delete("Pod", obj("a", "15", uid="old"))  # the old object's deletion, reported late
    assert cache.get("Pod", "ml", "a") is not None
    cache.delete("Pod", obj("a", "21", uid="new"))
    assert cache.get("Pod", "ml", "a") is None


def test_owned_objects_follow_their_label():
    cache = ObjectCache()
    cache.put("Pod", obj("a", "1"))
    cache.put("Pod", obj("b", "1", service="other"))
    assert [p["metadata"]["name"] for p in cache.owned("Pod", "ml", "chat")] == ["a"]
    cache.put("Pod", obj("a", "2", service="other"))  # relabelled
    assert cache.owned("Pod", "ml", "chat") == []
    assert sorted(p["metadata"]["name"] for p in cache.owned("Pod", "ml", "other")) == ["a", "b"]
    cache.forget("Pod", "ml", "a")
    assert [p["metadata"]["name"] for p in cache.owned("Pod", "ml", "other")] == ["b"]


def test_a_write_is_unconfirmed_until_a_watch_delivers_it():
    now = [0.0]
    cache = ObjectCache(clock=lambda: now[0])
    cache.put("PodMonitor", obj("a", "5"), written=True)
    now[0] = 10.0
    assert cache.unconfirmed("PodMonitor", "ml", "a", for_s=5.0)
    assert not cache.unconfirmed("PodMonitor", "ml", "a", for_s=20.0)
    cache.put("PodMonitor", obj("a", "5"))  # the watch's event for the same version
    assert not cache.unconfirmed("PodMonitor", "ml", "a", for_s=5.0)
    cache.put("PodMonitor", obj("a", "6"), written=True)
    cache.confirm("PodMonitor", "ml", "a")
    assert not cache.unconfirmed("PodMonitor", "ml", "a", for_s=0.0)
