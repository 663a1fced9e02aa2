"""The base image both Dockerfiles start from (their BASE_IMAGE argument).

The default is Debian's public slim image. Where no registry can be reached, an equivalent base is made here
from Debian packages: mmdebstrap writes a minimal bookworm root filesystem as a tarball (the same suites and
mirror the public image uses) and `podman import` turns it into an image. Both bases give the same thing to the
Dockerfiles (Debian 12: apt, Python 3.11 from its packages), so the images built on either behave alike.
"""
from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from .podman import Podman, PodmanError

DEFAULT_BASE = "docker.io/library/debian:bookworm-slim"
LOCAL_BASE = "localhost/metronome-debian:bookworm"
PULL_TIMEOUT_S = 30
MIRROR = "http://deb.debian.org"
SOURCES = (
    f"deb {MIRROR}/debian bookworm main",
    f"deb {MIRROR}/debian bookworm-updates main",
    f"deb {MIRROR}/debian-security bookworm-security main",
)
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # as in Debian's public image
# What the slim image leaves out too: documentation, manuals, translations.
DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*")


def resolve_base(podman: Podman, requested: str | None = None, log=print) -> str:
    """The base to build on: `requested` as given; else the public default if present or pullable; else the local
    base (made once, then reused)."""
    if requested:
        return requested
    if podman.image_exists(DEFAULT_BASE):
        return DEFAULT_BASE
    if podman.image_exists(LOCAL_BASE):
        return LOCAL_BASE
    if podman.try_pull(DEFAULT_BASE, timeout=PULL_TIMEOUT_S):
        return DEFAULT_BASE
    log(f"images: {DEFAULT_BASE} cannot be pulled; building {LOCAL_BASE} from Debian packages (mmdebstrap)")
    build_local_base(podman)
    return LOCAL_BASE


def mmdebstrap_argv(tarball: Path) -> list[str]:
    dpkg = [f"--dpkgopt=path-exclude={pattern}" for pattern in DPKG_EXCLUDES]
    dpkg.append("--dpkgopt=path-include=/usr/share/doc/*/copyright")  # licences stay
    return ["mmdebstrap", "--variant=minbase", "--include=ca-certificates", *dpkg, "bookworm", str(tarball), *SOURCES]


def build_local_base(podman: Podman, log=print) -> float:
    """Makes LOCAL_BASE; returns the seconds it took."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="metronome-base-") as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        result = subprocess.run(mmdebstrap_argv(tarball), capture_output=True, text=True)
        if result.returncode != 0:
            raise PodmanError(f"mmdebstrap failed ({result.returncode}):\n{result.stderr[-3000:]}")
        changes = ["--change", f"ENV PATH={IMAGE_PATH}", "--change", 'CMD ["/bin/bash"]']
        podman.run("import", *changes, str(tarball), LOCAL_BASE)
    seconds = time.monotonic() - start
    log(f"images: {LOCAL_BASE} built in {seconds:.0f} s")
    return seconds
