"""`metronome bench isolation`: can one client's requests disturb the others' token streams?

A few steady streaming clients run for the whole benchmark. The run alternates quiet and hostile phases of equal
length (Q H Q H ...); each hostile phase injects one kind of hostile request, the kinds in turn: multi-MB bodies,
text prompts of ~10k tokens (past the context limit, so the server must size them and refuse), bursts of small
requests beyond the waiting queue's limit, and storms of streams dropped right after their first token. Each gap
between two chunks of a steady stream is attributed to the phase it ended in; the report compares the quiet
phases' TBT p50/p99 and longest gap with the hostile phases', per kind and all together, counts what the hostile
requests got back (any 5xx is a failure), and reads the KV leak gauge at the end.

The first two kinds are refused (413, 400): they must cost the other streams nothing. Bursts and storms are
partly admitted, so they add real work to the batch; the scheduler's token budget bounds what that costs, and the
per-kind figures show it apart from the refusals.

The steady streams and the hostile requests come as two clients (the OpenAI `user` field: STEADY_USER and
HOSTILE_USER), the situation the server's per-client shares protect (server/api/client_share.py): the hostile
client gets at most half of the waiting queue and of the running slots while the steady one is active.
`hostile_client="same"` sends the hostile requests as the steady client instead, so the two can be compared.

The injector runs in its own process: building and sending 16 MB bodies in the measuring process would delay
its own reading of the steady streams and blame the server for it.

Targets: hostile p99 within 10 % of quiet p99, hostile max gap within 2x of quiet max gap.
"""
from __future__ import annotations

import asyncio
import json
import platform
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from metronome.contract.rfc3339 import format_time
from metronome.server.bench.load.stats import percentile
from metronome.server.bench.robustness.isolation_server import (
    LONG_STEP_S,
    format_server_table,
    phase_delta,
    phase_deltas,
    scrape_metrics,
)
from metronome.server.bench.robustness.isolation_server import view_dict as server_view

HOSTILE_KINDS = ("big_body", "long_prompt", "burst", "disconnect_storm")
HOSTILE_CLIENTS = ("other", "same")  # hostile requests as a client of their own, or as the steady one
STEADY_USER, HOSTILE_USER = "isolation-steady", "isolation-hostile"
P99_TARGET, MAX_GAP_TARGET = 1.10, 2.0


@dataclass
class IsolationConfig:
    url: str
    model: str | None
    streams: int = 4
    stream_tokens: int = 128
    phase_seconds: float = 10.0
    rounds: int = 4  # quiet+hostile pairs; hostile kinds rotate, so 4 gives each kind one phase
    big_body_mb: float = 16.0
    long_prompt_tokens: int = 10_000
    burst: int = 64
    storm: int = 32
    token_id_range: tuple[int, int] = (300, 500)
    seed: int = 0
    hostile_client: str = "other"  # one of HOSTILE_CLIENTS

    def __post_init__(self) -> None:
        if self.hostile_client not in HOSTILE_CLIENTS:
            raise ValueError(f"hostile_client must be one of {HOSTILE_CLIENTS}, got {self.hostile_client!r}")

    @property
    def hostile_user(self) -> str:
        return HOSTILE_USER if self.hostile_client == "other" else STEADY_USER


@dataclass
class PhaseStats:
    gaps: int
    tbt_p50_ms: float | None
    tbt_p99_ms: float | None
    max_gap_ms: float | None


@dataclass
class IsolationResult:
    config: dict
    phases: list[dict]  # [{"kind": "quiet"|"hostile", "start_s", "end_s"}]
    quiet: PhaseStats
    hostile: PhaseStats  # all hostile phases together; the targets apply to these
    by_kind: dict[str, dict]  # per hostile kind: its PhaseStats and ratios to quiet
    p99_ratio: float | None
    max_gap_ratio: float | None
    targets: dict
    hostile_statuses: dict[str, dict[str, int]]
    steady_statuses: dict[str, int]
    server_errors: int
    kv_blocks_leaked: float | None
    rejected_by_reason: dict[str, float] = field(default_factory=dict)  # metronome_requests_rejected_total, the run's
    # The server's own view of the run (counter increases): Triton compiles while serving and steps over 100 ms
    # tell a compile stall or a long engine step from a gap the engine never saw (delivery, the host).
    server: dict = field(default_factory=dict)
    # The engine's own figures per phase kind (isolation_server.py), from /metrics at every phase boundary: engine
    # TBT p99 and step durations that rise with the client's gaps mean engine work; flat ones mean the host side.
    server_quiet: dict = field(default_factory=dict)
    server_hostile: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- steady load


async def steady_stream(client: httpx.AsyncClient, cfg: IsolationConfig, rng: random.Random, stop: asyncio.Event,
                        arrivals: list[tuple[float, float]], statuses: Counter) -> None:
    """Stream one request after another until `stop`; record (gap end time, gap) for every chunk after the first."""
    low, high = cfg.token_id_range
    while not stop.is_set():
        body = {"prompt": [rng.randrange(low, high) for _ in range(32)], "max_tokens": cfg.stream_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True, "user": STEADY_USER, **_model(cfg)}
        try:
            async with client.stream("POST", cfg.url + "/v1/completions", json=body) as response:
                statuses[str(response.status_code)] += 1
                if response.status_code != 200:
                    await response.aread()
                    await asyncio.sleep(0.1)
                    continue
                last = None
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.monotonic()
                    if last is not None:
                        arrivals.append((now, now - last))
                    last = now
        except httpx.HTTPError as error:
            statuses[type(error).__name__] += 1


# ---------------------------------------------------------------------------------------------------- hostile load


_BODIES: dict[tuple[int, str, str | None], bytes] = {}


async def big_body(client: httpx.AsyncClient, cfg: IsolationConfig, rng: random.Random) -> str:
    """A multi-MB JSON body (a prompt that long): refused at the header by the body limit, or parsed and sized."""
    size = int(cfg.big_body_mb * (1 << 20))
    key = (size, cfg.hostile_user, cfg.model)
    if key not in _BODIES:  # built once: the injector should spend its time sending
        _BODIES[key] = (b'{"prompt": "' + b"a" * size + b'", "max_tokens": 4, "user": '
                        + json.dumps(cfg.hostile_user).encode() + _model_bytes(cfg) + b"}")
    payload = _BODIES[key]
    try:
        response = await client.post(cfg.url + "/v1/completions", content=payload,
                                     headers={"content-type": "application/json"})
        return str(response.status_code)
    except httpx.HTTPError as error:  # the server may close the connection while the client still writes
        return type(error).__name__


async def long_prompt(client: httpx.AsyncClient, cfg: IsolationConfig, rng: random.Random) -> str:
    """~long_prompt_tokens tokens of ordinary text: more than a small model's context, so it must be refused."""
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"]
    text = " ".join(rng.choice(words) for _ in range(cfg.long_prompt_tokens))
    response = await client.post(cfg.url + "/v1/completions", json={"prompt": text, "max_tokens": 4,
                                                                     "user": cfg.hostile_user, **_model(cfg)})
    return str(response.status_code)


async def burst(client: httpx.AsyncClient, cfg: IsolationConfig, rng: random.Random) -> list[str]:
    """`burst` small requests at once, more than the waiting queue holds: most must get 429."""
    low, high = cfg.token_id_range

    async def one() -> str:
        body = {"prompt": [rng.randrange(low, high) for _ in range(8)], "max_tokens": 1, "user": cfg.hostile_user,
                **_model(cfg)}
        try:
            return str((await client.post(cfg.url + "/v1/completions", json=body)).status_code)
        except httpx.HTTPError as error:
            return type(error).__name__

    return list(await asyncio.gather(*(one() for _ in range(cfg.burst))))


async def disconnect_storm(client: httpx.AsyncClient, cfg: IsolationConfig, rng: random.Random) -> list[str]:
    """`storm` streams, each closed as soon as its first chunk arrives (the server must abort and free them)."""
    low, high = cfg.token_id_range

    async def one() -> str:
        body = {"prompt": [rng.randrange(low, high) for _ in range(16)], "max_tokens": 512, "ignore_eos": True,
                "stream": True, "user": cfg.hostile_user, **_model(cfg)}
        try:
            async with client.stream("POST", cfg.url + "/v1/completions", json=body) as response:
                async for _ in response.aiter_bytes():
                    break
                return str(response.status_code)
        except httpx.HTTPError as error:
            return type(error).__name__

    return list(await asyncio.gather(*(one() for _ in range(cfg.storm))))


HOSTILE = {"big_body": big_body, "long_prompt": long_prompt, "burst": burst, "disconnect_storm": disconnect_storm}


def injector_main(cfg: IsolationConfig, commands, results) -> None:
    """The injector process: for each (kind, seconds) from `commands`, inject that long, then put the status
    counts on `results`; None ends it."""
    async def serve() -> None:
        rng = random.Random(cfg.seed + 1000)
        limits = httpx.Limits(max_connections=cfg.burst + cfg.storm + 8)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as client:
            loop = asyncio.get_running_loop()
            while True:
                command = await loop.run_in_executor(None, commands.get)
                if command is None:
                    return
                kind, seconds = command
                statuses = {kind: Counter()}
                await inject(client, cfg, rng, kind, time.monotonic() + seconds, statuses)
                results.put(dict(statuses[kind]))

    asyncio.run(serve())


async def inject(client: httpx.AsyncClient, cfg: IsolationConfig, rng: random.Random, kind: str, until: float,
                 statuses: dict[str, Counter]) -> None:
    """Hostile requests of one kind, back to back, until `until` (monotonic)."""
    while time.monotonic() < until:
        outcome = await HOSTILE[kind](client, cfg, rng)
        for status in outcome if isinstance(outcome, list) else [outcome]:
            statuses[kind][status] += 1
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------------------------- the run


async def run_isolation(cfg: IsolationConfig) -> IsolationResult:
    import multiprocessing

    context = multiprocessing.get_context("fork")  # started before any thread of ours; its own event loop
    commands, results = context.Queue(), context.Queue()
    injector = context.Process(target=injector_main, args=(cfg, commands, results), daemon=True)
    injector.start()
    limits = httpx.Limits(max_connections=cfg.streams + 8)
    timeout = httpx.Timeout(120.0)
    arrivals: list[tuple[float, float]] = []
    steady_statuses: Counter = Counter()
    hostile_statuses: dict[str, Counter] = {kind: Counter() for kind in HOSTILE_KINDS}
    phases: list[dict] = []
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as steady:
        stop = asyncio.Event()
        streams = [asyncio.create_task(steady_stream(steady, cfg, random.Random(cfg.seed + 1 + i), stop, arrivals,
                                                     steady_statuses)) for i in range(cfg.streams)]
        await _wait_for_tokens(arrivals, cfg.streams)  # warm: every stream is producing before phase 1
        first = (await steady.get(cfg.url + "/metrics")).text
        before = server_counters(first)
        boundaries: list[str | None] = [first]  # texts only: parsed after the run, off the hot path
        t0 = time.monotonic()
        for round_index in range(cfg.rounds):
            for kind in ("quiet", HOSTILE_KINDS[round_index % len(HOSTILE_KINDS)]):
                start = time.monotonic()
                end = start + cfg.phase_seconds
                if kind != "quiet":
                    commands.put((kind, end - time.monotonic()))
                    hostile_statuses[kind].update(await loop.run_in_executor(None, results.get))
                await asyncio.sleep(max(0.0, end - time.monotonic()))
                phases.append({"kind": kind, "round": round_index, "start_s": start - t0,
                               "end_s": time.monotonic() - t0, "_start": start, "_end": time.monotonic()})
                boundaries.append(await scrape_metrics(steady, cfg.url))  # this phase's end, the next one's start
        stop.set()
        commands.put(None)
        await asyncio.wait(streams, timeout=120)
        for task in streams:
            task.cancel()
        leaked = await _kv_leaked(steady, cfg.url)
        after = server_counters((await steady.get(cfg.url + "/metrics")).text)
    injector.join(timeout=30)
    gaps = _gaps_by_phase(arrivals, phases)  # also fills each phase's "stats"
    for phase, delta in zip(phases, phase_deltas(boundaries), strict=True):
        phase["server"], phase["_delta"] = None if delta is None else server_view([delta]), delta

    def server_of(kinds) -> dict:
        return server_view([phase["_delta"] for phase in phases if phase["kind"] in kinds])
    quiet_stats = _stats(gaps.get("quiet", []))
    hostile_stats = _stats([g for kind, values in gaps.items() if kind != "quiet" for g in values])
    by_kind = {}
    for kind in HOSTILE_KINDS:
        if kind in gaps:
            stats = _stats(gaps[kind])
            by_kind[kind] = {**asdict(stats), "p99_ratio": _ratio(stats.tbt_p99_ms, quiet_stats.tbt_p99_ms),
                             "max_gap_ratio": _ratio(stats.max_gap_ms, quiet_stats.max_gap_ms),
                             "server": server_of({kind})}
    p99_ratio = _ratio(hostile_stats.tbt_p99_ms, quiet_stats.tbt_p99_ms)
    gap_ratio = _ratio(hostile_stats.max_gap_ms, quiet_stats.max_gap_ms)
    server_errors = sum(n for counts in [steady_statuses, *hostile_statuses.values()]
                        for status, n in counts.items() if status.startswith("5"))
    return IsolationResult(
        config={**asdict(cfg), "token_id_range": list(cfg.token_id_range)},
        phases=[{k: v for k, v in phase.items() if not k.startswith("_")} for phase in phases],
        quiet=quiet_stats, hostile=hostile_stats, by_kind=by_kind, p99_ratio=p99_ratio, max_gap_ratio=gap_ratio,
        targets={"p99_ratio_max": P99_TARGET, "max_gap_ratio_max": MAX_GAP_TARGET,
                 "p99_met": p99_ratio is not None and p99_ratio <= P99_TARGET,
                 "max_gap_met": gap_ratio is not None and gap_ratio <= MAX_GAP_TARGET,
                 "no_5xx": server_errors == 0, "no_kv_leak": leaked == 0},
        hostile_statuses={kind: dict(counts) for kind, counts in hostile_statuses.items()},
        steady_statuses=dict(steady_statuses), server_errors=server_errors, kv_blocks_leaked=leaked,
        rejected_by_reason={reason[len(REJECTED_PREFIX):]: after[reason] - before.get(reason, 0.0)
                            for reason in sorted(after) if reason.startswith(REJECTED_PREFIX)},
        server={key: after.get(key, 0.0) - before.get(key, 0.0) for key in SERVER_COUNTERS},
        server_quiet=server_of({"quiet"}), server_hostile=server_of(set(HOSTILE_KINDS)),
        machine=machine_info())


def _gaps_by_phase(arrivals, phases) -> dict[str, list[float]]:
    """{phase kind: the gaps that ended in a phase of that kind}; each phase also gets its own stats, so the
    spread between phases of one kind shows how noisy the machine was."""
    gaps: dict[str, list[float]] = {}
    own: list[list[float]] = [[] for _ in phases]
    for at, gap in arrivals:
        for index, phase in enumerate(phases):
            if phase["_start"] <= at < phase["_end"]:
                gaps.setdefault(phase["kind"], []).append(gap)
                own[index].append(gap)
                break
    for phase, values in zip(phases, own):
        phase["stats"] = asdict(_stats(values))
    return gaps


def _stats(gaps: list[float]) -> PhaseStats:
    if not gaps:
        return PhaseStats(0, None, None, None)
    ms = sorted(g * 1000.0 for g in gaps)
    return PhaseStats(len(ms), round(percentile(ms, 50), 3), round(percentile(ms, 99), 3), round(ms[-1], 3))


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


async def _wait_for_tokens(arrivals: list, streams: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(arrivals) < 4 * streams:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the steady streams produced no tokens within {timeout_s:.0f}s")
        await asyncio.sleep(0.1)


REJECTED_PREFIX = "rejected:"
SERVER_COUNTERS = ("kernel_compiles_after_ready", "steps", "steps_over_100ms")


def server_counters(metrics_text: str) -> dict[str, float]:
    """From one /metrics scrape: rejections by reason (keys `rejected:<reason>`), Triton compiles after ready,
    steps, and steps longer than LONG_STEP_S (every kind and model: the phase view's delta from no scrape). Pure."""
    from prometheus_client.parser import text_string_to_metric_families

    from metronome.contract import metric_names as names

    since_start = phase_delta("", metrics_text)
    totals = {"kernel_compiles_after_ready": 0.0, "steps": sum(since_start.steps.values()),
              "steps_over_100ms": since_start.steps_over_long}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == names.REQUESTS_REJECTED:
                key = REJECTED_PREFIX + sample.labels.get("reason", "")
                totals[key] = totals.get(key, 0.0) + sample.value
            elif sample.name == names.KERNEL_COMPILES_AFTER_READY:
                totals["kernel_compiles_after_ready"] += sample.value
    return totals


async def _kv_leaked(client: httpx.AsyncClient, url: str) -> float | None:
    """metronome_kv_blocks_leaked once the server is idle again (None if /metrics lacks it)."""
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(50):
        text = (await client.get(url + "/metrics")).text
        values = {sample.name: sample.value for family in text_string_to_metric_families(text)
                  for sample in family.samples}
        if values.get("metronome_requests_running", 0) == 0:
            return values.get("metronome_kv_blocks_leaked")
        await asyncio.sleep(0.2)
    return values.get("metronome_kv_blocks_leaked")


def _model(cfg: IsolationConfig) -> dict:
    return {"model": cfg.model} if cfg.model else {}


def _model_bytes(cfg: IsolationConfig) -> bytes:
    return f', "model": {json.dumps(cfg.model)}'.encode() if cfg.model else b""


def machine_info() -> dict:
    import os

    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()], "date": format_time()}


# ---------------------------------------------------------------------------------------------------- report


def run_command(args) -> int:
    """`metronome bench isolation` (flags: cli.py)."""
    fields = dict(streams=args.streams, stream_tokens=args.stream_tokens, phase_seconds=args.phase_seconds,
                  rounds=args.rounds, big_body_mb=args.big_body_mb, long_prompt_tokens=args.long_prompt_tokens,
                  burst=args.burst, storm=args.storm, seed=args.seed, hostile_client=args.hostile_client)
    if args.url:
        result = asyncio.run(run_isolation(IsolationConfig(url=args.url.rstrip("/"), model=args.model, **fields)))
    else:
        from metronome.server.bench.robustness.local_server import local_server

        serve_args = ["--model", args.model, "--device", "cpu", *args.serve_arg]
        with local_server(serve_args) as url:
            result = asyncio.run(run_isolation(IsolationConfig(url=url, model=None, **fields)))
        result.config["serve_args"] = serve_args
    print(format_report(result))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(asdict(result), handle, indent=2)
            handle.write("\n")
    return 0 if all(result.targets[k] for k in ("p99_met", "max_gap_met", "no_5xx", "no_kv_leak")) else 1


def format_report(result: IsolationResult) -> str:
    rows = [f"{'phase':<17} {'gaps':>7} {'TBT p50 ms':>11} {'TBT p99 ms':>11} {'max gap ms':>11}"]
    named = [("quiet", asdict(result.quiet)), ("hostile", asdict(result.hostile)),
             *((f" {kind}", stats) for kind, stats in result.by_kind.items())]
    for name, stats in named:
        rows.append(f"{name:<17} {stats['gaps']:>7} {_fmt(stats['tbt_p50_ms']):>11} {_fmt(stats['tbt_p99_ms']):>11} "
                    f"{_fmt(stats['max_gap_ms']):>11}")
    t = result.targets
    rows.append(f"p99 ratio {_fmt(result.p99_ratio)} (target <= {P99_TARGET}: {'met' if t['p99_met'] else 'MISSED'}); "
                f"max-gap ratio {_fmt(result.max_gap_ratio)} (target <= {MAX_GAP_TARGET}: "
                f"{'met' if t['max_gap_met'] else 'MISSED'})")
    quiet_p99 = [p["stats"]["tbt_p99_ms"] for p in result.phases if p["kind"] == "quiet" and p["stats"]["gaps"]]
    if quiet_p99:
        rows.append(f"noise: the quiet phases' own TBT p99 ranged {_fmt(min(quiet_p99))}..{_fmt(max(quiet_p99))} ms")
    rows.append(f"5xx responses: {result.server_errors}; KV blocks leaked: {result.kv_blocks_leaked}")
    if result.server:
        rows.append(f"server: {result.server['steps']:.0f} steps, {result.server['steps_over_100ms']:.0f} over "
                    f"{LONG_STEP_S * 1e3:.0f} ms, {result.server['kernel_compiles_after_ready']:.0f} kernel compiles "
                    "after ready")
    hostile_as = result.config.get("hostile_client", "other")
    rows.append(f"hostile requests sent as {'a client of their own' if hostile_as == 'other' else 'the steady client'}"
                "; server rejections by reason: "
                + (", ".join(f"{reason}: {n:.0f}" for reason, n in result.rejected_by_reason.items() if n) or "none"))
    for kind, counts in result.hostile_statuses.items():
        rows.append(f"  {kind:<17} " + ", ".join(f"{status}: {n}" for status, n in sorted(counts.items())))
    if result.server_quiet:  # absent from results written before the per-phase server view
        rows.append(format_server_table([("quiet", result.server_quiet), ("hostile", result.server_hostile),
                                         *((f" {kind}", stats["server"]) for kind, stats in result.by_kind.items())]))
    return "\n".join(rows)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"
