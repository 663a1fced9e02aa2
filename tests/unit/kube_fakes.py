"""An in-memory API for the operator's unit tests, with k8s.Kube's interface: server-side apply that stores the
object as given (201 when new; the same object twice keeps its resourceVersion), merge patches, lists, deletes, Events,
and refusals on demand (`refuse[kind] = (status, message, causes)`, dry runs included). Every write's answer goes
into `cache`, as k8s.Kube does; `requests` counts what would have reached the API server. The real API server is
exercised by tests/integration."""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from metronome.operator import kinds, reconcile
from metronome.operator.cache import ObjectCache
from metronome.operator.k8s import Applied, KubeError


def _merge(target: dict, patch: Mapping[str, Any]) -> dict:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


class MemoryKube:
    def __init__(self, crds: tuple[str, ...] = ()):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.cache = ObjectCache()
        self.events: list[tuple[str, str, str]] = []
        self.requests: list[tuple[str, str]] = []  # (verb, kind)
        self.refuse: dict[str, tuple[int, str, list[dict]]] = {}
        self.version = 0
        for name in crds:
            self.cache.put(kinds.CRD.kind, {"metadata": {"name": name, "resourceVersion": "1"},
                                            "status": {"conditions": [{"type": "Established", "status": "True"}]}})

    def crd_served(self, name: str) -> bool:
        return self.cache.get(kinds.CRD.kind, None, name) is not None

    def children(self, **settings: Any) -> reconcile.Children:
        return reconcile.Children(kube=self, cache=self.cache, crd_served=self.crd_served, **settings)

    def _bump(self, obj: dict) -> None:
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)

    def apply(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> Applied:
        self.requests.append(("dry-run" if dry_run else "apply", obj["kind"]))
        if obj["kind"] in self.refuse:
            status, message, causes = self.refuse[obj["kind"]]
            raise KubeError(status, "Invalid", message, f"PATCH {obj['kind']}", {"causes": causes})
        key = (obj["kind"], obj["metadata"].get("namespace") or "", obj["metadata"]["name"])
        before = self.objects.get(key)
        desired = copy.deepcopy(dict(obj))
        if before is not None:
            desired.setdefault("status", before.get("status"))
            desired["metadata"]["resourceVersion"] = before["metadata"]["resourceVersion"]
        if dry_run:
            return Applied(created=before is None, obj=desired)
        if before != desired:
            self._bump(desired)
            self.objects[key] = desired
        self.cache.put(obj["kind"], copy.deepcopy(self.objects[key]))
        return Applied(created=before is None, obj=copy.deepcopy(self.objects[key]))

    def put(self, obj: Mapping[str, Any], watched: bool = True) -> dict:
        """An object someone else wrote; `watched`: the operator's watches deliver it (it carries their label)."""
        key = (obj["kind"], obj["metadata"].get("namespace") or "", obj["metadata"]["name"])
        stored = copy.deepcopy(dict(obj))
        self._bump(stored)
        self.objects[key] = stored
        if watched:
            self.cache.put(obj["kind"], copy.deepcopy(stored))
        return stored

    def get(self, api_version, kind, namespace, name):
        self.requests.append(("get", kind))
        obj = self.objects.get((kind, namespace or "", name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, api_version, kind, namespace, label_selector=None):
        """As the API server lists: the items carry no apiVersion or kind."""
        self.requests.append(("list", kind))
        wanted = dict(term.split("=", 1) for term in label_selector.split(",")) if label_selector else {}
        items = []
        for (k, ns, _), obj in sorted(self.objects.items()):
            labels = (obj.get("metadata") or {}).get("labels") or {}
            if k == kind and ns == (namespace or "") and all(labels.get(key) == v for key, v in wanted.items()):
                items.append({key: copy.deepcopy(v) for key, v in obj.items() if key not in ("apiVersion", "kind")})
        return items

    def patch(self, api_version, kind, namespace, name, body, subresource=None):
        self.requests.append(("patch", kind))
        key = (kind, namespace or "", name)
        if key not in self.objects:
            raise KubeError(404, "NotFound", f"{kind} {name} not found", f"PATCH {kind}")
        obj = self.objects[key]
        _merge(obj, body)
        self._bump(obj)
        self.cache.put(kind, copy.deepcopy(obj))
        return copy.deepcopy(obj)

    def delete(self, api_version, kind, namespace, name):
        self.requests.append(("delete", kind))
        self.cache.forget(kind, namespace or "", name)
        return self.objects.pop((kind, namespace or "", name), None) is not None

    def emit_event(self, owner, type_, reason, message):
        self.events.append((type_, reason, message))
