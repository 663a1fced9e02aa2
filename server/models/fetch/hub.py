"""hf://org/name[/file][@revision] through `huggingface_hub` (its own retries, resume, Xet and LFS handling).

Token: HF_TOKEN, or the file HF_TOKEN_PATH names (huggingface_hub reads both). Mirror: HF_ENDPOINT, or
`endpoint=`. The revision is resolved to a commit sha first, so every file comes from one commit, and that sha
is recorded in the cache marker.
"""
from __future__ import annotations

import importlib
import logging
import os
import shutil
from pathlib import Path

from metronome.contract.errors import ModelNotFoundError
from metronome.contract.remote_source import HubSource
from metronome.server.models.fetch.cache import Marker, RemoteFile
from metronome.server.models.fetch.files import select_model_files

log = logging.getLogger(__name__)
DEFAULT_ENDPOINT = "https://huggingface.co"


def hub_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def download_hub(source: HubSource, dest: Path, endpoint: str | None = None) -> Marker:
    """Download the model files of `source` into the empty folder `dest`; the marker describing them."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    url = hub_endpoint(endpoint)
    api = HfApi(endpoint=url)
    with _hub_errors(source, url):
        sha = api.model_info(source.repo_id, revision=source.revision).sha
        tree = {f.path: f for f in api.list_repo_tree(source.repo_id, revision=sha, recursive=True)
                if isinstance(f, RepoFile)}
        wanted = select_model_files(sorted(tree), source.uri, source.filename)
        log.info("%s: commit %s, fetching %d files (%.1f MB) from %s", source.uri, sha, len(wanted),
                 sum(tree[n].size for n in wanted) / 1e6, url)
        snapshot_download(source.repo_id, revision=sha, allow_patterns=wanted, local_dir=dest, endpoint=url)
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # huggingface_hub's own bookkeeping for local_dir
    files = [RemoteFile(n, tree[n].size, tree[n].lfs.sha256 if tree[n].lfs else tree[n].blob_id) for n in wanted]
    return Marker(source.uri, sha, files)


class _hub_errors:
    """Turns huggingface_hub's and the HTTP stack's exceptions into one ModelNotFoundError naming the source."""

    def __init__(self, source: HubSource, endpoint: str):
        self.source, self.endpoint = source, endpoint

    def __enter__(self):
        return self

    def __exit__(self, exc_type, error, tb):
        if error is None or isinstance(error, ModelNotFoundError):
            return False
        from huggingface_hub import errors as hub

        where = f"{self.source.uri} (from {self.endpoint})"
        status = getattr(getattr(error, "response", None), "status_code", None)
        if isinstance(error, hub.GatedRepoError):
            message = f"{where}: the repo is gated; accept its terms on the Hub and set HF_TOKEN to a token with access"
        elif isinstance(error, hub.RepositoryNotFoundError):
            message = (f"{where}: repo not found, or private and the token was refused (HTTP {status}); "
                       "check the name and HF_TOKEN")
        elif isinstance(error, hub.RevisionNotFoundError):
            message = f"{where}: revision {self.source.revision!r} not found"
        elif isinstance(error, hub.LocalEntryNotFoundError):  # what snapshot_download raises when offline
            message = f"{where}: cannot reach the Hub: {error}; check the network or HF_ENDPOINT"
        elif isinstance(error, hub.EntryNotFoundError):
            message = f"{where}: a file is missing from the repo: {error}"
        elif isinstance(error, hub.HfHubHTTPError) and status in (401, 403):
            message = f"{where}: access refused (HTTP {status}); check HF_TOKEN"
        elif isinstance(error, hub.HfHubHTTPError):
            message = f"{where}: the Hub answered HTTP {status}: {error}"
        elif isinstance(error, _transport_errors()):
            message = f"{where}: cannot reach the Hub: {error}; check the network or HF_ENDPOINT"
        else:
            return False
        raise ModelNotFoundError(message) from error


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level errors of whichever HTTP client this huggingface_hub uses."""
    classes: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx", "requests"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        classes.append(getattr(module, "TransportError", None) or module.exceptions.ConnectionError)
    return tuple(classes)
