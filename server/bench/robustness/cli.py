"""Flags of `metronome bench isolation` and `metronome bench fuzz`; argparse only, the work is imported when the
command runs."""
from __future__ import annotations

import argparse

from metronome.server.cli_types import nonneg_int, positive_float, positive_int


def _target(p: argparse.ArgumentParser, default_model: str) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", help="a running server; without it one is started on 127.0.0.1 with --model")
    g.add_argument("--model", default=default_model,
                   help=f"started server: its --model (default {default_model}); with --url: the served name to send")
    g.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the started server, repeatable (e.g. --serve-arg=--max-waiting=16)")


def configure_isolation(p: argparse.ArgumentParser) -> None:
    _target(p, "random:tiny")
    g = p.add_argument_group("load")
    g.add_argument("--streams", type=positive_int, default=4, help="steady streaming clients (4)")
    g.add_argument("--stream-tokens", type=positive_int, default=128, help="tokens per steady request (128)")
    g.add_argument("--phase-seconds", type=positive_float, default=10.0, help="length of each quiet/hostile phase (10)")
    g.add_argument("--rounds", type=positive_int, default=4,
                   help="quiet+hostile pairs; the hostile kinds rotate, so 4 gives each one phase (4)")
    g.add_argument("--big-body-mb", type=positive_float, default=16.0, help="size of the oversized bodies, MiB (16)")
    g.add_argument("--long-prompt-tokens", type=positive_int, default=10_000,
                   help="words in the long text prompts (10000)")
    g.add_argument("--burst", type=positive_int, default=64, help="requests per burst (64)")
    g.add_argument("--storm", type=positive_int, default=32, help="streams per disconnect storm (32)")
    g.add_argument("--hostile-client", choices=["other", "same"], default="other",
                   help="hostile requests as a client of their own (`user` field; default) or as the steady one")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", metavar="PATH", help="write the results JSON here")


def configure_fuzz(p: argparse.ArgumentParser) -> None:
    _target(p, "random:tiny")
    g = p.add_argument_group("soak")
    g.add_argument("--requests", type=positive_int, default=20_000, help="fuzzed requests to send (20000)")
    g.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight (16)")
    g.add_argument("--seed", type=nonneg_int, default=0)
    g.add_argument("--out", metavar="PATH", help="write the results JSON here")


def run_isolation(args: argparse.Namespace) -> int:
    from metronome.server.bench.robustness.isolation import run_command

    return run_command(args)


def run_fuzz(args: argparse.Namespace) -> int:
    from metronome.server.bench.robustness.fuzz_soak import run_command

    return run_command(args)
