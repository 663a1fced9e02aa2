"""Remote models into a local cache: `fetch_model("hf://org/name@rev")` → the folder the loaders read.

No torch here: `metronome fetch-model` runs this in the operator's init container (same server image) and the
server's loader calls it for `--model hf://…` / `s3://…`. huggingface_hub and boto3 load only when used.
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from metronome.contract.errors import ModelNotFoundError
from metronome.contract.remote_source import HubSource, RemoteSource, cache_subdir, parse_remote
from metronome.server.models.fetch.cache import Marker, default_cache_root, new_partial, publish, read_complete
from metronome.server.models.fetch.files import local_model_spec

log = logging.getLogger(__name__)

__all__ = ["Fetched", "fetch_model", "default_cache_root", "local_model_spec"]


@dataclass(frozen=True)
class Fetched:
    source: RemoteSource
    folder: Path
    marker: Marker
    downloaded: bool  # False: the cache already held a complete copy and nothing was transferred

    @property
    def local_spec(self) -> str:
        return local_model_spec(self.folder)


def fetch_model(uri: str, cache_root: str | Path | None = None, *, hf_endpoint: str | None = None,
                s3_endpoint: str | None = None) -> Fetched:
    """Make sure the cache holds a complete copy of `uri` (download it if not); ModelNotFoundError naming the
    source when it cannot be had (not found, access refused, unreachable, not a model)."""
    source = parse_remote(uri)
    root = Path(cache_root).expanduser() if cache_root else default_cache_root()
    dest = root / cache_subdir(source)
    marker = read_complete(dest, source.uri)
    if marker is not None:
        log.info("%s: cached in %s", source.uri, dest)
        return Fetched(source, dest, marker, downloaded=False)
    try:
        partial = new_partial(root)
    except OSError as error:
        raise ModelNotFoundError(f"{source.uri}: cannot write the model cache {root}: {error}") from None
    try:
        if isinstance(source, HubSource):
            from metronome.server.models.fetch.hub import download_hub

            marker = download_hub(source, partial, hf_endpoint)
        else:
            from metronome.server.models.fetch.s3 import download_s3

            marker = download_s3(source, partial, s3_endpoint)
        dest = publish(partial, dest, marker)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already once published
    log.info("%s: %d files in %s", source.uri, len(marker.files), dest)
    return Fetched(source, dest, marker, downloaded=True)
