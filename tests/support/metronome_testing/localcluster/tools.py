"""Where the Go-built tools live, and building them when they are missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from metronome_testing.checkout import HACK

from .errors import ToolsMissingError

BUILD_SCRIPT = HACK / "build-tools.sh"
VERSIONS_FILE = HACK / "tool-versions.sh"

K8S_COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
_ASSIGNMENT = re.compile(r"^([A-Z0-9_]+)=(\S+)\s*$")


def default_cache_dir() -> Path:
    return Path(os.environ.get("METRONOME_CACHE") or Path.home() / ".cache" / "metronome")


def default_state_dir() -> Path:
    return default_cache_dir() / "cluster"


def parse_versions(text: str) -> dict[str, str]:
    """Reads the KEY=value lines of tool-versions.sh (comments and blank lines ignored)."""
    versions = {}
    for line in text.splitlines():
        match = _ASSIGNMENT.match(line.strip())
        if match:
            versions[match.group(1)] = match.group(2)
    return versions


def tool_versions() -> dict[str, str]:
    """component -> version, for every tool build-tools.sh provides."""
    raw = parse_versions(VERSIONS_FILE.read_text(encoding="utf-8"))
    versions = {name: raw["K8S_VERSION"] for name in K8S_COMPONENTS}
    versions.update(etcd=raw["ETCD_VERSION"], kwok=raw["KWOK_VERSION"], helm=raw["HELM_VERSION"])
    return versions


@dataclass(frozen=True)
class ToolSet:
    """Paths of the Go-built tools (same layout as build-tools.sh: bin/<component>-<version>/<component>)."""

    cache_dir: Path
    versions: dict[str, str]

    @classmethod
    def default(cls) -> ToolSet:
        return cls(default_cache_dir(), tool_versions())

    def path(self, component: str) -> Path:
        return self.cache_dir / "bin" / f"{component}-{self.versions[component]}" / component

    @property
    def kubernetes_version(self) -> str:
        return self.versions["kube-apiserver"]

    def missing(self) -> list[str]:
        return [name for name in self.versions if not os.access(self.path(name), os.X_OK)]

    def ensure_built(self, build: bool = True) -> None:
        """Builds missing tools with hack/build-tools.sh (its progress goes to stderr), or names them."""
        missing = self.missing()
        if not missing:
            return
        if not build:
            raise ToolsMissingError(missing)
        print(f"[localcluster] building missing tools: {', '.join(missing)} (a cold build takes many minutes)",
              file=sys.stderr, flush=True)
        env = dict(os.environ, METRONOME_CACHE=str(self.cache_dir))
        result = subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, stdout=sys.stderr, stderr=sys.stderr)
        still_missing = self.missing()
        if result.returncode != 0 or still_missing:
            raise ToolsMissingError(still_missing or missing, f"{BUILD_SCRIPT} exited with {result.returncode}")

    def link_dir(self, target: Path) -> Path:
        """Makes `target` a folder of symlinks to every tool, to put first on PATH."""
        target.mkdir(parents=True, exist_ok=True)
        for name in self.versions:
            link = target / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(self.path(name))
        return target
