"""podman with the project's settings (hack/containers.conf through CONTAINERS_CONF, nothing under /etc),
and the Debian packages image builds need, installed on first use."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from metronome_testing.checkout import HACK

CONTAINERS_CONF = HACK / "containers.conf"
# command -> Debian package; runc because crun fails on this machine's hybrid cgroups (containers.conf picks it).
TOOLS = {"podman": "podman", "runc": "runc", "mmdebstrap": "mmdebstrap"}


class PodmanError(RuntimeError):
    pass


def missing_tools() -> list[str]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [pkg for cmd, pkg in TOOLS.items() if shutil.which(cmd, path=path) is None]


def ensure_tools() -> None:
    """apt-get installs podman, runc and mmdebstrap when one is missing; without root it says what to install."""
    packages = missing_tools()
    if not packages:
        return
    if os.geteuid() != 0:
        raise PodmanError(f"missing {', '.join(packages)}: install them (apt-get install {' '.join(packages)})")
    print(f"images: installing {' '.join(packages)} from Debian", flush=True)
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run([*apt, "install", "-y", *packages], env=env).returncode != 0:
        subprocess.run([*apt, "update", "-q"], env=env, check=True)
        subprocess.run([*apt, "install", "-y", *packages], env=env, check=True)
    if missing_tools():
        raise PodmanError(f"still missing after apt-get install: {', '.join(missing_tools())}")


@dataclass(frozen=True)
class Podman:
    conf: Path = CONTAINERS_CONF

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, CONTAINERS_CONF=str(self.conf))

    def argv(self, *args: str) -> list[str]:
        return ["podman", *args]

    def run(self, *args: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise PodmanError(f"podman {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def image_exists(self, ref: str) -> bool:
        return self.run("image", "exists", ref, check=False).returncode == 0

    def image_id(self, ref: str) -> str:
        return self.run("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()

    def image_size(self, ref: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", ref).stdout.strip())

    def storage_paths(self) -> dict[str, Path]:
        """Where a build writes: the image store and the folder a commit stages each layer's diff in."""
        graph_root = self.run("info", "--format", "{{.Store.GraphRoot}}").stdout.strip()
        return {"image store": Path(graph_root), "layer staging": Path(os.environ.get("TMPDIR", "/var/tmp"))}

    def try_pull(self, ref: str, timeout: float) -> bool:
        """True when `ref` could be pulled within `timeout` seconds (no registry is reachable on some machines)."""
        try:
            return self.run("pull", "--quiet", ref, check=False, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False
