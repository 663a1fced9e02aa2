"""`metronome bench [run|sweep|engine|loop|isolation|fuzz|stream-cost]`: argparse only here; the work is imported
when a command runs.

    metronome bench run    --model random:tiny --rate 2 --num-requests 50 --out r.json --plot r.png
    metronome bench run    --url http://127.0.0.1:8000 --concurrency 8 --duration 60
    metronome bench sweep  --model random:tiny --chunk-sizes 256,512 --policies fcfs,split --rates 1,2,4
    metronome bench sweep  --url http://127.0.0.1:8000 --config-file /etc/metronome/server.yaml ...
    metronome bench engine --model random:llama-3-8b --device cuda --out h200.json
    metronome bench loop   --model random:tiny --device cpu --static 512,split --out loop.json --plot loop.png
    metronome bench stream-cost --model random:tiny --streams 64 --tokens 400 --out cost.json

`metronome bench` without a sub-command is `bench run`. Flags are documented in docs/bench.md.
"""
from __future__ import annotations

import argparse
import math

from metronome.contract.config import QueuePolicy
from metronome.server.cli_types import fraction, nonneg_int, positive_chunk, positive_float, positive_int
from metronome.server.engine.flags import add_engine_flags, add_scheduler_flags

WORKLOADS = ("long-short", "chat", "shift", "jsonl")


def _rate(text: str) -> float:
    if text.strip().lower() in ("inf", "burst"):
        return math.inf
    return positive_float(text)


def _csv(item_type):
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return [item_type(t) for t in items]

    return parse


def _token_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token ids, got {text!r}") from None
    if not sep or lo < 0 or hi - lo < 2:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH with 0 <= LOW and HIGH - LOW >= 2, got {text!r}")
    return lo, hi


# A benchmark measures queueing: it does not want 429s unless asked (--max-waiting).
BENCH_MAX_WAITING = 100_000
POLICIES = tuple(p.value for p in QueuePolicy)


def _add_target(p: argparse.ArgumentParser, with_url: bool = True, model: str | None = None,
                engine_defaults: dict | None = None, scheduler_defaults: dict | None = None) -> None:
    """--url, or the in-process engine's flags (engine/flags.py; --seed, defined with the workload, seeds the
    engine too)."""
    g = p.add_argument_group("target")
    if with_url:
        g.add_argument("--url", help="benchmark a running server (OpenAI API) instead of an in-process engine")
    if with_url:
        g.add_argument("--model", default=model,
                       help="in-process: the model spec (random:<preset>, .gguf, hf-dir:...; default: the engine's "
                            "default model); with --url: the served model name (default: the first in /v1/models)")
    else:
        g.add_argument("--model", default=model,
                       help="the model spec (random:<preset>, .gguf, hf-dir:...; default: %(default)s)")
    add_engine_flags(g, skip=("model", "seed"), defaults={"max_waiting": BENCH_MAX_WAITING, **(engine_defaults or {})},
                     note="in-process: ")
    add_scheduler_flags(g, defaults=scheduler_defaults, note="in-process, initial: ")


def _add_workload(p: argparse.ArgumentParser, default_workload: str = "long-short") -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default=default_workload,
                   help=f"request mix (default: {default_workload})")
    g.add_argument("--jsonl", metavar="PATH", help="jsonl workload: one {prompt|prompt_token_ids, max_tokens} a line")
    g.add_argument("--max-tokens", type=positive_int, default=None, help="override every request's output length")
    g.add_argument("--long-fraction", type=fraction, default=0.2, help="long-short: share of long prompts")
    g.add_argument("--long-prompt-len", type=positive_int, default=2000, help="long-short/shift: long prompt tokens")
    g.add_argument("--short-prompt-len", type=positive_int, default=50, help="long-short/shift: short prompt tokens")
    g.add_argument("--output-len", type=positive_int, default=128, help="long-short/shift: output tokens")
    g.add_argument("--shift-after", type=int, default=None,
                   help="shift: requests in the short-heavy phase (default: half the run)")
    g.add_argument("--token-id-range", type=_token_range, default=None, metavar="LOW:HIGH",
                   help="prompt token ids to draw from (default in-process: the model's vocabulary minus special "
                        "ids; with --url: 300:500)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")


def _add_load(p: argparse.ArgumentParser, sweep: bool) -> None:
    g = p.add_argument_group("load")
    if sweep:
        g.add_argument("--rates", type=_csv(_rate), default=[1.0, 2.0, 4.0], help="Poisson rates, req/s (1,2,4)")
    else:
        mode = g.add_mutually_exclusive_group()
        mode.add_argument("--rate", type=_csv(_rate), default=None,
                          help="Poisson arrivals, req/s; a comma list runs once per rate; 'inf' = all at once")
        mode.add_argument("--concurrency", type=positive_int, default=None, help="fixed number of requests in flight")
    stop = g.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=positive_float, default=None, help="seconds of sending per run")
    stop.add_argument("--num-requests", type=positive_int, default=None, help="requests per run (default: 100)")
    g.add_argument("--request-timeout", type=positive_float, default=600.0, help="per-request limit, s (600)")
    g.add_argument("--drain-timeout", type=positive_float, default=120.0,
                   help="after the last send, in-flight requests get this long, then are cancelled (120)")
    g.add_argument("--warmup-requests", type=nonneg_int, default=2, help="unmeasured requests sent first (2)")


def _add_output(p: argparse.ArgumentParser, slo_default: str) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--slo-tbt-ms", type=_csv(positive_float), default=_csv(positive_float)(slo_default),
                   help=f"TBT SLO in ms for goodput and recommendations; sweep takes a list (default: {slo_default})")
    g.add_argument("--slo-ttft-ms", type=positive_float, default=None, help="optional TTFT SLO for goodput, ms")
    g.add_argument("--out", metavar="PATH", help="write results JSON here")
    g.add_argument("--plot", metavar="PATH", help="write a PNG: TBT CDF per run, TBT p99 vs throughput")
    g.add_argument("--no-records", action="store_true", help="leave raw per-request records out of the JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _configure_run(p: argparse.ArgumentParser) -> None:
    _add_target(p)
    _add_workload(p)
    _add_load(p, sweep=False)
    _add_output(p, "100")


def _configure_sweep(p: argparse.ArgumentParser) -> None:
    _add_target(p)
    _add_workload(p)
    _add_load(p, sweep=True)
    _add_output(p, "100")
    g = p.add_argument_group("sweep")
    g.add_argument("--chunk-sizes", type=_csv(positive_chunk), default=[256, 512, 1024, 2048],
                   help="chunk sizes to try ('unchunked' = 1<<20) (256,512,1024,2048)")
    g.add_argument("--policies", default="fcfs,split", help="queue policies to try (fcfs,split)")
    g.add_argument("--config-file", metavar="PATH",
                   help="with --url: the server's --config file, rewritten by a Kubernetes-style ..data swap")
    g.add_argument("--reload-timeout", type=positive_float, default=30.0,
                   help="with --url: seconds to wait for /v1/config to report a new generation (30)")


def _overlap_variant(value: str) -> str:
    from metronome.server.engine.config import MIXED_OVERLAP

    if value not in MIXED_OVERLAP:
        raise argparse.ArgumentTypeError(f"a mixed-overlap variant is one of {', '.join(MIXED_OVERLAP)}, got {value!r}")
    return value


def _configure_engine(p: argparse.ArgumentParser) -> None:
    _add_target(p, with_url=False, model="random:llama-3-8b", engine_defaults={"device": "cuda"},
                scheduler_defaults={"chunk_size": 2048})
    g = p.add_argument_group("engine benchmark")
    g.add_argument("--sections", type=_csv(str), default=["device", "decode", "prefill", "longshort", "hf"],
                   help="which parts to run (device,decode,prefill,longshort,hf; saturation only when named)")
    g.add_argument("--copy-mb", type=positive_int, default=2048, help="device copy size, MiB (2048)")
    g.add_argument("--matmul-size", type=positive_int, default=8192, help="square bf16 matmul size (8192)")
    g.add_argument("--reps", type=positive_int, default=10, help="timed repetitions per micro-benchmark (10)")
    g.add_argument("--batch-sizes", type=_csv(positive_int), default=[1, 16, 64, 256], help="decode batches")
    g.add_argument("--context", type=positive_int, default=2048, help="decode context length, tokens (2048)")
    g.add_argument("--decode-steps", type=positive_int, default=20, help="timed decode steps per batch (20)")
    g.add_argument("--prefill-prompt-len", type=positive_int, default=2048, help="prefill prompt length (2048)")
    g.add_argument("--prefill-prompts", type=positive_int, default=8, help="prompts in the prefill test (8)")
    g.add_argument("--prefill-chunk", type=positive_chunk, default=8192,
                   help="chunk size while building decode contexts and in the prefill test (8192)")
    g.add_argument("--rates", type=_csv(_rate), default=[8.0, 16.0, 32.0, 48.0, 64.0],
                   help="long-short Poisson rates, req/s (8,16,32,48,64)")
    g.add_argument("--chunk-sizes", type=_csv(positive_chunk), default=[256, 512, 1024, 2048, 1 << 20],
                   help="chunk sizes for long-short ('unchunked' = 1<<20)")
    g.add_argument("--queue-policy-longshort", dest="longshort_policy", choices=POLICIES,
                   default=QueuePolicy.FCFS.value, help="queue policy of the long-short runs (fcfs)")
    per_run = g.add_mutually_exclusive_group()
    per_run.add_argument("--num-requests", type=positive_int, default=None,
                         help="long-short requests per run (default: 200)")
    per_run.add_argument("--duration", type=positive_float, default=None,
                         help="long-short: seconds of sending per run instead of a count")
    g.add_argument("--drain-timeout", type=positive_float, default=120.0, help="long-short drain limit, s")
    g.add_argument("--mixed-overlap-variants", type=_csv(_overlap_variant), default=None, metavar="off,on",
                   help="long-short: run each chunk size and rate once per listed mixed-step overlap setting, one "
                        "right after the other on one engine (started with --mixed-overlap on), and compare them")
    g.add_argument("--warmup-requests", type=nonneg_int, default=16,
                   help="unmeasured long-short requests sent at once before each chunk size's runs (16)")
    g.add_argument("--long-prompt-len", type=positive_int, default=2000, help="long-short long prompt tokens")
    g.add_argument("--short-prompt-len", type=positive_int, default=50, help="long-short short prompt tokens")
    g.add_argument("--output-len", type=positive_int, default=128, help="long-short output tokens")
    g.add_argument("--long-fraction", type=fraction, default=0.2, help="long-short share of long prompts")
    g.add_argument("--batch-chunk-size", type=_csv(positive_chunk), default=[2048, 512],
                   help="chunk sizes of our engine on the same batch as transformers: the first is compared (its "
                        "throughput config), the others are recorded beside it (2048,512)")
    g.add_argument("--skip-hf", action="store_true", help="skip the transformers continuous-batching peer")
    g.add_argument("--hf-requests", type=positive_int, default=200, help="requests in the transformers batch (200)")
    g.add_argument("--hf-attn", default="paged|sdpa", help="transformers attn_implementation (paged|sdpa)")
    g.add_argument("--hf-timeout", type=positive_float, default=900.0, help="transformers batch limit, s")
    g.add_argument("--slo-tbt-ms", type=positive_float, default=30.0, help="TBT SLO for capacity, ms (30)")
    # saturation (engine/saturation.py)
    g.add_argument("--saturation-prompt-len", type=positive_int, default=1000, help="saturation prompt tokens (1000)")
    g.add_argument("--saturation-output-len", type=positive_int, default=1000, help="saturation output tokens (1000)")
    g.add_argument("--saturation-max-requests", type=positive_int, default=None,
                   help="cap on the saturation requests, which are as many as the KV cache holds (default: the "
                        "largest decode CUDA-graph size, 512); the engine starts with max_num_seqs >= this")
    g.add_argument("--saturation-chunk-size", type=positive_chunk, default=2048,
                   help="saturation prefill chunk (2048: with the decodes a step stays within the piecewise graphs)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", metavar="PATH", help="write the one results JSON here")
    g.add_argument("--plot", metavar="PATH", help="PNG of TBT p99 vs throughput per chunk size")
    g.add_argument("--no-records", action="store_true", help="leave raw per-request records out of the JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(bench_command="run")
    _configure_run(parser)  # `metronome bench ...` with no sub-command is `bench run ...`
    sub = parser.add_subparsers(dest="bench_command", metavar="{run,sweep,engine,loop,isolation,fuzz,stream-cost}")
    _configure_run(sub.add_parser("run", help="one workload at one or more loads (default)",
                                  description="Run a workload against a server or an in-process engine."))
    _configure_sweep(sub.add_parser("sweep", help="chunk sizes x policies x rates; recommend a configuration",
                                    description="Sweep scheduler configurations and recommend one for a TBT SLO."))
    _configure_engine(sub.add_parser("engine", help="in-process engine benchmark vs the hardware floor",
                                     description="Device peak, decode/prefill efficiency, long-short capacity "
                                                 "per chunk size, and transformers' continuous batching."))
    _configure_loop(sub)


    _configure_robustness(sub)
    _configure_stream_cost(sub.add_parser(
        "stream-cost", help="CPU per streamed token of a local server's API and engine processes",
        description="Start `metronome serve --engine-process on`, stream tokens, and read both processes' CPU "
                    "time around every round (docs/bench.md)."))


def _configure_stream_cost(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="random:tiny", help="the model spec to serve (default: %(default)s)")
    p.add_argument("--streams", type=positive_int, default=64, help="requests streamed at once per round (64)")
    p.add_argument("--tokens", type=positive_int, default=400, help="tokens per request (400)")
    p.add_argument("--rounds", type=positive_int, default=3, help="measured rounds, after one warm-up (3)")
    p.add_argument("--serve-arg", action="append", metavar="ARG",
                   help="one more `metronome serve` argument (repeatable), e.g. --serve-arg=--device=cuda")
    p.add_argument("--out", metavar="PATH", help="write the results JSON here")


def _configure_robustness(sub) -> None:
    """The robustness benchmarks; their flags live in robustness/cli.py."""
    from metronome.server.bench.robustness import cli as robustness_cli

    robustness_cli.configure_isolation(sub.add_parser(
        "isolation", help="steady streams with hostile requests injected: TBT p99 and max gap with and without",
        description="Can one client's requests disturb the others' token streams? (docs/bench.md)"))
    robustness_cli.configure_fuzz(sub.add_parser(
        "fuzz", help="many fuzzed requests against a server: no 5xx, OpenAI-style errors, no leaked KV blocks",
        description="A soak of fuzzed request bodies over every route (docs/bench.md)."))


def _configure_loop(sub) -> None:
    """The closed-loop benchmark; its flags live in loop/cli.py."""
    from metronome.server.bench.loop import cli as loop_cli

    loop_cli.configure(sub.add_parser(
        "loop", help="the operator's control loop against real servers, vs static configs",
        description="A phased workload on `metronome serve` processes retuned by the operator's decide(), and the "
                    "same workload on static configs (docs/bench.md)."))


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "loop":
        from metronome.server.bench.loop.cli import main as loop_main

        return loop_main(args)
    if args.bench_command == "stream-cost":
        from metronome.server.bench.robustness.stream_cost import main as stream_cost_main

        return stream_cost_main(args)
    if args.bench_command in ("isolation", "fuzz"):
        from metronome.server.bench.robustness import cli as robustness_cli

        return (robustness_cli.run_isolation if args.bench_command == "isolation" else robustness_cli.run_fuzz)(args)
    from metronome.server.bench.load.commands import main

    return main(args)
