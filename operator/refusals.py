"""Pure: the API server refused a child (422 Invalid, an admission webhook's or a quota's 400/403) → a message
that names the InferenceService's own field, so the user knows what to change in the resource, not in a
Deployment they never wrote.

A field path of the child (`spec.template.spec.containers[1].ports[0].name`) is mapped onto the spec field it
comes from (`spec.podTemplate.spec.containers[exporter].ports[0].name`); list items with a name are named, since
the child's indexes are not the resource's. A path with no known source is quoted as the child's.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Statuses that refuse this object for what it is (retrying the same object cannot help).
REFUSAL_STATUSES = frozenset({400, 403, 409, 422})

_SEGMENT = re.compile(r"^([^\[\]]+)((?:\[[^\]]*\])*)$")
_INDEX = re.compile(r"\[([^\]]*)\]")

# Pod fields spec.podTemplate.spec sets as they are.
_OVERLAY_POD_FIELDS = ("affinity", "topologySpreadConstraints", "priorityClassName", "runtimeClassName",
                       "serviceAccountName", "imagePullSecrets", "automountServiceAccountToken")
# The server container's fields that come from a spec field of their own, and those an overlay adds to.
_SERVER_FIELDS = {"image": "spec.image", "imagePullPolicy": "spec.imagePullPolicy", "resources": "spec.resources",
                  "args": "spec.engine.extraArgs"}
_SERVER_OVERLAY_FIELDS = ("env", "envFrom", "volumeMounts")
_VOLUMES = {"dshm": "spec.resources.shmSize", "model": "spec.model"}


@dataclass(frozen=True)
class Cause:
    field: str | None
    message: str


@dataclass(frozen=True)
class Refusal:
    """A child the API server refused: what to tell the user."""

    kind: str
    name: str
    status: int
    message: str  # names the resource's field where it can

    @property
    def reason(self) -> str:
        return "SpecRejected"


def _segments(path: str) -> list[tuple[str, list[str]]]:
    out = []
    for part in path.split("."):
        match = _SEGMENT.match(part)
        if not match:
            return []
        out.append((match.group(1), _INDEX.findall(match.group(2))))
    return out


def _render(segments: Sequence[tuple[str, list[str]]], child: Any) -> tuple[list[str], Any]:
    """Path text with named list items, walking `child` alongside; also the node reached."""
    parts, node = [], child
    for name, indexes in segments:
        node = node.get(name) if isinstance(node, Mapping) else None
        text = name
        for index in indexes:
            item = node[int(index)] if isinstance(node, list) and index.isdigit() and int(index) < len(node) else None
            label = item.get("name") if isinstance(item, Mapping) and isinstance(item.get("name"), str) else index
            text += f"[{label}]"
            node = item
        parts.append(text)
    return parts, node


def spec_field(kind: str, path: str, child: Mapping[str, Any]) -> str | None:
    """The InferenceService field a child's field path comes from, or None when it is the operator's own."""
    segments = _segments(path)
    if not segments:
        return None
    parts, _ = _render(segments, child)
    names = [name for name, _ in segments]
    if kind == "PodDisruptionBudget" and names[:1] == ["spec"] and len(names) > 1 and names[1] in (
            "maxUnavailable", "minAvailable"):
        return "spec.disruption." + ".".join(parts[1:])
    if kind != "Deployment" or names[:1] != ["spec"]:
        return None
    if names[1:2] in (["replicas"], ["strategy"]):
        return "spec." + ".".join(parts[1:])
    if names[1:3] == ["template", "metadata"]:
        return "spec.podTemplate.metadata." + ".".join(parts[3:]) if len(parts) > 3 else "spec.podTemplate.metadata"
    if names[1:3] != ["template", "spec"] or len(names) < 4:
        return None
    field, rest = names[3], parts[4:]
    tail = ("." + ".".join(rest)) if rest else ""
    if field in ("tolerations", "nodeSelector"):
        return f"spec.resources.{parts[3]}{tail}"
    if field in _OVERLAY_POD_FIELDS:
        return f"spec.podTemplate.spec.{parts[3]}{tail}"
    if field == "terminationGracePeriodSeconds":
        return "spec.shutdown"
    if field == "initContainers":
        return "spec.model (its download container: " + ".".join(parts[3:]) + ")"
    if field == "volumes":
        volume = parts[3][len("volumes["):-1]
        return _VOLUMES.get(volume, f"spec.podTemplate.spec.{parts[3]}{tail}")
    if field == "containers":
        container = parts[3][len("containers["):-1]
        if container != "server":
            return f"spec.podTemplate.spec.{parts[3]}{tail}"
        if rest and names[4] in _SERVER_OVERLAY_FIELDS:
            return "spec.podTemplate.spec.containers[server]." + ".".join(rest)
        if rest and names[4] in _SERVER_FIELDS:
            return _SERVER_FIELDS[names[4]]
    return None


def _causes(details: Mapping[str, Any] | None) -> list[Cause]:
    return [Cause(c.get("field") or None, str(c.get("message") or "").strip())
            for c in (details or {}).get("causes") or [] if c.get("message")]


def explain(kind: str, name: str, status: int, message: str, details: Mapping[str, Any] | None,
            child: Mapping[str, Any]) -> Refusal:
    """The refusal of `child` (a `kind` named `name`) in the resource's terms."""
    lines = []
    for cause in _causes(details):
        source = spec_field(kind, cause.field, child) if cause.field else None
        if source is not None:
            lines.append(f"{source}: {cause.message} ({kind} field {cause.field})")
        elif cause.field:
            lines.append(f"{kind} {name} field {cause.field}: {cause.message}")
        else:
            lines.append(f"{kind} {name}: {cause.message}")
    text = "; ".join(lines) if lines else f"{kind} {name}: {message}"
    return Refusal(kind=kind, name=name, status=status, message=f"the API server refused it: {text}")
