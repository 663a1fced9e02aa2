"""The operator's object cache (operator/cache.py): the later resourceVersion wins, a deletion removes only the
object it names and keeps a write answered before it from bringing the object back, a service's children and pods
are found by its label, and another autoscaler's objects (no label) by their namespace."""
from __future__ import annotations

from metronome.operator.cache import DELETED_UIDS_KEPT_S, LABEL_SERVICE, ObjectCache


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


def test_a_write_answered_before_a_deletion_does_not_bring_the_object_back():
    now = [0.0]
    cache = ObjectCache(clock=lambda: now[0])
    cache.put("InferenceService", obj("chat", "30", uid="svc"))
    cache.delete("InferenceService", obj("chat", "31", uid="svc"))  # the watch reports the deletion
    # then the answer to a status patch the API server applied just before it
    assert not cache.put("InferenceService", obj("chat", "29", uid="svc"), written=True)
    assert not cache.put("InferenceService", obj("chat", "30", uid="svc"))  # nor a listing taken before it
    assert cache.get("InferenceService", "ml", "chat") is None
    assert cache.put("InferenceService", obj("chat", "40", uid="again"))  # created anew under the same name
    now[0] = DELETED_UIDS_KEPT_S + 1.0
    cache.delete("Pod", obj("p", "50", uid="pod"))  # the old uids are let go as new deletions come
    assert cache.put("InferenceService", obj("chat", "42", uid="svc"))


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


def test_objects_without_an_owner_label_are_found_by_namespace():
    cache = ObjectCache()
    cache.put("HorizontalPodAutoscaler", obj("a", "1", service=None))
    cache.put("HorizontalPodAutoscaler", obj("b", "1", service=None))
    other = obj("c", "1", service=None)
    other["metadata"]["namespace"] = "web"
    cache.put("HorizontalPodAutoscaler", other)
    assert [h["metadata"]["name"] for h in cache.in_namespace("HorizontalPodAutoscaler", "ml")] == ["a", "b"]
    cache.put("HorizontalPodAutoscaler", obj("a", "2", service=None))  # a new version: still one of it
    cache.delete("HorizontalPodAutoscaler", obj("b", "3", service=None))
    assert [h["metadata"]["resourceVersion"] for h in cache.in_namespace("HorizontalPodAutoscaler", "ml")] == ["2"]
    cache.forget("HorizontalPodAutoscaler", "ml", "a")
    assert cache.in_namespace("HorizontalPodAutoscaler", "ml") == []
    assert cache.in_namespace("Pod", "ml") == [] and len(cache.in_namespace("HorizontalPodAutoscaler", "web")) == 1
