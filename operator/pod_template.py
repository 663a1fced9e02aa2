"""spec.podTemplate: a partial pod template merged onto the pod the operator builds. Pure.

The overlay is Kubernetes-shaped (`metadata.labels/annotations`, `spec.<field>`) but only the fields in
POD_FIELDS and the container fields below are accepted; anything else is rejected with its path, so a typo never
silently does nothing. The CRD's schema and CEL rules (crds/inferenceservice.yaml) check the same and more
deeply; this module is the operator's own check (bodies that bypassed the schema, names the CEL cannot see) and
the merge itself. Merge semantics, as a strategic merge patch would do them:

- labels and annotations are added; keys the operator sets itself (RESERVED_LABELS, the `metronome.dev/`
  prefix) are refused, since the selector, the metrics and the stand-in rely on them;
- pod-level fields are set (the built pod sets none of them except automountServiceAccountToken: False);
- `volumes` are added by name and may not reuse BUILT_VOLUMES;
- `containers` merge by name: `server` (the built server container) takes extra env (by name: the overlay
  wins), envFrom and volumeMounts (by mountPath; BUILT_MOUNT_PATHS are refused); any other name is a sidecar
  and is added as given;
- a topology spread constraint without a labelSelector counts this service's pods.
"""
from __future__ import annotations

import copy
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metronome.contract.errors import MetronomeError

WHERE = "spec.podTemplate"
SERVER_CONTAINER = "server"

# What the built pod owns (builders.py builds exactly these; tests/unit/test_pod_template.py holds it to that,
# and the CRD's CEL rules list the same names).
BUILT_VOLUMES = ("config", "model", "tmp", "dshm")
BUILT_MOUNT_PATHS = ("/etc/metronome", "/models", "/tmp", "/dev/shm")
RESERVED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
)
RESERVED_PREFIX = "metronome.dev/"

# spec.podTemplate.spec fields → the type each must have (the CRD describes their insides).
POD_FIELDS: dict[str, type] = {
    "serviceAccountName": str,
    "automountServiceAccountToken": bool,
    "imagePullSecrets": list,
    "affinity": Mapping,
    "topologySpreadConstraints": list,
    "priorityClassName": str,
    "runtimeClassName": str,
    "volumes": list,
    "containers": list,
}
# What an overlay may add to the server container; image, args and resources have their own spec fields.
SERVER_FIELDS: dict[str, type] = {"name": str, "env": list, "envFrom": list, "volumeMounts": list}
SIDECAR_FIELDS: dict[str, type] = {
    **SERVER_FIELDS,
    "image": str,
    "imagePullPolicy": str,
    "command": list,
    "args": list,
    "ports": list,
    "resources": Mapping,
}
POD_INSTEAD = {"nodeSelector": "spec.resources.nodeSelector", "tolerations": "spec.resources.tolerations",
               "terminationGracePeriodSeconds": "spec.shutdown"}
SERVER_INSTEAD = {"image": "spec.image", "imagePullPolicy": "spec.imagePullPolicy", "args": "spec.engine.extraArgs",
                  "command": "spec.engine.extraArgs", "resources": "spec.resources", "ports": "nothing (port 8000)"}
VOLUME_SOURCES = ("configMap", "secret", "emptyDir", "persistentVolumeClaim", "csi", "nfs")
ENV_FIELDS: dict[str, type] = {"name": str, "value": str, "valueFrom": Mapping}
ENV_FROM_FIELDS: dict[str, type] = {"configMapRef": Mapping, "secretRef": Mapping, "prefix": str}
MOUNT_FIELDS: dict[str, type] = {"name": str, "mountPath": str, "readOnly": bool, "subPath": str,
                                 "subPathExpr": str}

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


class PodTemplateError(MetronomeError, ValueError):
    """An overlay the operator will not merge; the message starts with the field's path."""


@dataclass(frozen=True)
class PodOverlay:
    """A checked spec.podTemplate: plain Kubernetes fragments (deep copies of the CR's)."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    pod: Mapping[str, Any] = field(default_factory=dict)  # the POD_FIELDS except volumes and containers
    volumes: tuple[Mapping[str, Any], ...] = ()
    containers: tuple[Mapping[str, Any], ...] = ()

    @property
    def empty(self) -> bool:
        return self == PodOverlay()


# --- checking ------------------------------------------------------------------------------------------------


def _kind_name(kind: type) -> str:
    return {Mapping: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(kind, kind.__name__)


def _typed(value: Any, kind: type, where: str) -> Any:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise PodTemplateError(f"{where}: expected {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _only(data: Mapping[str, Any], allowed: Mapping[str, type], where: str) -> None:
    """Every key of `data` is allowed and of its type."""
    for key, value in data.items():
        if key not in allowed:
            names = ", ".join(allowed)
            raise PodTemplateError(f"{where}.{key}: not a field the overlay may set (allowed: {names})")
        if value is not None:
            _typed(value, allowed[key], f"{where}.{key}")


def _items(data: Mapping[str, Any], key: str, where: str) -> list[Mapping[str, Any]]:
    items = data.get(key) or []
    for index, item in enumerate(items):
        _typed(item, Mapping, f"{where}.{key}[{index}]")
    return items


def _named(item: Mapping[str, Any], where: str, pattern: re.Pattern = _DNS_LABEL) -> str:
    name = item.get("name")
    if not isinstance(name, str) or not pattern.match(name):
        raise PodTemplateError(f"{where}.name: {name!r} is not a valid name (lower case letters, digits, '-')")
    return name


def _unique(names: list[str], where: str) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise PodTemplateError(f"{where}: {name!r} appears twice")
        seen.add(name)


def _check_metadata_map(data: Mapping[str, Any], where: str, values: re.Pattern | None) -> dict[str, str]:
    out = {}
    for key, value in data.items():
        prefix, _, name = str(key).rpartition("/")
        if not _LABEL_NAME.match(name) or len(name) > 63 or (prefix and not _DNS_SUBDOMAIN.match(prefix)):
            raise PodTemplateError(f"{where}: {key!r} is not a valid key ([prefix/]name)")
        if key in RESERVED_LABELS or key.startswith(RESERVED_PREFIX):
            raise PodTemplateError(f"{where}.{key}: set by the operator (its selector and metrics rely on it)")
        _typed(value, str, f"{where}.{key}")
        if values is not None and (len(value) > 63 or not values.match(value)):
            raise PodTemplateError(f"{where}.{key}: {value!r} is not a valid label value")
        out[key] = value
    return out


def _check_env(container: Mapping[str, Any], where: str) -> None:
    env = _items(container, "env", where)
    for index, var in enumerate(env):
        var_where = f"{where}.env[{index}]"
        _only(var, ENV_FIELDS, var_where)
        if not var.get("name"):
            raise PodTemplateError(f"{var_where}.name: required")
        if "value" in var and "valueFrom" in var:
            raise PodTemplateError(f"{var_where}: set value or valueFrom, not both")
    _unique([var["name"] for var in env], f"{where}.env")
    for index, source in enumerate(_items(container, "envFrom", where)):
        source_where = f"{where}.envFrom[{index}]"
        _only(source, ENV_FROM_FIELDS, source_where)
        if ("configMapRef" in source) == ("secretRef" in source):
            raise PodTemplateError(f"{source_where}: set exactly one of configMapRef, secretRef")


def _check_mounts(container: Mapping[str, Any], where: str, volumes: set[str]) -> None:
    for index, mount in enumerate(_items(container, "volumeMounts", where)):
        mount_where = f"{where}.volumeMounts[{index}]"
        _only(mount, MOUNT_FIELDS, mount_where)
        if mount.get("name") not in volumes:
            known = ", ".join(sorted(volumes))
            raise PodTemplateError(f"{mount_where}.name: {mount.get('name')!r} is not a volume (known: {known})")
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/"):
            raise PodTemplateError(f"{mount_where}.mountPath: an absolute path is required, got {path!r}")


def _check_container(container: Mapping[str, Any], where: str, volumes: set[str]) -> None:
    name = _named(container, where)
    if name == SERVER_CONTAINER:
        for key in container:
            if key not in SERVER_FIELDS and key in SERVER_INSTEAD:
                raise PodTemplateError(f"{where}.{key}: the server container's {key} comes from "
                                       f"{SERVER_INSTEAD[key]}")
        _only(container, SERVER_FIELDS, where)
    else:
        _only(container, SIDECAR_FIELDS, where)
        if not container.get("image"):
            raise PodTemplateError(f"{where}.image: required for a sidecar container ({name!r})")
    _check_env(container, where)
    _check_mounts(container, where, volumes)
    if name == SERVER_CONTAINER:
        for index, mount in enumerate(container.get("volumeMounts") or []):
            if posixpath.normpath(mount["mountPath"]) in BUILT_MOUNT_PATHS:
                raise PodTemplateError(f"{where}.volumeMounts[{index}].mountPath: {mount['mountPath']} is the "
                                       f"operator's own mount ({', '.join(BUILT_MOUNT_PATHS)})")


def _check_volume(volume: Mapping[str, Any], where: str) -> str:
    name = _named(volume, where)
    if name in BUILT_VOLUMES:
        raise PodTemplateError(f"{where}.name: {name!r} is one of the operator's own volumes "
                               f"({', '.join(BUILT_VOLUMES)})")
    sources = [key for key in volume if key != "name"]
    unknown = [key for key in sources if key not in VOLUME_SOURCES]
    if unknown:
        raise PodTemplateError(f"{where}.{unknown[0]}: not a volume source the overlay may use "
                               f"(allowed: {', '.join(VOLUME_SOURCES)})")
    if len(sources) != 1:
        raise PodTemplateError(f"{where}: set exactly one volume source, got {len(sources)}")
    _typed(volume[sources[0]], Mapping, f"{where}.{sources[0]}")
    return name


def parse_overlay(data: Mapping[str, Any] | None, where: str = WHERE) -> PodOverlay:
    """Check spec.podTemplate and return it as a PodOverlay; PodTemplateError names the first bad field."""
    if not data:
        return PodOverlay()
    _typed(data, Mapping, where)
    _only(data, {"metadata": Mapping, "spec": Mapping}, where)
    metadata = data.get("metadata") or {}
    _only(metadata, {"labels": Mapping, "annotations": Mapping}, f"{where}.metadata")
    labels = _check_metadata_map(metadata.get("labels") or {}, f"{where}.metadata.labels", _LABEL_VALUE)
    annotations = _check_metadata_map(metadata.get("annotations") or {}, f"{where}.metadata.annotations", None)
    spec = data.get("spec") or {}
    spec_where = f"{where}.spec"
    for key in spec:
        if key in POD_INSTEAD:
            raise PodTemplateError(f"{spec_where}.{key}: set {POD_INSTEAD[key]} instead (one place for it)")
    _only(spec, POD_FIELDS, spec_where)
    for key in ("serviceAccountName", "priorityClassName", "runtimeClassName"):
        if key in spec and not _DNS_SUBDOMAIN.match(spec[key]):
            raise PodTemplateError(f"{spec_where}.{key}: {spec[key]!r} is not a valid object name")
    for index, secret in enumerate(_items(spec, "imagePullSecrets", spec_where)):
        _named(secret, f"{spec_where}.imagePullSecrets[{index}]", _DNS_SUBDOMAIN)
    for index, constraint in enumerate(_items(spec, "topologySpreadConstraints", spec_where)):
        for key in ("maxSkew", "topologyKey", "whenUnsatisfiable"):
            if key not in constraint:
                raise PodTemplateError(f"{spec_where}.topologySpreadConstraints[{index}].{key}: required")
    volumes = [_check_volume(volume, f"{spec_where}.volumes[{index}]")
               for index, volume in enumerate(_items(spec, "volumes", spec_where))]
    _unique(volumes, f"{spec_where}.volumes")
    known_volumes = set(BUILT_VOLUMES) | set(volumes)
    containers = _items(spec, "containers", spec_where)
    for index, container in enumerate(containers):
        _check_container(container, f"{spec_where}.containers[{index}]", known_volumes)
    _unique([c["name"] for c in containers], f"{spec_where}.containers")
    pod = {k: copy.deepcopy(v) for k, v in spec.items() if k not in ("volumes", "containers") and v is not None}
    return PodOverlay(
        labels=labels,
        annotations=annotations,
        pod=pod,
        volumes=tuple(copy.deepcopy(v) for v in spec.get("volumes") or []),
        containers=tuple(copy.deepcopy(c) for c in containers),
    )


# --- merging -------------------------------------------------------------------------------------------------


def _merge_by(built: list[dict], extra: list[Mapping[str, Any]], key: str) -> list[dict]:
    """`built` with each `extra` item replacing the one of the same `key` in place, or appended."""
    out = [dict(item) for item in built]
    index = {item[key]: i for i, item in enumerate(out)}
    for item in extra:
        if item[key] in index:
            out[index[item[key]]] = copy.deepcopy(dict(item))
        else:
            index[item[key]] = len(out)
            out.append(copy.deepcopy(dict(item)))
    return out


def _merge_server(container: dict[str, Any], overlay: Mapping[str, Any], where: str) -> None:
    container["env"] = _merge_by(container.get("env") or [], overlay.get("env") or [], "name")
    if overlay.get("envFrom"):
        container["envFrom"] = [*container.get("envFrom", []), *copy.deepcopy(overlay["envFrom"])]
    taken = {posixpath.normpath(m["mountPath"]) for m in container.get("volumeMounts") or []}
    for index, mount in enumerate(overlay.get("volumeMounts") or []):
        if posixpath.normpath(mount["mountPath"]) in taken:
            raise PodTemplateError(f"{where}.volumeMounts[{index}].mountPath: {mount['mountPath']} is already "
                                   "mounted by the operator")
    container["volumeMounts"] = [*container.get("volumeMounts", []), *copy.deepcopy(overlay.get("volumeMounts", []))]


def merge(template: Mapping[str, Any], overlay: PodOverlay, selector: Mapping[str, str]) -> dict[str, Any]:
    """The pod template (`{"metadata": ..., "spec": ...}`) with `overlay` merged in; `template` is not changed.
    `selector`: the service's pod selector labels (a spread constraint without labelSelector counts those)."""
    out = copy.deepcopy(dict(template))
    if overlay.empty:
        return out
    metadata = out.setdefault("metadata", {})
    metadata["labels"] = {**overlay.labels, **metadata.get("labels", {})}
    metadata["annotations"] = {**metadata.get("annotations", {}), **overlay.annotations}
    pod = out["spec"]
    pod.update(copy.deepcopy(dict(overlay.pod)))
    for constraint in pod.get("topologySpreadConstraints") or []:
        if "labelSelector" not in constraint and not constraint.get("matchLabelKeys"):
            constraint["labelSelector"] = {"matchLabels": dict(selector)}
    spec_where = f"{WHERE}.spec"
    built_volumes = {v["name"] for v in pod.get("volumes") or []}
    for index, volume in enumerate(overlay.volumes):
        if volume["name"] in built_volumes:
            raise PodTemplateError(f"{spec_where}.volumes[{index}].name: {volume['name']!r} is the operator's")
    pod["volumes"] = [*pod.get("volumes", []), *copy.deepcopy(list(overlay.volumes))]
    containers = {c["name"]: c for c in pod["containers"]}
    taken = containers.keys() | {c["name"] for c in pod.get("initContainers") or []}
    for index, container in enumerate(overlay.containers):
        where = f"{spec_where}.containers[{index}]"
        if container["name"] == SERVER_CONTAINER:
            _merge_server(containers[SERVER_CONTAINER], container, where)
        elif container["name"] in taken:
            raise PodTemplateError(f"{where}.name: {container['name']!r} is the operator's container")
        else:
            pod["containers"].append(copy.deepcopy(dict(container)))
    return out
