"""Pure: what a server Pod asks the kubelet for, turned into a local `metronome serve` command line.

A Pod of an InferenceService Deployment names its program (`command`/`args` of the `server` container), mounts its
config folder (a ConfigMap volume, or a projected volume of ConfigMaps and the pod's own labels through the
downward API), and mounts its model somewhere (hostPath file or folder, or emptyDir for random
weights). The stand-in runs the same program on this machine, so every path inside a mount is mapped to the local
folder that plays that volume, and the bind address, port and device are the stand-in's own:
- `--host`/`--port` → a loopback address 127.0.0.x and a free port (never the pod's IP);
- `--device` → the stand-in's device (cpu here): the GPUs the pod asked for exist on paper only;
- a path under a mount → the same relative path under the volume's local folder.
No I/O here; `PodSpecError` names what cannot be played locally (a PVC, no server container, ...).
"""
from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metronome.contract import variant
from metronome.contract.errors import MetronomeError
from metronome.operator.builders import LABEL_INSTANCE, LABEL_NAME, LABEL_SERVICE, SERVER_CONTAINER

SERVER_POD_SELECTOR = f"{LABEL_NAME}=metronome-server,{LABEL_SERVICE}"
REPLACED_FLAGS = ("--host", "--port", "--device")


class PodSpecError(MetronomeError, ValueError):
    """A server Pod that the stand-in cannot play locally; the message names the pod and the field."""


DOWNWARD_FIELDS = ("metadata.labels", "metadata.annotations")  # the maps a downward-API file may hold


@dataclass(frozen=True)
class ConfigMapSource:
    """One ConfigMap in a volume: which keys to which relative paths (None = every key as itself)."""

    config_map: str
    items: tuple[tuple[str, str], ...] | None = None
    optional: bool = False

    def files(self, data: Mapping[str, str]) -> dict[str, str]:
        """Its files (relative path → text) for the ConfigMap's `data`, as the kubelet projects them."""
        if self.items is None:
            return dict(data)
        return {path: data[key] for key, path in self.items if key in data}


@dataclass(frozen=True)
class ConfigMapVolume:
    """A ConfigMap volume, or a projected one of ConfigMaps and downward-API files of the pod's own labels or
    annotations, the kubelet's format (`downward`: (relative path, field path)). Kept in sync like a ConfigMap."""

    volume: str
    sources: tuple[ConfigMapSource, ...] = ()
    downward: tuple[tuple[str, str], ...] = ()

    @property
    def config_map(self) -> str:
        """The first ConfigMap's name (a plain ConfigMap volume has one)."""
        return self.sources[0].config_map if self.sources else ""

    def files(self, data: Mapping[str, Mapping[str, str] | None], labels: Mapping[str, str] = {},
              annotations: Mapping[str, str] = {}) -> dict[str, str]:
        """The folder's files for the ConfigMaps' `data` by name (None: missing) and the pod's metadata."""
        out: dict[str, str] = {}
        for source in self.sources:
            found = data.get(source.config_map)
            if found is not None:
                out.update(source.files(found))
        maps = {"metadata.labels": labels, "metadata.annotations": annotations}
        for path, field_path in self.downward:
            out[path] = variant.format_labels(maps[field_path])
        return out


@dataclass(frozen=True)
class ServerPod:
    """One Running server Pod, as the stand-in needs it. `key` = namespace/name/uid: a re-created pod of the
    same name is a different pod."""

    namespace: str
    name: str
    uid: str
    service: str
    command: tuple[str, ...]
    args: tuple[str, ...]
    config_maps: tuple[tuple[str, ConfigMapVolume], ...] = ()  # (mount path, volume): ConfigMap and projected
    labels: tuple[tuple[str, str], ...] = ()  # the pod's labels now (a downward-API file projects them)
    annotations: tuple[tuple[str, str], ...] = ()
    host_paths: tuple[tuple[str, str], ...] = ()  # (mount path, host path)
    scratch_mounts: tuple[str, ...] = ()  # emptyDir mount paths
    grace_seconds: float = 30.0
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    container_port: int | None = None  # the server container's first declared port
    pre_stop_seconds: float = 0.0  # the server container's preStop sleep (lifecycle.preStop.sleep.seconds)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}/{self.uid}"


def is_running(pod: Mapping[str, Any]) -> bool:
    """What the kubelet would be running: phase Running (kwok sets it) and not being deleted."""
    metadata = pod.get("metadata") or {}
    return (pod.get("status") or {}).get("phase") == "Running" and not metadata.get("deletionTimestamp")


def server_pod(pod: Mapping[str, Any], container_name: str = SERVER_CONTAINER) -> ServerPod:
    """Read a Pod (the API's JSON shape) into a ServerPod. Raises PodSpecError naming the problem."""
    metadata = pod.get("metadata") or {}
    namespace, name = metadata.get("namespace", ""), metadata.get("name", "")
    where = f"pod {namespace}/{name}"
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    container = next((c for c in containers if c.get("name") == container_name), None)
    if container is None:
        raise PodSpecError(f"{where}: no container named {container_name!r}")
    labels = metadata.get("labels") or {}
    service = labels.get(LABEL_INSTANCE) or labels.get(LABEL_SERVICE)
    if not service:
        raise PodSpecError(f"{where}: no {LABEL_INSTANCE} label to name its service")
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    config_maps, host_paths, scratch = [], [], []
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount.get("name"))
        mount_path = mount.get("mountPath", "")
        if volume is None:
            raise PodSpecError(f"{where}: volumeMount {mount.get('name')!r} names no volume")
        if "configMap" in volume:
            source = _config_map_source(volume["configMap"])
            config_maps.append((mount_path, ConfigMapVolume(volume["name"], (source,))))
        elif "projected" in volume:
            config_maps.append((mount_path, _projected(volume, f"{where}: volume {volume['name']!r}")))
        elif "hostPath" in volume:
            host_paths.append((mount_path, volume["hostPath"]["path"]))
        elif "emptyDir" in volume:
            scratch.append(mount_path)
        else:
            kinds = sorted(k for k in volume if k != "name")
            raise PodSpecError(f"{where}: volume {volume.get('name')!r} of kind {', '.join(kinds)} cannot be "
                               "played on this machine (the stand-in supports configMap, projected, hostPath, "
                               "emptyDir)")
    env = tuple((e["name"], e["value"]) for e in container.get("env") or [] if "value" in e)
    ports = [p.get("containerPort") for p in container.get("ports") or [] if p.get("containerPort")]
    return ServerPod(
        namespace=namespace, name=name, uid=metadata.get("uid", ""), service=service,
        command=tuple(container.get("command") or ()), args=tuple(container.get("args") or ()),
        config_maps=tuple(config_maps), host_paths=tuple(host_paths), scratch_mounts=tuple(scratch),
        grace_seconds=float(spec.get("terminationGracePeriodSeconds", 30)), env=env,
        container_port=int(ports[0]) if ports else None, labels=tuple(sorted(labels.items())),
        annotations=tuple(sorted((metadata.get("annotations") or {}).items())),
        pre_stop_seconds=float((((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {})
                               .get("seconds", 0)))


def _config_map_source(source: Mapping[str, Any]) -> ConfigMapSource:
    items = source.get("items")
    return ConfigMapSource(config_map=source.get("name", ""),
                           items=tuple((i["key"], i.get("path", i["key"])) for i in items) if items else None,
                           optional=bool(source.get("optional", False)))


def _projected(volume: Mapping[str, Any], where: str) -> ConfigMapVolume:
    """A projected volume of ConfigMaps and downward-API labels/annotations (what the stand-in can project)."""
    sources, downward = [], []
    for source in (volume.get("projected") or {}).get("sources") or []:
        if "configMap" in source:
            sources.append(_config_map_source(source["configMap"]))
        elif "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or []:
                field_path = (item.get("fieldRef") or {}).get("fieldPath")
                if field_path not in DOWNWARD_FIELDS:
                    raise PodSpecError(f"{where}: downward-API field {field_path!r} cannot be projected here "
                                       f"(the stand-in projects {', '.join(DOWNWARD_FIELDS)})")
                downward.append((item["path"], field_path))
        else:
            kinds = ", ".join(sorted(source))
            raise PodSpecError(f"{where}: projected source {kinds} cannot be played on this machine (the stand-in "
                               "projects configMap and downwardAPI)")
    return ConfigMapVolume(volume["name"], tuple(sources), tuple(downward))


@dataclass(frozen=True)
class LocalMounts:
    """Where each mount of a pod lives on this machine: mount path → local path."""

    paths: tuple[tuple[str, str], ...]

    def translate(self, value: str) -> str:
        """A path inside a mount → the local path; anything else unchanged. The longest mount path wins."""
        for mount_path, local in sorted(self.paths, key=lambda p: -len(p[0])):
            mount_path = mount_path.rstrip("/") or "/"
            if value == mount_path:
                return local
            if value.startswith(mount_path + "/"):
                return posixpath.join(local, value[len(mount_path) + 1:])
        return value


def local_argv(pod: ServerPod, program: list[str], host: str, port: int, device: str, mounts: LocalMounts,
               extra_args: tuple[str, ...] = ()) -> list[str]:
    """The command line that plays `pod` here: `program` in place of the image's `metronome` entry point,
    the pod's args with host/port/device replaced and paths mapped, then
    `extra_args` (local tuning such as a KV budget or a shorter drain)."""
    if pod.command and posixpath.basename(pod.command[0]) != "metronome":
        raise PodSpecError(f"pod {pod.namespace}/{pod.name}: command {list(pod.command)} is not `metronome`")
    args = list(pod.command[1:]) + list(pod.args)
    out: list[str] = []
    i = 0
    while i < len(args):
        flag, value, consumed = _split_flag(args, i)
        if flag in REPLACED_FLAGS:
            i += consumed
            continue  # appended below with the stand-in's values
        if value is None:
            out.append(mounts.translate(args[i]))
        elif consumed == 1:
            out.append(f"{flag}={mounts.translate(value)}")
        else:
            out += [flag, mounts.translate(value)]
        i += consumed
    if not out or out[0] != "serve":
        raise PodSpecError(f"pod {pod.namespace}/{pod.name}: args {args[:3]} do not run `metronome serve`")
    return [*program, *out, "--host", host, "--port", str(port), "--device", device, *extra_args]


def _split_flag(args: list[str], i: int) -> tuple[str | None, str | None, int]:
    """(flag, value, how many items it takes) for args[i]; (None, None, 1) for a positional word."""
    word = args[i]
    if not word.startswith("--"):
        return None, None, 1
    if "=" in word:
        flag, value = word.split("=", 1)
        return flag, value, 1
    if i + 1 < len(args) and not args[i + 1].startswith("--"):
        return word, args[i + 1], 2
    return word, None, 1
