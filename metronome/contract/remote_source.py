"""Remote model sources: `hf://org/name[/file][@revision]` and `s3://bucket[/prefix]`.

Pure parsing and cache naming behind the `hf` and `s3` entries of metronome.contract.model_source, shared by the
downloader (`metronome fetch-model`, the server's loader) and the operator (which validates the URI and hands it
to the init container). No network, no heavy imports. Bad syntax raises ModelSourceError.

    hf://HuggingFaceTB/SmolLM2-135M-Instruct              the repo's main branch
    hf://HuggingFaceTB/SmolLM2-135M-Instruct@<sha|tag|branch>
    hf://bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf@main   one file of a GGUF repo
    s3://models/smollm2                                   every object under models/smollm2/ (or that one key)

The cache folder of a source is a pure function of the URI, so the init container that downloads and the
server that loads agree on it without talking to each other.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from metronome.contract.model_source import ModelSourceError

CACHE_ENV = "METRONOME_MODEL_CACHE"  # the cache root, for the server and `metronome fetch-model` alike
HF_SCHEME = "hf://"
S3_SCHEME = "s3://"
DEFAULT_HF_REVISION = "main"

# The Hub's own rules for ids: letters, digits, '-', '_', '.'; no '--' or '..'; at most 96 characters.
_HUB_NAME = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# S3 bucket names (the DNS-compatible rules every S3 implementation accepts).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")


@dataclass(frozen=True)
class HubSource:
    repo_id: str  # "org/name"
    revision: str  # a branch, tag or commit sha; "main" unless given
    filename: str | None  # one file inside the repo (e.g. a single .gguf of a multi-quant repo), else None
    uri: str  # as the user wrote it, normalised

    @property
    def name(self) -> str:
        """What logs and metrics call the model: the repo id, as vLLM does."""
        return self.repo_id


@dataclass(frozen=True)
class S3Source:
    bucket: str
    prefix: str  # no leading or trailing '/'; "" = the whole bucket
    uri: str

    @property
    def name(self) -> str:
        return self.prefix.rsplit("/", 1)[-1] or self.bucket


RemoteSource = HubSource | S3Source


def is_remote(spec: str) -> bool:
    return spec.startswith((HF_SCHEME, S3_SCHEME))


def parse_remote(spec: str) -> RemoteSource:
    """Parse an hf:// or s3:// URI; ModelSourceError (naming the URI and the rule it breaks) otherwise."""
    if spec.startswith(HF_SCHEME):
        return parse_hf(spec)
    if spec.startswith(S3_SCHEME):
        return parse_s3(spec)
    raise ModelSourceError(f"{spec!r} is not a remote model source; use hf://org/name[@revision] or s3://bucket/prefix")


def parse_hf(spec: str) -> HubSource:
    body = spec[len(HF_SCHEME):]
    path, at, revision = body.partition("@")
    if at and not _REVISION.fullmatch(revision):
        raise ModelSourceError(f"{spec}: revision {revision!r} is not a branch, tag or commit sha")
    parts = path.strip("/").split("/")
    if len(parts) < 2 or not all(_HUB_NAME.fullmatch(p) for p in parts[:2]):
        raise ModelSourceError(f"{spec}: expected hf://org/name[/file][@revision] with org and name made of "
                                 "letters, digits, '-', '_' and '.'")
    filename = "/".join(parts[2:]) or None
    if filename is not None and any(p in ("", ".", "..") for p in parts[2:]):
        raise ModelSourceError(f"{spec}: file path {filename!r} inside the repo is not a plain relative path")
    revision = revision if at else DEFAULT_HF_REVISION
    repo_id = "/".join(parts[:2])
    normalised = f"{HF_SCHEME}{repo_id}" + (f"/{filename}" if filename else "") + f"@{revision}"
    return HubSource(repo_id, revision, filename, normalised)


def parse_s3(spec: str) -> S3Source:
    body = spec[len(S3_SCHEME):]
    bucket, _, prefix = body.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ModelSourceError(f"{spec}: bucket {bucket!r} is not a valid S3 bucket name "
                                 "(3-63 lowercase letters, digits, '.' and '-')")
    prefix = prefix.strip("/")
    if any(p in ("", ".", "..") for p in prefix.split("/")) and prefix:
        raise ModelSourceError(f"{spec}: prefix {prefix!r} has an empty, '.' or '..' segment")
    return S3Source(bucket, prefix, f"{S3_SCHEME}{bucket}" + (f"/{prefix}" if prefix else ""))


def cache_subdir(source: RemoteSource) -> str:
    """The source's folder under the cache root: readable, and unique per normalised URI (a short hash breaks
    ties between URIs that read the same once made safe for a file name)."""
    if isinstance(source, HubSource):
        readable = f"hf/{source.repo_id.replace('/', '--')}"
        if source.filename:
            readable += "--" + source.filename.replace("/", "--")
        readable += "@" + source.revision.replace("/", "--")
    else:
        readable = f"s3/{source.bucket}" + (f"--{source.prefix.replace('/', '--')}" if source.prefix else "")
    digest = hashlib.sha256(source.uri.encode()).hexdigest()[:10]
    return f"{readable}-{digest}"
