"""`metronome fetch-model SOURCE`: download an hf:// or s3:// model into the cache and print its folder.

The operator runs this as the init container of every server pod whose spec.model.source is remote; the server
container then finds the complete copy and loads it without touching the network.
"""
from __future__ import annotations

import argparse
import logging
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="hf://org/name[/file.gguf][@revision] or s3://bucket/prefix")
    parser.add_argument("--cache-dir", default=None,
                        help="cache root (default: $METRONOME_MODEL_CACHE, else ~/.cache/metronome/models)")
    parser.add_argument("--hf-endpoint", default=None,
                        help="Hub or mirror URL (default: $HF_ENDPOINT, else huggingface.co)")
    parser.add_argument("--s3-endpoint", default=None,
                        help="S3-compatible endpoint URL (default: $AWS_ENDPOINT_URL_S3, else $AWS_ENDPOINT_URL, "
                             "else AWS)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    from metronome.contract.errors import MetronomeError
    from metronome.server.models.fetch import fetch_model, local_model_spec

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":  # one line per HTTP request from the clients' stacks is noise here
        for name in ("httpx", "httpx2", "botocore", "boto3", "urllib3", "s3transfer"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        fetched = fetch_model(args.source, args.cache_dir, hf_endpoint=args.hf_endpoint, s3_endpoint=args.s3_endpoint)
        local_model_spec(fetched.folder)  # the folder must be loadable, not merely present
    except MetronomeError as exc:
        print(f"metronome fetch-model: error: {exc}", file=sys.stderr)
        return 1
    print(fetched.folder)
    return 0
