"""The host-side wheel cache that image builds install from.

The host's pip (the venv's, with the host's index and CA settings) downloads each pinned wheel once into
$METRONOME_CACHE/images/wheels; the build mounts that folder read-only and installs with --no-index, so torch and
its CUDA libraries (several GB) cross the network once, and a build needs no PyPI access of its own.
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
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


ATTEMPTS = 4
RETRY_AFTER_S = 60.0  # an index mirror can list a release a little after the venv's resolver saw it


def fetch(pins: Pins, wheel_dir: Path, echo: bool = True,
          run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
          sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Downloads the missing wheels (binary only, no dependencies: the pins are already closed); returns them. A
    failed download is tried again for the wheels still missing, ATTEMPTS times in all."""
    wheel_dir.mkdir(parents=True, exist_ok=True)

    def still_missing() -> list[str]:
        return missing(pins, [p.name for p in wheel_dir.glob("*.whl")])

    wanted = todo = still_missing()
    if not todo:
        return []
    for attempt in range(1, ATTEMPTS + 1):
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(wheel_dir),
                *todo]
        result = run(argv, stdout=None if echo else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode == 0:
            return wanted
        todo = still_missing()
        if not todo:
            return wanted
        if attempt < ATTEMPTS:
            sleep(RETRY_AFTER_S)
    raise RuntimeError(f"pip download failed ({result.returncode}) {ATTEMPTS} times; still missing: {', '.join(todo)}"
                       f"\n{(result.stdout or '')[-3000:]}")


def _normal(version: str) -> str:
    return str(Version(version))
