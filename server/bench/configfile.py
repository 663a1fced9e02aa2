"""Rewrite a mounted config file the way the kubelet updates a ConfigMap volume.

The folder holds a timestamped data directory, a `..data` symlink to it, and `server.yaml -> ..data/server.yaml`.
An update writes a new timestamped directory, points a temporary symlink at it and renames that over `..data`
(one atomic rename), then removes the old directory. A watcher that resolves the path afresh sees either the old
or the new file, never a half-written one — and an inotify watch on `server.yaml` sees nothing at all.
"""
from __future__ import annotations

import datetime as _dt
import os
import shutil
import tempfile
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
    folder, name = path.parent, path.name
    if not folder.is_dir():
        raise ConfigFileError(f"{folder}: not a folder (the config file's folder must exist)")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("..%Y_%m_%d_%H_%M_%S.")
    try:
        data_dir = Path(tempfile.mkdtemp(prefix=stamp, dir=folder))
        (data_dir / name).write_text(text)
        os.chmod(data_dir, 0o755)
        old_target = os.readlink(folder / DATA_LINK) if (folder / DATA_LINK).is_symlink() else None

        tmp_link = folder / (DATA_LINK + "_tmp")
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(data_dir.name, tmp_link)
        os.replace(tmp_link, folder / DATA_LINK)

        wanted = os.path.join(DATA_LINK, name)
        if not (path.is_symlink() and os.readlink(path) == wanted):
            tmp_file_link = folder / f".{name}.tmp-link"
            if tmp_file_link.is_symlink() or tmp_file_link.exists():
                tmp_file_link.unlink()
            os.symlink(wanted, tmp_file_link)
            os.replace(tmp_file_link, path)

        if old_target and old_target.startswith("..") and old_target != data_dir.name:
            shutil.rmtree(folder / old_target, ignore_errors=True)
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot rewrite: {exc.strerror or exc}") from exc
    return data_dir
