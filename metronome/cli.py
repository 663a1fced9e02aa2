"""The `metronome` command. Sub-commands live in their own modules and are imported only when chosen, so
`metronome operator` never pays for torch and `metronome --help` is instant.

Each sub-command module exposes `configure(parser)` (argparse only, no heavy imports) and `run(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from metronome import __version__

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("metronome.server.generate_cli", "run prompts through the engine and print the completions"),
    "serve": ("metronome.server.api.serve_cli", "run the OpenAI-compatible streaming server"),
    "bench": ("metronome.server.bench.cli", "measure TTFT/TBT/throughput against a server or in-process engine"),
    "operator": ("metronome.operator.main", "run the Kubernetes operator (kopf)"),
    "operator-stop": ("metronome.operator.stop", "stop the operator's replicas and remove its Lease (the chart's "
                      "pre-delete hook)"),
    "fetch-model": ("metronome.server.models.fetch.cli", "download an hf:// or s3:// model into the local cache"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metronome", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"metronome {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.configure(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
