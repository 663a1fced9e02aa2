"""Rewrite a mounted config folder the way the kubelet updates a ConfigMap volume: atomically, by swapping `..data`.

Layout (what a container sees under its mount path):
    ..2024_01_02_03_04_05.123456789/server.yaml   the files of one version
    ..data -> ..2024_01_02_03_04_05.123456789     swapped with one rename(2) per update
    server.yaml -> ..data/server.yaml             stable names, through ..data
An update writes the new version's folder in full, points a temporary link at it, renames that link over
`..data`, then removes the old folder. A reader that resolves `server.yaml` afresh sees the old or the new
content, never a mix; an inotify watch on `server.yaml` itself sees nothing (it is the same link).

`metronome bench sweep` and `bench loop` rewrite their servers' config file this way; the tests' kubelet stand-in
projects pods' ConfigMaps with it.
"""
from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from metronome.contract.errors import MetronomeError

DATA_LINK = "..data"


class ConfigFileError(MetronomeError):
    """The config file cannot be rewritten (missing folder, permissions)."""


def atomic_configmap_write(path: str | Path, text: str) -> Path:
    """Make `path` read `text` through a `..data` swap; convert a plain file into that layout on first use.

    Returns the new data directory.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigFileError(f"{path.parent}: not a folder (the config file's folder must exist)")
    try:
        return _swap(path.parent, {path.name: text})
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot rewrite: {exc.strerror or exc}") from exc


def current_files(folder: Path) -> dict[str, str] | None:
    """The files the folder serves now (relative path → text), or None when nothing was projected yet."""
    data = folder / DATA_LINK
    if not data.is_symlink():
        return None
    root = folder / os.readlink(data)
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = path.read_text(encoding="utf-8")
    return out


def project(folder: Path, files: Mapping[str, str]) -> bool:
    """Make `folder` serve exactly `files`; returns False (touching nothing) when it already does."""
    folder.mkdir(parents=True, exist_ok=True)
    if current_files(folder) == dict(files):
        return False
    _swap(folder, files)
    return True


def _swap(folder: Path, files: Mapping[str, str]) -> Path:
    """Writes a new version holding `files`, swaps `..data` to it, links each top-level name through `..data`,
    drops links to names no longer provided and removes the old version. Returns the new version's folder."""
    for relative in files:
        if relative.startswith(("..", "/")) or "/.." in relative:
            raise ValueError(f"ConfigMap item path {relative!r} would leave the volume")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("..%Y_%m_%d_%H_%M_%S.")
    version = Path(tempfile.mkdtemp(prefix=stamp, dir=folder))
    for relative, text in files.items():
        target = version / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    version.chmod(0o755)
    data = folder / DATA_LINK
    old = os.readlink(data) if data.is_symlink() else None
    _replace_link(folder / f"{DATA_LINK}_tmp", version.name, data)
    tops = {relative.split("/", 1)[0] for relative in files}
    for top in tops:
        link = folder / top
        wanted = f"{DATA_LINK}/{top}"
        if not (link.is_symlink() and os.readlink(link) == wanted):
            _replace_link(folder / f".{top}.tmp-link", wanted, link)
    for entry in folder.iterdir():  # names a key no longer provides
        if entry.is_symlink() and os.readlink(entry).startswith(f"{DATA_LINK}/") and entry.name not in tops:
            entry.unlink()
    if old and old.startswith("..") and old != version.name:
        shutil.rmtree(folder / old, ignore_errors=True)
    return version


def _replace_link(temporary: Path, target: str, final: Path) -> None:
    if temporary.is_symlink() or temporary.exists():
        temporary.unlink()
    os.symlink(target, temporary)
    os.replace(temporary, final)  # atomic: readers see the old link or the new one
