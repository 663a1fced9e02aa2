"""The host-side wheel cache that image builds install from.

The host's pip (the venv's, with the host's index and CA settings) downloads each pinned wheel once into
$METRONOME_CACHE/images/wheels; the build mounts that folder read-only and installs with --no-index, so torch and
its CUDA libraries (several GB) cross the network once, and a build needs no PyPI access of its own.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from .pins import Pins


def missing(pins: Pins, filenames: list[str]) -> list[str]:
    """The pins ("name==version") with no wheel of that name and version among `filenames`."""
    have: set[tuple[str, str]] = set()
    for filename in filenames:
        try:
            name, version, _, _ = parse_wheel_filename(filename)
        except InvalidWheelFilename:
            continue
        have.add((name, str(version)))
    wanted = [*pins.requirements, *pins.no_deps]
    return [pin for pin in wanted if (canonicalize_name(pin.split("==")[0]), _normal(pin.split("==")[1])) not in have]


def fetch(pins: Pins, wheel_dir: Path, echo: bool = True) -> list[str]:
    """Downloads the missing wheels (binary only, no dependencies: the pins are already closed); returns them."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    todo = missing(pins, [p.name for p in wheel_dir.glob("*.whl")])
    if not todo:
        return []
    pip = [sys.executable, "-m", "pip"]
    argv = [*pip, "download", "--no-deps", "--only-binary=:all:", "--dest", str(wheel_dir), *todo]
    result = subprocess.run(argv, stdout=None if echo else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed ({result.returncode}):\n{(result.stdout or '')[-3000:]}")
    return todo


def _normal(version: str) -> str:
    return str(Version(version))
