"""The glue behind `metronome bench run` and `metronome bench sweep`: build the target, run, print, write."""
from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metronome.contract.config import ConfigError, validate_scheduler
from metronome.contract.errors import MetronomeError
from metronome.server.bench.load.clients import Client, EngineClient, HttpClient
from metronome.server.bench.load.inprocess import DEFAULT_HTTP_TOKEN_RANGE, sampler_for_engine, sampler_for_range
from metronome.server.bench.load.plots import plot_runs
from metronome.server.bench.load.results import RunEntry, environment, write_json
from metronome.server.bench.load.run_output import args_config, plot_entries
from metronome.server.bench.load.runner import LoadPattern, StopRule, run_load
from metronome.server.bench.load.stats import summarize
from metronome.server.bench.load.workloads import (
    LongShortSpec,
    ShiftSpec,
    TokenSampler,
    WorkloadSpec,
    iter_requests,
    load_jsonl,
    validate_spec,
)
from metronome.server.engine.flags import engine_config_from_args, scheduler_from_args


@dataclass
class Target:
    client: Client
    sampler: TokenSampler | None
    engine: Any = None  # AsyncEngine when in-process
    http: HttpClient | None = None
    description: str = ""


@asynccontextmanager
async def open_target(args: argparse.Namespace) -> AsyncIterator[Target]:
    token_range = args.token_id_range
    if args.url:
        http = HttpClient(args.url, model=args.model, timeout_s=args.request_timeout)
        try:
            await http.discover()
            sampler = sampler_for_range(*(token_range or DEFAULT_HTTP_TOKEN_RANGE))
            yield Target(http, sampler, http=http, description=f"{http.base_url} ({http.model})")
        finally:
            await http.close()
        return
    from metronome.server.engine.async_engine import AsyncEngine
    from metronome.server.engine.engine import EngineCore

    core = EngineCore.from_config(engine_config_from_args(args), scheduler_from_args(args))
    engine = AsyncEngine(core)
    await engine.start()
    try:
        sampler = sampler_for_range(*token_range) if token_range else sampler_for_engine(core)
        yield Target(EngineClient(engine), sampler, engine=engine, description=f"in-process {core.model_name}")
    finally:
        await engine.shutdown()
        core.close()


def workload_spec(args: argparse.Namespace, expected_requests: int | None) -> WorkloadSpec:
    """The workload the flags describe, checked (a jsonl file is read once here) before any engine is built."""
    shift_after = args.shift_after
    if shift_after is None:
        shift_after = max(1, (expected_requests or 200) // 2)
    spec = WorkloadSpec(
        name=args.workload,
        long_short=LongShortSpec(long_fraction=args.long_fraction, long_prompt_len=args.long_prompt_len,
                                 short_prompt_len=args.short_prompt_len, output_len=args.output_len),
        shift=ShiftSpec(shift_after=shift_after, long_prompt_len=args.long_prompt_len,
                        short_prompt_len=args.short_prompt_len, output_len=args.output_len),
        jsonl_path=args.jsonl,
        output_len_override=args.max_tokens,
    )
    validate_spec(spec)
    if spec.name == "jsonl":
        load_jsonl(spec.jsonl_path)  # type: ignore[arg-type]
    return spec


def stop_rule(args: argparse.Namespace) -> StopRule:
    num = args.num_requests if (args.num_requests or args.duration) else 100
    return StopRule(num_requests=num, duration_s=args.duration, request_timeout_s=args.request_timeout,
                    drain_timeout_s=args.drain_timeout)


async def warm_up(target: Target, spec: WorkloadSpec, seed: int, count: int) -> None:
    """Unmeasured requests first (compilation, allocator, connection pool); a different seed keeps the measured
    prompts out of the prefix cache."""
    if count <= 0:
        return
    stop = StopRule(num_requests=count, request_timeout_s=600.0, drain_timeout_s=600.0)
    await run_load(target.client, iter_requests(spec, target.sampler, seed + 1_000_003),
                   LoadPattern(concurrency=min(count, 4)), stop)


async def bench_run(args: argparse.Namespace) -> int:
    from metronome.server.bench.load.report import console, runs_table

    stop = stop_rule(args)
    if args.concurrency is not None:
        patterns = [LoadPattern(concurrency=args.concurrency)]
    else:
        patterns = [LoadPattern(rate=r) for r in (args.rate or [4.0])]
    spec = workload_spec(args, stop.expected_requests(patterns[0]))
    slo = args.slo_tbt_ms[0]
    runs: list[RunEntry] = []
    async with open_target(args) as target:
        await warm_up(target, spec, args.seed, args.warmup_requests)
        for pattern in patterns:
            label = f"{args.workload} @ {pattern.label()}"
            result = await run_load(target.client, iter_requests(spec, target.sampler, args.seed), pattern, stop,
                                    seed=args.seed, progress=not args.no_progress, label=label)
            params = {"workload": args.workload, "rate": pattern.rate, "concurrency": pattern.concurrency}
            runs.append(RunEntry(label, params, summarize(result.records, slo, args.slo_ttft_ms), result.records,
                                 result.started_at, result.wall_s))
        description = target.description
    console().print(runs_table(runs, title=f"metronome bench run: {description}"))
    if args.out:
        write_json(args.out, {"kind": "run", "config": args_config(args), "environment": environment(),
                              "target": description,
                              "runs": [r.to_dict(include_records=not args.no_records) for r in runs]})
    if args.plot:
        plot_runs(plot_entries(runs, lambda r: args.workload), args.plot, slo,
                  title=f"{description}: {args.workload}")
    return 0


async def bench_sweep(args: argparse.Namespace) -> int:
    from metronome.server.bench.load.experiment_manifest import check_service_name, experiment_manifest
    from metronome.server.bench.load.report import console, recommendation_lines, recommendation_table, runs_table
    from metronome.server.bench.load.sweep import (
        EngineTarget,
        ServerFileTarget,
        SweepError,
        grid,
        parse_policies,
        recommend,
        run_sweep,
    )

    if args.url and not args.config_file:
        raise SweepError("a sweep against --url needs --config-file: the server's --config file to rewrite")
    if args.emit_experiment and not args.service:
        raise SweepError("--emit-experiment needs --service: the InferenceService to try the recommendation on")
    if args.emit_experiment:
        check_service_name(args.service)
    configs = grid(args.chunk_sizes, parse_policies(args.policies))
    stop = stop_rule(args)
    spec = workload_spec(args, stop.expected_requests(LoadPattern(rate=max(args.rates))))
    async with open_target(args) as target:
        if target.http is not None:
            config_target = ServerFileTarget(args.config_file, target.http, timeout_s=args.reload_timeout)
            current = await target.http.get_json("/v1/config")
            try:
                base = validate_scheduler(current.get("scheduler") or {}, source=f"{args.url}/v1/config")
            except ConfigError as exc:
                raise SweepError(str(exc)) from exc
        else:
            config_target = EngineTarget(target.engine)
            base = scheduler_from_args(args)
        await warm_up(target, spec, args.seed, args.warmup_requests)
        runs = await run_sweep(config_target, target.client, base, configs, args.rates,
                               lambda: iter_requests(spec, target.sampler, args.seed), stop, args.seed,
                               args.slo_tbt_ms[0], args.slo_ttft_ms, progress=not args.no_progress)
        description = target.description
    recommendations = [recommend(runs, slo) for slo in args.slo_tbt_ms]
    out = console()
    out.print(runs_table(runs, title=f"metronome bench sweep: {description}, workload {args.workload}"))
    out.print(recommendation_table(recommendations))
    for line in recommendation_lines(recommendations):
        out.print(line)
    if args.out:
        from dataclasses import asdict

        write_json(args.out, {"kind": "sweep", "config": args_config(args), "environment": environment(),
                              "target": description,
                              "runs": [r.to_dict(include_records=not args.no_records) for r in runs],
                              "recommendations": [asdict(r) for r in recommendations]})
    if args.emit_experiment:
        Path(args.emit_experiment).write_text(experiment_manifest(recommendations[0], args.service, args.namespace))
        out.print(f"experiment manifest for {args.service}: {args.emit_experiment}")
    if args.plot:
        plot_runs(plot_entries(runs, lambda r: f"chunk {r.params['chunk_size']} / {r.params['queue_policy']}"),
                  args.plot, args.slo_tbt_ms[0], title=f"{description}: {args.workload} sweep")
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        if args.bench_command == "engine":
            from metronome.server.bench.engine.command import main as engine_main

            return engine_main(args)
        if args.bench_command == "sweep":
            return asyncio.run(bench_sweep(args))
        return asyncio.run(bench_run(args))
    except (MetronomeError, ConfigError) as exc:
        print(f"metronome bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("metronome bench: interrupted", file=sys.stderr)
        return 130
