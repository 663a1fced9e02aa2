"""s3://bucket[/prefix] through boto3 (the AWS SDK's managed transfers: multipart, parallel, retried).

Endpoint: `endpoint=`, else AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (any S3-compatible server: MinIO, Ceph,
GCS's XML API, R2, versitygw); path-style addressing whenever an endpoint is given. Credentials: boto3's own
chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, the file AWS_SHARED_CREDENTIALS_FILE names, web identity,
instance metadata); with none at all the requests go unsigned, which public buckets accept.

`prefix` names a folder (every object under `prefix/`) or, failing that, a single object (`.../model.gguf`).
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from metronome.contract.errors import ModelNotFoundError
from metronome.contract.remote_source import S3Source
from metronome.server.models.fetch.cache import Marker, RemoteFile
from metronome.server.models.fetch.files import select_model_files

log = logging.getLogger(__name__)
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
               "InvalidToken", "ExpiredToken", "AccountProblem", "403", "401"}
_NOT_FOUND_CODES = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}


def s3_endpoint(endpoint: str | None = None) -> str | None:
    return endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def download_s3(source: S3Source, dest: Path, endpoint: str | None = None) -> Marker:
    """Download the model files under `source` into the empty folder `dest`; the marker describing them."""
    url = s3_endpoint(endpoint)
    client = _client(url)
    where = source.uri + (f" (endpoint {url})" if url else "")
    with _s3_errors(where):
        objects = _list_objects(client, source)
        if not objects:
            raise ModelNotFoundError(f"{where}: no objects under this prefix")
        wanted = select_model_files(sorted(objects), source.uri)
        progress = _Progress(source.uri, sum(objects[n][1] for n in wanted))
        log.info("%s: fetching %d files (%.1f MB)", where, len(wanted), progress.total / 1e6)
        for name in wanted:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(source.bucket, objects[name][0], str(target), Callback=progress)
    return Marker(source.uri, None, [RemoteFile(n, objects[n][1], objects[n][2]) for n in wanted])


class _Progress:
    """boto3's transfer callback (called from its worker threads with byte counts): one log line per 10%."""

    def __init__(self, uri: str, total: int):
        self.uri, self.total, self.done, self.logged = uri, total, 0, 0
        self.lock = threading.Lock()

    def __call__(self, chunk: int) -> None:
        with self.lock:
            self.done += chunk
            tenth = self.done * 10 // max(self.total, 1)
            if tenth > self.logged:
                self.logged = tenth
                log.info("%s: %d%% (%.1f of %.1f MB)", self.uri, min(tenth * 10, 100), self.done / 1e6,
                         self.total / 1e6)


def _client(endpoint: str | None):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    session = boto3.session.Session()
    config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=60,
                    s3={"addressing_style": "path" if endpoint else "auto"},
                    signature_version=None if session.get_credentials() else UNSIGNED)
    region = session.region_name or "us-east-1"
    return session.client("s3", endpoint_url=endpoint, region_name=region, config=config)


def _list_objects(client, source: S3Source) -> dict[str, tuple[str, int, str | None]]:
    """relative name -> (key, size, etag) for the objects of the source (folder first, then a single key)."""
    folder = f"{source.prefix}/" if source.prefix else ""
    found: dict[str, tuple[str, int, str | None]] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=source.bucket, Prefix=folder):
        for obj in page.get("Contents", []):
            if not obj["Key"].endswith("/"):  # folder placeholders some tools create
                found[obj["Key"][len(folder):]] = (obj["Key"], obj["Size"], obj.get("ETag", "").strip('"') or None)
    if found or not source.prefix:
        return found
    from botocore.exceptions import ClientError

    try:
        head = client.head_object(Bucket=source.bucket, Key=source.prefix)
    except ClientError as error:
        if _code(error) in _NOT_FOUND_CODES:
            return {}
        raise
    name = source.prefix.rsplit("/", 1)[-1]
    return {name: (source.prefix, head["ContentLength"], head.get("ETag", "").strip('"') or None)}


def _code(error) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


class _s3_errors:
    """Turns botocore's exceptions into one ModelNotFoundError naming the source and what went wrong."""

    def __init__(self, where: str):
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, exc_type, error, tb):
        if error is None or isinstance(error, ModelNotFoundError):
            return False
        from boto3.exceptions import S3TransferFailedError
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

        if isinstance(error, ClientError):
            code = _code(error)
            if code == "NoSuchBucket":
                message = f"{self.where}: bucket not found"
            elif code in _NOT_FOUND_CODES:
                message = f"{self.where}: object not found ({code})"
            elif code in _AUTH_CODES:
                message = (f"{self.where}: access refused ({code}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                           "and the bucket's policy")
            else:
                message = f"{self.where}: the S3 server answered {code}: {error}"
        elif isinstance(error, EndpointConnectionError):
            message = f"{self.where}: cannot reach the S3 endpoint: {error}"
        elif isinstance(error, (BotoCoreError, S3TransferFailedError)):
            message = f"{self.where}: {error}"
        else:
            return False
        raise ModelNotFoundError(message) from error
