"""The model cache: one folder per source, published atomically, with a marker that makes a second fetch a no-op.

    <root>/<cache_subdir(source)>/                   the model files, as the loaders read them
    <root>/<cache_subdir(source)>/.metronome-fetch.json   uri, resolved revision, every file's size and etag
    <root>/.partial/<random>/                        a download in progress (renamed into place when complete;
                                                     left over by a crash, removed a day later)

A folder exists under its final name only once every file is in it, so a crashed download, or two init
containers racing on a shared ReadWriteMany volume, never leave a half model where the server looks. A folder
counts as complete when its marker names the same URI and every listed file has the listed size.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from metronome.contract.errors import ModelNotFoundError
from metronome.contract.remote_source import CACHE_ENV

MARKER = ".metronome-fetch.json"
PARTIAL = ".partial"
STALE_PARTIAL_SECONDS = 24 * 3600


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the model folder, '/'-separated
    size: int
    etag: str | None = None  # S3 ETag, or the Hub's LFS sha256 / git blob id


@dataclass
class Marker:
    uri: str
    resolved: str | None  # the Hub commit sha the files came from; None for S3
    files: list[RemoteFile] = field(default_factory=list)

    def dumps(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> Marker:
        raw = json.loads(text)
        return cls(raw["uri"], raw.get("resolved"), [RemoteFile(**f) for f in raw["files"]])


def default_cache_root() -> Path:
    """$METRONOME_MODEL_CACHE, else ~/.cache/metronome/models."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "metronome" / "models"


def read_complete(folder: Path, uri: str) -> Marker | None:
    """The folder's marker if the folder holds a complete download of `uri`, else None."""
    try:
        marker = Marker.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if marker.uri != uri or not marker.files:
        return None
    for f in marker.files:
        try:
            if (folder / f.path).stat().st_size != f.size:
                return None
        except OSError:
            return None
    return marker


def new_partial(root: Path, now: float | None = None) -> Path:
    """A fresh folder for one download. Downloads that crashed (a killed init container) leave theirs behind:
    any untouched for STALE_PARTIAL_SECONDS is removed first (on a shared volume a live one is written to)."""
    partials = root / PARTIAL
    partials.mkdir(parents=True, exist_ok=True)
    now = time.time() if now is None else now
    for old in partials.iterdir():
        try:
            if now - old.stat().st_mtime > STALE_PARTIAL_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # another fetch removed it first
    return Path(tempfile.mkdtemp(prefix="fetch-", dir=partials))


def publish(partial: Path, dest: Path, marker: Marker) -> Path:
    """Write the marker, then rename the finished download into place. If another fetch published a complete
    copy first, keep that one and drop ours; an incomplete folder under the final name is replaced."""
    for f in marker.files:
        size = (partial / f.path).stat().st_size
        if size != f.size:
            raise ModelNotFoundError(f"{marker.uri}: {f.path} arrived with {size} bytes, the source lists {f.size}")
    (partial / MARKER).write_text(marker.dumps(), encoding="utf-8")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(partial, dest)
        return dest
    except OSError:
        pass  # dest exists (rename onto a non-empty folder fails)
    if read_complete(dest, marker.uri) is not None:
        shutil.rmtree(partial, ignore_errors=True)
        return dest
    stale = dest.with_name(dest.name + f".stale-{os.getpid()}")
    os.rename(dest, stale)
    os.rename(partial, dest)
    shutil.rmtree(stale, ignore_errors=True)
    return dest
