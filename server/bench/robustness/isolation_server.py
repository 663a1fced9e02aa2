"""The server's own view of each `bench isolation` phase, from /metrics scraped at the phase boundaries.

It tells why a hostile phase raises the steady streams' client-side TBT: when the engine's TBT p99 and its step
durations rise with it, the engine did more work per step (prefill load); when they stay as in the quiet phases
while the client's gaps grow, the time was lost on the host side (request handling, delivery), outside the engine.

A phase's figures are the increase of the counters and histograms between the scrape at its start and the one at
its end, summed over lanes and models; phases of one kind are added before the quantile is taken, as
`histogram_quantile(0.99, sum by (le) (increase(...)))` over those phases would. A scrape that failed is None: the
phases it bounds get no server view and are counted as missing. The parsing is pure; `scrape_metrics` is the I/O.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import httpx

from metronome.contract import metric_names as names
from metronome.contract.histogram import bucket_increase, histogram_quantile
from metronome.server.bench.loop.scrape import Scrape, parse_scrape
from metronome.server.engine.slow_steps import GPU_STALL_S

LONG_STEP_S = GPU_STALL_S  # one of STEP_BUCKETS' bounds, so the histogram resolves "over 100 ms" exactly
SCRAPE_TIMEOUT_S = 10.0


@dataclass
class ServerDelta:
    """What the engine did between two scrapes; deltas add, so phases of one kind are summed before summarizing."""

    tbt_buckets: dict[float, float] = field(default_factory=dict)  # cumulative increase by `le`, every lane
    steps: dict[str, float] = field(default_factory=dict)  # by step kind (decode, mixed)
    step_seconds: dict[str, float] = field(default_factory=dict)  # by step kind
    steps_over_long: float = 0.0  # steps longer than LONG_STEP_S, every kind
    mixed_step_tokens: float = 0.0  # tokens computed in mixed steps (prefill and the batch's decode tokens)

    def __add__(self, other: ServerDelta) -> ServerDelta:
        return ServerDelta(_add(self.tbt_buckets, other.tbt_buckets), _add(self.steps, other.steps),
                           _add(self.step_seconds, other.step_seconds), self.steps_over_long + other.steps_over_long,
                           self.mixed_step_tokens + other.mixed_step_tokens)


@dataclass
class ServerView:
    """The summary of one phase, or of every phase of one kind, as stored in the JSON (`server`)."""

    phases: int  # phases with both scrapes
    phases_missing: int  # phases without a server view (a scrape at their start or end failed)
    server_tbt_p99_ms: float | None  # metronome_time_between_tokens_seconds, every lane, interpolated like PromQL
    tbt_observations: float
    steps: dict[str, float]  # by kind
    step_mean_ms: dict[str, float | None]  # by kind
    mixed_share: float | None  # mixed steps / all steps
    steps_over_100ms: float
    mixed_step_tokens_mean: float | None  # metronome_step_tokens{kind="mixed"}: tokens per mixed step


def phase_delta(start_text: str, end_text: str) -> ServerDelta:
    """The engine's work between the scrape `start_text` and the later scrape `end_text`. Pure."""
    start, end = parse_scrape(start_text, "server", 0.0), parse_scrape(end_text, "server", 1.0)
    tbt = dict(bucket_increase(end.buckets(names.TIME_BETWEEN_TOKENS), start.buckets(names.TIME_BETWEEN_TOKENS)))
    steps_by_le = dict(bucket_increase(end.buckets(names.STEP_DURATION), start.buckets(names.STEP_DURATION)))
    kind = names.STEP_KIND_LABEL
    steps = {k: _increase(start, end, names.STEP_DURATION + "_count", **{kind: k}) for k in names.STEP_KINDS}
    seconds = {k: _increase(start, end, names.STEP_DURATION + "_sum", **{kind: k}) for k in names.STEP_KINDS}
    over = steps_by_le.get(math.inf, 0.0) - steps_by_le.get(LONG_STEP_S, 0.0) if steps_by_le else 0.0
    return ServerDelta(tbt, steps, seconds, over,
                       _increase(start, end, names.STEP_TOKENS + "_sum", **{kind: "mixed"}))


def summarize(deltas: list[ServerDelta | None]) -> ServerView:
    """One view of these phases' deltas added together; a None (a failed scrape) is counted as missing. Pure."""
    present = [d for d in deltas if d is not None]
    total = sum(present, ServerDelta())
    p99 = histogram_quantile(0.99, total.tbt_buckets.items()) if total.tbt_buckets else math.nan
    steps = {k: total.steps.get(k, 0.0) for k in names.STEP_KINDS}
    all_steps = sum(steps.values())
    return ServerView(
        phases=len(present), phases_missing=len(deltas) - len(present),
        server_tbt_p99_ms=None if math.isnan(p99) else round(p99 * 1e3, 3),
        tbt_observations=total.tbt_buckets.get(math.inf, 0.0), steps=steps,
        step_mean_ms={k: round(total.step_seconds.get(k, 0.0) / n * 1e3, 3) if n else None for k, n in steps.items()},
        mixed_share=round(steps["mixed"] / all_steps, 4) if all_steps else None,
        steps_over_100ms=total.steps_over_long,
        mixed_step_tokens_mean=round(total.mixed_step_tokens / steps["mixed"], 1) if steps["mixed"] else None)


def phase_deltas(texts: list[str | None]) -> list[ServerDelta | None]:
    """Boundary scrapes (n + 1 for n back-to-back phases) to each phase's delta; None where a scrape is missing."""
    return [phase_delta(a, b) if a is not None and b is not None else None for a, b in zip(texts, texts[1:])]


def view_dict(deltas: list[ServerDelta | None]) -> dict:
    return asdict(summarize(deltas))


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> str | None:
    """One GET of /metrics; None when it fails (the run goes on, that phase just has no server view)."""
    try:
        response = await client.get(url + "/metrics", timeout=SCRAPE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def format_server_table(rows: list[tuple[str, dict]]) -> str:
    """The second table of the text report: per phase kind, the server's own figures (its TBT is the gaps as it
    handed tokens out, token_gaps.py; runs before that recorded the engine's gaps as `engine_tbt_p99_ms`)."""
    out = [f"{'server view':<17} {'phases':>7} {'server p99 ms':>13} {'decode step ms':>14} {'mixed step ms':>13} "
           f"{'mixed share':>11} {'steps>100ms':>11}"]
    missing = 0
    for name, view in rows:
        if name in ("quiet", "hostile"):
            missing += view["phases_missing"]
        share = view["mixed_share"]
        out.append(f"{name:<17} {view['phases']:>7} {_fmt(view['server_tbt_p99_ms']):>13} "
                   f"{_fmt(view['step_mean_ms']['decode']):>14} {_fmt(view['step_mean_ms']['mixed']):>13} "
                   f"{'-' if share is None else f'{share:.1%}':>11} {view['steps_over_100ms']:>11.0f}")
    if missing:
        out.append(f"server view missing for {missing} phase(s): a /metrics scrape at their start or end failed")
    return "\n".join(out)


def _increase(start: Scrape, end: Scrape, name: str, **labels: str) -> float:
    later, earlier = end.total(name, **labels) or 0.0, start.total(name, **labels) or 0.0
    return later - earlier if later >= earlier else later  # a drop: the server restarted, count from zero


def _add(a: dict[float | str, float], b: dict[float | str, float]) -> dict:
    return {key: a.get(key, 0.0) + b.get(key, 0.0) for key in a.keys() | b.keys()}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"
