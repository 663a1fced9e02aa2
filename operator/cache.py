"""The objects the operator's watches deliver, as they last arrived (an informer's store): the InferenceServices,
every kind of child, the server pods, the other autoscalers (HPAs, ScaledObjects) and the CRDs of the optional
kinds. The reconcile reads from here and
the API only for writes, so an idle operator sends the API server nothing, however many services it serves.

The operator's own writes are put in as the API server answered them (the watch event follows): the next
reconcile sees what it wrote, never the version before, so it neither writes the same twice nor announces the same
change twice. Of two versions of one object the later resourceVersion wins (etcd's revisions only grow), and a
deletion removes only the object it names (its uid), not one created since under the same name.

A written object stays unconfirmed until a watch delivers it (or a later version). One that stays unconfirmed was
written while no watch of its kind ran yet — right after its CRD appeared, before kopf's watch of the new kind
listed — and a deletion in that window is never reported: the reconcile then looks it up once (`unconfirmed`).
What a new operator reads from the API before its watches have listed (startup_reads.py) is put in the same way.

The uid of an object a watch reported deleted is remembered for a while (`DELETED_UIDS_KEPT_S`, longer than any
request may take): the answer to a write sent before the deletion can arrive after the watch reported it, and
putting it in would bring the object back into the cache for good. An InferenceService brought back so would have
its children recreated, owned by a uid that no longer exists, garbage-collected and recreated again, without end.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

LABEL_SERVICE = "metronome.dev/inferenceservice"  # builders.LABEL_SERVICE: the owner of a child or a pod
DELETED_UIDS_KEPT_S = 300.0  # k8s.Kube's requests time out after 30 s

Key = tuple[str, str, str]  # (kind, namespace, name); namespace "" for cluster-scoped objects


def _revision(obj: Mapping[str, Any]) -> int | None:
    text = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    return int(text) if text.isdigit() else None


def _newer(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    new_rev, old_rev = _revision(new), _revision(old)
    if new_rev is None or old_rev is None:
        return True
    return new_rev >= old_rev


class ObjectCache:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._objects: dict[Key, dict[str, Any]] = {}
        self._owned: dict[tuple[str, str, str], set[str]] = {}  # (kind, namespace, service) -> names
        self._by_namespace: dict[tuple[str, str], set[str]] = {}  # (kind, namespace) -> names
        self._unconfirmed: dict[Key, float] = {}  # written by the operator, not delivered by a watch since: when
        self._deleted_uids: dict[str, float] = {}  # uid -> when its deletion was learnt, oldest first

    @staticmethod
    def _key(kind: str, obj: Mapping[str, Any]) -> Key:
        meta = obj.get("metadata") or {}
        return kind, meta.get("namespace") or "", meta.get("name") or ""

    def put(self, kind: str, obj: Mapping[str, Any], *, written: bool = False) -> bool:
        """Keep `obj` unless a later version is already here; True when kept. `written`: the answer to the
        operator's own write (else a watch delivered it)."""
        with self._lock:
            return self._keep(self._key(kind, obj), obj, written)

    def put_read(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """Keep `obj`, read from the API in place of a watch's listing, as unconfirmed (as `put(written=True)`),
        unless it is the very version a watch already delivered: no later event would confirm that one, and none
        needs to."""
        key = self._key(kind, obj)
        with self._lock:
            if self._delivered(key, obj):
                return False
            return self._keep(key, obj, written=True)

    def _delivered(self, key: Key, obj: Mapping[str, Any]) -> bool:
        old = self._objects.get(key)
        revision = _revision(obj)
        return (old is not None and key not in self._unconfirmed and revision is not None
                and revision == _revision(old))

    def _keep(self, key: Key, obj: Mapping[str, Any], written: bool) -> bool:
        old = self._objects.get(key)
        if old is not None and not _newer(obj, old):
            return False
        if (obj.get("metadata") or {}).get("uid") in self._deleted_uids:
            return False  # a version from before its deletion, arriving after it
        if written:
            self._unconfirmed[key] = self._clock()
        else:
            self._unconfirmed.pop(key, None)
        self._unindex(key, old)
        self._objects[key] = dict(obj)
        self._index(key, obj)
        return True

    def unconfirmed(self, kind: str, namespace: str | None, name: str, for_s: float) -> bool:
        """The operator wrote (or read) it at least `for_s` ago and no watch has delivered it since."""
        with self._lock:
            since = self._unconfirmed.get((kind, namespace or "", name))
        return since is not None and self._clock() - since >= for_s

    def confirm(self, kind: str, namespace: str | None, name: str) -> None:
        """Looked up and found as cached: no need to look again."""
        with self._lock:
            self._unconfirmed.pop((kind, namespace or "", name), None)

    def delete(self, kind: str, obj: Mapping[str, Any]) -> None:
        """A deletion the watch reported: forget the object, unless the name now belongs to a newer one."""
        key = self._key(kind, obj)
        uid = (obj.get("metadata") or {}).get("uid")
        with self._lock:
            self._remember_deleted(uid)
            old = self._objects.get(key)
            if old is None or (uid and (old.get("metadata") or {}).get("uid") not in (None, uid)):
                return
            self._unindex(key, old)
            del self._objects[key]
            self._unconfirmed.pop(key, None)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """The API answered 404 for it: it is gone, whatever the last event said."""
        key = (kind, namespace, name)
        with self._lock:
            self._unindex(key, self._objects.pop(key, None))
            self._unconfirmed.pop(key, None)

    def _remember_deleted(self, uid: str | None) -> None:
        now = self._clock()
        while self._deleted_uids:
            oldest, when = next(iter(self._deleted_uids.items()))
            if now - when < DELETED_UIDS_KEPT_S:
                break
            del self._deleted_uids[oldest]
        if uid:
            self._deleted_uids.pop(uid, None)
            self._deleted_uids[uid] = now

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get((kind, namespace or "", name))

    def owned(self, kind: str, namespace: str, service: str) -> list[dict[str, Any]]:
        """Objects of `kind` labelled as `service`'s (its pods, its children)."""
        with self._lock:
            names = sorted(self._owned.get((kind, namespace, service), ()))
            return [self._objects[(kind, namespace, name)] for name in names]

    def in_namespace(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        """Every object of `kind` held in `namespace` (another autoscaler's, which carries no owner label)."""
        with self._lock:
            names = sorted(self._by_namespace.get((kind, namespace), ()))
            return [self._objects[(kind, namespace, name)] for name in names]

    def names(self, kind: str) -> list[tuple[str, str]]:
        """(namespace, name) of every object of `kind` held."""
        with self._lock:
            return [(ns, name) for k, ns, name in self._objects if k == kind]

    def _index(self, key: Key, obj: Mapping[str, Any] | None) -> None:
        self._by_namespace.setdefault(key[:2], set()).add(key[2])
        service = self._service(obj)
        if service:
            self._owned.setdefault((key[0], key[1], service), set()).add(key[2])

    def _unindex(self, key: Key, obj: Mapping[str, Any] | None) -> None:
        if obj is not None:
            in_namespace = self._by_namespace.get(key[:2])
            if in_namespace is not None:
                in_namespace.discard(key[2])
                if not in_namespace:
                    del self._by_namespace[key[:2]]
        service = self._service(obj)
        if service:
            names = self._owned.get((key[0], key[1], service))
            if names is not None:
                names.discard(key[2])
                if not names:
                    del self._owned[(key[0], key[1], service)]

    @staticmethod
    def _service(obj: Mapping[str, Any] | None) -> str | None:
        if not obj:
            return None
        return ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_SERVICE)
