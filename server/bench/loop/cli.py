"""`metronome bench loop` flags (configure) and the command (main). Flags are documented in docs/bench.md.

    metronome bench loop --model random:tiny --device cpu --slo-tbt-ms 40 --slo-ttft-ms 3000 \\
        --phases chat:4:60,long-short:3:60,long-short:8:30 --initial 4096,fcfs \\
        --tuning-policies model,multiplicative --static 4096,fcfs --static 512,split --out loop.json --plot loop.png
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from metronome.contract.config import QueuePolicy

DEFAULT_PHASES = "chat:4:60,long-short:3:60,long-short:8:30"


def _chunk_policy(text: str) -> tuple[int, str]:
    chunk, sep, policy = text.partition(",")
    try:
        size = int(chunk)
    except ValueError:
        size = 0
    if not sep or size < 1 or policy.strip() not in [p.value for p in QueuePolicy]:
        raise argparse.ArgumentTypeError(f"expected CHUNK,POLICY (e.g. 512,split; policy one of "
                                         f"{', '.join(p.value for p in QueuePolicy)}), got {text!r}")
    return size, policy.strip()


def _static(text: str) -> tuple[int, str, int | None]:
    """CHUNK,POLICY[,SERVERS]: a static config, on SERVERS servers (None: --servers)."""
    head, _, servers = text.rpartition(",")
    if head.count(",") == 1:
        try:
            count = int(servers)
        except ValueError:
            count = 0
        if count < 1:
            raise argparse.ArgumentTypeError(f"expected CHUNK,POLICY[,SERVERS] with SERVERS >= 1, got {text!r}")
        return (*_chunk_policy(head), count)
    return (*_chunk_policy(text), None)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of spec.autotune keys")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    from metronome.server.bench.cli import _token_range
    from metronome.server.cli_types import fraction, nonneg_float, positive_float, positive_int

    g = p.add_argument_group("servers")
    g.add_argument("--model", default=None, help="passed to `metronome serve --model` (default: serve's default)")
    g.add_argument("--device", default=None, help="passed to `metronome serve --device` (default: serve's default)")
    g.add_argument("--servers", type=positive_int, default=1,
                   help="server processes, all on 127.0.0.1: every run's, or with --scale-replicas the most a loop "
                        "run may start (1)")
    g.add_argument("--scale-replicas", action="store_true",
                   help="loop runs decide the number of servers too (the operator's replica loop): they start at "
                        "--min-servers and start or drain servers within [--min-servers, --servers]; the load goes "
                        "to the live ones, a server leaves it before it is drained")
    g.add_argument("--min-servers", type=positive_int, default=1,
                   help="with --scale-replicas: the fewest servers, where loop runs start (1)")
    g.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more word for every `metronome serve` (repeatable; e.g. --serve-arg=--max-num-seqs=64)")
    g.add_argument("--server-timeout", type=positive_float, default=600.0,
                   help="seconds for a server to become ready (600)")
    g.add_argument("--work-dir", type=Path, default=None, help="servers' config folders and logs (a temp folder)")
    g.add_argument("--reuse-servers", action="store_true",
                   help="one set of servers for every run, each run starting from its own config once they are idle "
                        "(start-up takes minutes on a GPU; pair with --serve-arg=--no-prefix-caching so a later run "
                        "does not hit the cache an earlier run filled)")

    g = p.add_argument_group("workload")
    g.add_argument("--phases", default=DEFAULT_PHASES,
                   help="WORKLOAD:RATE:SECONDS[:LONG_FRACTION[:OUTPUT_LEN]],... with WORKLOAD chat or long-short, "
                        "Poisson rate in req/s, an optional long share and output length per phase "
                        f"(default {DEFAULT_PHASES}: short-heavy chat, the long-short mix, a burst)")
    g.add_argument("--long-fraction", type=fraction, default=0.2, help="long-short: share of long prompts (0.2)")
    g.add_argument("--long-prompt-len", type=positive_int, default=2000, help="long-short: long prompt tokens (2000)")
    g.add_argument("--short-prompt-len", type=positive_int, default=50, help="long-short: short prompt tokens (50)")
    g.add_argument("--output-len", type=positive_int, default=128, help="long-short: output tokens (128)")
    g.add_argument("--chat-prompt-median", type=positive_float, default=300.0, help="chat: median prompt tokens")
    g.add_argument("--chat-output-median", type=positive_float, default=150.0, help="chat: median output tokens")
    g.add_argument("--chat-max-prompt-len", type=positive_int, default=4000, help="chat: longest prompt (4000)")
    g.add_argument("--token-id-range", type=_token_range, default=(300, 500), metavar="LOW:HIGH",
                   help="prompt token ids to draw from (300:500)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (0)")
    g.add_argument("--request-timeout", type=positive_float, default=600.0, help="per-request limit, s (600)")
    g.add_argument("--drain-timeout", type=positive_float, default=60.0,
                   help="after the last phase, in-flight requests get this long (60)")
    g.add_argument("--client-processes", type=positive_int, default=1,
                   help="send the load from this many client processes, requests dealt round-robin: one Python "
                        "process reading thousands of streamed tokens/s adds its own delays to the TBT it records "
                        "(1)")
    g.add_argument("--warmup", type=nonneg_float, default=0.0, metavar="SECONDS",
                   help="after each server start, send the first phase's first SECONDS of requests unrecorded, so "
                        "no run pays for the servers' first seconds (0)")

    g = p.add_argument_group("loop")
    g.add_argument("--slo-tbt-ms", type=positive_float, default=30.0, help="TBT p99 target, ms (30)")
    g.add_argument("--slo-ttft-ms", type=positive_float, default=None,
                   help="TTFT p99 limit, ms: a constraint for the controller and part of goodput (none)")
    g.add_argument("--initial", type=_chunk_policy, default=(4096, "fcfs"), metavar="CHUNK,POLICY",
                   help="every loop run starts here (4096,fcfs: violating a tight TBT target)")
    g.add_argument("--tuning-policies", default="model",
                   help="one loop run per policy: model, multiplicative (the x0.9/x1.1 rule) (model)")
    g.add_argument("--static", type=_static, action="append", default=[], metavar="CHUNK,POLICY[,SERVERS]",
                   help="also run the workload with this config held on SERVERS servers (default --servers), no "
                        "loop (repeatable); the best per phase is the oracle")
    g.add_argument("--repeats", type=positive_int, default=1,
                   help="run every loop and static config this many times, round by round; each config is then "
                        "judged by its mean goodput per phase (one run's goodput is noisy) (1)")
    g.add_argument("--interval", type=positive_float, default=10.0, help="seconds between decisions (10)")
    g.add_argument("--window", type=positive_float, default=20.0, help="seconds each observation covers (20)")
    g.add_argument("--scrape-interval", type=positive_float, default=1.0, help="seconds between /metrics reads (1)")
    g.add_argument("--autotune", type=_json_object, default={},
                   help='spec.autotune keys as in the CRD, JSON (e.g. \'{"minChunkSize": 64, "cooldownSeconds": 10}\')'
                        "; mode is apply, policy comes from --tuning-policies, intervalSeconds from --interval")

    g = p.add_argument_group("output")
    g.add_argument("--out", metavar="PATH", help="write the JSON here")
    g.add_argument("--plot", metavar="PATH", help="write the timeline PNG here")


def main(args: argparse.Namespace) -> int:
    from metronome.contract.errors import MetronomeError

    try:
        return _main(args)
    except (MetronomeError, ValueError) as exc:
        print(f"metronome bench loop: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("metronome bench loop: interrupted", file=sys.stderr)
        return 130


def _main(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from metronome.contract.config import SchedulerConfig
    from metronome.operator import metrics_source as ms
    from metronome.operator.spec import SLOSpec, SpecError, parse_autotune
    from metronome.operator.tuning.settings import TuningPolicy
    from metronome.server.bench.load.workloads import ChatSpec, LongShortSpec, TokenSampler, WorkloadSpec
    from metronome.server.bench.loop import runner as loop
    from metronome.server.bench.loop.load import run_client_loop
    from metronome.server.bench.loop.phases import parse_phases, schedule

    phases = parse_phases(args.phases)
    policies = [t.strip() for t in args.tuning_policies.split(",") if t.strip()]
    allowed = [p.value for p in TuningPolicy]
    if any(p not in allowed for p in policies):
        raise ValueError(f"--tuning-policies: choose from {', '.join(allowed)}, got {args.tuning_policies!r}")
    if not policies and not args.static:
        raise ValueError("nothing to run: give --tuning-policies or at least one --static")
    if args.window < args.scrape_interval * 4:
        raise ValueError("--window must hold at least 4 scrapes (--scrape-interval)")
    if args.min_servers > args.servers:
        raise ValueError(f"--min-servers {args.min_servers} is more than --servers {args.servers}")
    base = SchedulerConfig()
    initial = loop.initial_scheduler(base, *args.initial)
    slo = SLOSpec(tbt_p99_ms=args.slo_tbt_ms, ttft_p99_ms=args.slo_ttft_ms)
    autotune_keys = {**args.autotune, "intervalSeconds": args.interval}
    try:
        autotune = parse_autotune(autotune_keys, {}, slo, initial)
    except SpecError as exc:
        raise ValueError(f"--autotune: {exc}") from None
    workload = WorkloadSpec(
        long_short=LongShortSpec(args.long_fraction, args.long_prompt_len, args.short_prompt_len, args.output_len),
        chat=replace(ChatSpec(), prompt_median=args.chat_prompt_median, output_median=args.chat_output_median,
                     max_prompt_len=args.chat_max_prompt_len))
    low, high = args.token_id_range
    requests = list(schedule(phases, workload, TokenSampler(high, low=low), args.seed))
    serve_args = [*(["--model", args.model] if args.model else []), *(["--device", args.device] if args.device else []),
                  *args.serve_arg]
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="metronome-loop-"))
    settings = loop.LoopSettings(
        phases=phases, requests=requests, servers=args.servers, serve_args=tuple(serve_args), work_dir=work_dir,
        interval_s=args.interval, scrape_interval_s=args.scrape_interval,
        window=ms.QueryWindow.for_window(args.window, scrape_interval_seconds=args.scrape_interval),
        slo_tbt_s=args.slo_tbt_ms / 1000, slo_ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None,
        request_timeout_s=args.request_timeout, drain_timeout_s=args.drain_timeout,
        server_timeout_s=args.server_timeout, reuse_servers=args.reuse_servers,
        client_processes=args.client_processes, warmup_s=args.warmup, scale_replicas=args.scale_replicas,
        min_servers=args.min_servers)
    # Server counts name the runs once more than one count is in play.
    counted = args.servers > 1 or any(n is not None for *_, n in args.static)
    start = args.min_servers if args.scale_replicas else args.servers
    plans = [loop.RunPlan(f"loop {p}" + (f" x{start}" if counted and not args.scale_replicas else ""),
                          loop.autotune_for(autotune, TuningPolicy(p), settings), initial, servers=start)
             for p in policies]
    plans += [loop.RunPlan(f"static {c}/{p}" + (f" x{n or args.servers}" if counted else ""), None,
                           loop.initial_scheduler(base, c, p), servers=n or args.servers) for c, p, n in args.static]
    plans = loop.repeated(plans, args.repeats)
    print(f"metronome bench loop: {len(plans)} run(s) of {len(requests)} requests; servers' logs in {work_dir}",
          file=sys.stderr)
    command = "metronome bench loop " + " ".join(shlex.quote(a) for a in sys.argv[3:]) \
        if sys.argv[1:3] == ["bench", "loop"] else " ".join(shlex.quote(a) for a in sys.argv)

    def write(runs: list[dict]) -> dict:
        result = loop.report(runs, settings, command)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return result

    runs = run_client_loop(loop.run_plans(plans, settings, progress=lambda m: print(m, file=sys.stderr, flush=True),
                                      on_run=write))
    result = write(runs)
    if args.plot:
        from metronome.server.bench.loop.plot import plot_timeline

        plot_timeline(result, args.plot)
    print(_summary(result))
    return 0


def _summary(result: dict) -> str:
    if max(c["repeats"] for c in result["configs"].values()) > 1:
        return _summary_of_repeats(result)
    lines = []
    for run in result["runs"]:
        phases = ", ".join(f"{p['goodput_tok_s']:.1f}" for p in run["phases"])
        line = (f"{run['label']:<24} goodput {run['goodput_tok_s']:8.2f} tok/s (per phase: {phases}), "
                f"{run['goodput_per_server_s']:.2f} tok per server-second over {run['server_seconds']:.0f} s")
        if not run["static"]:
            t = run["targets"]
            line += (f"; SLO after {t['intervals_to_slo']} interval(s), {t['changes_per_10_intervals']} changes/10 "
                     f"steady intervals, {t['reversals_within_phases']} reversal(s), "
                     f"vs oracle {t.get('goodput_vs_oracle')}")
        lines.append(line)
    if result["oracle"]:
        lines.append(f"oracle (best static per phase{_over_statics(result['oracle'])}): "
                     f"{result['oracle']['goodput_tok_s']:.2f} tok/s")
    return "\n".join(lines)


def _over_statics(oracle: dict) -> str:
    """How many static configs an oracle is the best of: over one it is that config, not a hindsight choice."""
    count = len(oracle["static_losses"])
    return (" of 1 static config: a comparison with that config, not an oracle" if count == 1
            else f" of {count} static configs")


def _summary_of_repeats(result: dict) -> str:
    """Per config its mean goodput with min-max, overall and per phase; the oracle by means; the largest spreads."""
    def over(stats: dict) -> str:
        return f"{stats['mean']:.1f} ({stats['min']:.1f}-{stats['max']:.1f})"

    lines = []
    for label, config in result["configs"].items():
        line = (f"{label:<24} goodput {over(config['goodput_tok_s'])} tok/s over {config['repeats']} run(s) "
                f"(per phase: {', '.join(over(p) for p in config['phases'])}), "
                f"{over(config['goodput_per_server_s'])} tok per server-second")
        if not config["static"]:
            line += f"; vs oracle by means {config.get('goodput_vs_oracle')}"
        lines.append(line)
    best = result["oracle_by_mean"]
    if best:
        configs = ", ".join(b["config"] for b in best["best_by_phase"])
        lines.append(f"oracle by means (best static mean per phase: {configs}{_over_statics(best)}): "
                     f"{best['goodput_tok_s']:.2f} tok/s")
    spreads = ", ".join(f"{s['spread']:.0%} ({s['config']})" for s in result["spread"]["largest_by_phase"])
    lines.append(f"largest spread (max-min)/mean per phase: {spreads}")
    return "\n".join(lines)
