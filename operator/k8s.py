"""Thin API glue over the official `kubernetes` client: get, server-side apply, list, Events. No decisions here.

Children are written with server-side apply (one field manager, `force`), which makes create-or-patch one
idempotent call: applying the same object twice changes nothing (same resourceVersion), fields the operator stops
setting are removed, and a restarted operator never creates duplicates (names are fixed).
"""
from __future__ import annotations

import enum
import json
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metronome.contract.rfc3339 import format_time

FIELD_MANAGER = "metronome-operator"
EVENT_COMPONENT = "metronome-operator"

_PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): "customresourcedefinitions",
    ("metronome.dev/v1alpha1", "InferenceService"): "inferenceservices",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
}

log = logging.getLogger(__name__)


class KubeError(RuntimeError):
    """An API request that failed; carries the HTTP status and the API server's own message."""

    def __init__(self, status: int, reason: str, message: str, request: str):
        super().__init__(f"{request}: HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class Action(str, enum.Enum):
    CREATED = "Created"
    UPDATED = "Updated"
    UNCHANGED = "Unchanged"


@dataclass(frozen=True)
class Applied:
    action: Action
    before: dict[str, Any] | None
    after: dict[str, Any]


def load_config() -> None:
    """Configure the client in the cluster (service account) or from KUBECONFIG / ~/.kube/config."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def resource_path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    plural = _PLURALS.get((api_version, kind))
    if plural is None:
        raise ValueError(f"no REST path known for {kind} {api_version}")
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    return f"{path}/{name}" if name else path


class Kube:
    """The handful of API calls the operator makes, on a `kubernetes.client.ApiClient`."""

    def __init__(self, api_client: Any = None):
        import kubernetes

        self.api = api_client or kubernetes.client.ApiClient()

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.api.call_api(*request, _request_timeout=30)
        data = response.read()
        text = data.decode("utf-8") if data else ""
        payload = _json_or_text(text)
        if not 200 <= response.status <= 299:
            message = payload.get("message", text) if isinstance(payload, dict) else text
            reason = payload.get("reason", response.reason) if isinstance(payload, dict) else response.reason
            raise KubeError(response.status, str(reason), str(message), f"{method} {path}")
        return payload if isinstance(payload, dict) else {}

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", resource_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        path = resource_path(api_version, kind, namespace)
        return self._call("GET", path, query=[("labelSelector", label_selector)]).get("items") or []

    def apply(self, obj: Mapping[str, Any]) -> Applied:
        """Create or patch `obj` by server-side apply; say whether anything changed."""
        meta = obj["metadata"]
        before = self.get(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        after = self._call(
            "PATCH",
            path,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=dict(obj),
            content_type="application/apply-patch+yaml",
        )
        if before is None:
            action = Action.CREATED
        elif before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
            action = Action.UPDATED
        else:
            action = Action.UNCHANGED
        return Applied(action, before, after)

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str, body: Mapping[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch (None deletes a key), of the object or of a subresource such as `status`."""
        path = resource_path(api_version, kind, namespace, name)
        if subresource:
            path += f"/{subresource}"
        return self._call("PATCH", path, body=dict(body), content_type="application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete one object; False when it was not there (a child the spec no longer asks for)."""
        try:
            self._call("DELETE", resource_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def crd_exists(self, name: str) -> bool:
        return self.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, name) is not None

    def emit_event(self, owner: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """Post a core/v1 Event about `owner` (a CR body). Best effort: an Event that cannot be posted is logged,
        never raised, so it cannot fail the change it reports."""
        meta = owner.get("metadata") or {}
        now = format_time()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'inferenceservice')}.",
                         "namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": owner.get("apiVersion"),
                "kind": owner.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": EVENT_COMPONENT},
            "reportingComponent": EVENT_COMPONENT,
            "reportingInstance": socket.gethostname()[:128],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._call("POST", resource_path("v1", "Event", meta.get("namespace")), body=event)
        except Exception as exc:  # noqa: BLE001 - reporting must never break acting
            log.warning("could not post Event %s for %s: %s", reason, meta.get("name"), exc)


def _json_or_text(text: str) -> Any:
    if not text:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
