"""Thin API glue over the official `kubernetes` client: get, server-side apply (and its dry run), merge patches,
deletes, Events. No decisions here.

Children are written with server-side apply (one field manager, `force`), which makes create-or-patch one
idempotent call: applying the same object twice changes nothing (same resourceVersion), fields the operator stops
setting are removed, and a restarted operator never creates duplicates (names are fixed).

Every write first asks the `fence` (leader.Leadership.check): a replica that is no longer sure to hold the Lease
raises there, before the request leaves, so a paused and resumed leader writes nothing.
"""
from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from metronome.contract.rfc3339 import format_time
from metronome.operator import kinds

FIELD_MANAGER = "metronome-operator"
EVENT_COMPONENT = "metronome-operator"

log = logging.getLogger(__name__)


class LeadershipLost(RuntimeError):
    """This replica may not write any more: it could not renew the Lease in time, or another holds it."""


class KubeError(RuntimeError):
    """An API request that failed; carries the HTTP status and the API server's own message."""

    def __init__(self, status: int, reason: str, message: str, request: str,
                 details: Mapping[str, Any] | None = None):
        super().__init__(f"{request}: HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.details = dict(details or {})  # the Status' details: causes with the refused field paths


@dataclass(frozen=True)
class Applied:
    created: bool  # the API server answered 201: the object did not exist
    obj: dict[str, Any]  # the object as stored (or as it would be, for a dry run)


def load_config() -> None:
    """Configure the client in the cluster (service account) or from KUBECONFIG / ~/.kube/config."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def resource_path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    plural = kinds.by_kind(kind, api_version).plural
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    return f"{path}/{name}" if name else path


class Kube:
    """The handful of API calls the operator makes, on a `kubernetes.client.ApiClient`."""

    def __init__(self, api_client: Any = None, fence: Callable[[], None] | None = None, cache: Any = None):
        import kubernetes

        self.api = api_client or kubernetes.client.ApiClient()
        self.fence = fence  # raises when this replica may not write (leader.Leadership.check)
        self.cache = cache  # cache.ObjectCache: every write's answer goes in at once (the watch event follows)

    def _remember(self, obj: Mapping[str, Any]) -> None:
        if self.cache is not None and obj.get("kind") and obj.get("metadata"):
            self.cache.put(obj["kind"], obj, written=True)

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> tuple[int, dict[str, Any]]:
        dry_run = ("dryRun", "All") in (query or [])
        if method != "GET" and not dry_run and self.fence is not None:
            self.fence()
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
            details = payload.get("details") if isinstance(payload, dict) else None
            raise KubeError(response.status, str(reason), str(message), f"{method} {path}", details)
        return response.status, payload if isinstance(payload, dict) else {}

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", resource_path(api_version, kind, namespace, name))[1]
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str | None = None
             ) -> list[dict[str, Any]]:
        """The objects of `kind` in `namespace` (those `label_selector` selects, else all). The items of a list
        carry no apiVersion or kind of their own."""
        path = resource_path(api_version, kind, namespace)
        query = [("labelSelector", label_selector)] if label_selector else []
        return self._call("GET", path, query=query)[1].get("items") or []

    def apply(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> Applied:
        """Create or patch `obj` by server-side apply (`dry_run`: validated and admitted, not stored)."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")] + ([("dryRun", "All")] if dry_run else [])
        status, after = self._call("PATCH", path, query=query, body=dict(obj),
                                   content_type="application/apply-patch+yaml")
        if not dry_run:
            self._remember(after)
        return Applied(created=status == 201, obj=after)

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str, body: Mapping[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch (None deletes a key), of the object or of a subresource such as `status`."""
        path = resource_path(api_version, kind, namespace, name)
        if subresource:
            path += f"/{subresource}"
        after = self._call("PATCH", path, body=dict(body), content_type="application/merge-patch+json")[1]
        self._remember(after)
        return after

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete one object; False when it was not there (a child the spec no longer asks for)."""
        try:
            self._call("DELETE", resource_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        finally:
            if self.cache is not None:
                self.cache.forget(kind, namespace or "", name)
        return True

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
        except LeadershipLost:
            raise
        except KubeError as exc:
            level = logging.DEBUG if namespace_terminating(exc) else logging.WARNING
            log.log(level, "could not post Event %s for %s: %s", reason, meta.get("name"), exc)
        except Exception as exc:  # noqa: BLE001 - reporting must never break acting
            log.warning("could not post Event %s for %s: %s", reason, meta.get("name"), exc)


def namespace_terminating(exc: KubeError) -> bool:
    """The API server refuses anything new in a namespace being deleted: nothing to act on or report there."""
    return exc.status == 403 and "because it is being terminated" in exc.message


def _json_or_text(text: str) -> Any:
    if not text:
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
