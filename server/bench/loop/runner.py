"""`metronome bench loop`: the operator's control loop against real servers, minus Kubernetes and Prometheus.

One command runs the same phased workload (phases.py) several times, each time on fresh `metronome serve`
processes (servers.py) started from the same initial config:
- once per tuning policy (`--tuning-policies model,multiplicative`): every `--interval` seconds the servers'
  /metrics scrapes of the last `--window` seconds become an Observation through the operator's own queries and
  parser (scrape.py), the operator's own step runs on it (metronome.operator.tuning.actuation.tune: decide,
  lay a changed budget out, the next server.yaml generation), and a new generation is written to every server's
  config folder by the `..data` swap;
- once per `--static CHUNK,POLICY`, with the config held: the oracle is the best of these per phase;
- all of that `--repeats` times, round by round (repeated), each config then judged by its means over the repeats.
Per interval it records the config, what the controller saw, the clients' TBT/TTFT p99, throughput and goodput, and
the decision with its reason; report.py turns that into the targets, plot.py into a timeline.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from metronome.contract.budget import prefill_budget, with_budget
from metronome.contract.config import ConfigError, SchedulerConfig, ServerConfigFile
from metronome.operator import metrics_source as ms
from metronome.operator.tuning.actuation import tune
from metronome.operator.tuning.decision import CurrentConfig
from metronome.operator.tuning.replicas import Recommendation, prune
from metronome.operator.tuning.settings import AutotuneMode, AutotuneSpec
from metronome.server.bench.load.clients import HttpClient
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.loop import report as loop_report
from metronome.server.bench.loop.fleet import ServerFleet
from metronome.server.bench.loop.load import ClientPool, Load, LoadTarget
from metronome.server.bench.loop.phases import Phase, Scheduled, phase_bounds
from metronome.server.bench.loop.scrape import Scrape, observe, parse_scrape
from metronome.server.bench.loop.servers import LoopServer, LoopServerError


@dataclass(frozen=True)
class RunPlan:
    label: str  # "loop model", "static 512/split", "static 512/split #2"
    autotune: AutotuneSpec | None  # None: a static run
    initial: SchedulerConfig
    config_label: str = ""  # the label without the repeat's suffix ("": the label)
    repeat: int = 1
    servers: int = 1  # servers at the start (a static run keeps them; a loop with scale_replicas moves them)

    def __post_init__(self) -> None:
        if not self.config_label:
            object.__setattr__(self, "config_label", self.label)


def repeated(plans: Sequence[RunPlan], repeats: int) -> list[RunPlan]:
    """Every plan `repeats` times, round by round (all plans, then all again), so a drift of the machine over the
    command falls on every config alike. Repeat 1 keeps its label; repeat k > 1 gets " #k"."""
    return [replace(plan, label=plan.label if k == 1 else f"{plan.label} #{k}", config_label=plan.label, repeat=k)
            for k in range(1, repeats + 1) for plan in plans]


@dataclass(frozen=True)
class LoopSettings:
    phases: list[Phase]
    requests: list[Scheduled]
    servers: int
    serve_args: tuple[str, ...]
    work_dir: Path
    interval_s: float
    window: ms.QueryWindow
    scrape_interval_s: float
    slo_tbt_s: float
    slo_ttft_s: float | None
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 60.0
    server_timeout_s: float = 600.0
    reuse_servers: bool = False  # one set of servers for every run (start-up is minutes on a GPU)
    client_processes: int = 1  # >1: the load spread over that many client processes (load.py)
    warmup_s: float = 0.0  # the first phase's first seconds sent, unrecorded, once per server start
    env: dict[str, str] = field(default_factory=dict)
    scale_replicas: bool = False  # loop runs decide the number of servers too, within [min_servers, servers]
    min_servers: int = 1


def initial_scheduler(base: SchedulerConfig, chunk: int, policy: str) -> SchedulerConfig:
    """The base scheduler with a prefill budget of `chunk` under `policy`, laid out as the operator would."""
    return with_budget(base, chunk, policy, source="the initial config")


# --- one run -------------------------------------------------------------------------------------------------------

@dataclass
class _Loop:
    """The mutable state of one run's control loop."""

    plan: RunPlan
    config: ServerConfigFile
    current: CurrentConfig
    fleet: ServerFleet
    scrapes: dict[str, list[Scrape]] = field(default_factory=dict)
    intervals: list[dict[str, Any]] = field(default_factory=list)
    recent: tuple[Recommendation, ...] = ()  # the replica recommendations a scale-down must agree with


async def run_plans(plans: Sequence[RunPlan], settings: LoopSettings, progress=print,
                    on_run=None) -> list[dict[str, Any]]:
    """Every plan in turn, each on a fresh fleet, or all on one with `settings.reuse_servers` (each run then starts
    from its own initial config as a new generation and its own server count, once the servers are idle).
    `on_run(runs)` is called after each run with the runs so far (the CLI writes its JSON then: a command cut
    short keeps what it measured)."""
    done = on_run or (lambda runs: None)
    pool = await asyncio.to_thread(ClientPool, settings.client_processes) if settings.client_processes > 1 else None
    runs: list[dict[str, Any]] = []
    try:
        if not settings.reuse_servers:
            for plan in plans:
                folder = settings.work_dir / plan.label.replace(" ", "-").replace("/", "-")
                fleet = ServerFleet(folder, settings.serve_args, settings.env, settings.server_timeout_s, progress)
                config = ServerConfigFile(generation=1, scheduler=plan.initial)
                try:
                    load = await _ready(fleet, plan, config, settings, pool, progress)
                    runs.append(await _run_on(plan, fleet, config, settings, load, progress))
                finally:
                    await fleet.close()
                done(runs)
            return runs
        fleet = ServerFleet(settings.work_dir / "servers", settings.serve_args, settings.env,
                            settings.server_timeout_s, progress)
        try:
            load = None
            for plan in plans:
                # a new generation even when the initial config repeats: the server applies it anew
                config = ServerConfigFile(generation=runs[-1]["last_generation"] + 1 if runs else 1,
                                          scheduler=plan.initial)
                load = await _ready(fleet, plan, config, settings, pool, progress, load)
                await _wait_idle_on(fleet.live, config.generation, timeout_s=settings.drain_timeout_s + 60)
                runs.append(await _run_on(plan, fleet, config, settings, load, progress))
                done(runs)
        finally:
            await fleet.close()
        return runs
    finally:
        if pool is not None:
            pool.close()


async def _ready(fleet: ServerFleet, plan: RunPlan, config: ServerConfigFile, settings: LoopSettings,
                 pool: ClientPool | None, progress, load: Load | None = None) -> Load:
    """The fleet at the plan's server count on `config`, and the load for it (the model asked once). When servers
    were started, `settings.warmup_s` of the first phase's requests are sent and thrown away first: a server's
    first seconds (allocator growth, first batch shapes) would otherwise fall on whichever run comes first."""
    started = time.monotonic()
    before = len(fleet.live)
    await fleet.start(plan.servers, config)
    if len(fleet.live) > before:
        progress(f"[{plan.label}] {len(fleet.live)} server(s) ready in {time.monotonic() - started:.0f} s")
    if load is None:
        probe = HttpClient(fleet.live[0].base_url, timeout_s=settings.request_timeout_s)
        try:
            await probe.discover()
        finally:
            await probe.close()
        target = LoadTarget(base_urls=tuple(s.base_url for s in fleet.live), model=probe.model,
                            request_timeout_s=settings.request_timeout_s, drain_timeout_s=settings.drain_timeout_s,
                            routes_path=str(fleet.routes_path))
        load = Load(target, pool)
    warmup = [item for item in settings.requests if item.phase == 0 and item.offset_s < settings.warmup_s]
    if warmup and len(fleet.live) > before:
        started = time.monotonic()
        records = await load.send(warmup, started)
        progress(f"[warm-up] {sum(r.ok for r in records)}/{len(records)} requests of the first "
                 f"{settings.warmup_s:g} s completed in {time.monotonic() - started:.0f} s (not recorded)")
        await _wait_idle_on(fleet.live, config.generation, timeout_s=settings.drain_timeout_s + 60)
    return load


async def _wait_idle_on(servers: Sequence[LoopServer], generation: int, timeout_s: float) -> None:
    """Until every server reports `generation` in /v1/config and has nothing running or waiting."""
    import httpx

    from metronome.contract import metric_names as names

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            ready = 0
            for server in servers:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    applied = (await http.get(server.base_url + "/v1/config")).json()["generation"]
                    scrape = parse_scrape((await http.get(server.base_url + "/metrics")).text, server.name, 0.0)
                    busy = (scrape.total(names.REQUESTS_RUNNING) or 0) + (scrape.total(names.REQUESTS_WAITING) or 0)
                    ready += applied >= generation and busy == 0
            if ready == len(servers):
                return
            if time.monotonic() > deadline:
                raise LoopServerError(f"servers not idle on config generation {generation} after {timeout_s:.0f} s")
            await asyncio.sleep(0.5)


async def _run_on(plan: RunPlan, fleet: ServerFleet, config: ServerConfigFile, settings: LoopSettings,
                  load: Load, progress) -> dict[str, Any]:
    """Drive the workload on the fleet serving `config`, with the loop unless the plan is static; returns the
    run's JSON (with `records` for the report)."""
    progress(f"[{plan.label}] {len(settings.requests)} requests over {sum(p.duration_s for p in settings.phases):g} "
             f"s on {len(fleet.live)} server(s)")
    state = _Loop(plan, config, CurrentConfig.from_scheduler(plan.initial, fleet.desired, config.generation), fleet)
    t0 = time.monotonic()
    records = await _drive(settings, load, state, t0, progress)
    end = sum(p.duration_s for p in settings.phases)
    return {"label": plan.label, "config_label": plan.config_label, "repeat": plan.repeat,
            "static": plan.autotune is None,
            "tuning_policy": plan.autotune.policy.value if plan.autotune else None,
            "initial": {"chunk_size": prefill_budget(plan.initial), "queue_policy": plan.initial.queue_policy,
                        "servers": plan.servers},
            "server_seconds": round(fleet.server_seconds(t0, t0 + end), 3),
            "server_timeline": fleet.timeline(t0, t0 + end),
            "server_seconds_by_phase": [round(fleet.server_seconds(t0 + a, t0 + b), 3)
                                        for a, b in phase_bounds(settings.phases)],
            "last_generation": state.config.generation, "intervals": state.intervals, "records": records}


async def _drive(settings: LoopSettings, load: Load, state: _Loop, t0: float, progress) -> list[RequestRecord]:
    import httpx

    sending = asyncio.create_task(load.send(settings.requests, t0))
    end = sum(p.duration_s for p in settings.phases)
    next_decision = settings.interval_s
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            now = time.monotonic() - t0
            await _scrape(http, state, t0, keep_s=settings.window.window_seconds + settings.interval_s)
            if now >= next_decision:
                state.fleet.check()
                _control(state, settings, next_decision, now)
                interval = state.intervals[-1]
                progress(f"[{state.plan.label}] t={now:5.0f} s chunk {interval['chunk_size']:>5} "
                         f"{interval['queue_policy']:<5} x{interval['servers']} {interval['decision']['summary']}")
                next_decision += settings.interval_s
            if now >= end:
                break
            await asyncio.sleep(max(0.0, settings.scrape_interval_s - (time.monotonic() - t0 - now)))
    records = await sending
    await state.fleet.settle()  # drains under way finish before the next run starts
    return records


async def _scrape(http, state: _Loop, t0: float, keep_s: float) -> None:
    """Every live and draining server once; a stopped server's history goes (Prometheus marks its series stale)."""
    servers = state.fleet.scraped()

    async def one(server: LoopServer) -> None:
        with contextlib.suppress(Exception):  # a missed scrape is a gap in the window, as with Prometheus
            response = await http.get(server.base_url + "/metrics")
            # parsed off the event loop: it also timestamps every streamed token of the run
            scrape = await asyncio.to_thread(parse_scrape, response.text, server.name, time.monotonic() - t0)
            history = state.scrapes.setdefault(server.name, [])
            history.append(scrape)
            while history and history[0].time < scrape.time - keep_s:
                history.pop(0)

    await asyncio.gather(*(one(s) for s in servers))
    names = {s.name for s in servers}
    for gone in [name for name in state.scrapes if name not in names]:
        del state.scrapes[gone]


def _control(state: _Loop, settings: LoopSettings, due: float, now: float) -> None:
    """One control interval: observe, decide (unless static), carry the decision out, record it."""
    try:
        observation = observe(state.scrapes, settings.window, now)
    except ms.MetricsUnavailable:
        observation = None
    before = state.current
    fleet = state.fleet
    servers = {"servers": fleet.desired, "servers_live": len(fleet.live), "servers_draining": len(fleet.draining)}
    if state.plan.autotune is None:
        summary = reason = "static config"
        changed, actions, to = False, ["static"], (before.chunk_size, before.queue_policy, before.replicas)
    elif due < settings.window.window_seconds:
        # A running service's window is always full; the load here started at 0, so the first decision waits.
        summary, changed, actions = "warm-up", False, ["warm_up"]
        to = (before.chunk_size, before.queue_policy, before.replicas)
        reason = f"warm-up: the {settings.window.window_seconds:g} s window is not full yet"
    else:
        wall = time.time()  # the servers stamp config_applied in Unix time
        tuned = tune(observation, state.config, before.replicas, state.plan.autotune, wall, before.last_change_time,
                     state.recent)
        decision = tuned.decision
        changed, actions, reason = decision.changed, [a.value for a in decision.actions], decision.reason
        to = (decision.chunk_size, decision.queue_policy, decision.replicas)
        summary = decision.describe_change(before) if changed else actions[0]
        if tuned.problem is not None:
            raise ConfigError(tuned.problem)
        if decision.recommended_replicas is not None:
            state.recent = prune((*state.recent, Recommendation(wall, decision.recommended_replicas)), wall,
                                 state.plan.autotune.scale_down_stabilization_seconds)
        if changed:
            if tuned.config is not None:  # None: the decision lays out as the config already served
                state.config = tuned.config
                fleet.write_config(state.config)
            if decision.replicas != before.replicas:
                fleet.scale_to(decision.replicas)
            state.current = CurrentConfig.from_scheduler(state.config.scheduler, fleet.desired,
                                                         state.config.generation, last_change_time=wall)
    generations = observation.pod_generations if observation else {}
    state.intervals.append({
        "t_start": round(due - settings.interval_s, 3), "t_end": round(due, 3),
        "chunk_size": before.chunk_size, "queue_policy": before.queue_policy, "generation": before.generation,
        **servers,
        "pods_on_generation": sum(1 for g in generations.values() if g >= before.generation),
        "observed": _observed(observation),
        "decision": {"changed": changed, "actions": actions, "summary": summary, "reason": reason,
                     "to": {"chunk_size": to[0], "queue_policy": to[1], "servers": to[2]}},
    })


def _observed(observation) -> dict[str, Any] | None:
    if observation is None:
        return None

    def ms_of(seconds):
        return round(seconds * 1000, 2) if seconds is not None else None

    return {"tbt_p99_ms": ms_of(observation.tbt_p99_s), "ttft_p99_ms": ms_of(observation.ttft_p99_s),
            "short_tbt_p99_ms": ms_of(observation.short_tbt_p99_s), "samples": observation.sample_count,
            "output_tok_s": round(observation.output_tokens_per_s, 2),
            "long_prompt_share": observation.long_prompt_share, "waiting": observation.waiting_requests,
            "waiting_growth": observation.waiting_growth}


# --- the whole command ---------------------------------------------------------------------------------------------

def report(runs: list[dict[str, Any]], settings: LoopSettings, command: str) -> dict[str, Any]:
    """Client-side interval and phase stats per run, each config over its repeats, the oracles (of single runs and
    by means; loops are judged against the one by means) and the targets; records are left out (the runs given are
    not changed: the CLI reports after every run)."""
    bounds = phase_bounds(settings.phases)
    durations = [end - start for start, end in bounds]
    static_phases: dict[str, list[dict[str, Any]]] = {}
    target_ms = settings.slo_tbt_s * 1000
    ttft_ms = settings.slo_ttft_s * 1000 if settings.slo_ttft_s is not None else None
    out_runs = []
    for raw in runs:
        records = raw["records"]
        run = {key: value for key, value in raw.items() if key not in ("records", "intervals")}
        run["intervals"] = [dict(interval) for interval in raw["intervals"]]
        out_runs.append(run)
        good = loop_report.good_requests(records, settings.slo_tbt_s, settings.slo_ttft_s)
        run["phases"] = [dict(label=p.label, **s.to_dict()) for p, s in
                         zip(settings.phases, loop_report.phase_stats(records, good, bounds), strict=True)]
        run["goodput_tok_s"] = round(loop_report.run_goodput(run["phases"], durations), 3)
        run["goodput_per_server_s"] = loop_report.per_server_second(run["goodput_tok_s"] * sum(durations),
                                                                    run["server_seconds"])
        for phase, duration, seconds in zip(run["phases"], durations, run["server_seconds_by_phase"], strict=True):
            phase["goodput_per_server_s"] = loop_report.per_server_second(phase["goodput_tok_s"] * duration, seconds)
        by_server: dict[str, int] = {}
        for record in records:
            by_server[record.server] = by_server.get(record.server, 0) + 1
        run["requests"] = {"scheduled": len(records), "sent": sum(1 for r in records if r.sent_s is not None),
                           "completed": sum(1 for r in records if r.ok), "good": len(good),
                           "aborted": sum(1 for r in records if r.finish_reason == "abort"),
                           "by_server": by_server,
                           "errors": sorted({(r.error or "")[:80] for r in records if r.error})[:5]}
        for interval in run["intervals"]:
            interval["client"] = loop_report.window_stats(records, good, interval["t_start"],
                                                          interval["t_end"]).to_dict()
        phase_of = [_phase_at(bounds, interval["t_end"] - 1e-6) for interval in run["intervals"]]
        if run["static"]:
            static_phases[run["label"]] = run["phases"]
        else:
            run["targets"] = loop_report.loop_targets(run["intervals"], phase_of, target_ms, ttft_ms)
    configs = loop_report.config_stats(out_runs)
    by_mean = loop_report.oracle_by_mean(configs, durations)
    for run in out_runs:
        if not run["static"] and by_mean:
            run["targets"]["goodput_vs_oracle"] = loop_report.versus(run["goodput_tok_s"], by_mean)
    for config in configs.values():
        if not config["static"] and by_mean:
            config["goodput_vs_oracle"] = loop_report.versus(config["goodput_tok_s"]["mean"], by_mean)
    return {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version()},
        "slo": {"tbt_p99_ms": target_ms, "ttft_p99_ms": ttft_ms},
        "interval_s": settings.interval_s, "window_s": settings.window.window_seconds,
        "phases": [{"label": p.label, "workload": p.workload, "rate": p.rate, "duration_s": p.duration_s,
                    "long_fraction": p.long_fraction, "output_len": p.output_len} for p in settings.phases],
        "runs": out_runs,
        "oracle": loop_report.oracle(static_phases, durations),  # over single runs: biased up by noise on repeats
        "configs": configs,
        "oracle_by_mean": by_mean,
        "spread": loop_report.spread(configs),
    }


def _phase_at(bounds: Sequence[tuple[float, float]], t: float) -> int:
    return next((i for i, (start, end) in enumerate(bounds) if start <= t < end), len(bounds) - 1)


def autotune_for(base: AutotuneSpec, policy, settings: LoopSettings) -> AutotuneSpec:
    """A loop run's spec: apply mode, the policy, and the replica bounds of the fleet when it scales."""
    return replace(base, mode=AutotuneMode.APPLY, policy=policy, scale_replicas=settings.scale_replicas,
                   min_replicas=settings.min_servers, max_replicas=settings.servers)
