"""What one `metronome bench loop` command measured, from the clients' own token timestamps. Pure.

- A request is *good* when it completed, its TTFT met the TTFT limit (when one is set) and the p99 of its own
  token gaps met the TBT target (stats.is_good). Goodput = output tokens per second of good requests, counted
  when each token was emitted, so an interval's or a phase's goodput is what reached users on time then.
- The oracle is the best static config per phase in hindsight: for each phase, the highest goodput any `--static`
  run had in it. The loop is judged against the sum over phases, and each static config by its worst phase.
- With `--repeats` every config runs several times: one run's goodput is noisy (the same config twice differed by
  up to 30 % in a phase on the H200), so the best single run overstates the oracle. Each config is then summarised
  over its repeats (mean, min, max, spread = (max - min) / mean per phase) and judged by its means: the oracle by
  means is the best static mean per phase.
- Targets: control intervals from the first decision (made once the first window is full, on the
  violating start) until an interval's client-side TBT p99 is within target (0: the start was not violating),
  and the same from each phase's first interval (a change of workload is a new violating start);
  config changes per 10 intervals once a phase has settled (after its first `settle_intervals`), and reversals
  (a chunk change against the direction of the change before it in the same phase: what oscillation is, where a
  phase's load may ask for several steps the same way); intervals where TTFT p99 exceeded its limit while the
  last change before it had shrunk the budget.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.stats import gaps, is_good, percentile, ttft


@dataclass(frozen=True)
class WindowStats:
    tbt_p99_ms: float | None
    ttft_p99_ms: float | None
    throughput_tok_s: float
    goodput_tok_s: float
    tokens: int
    requests_started: int  # first token inside the window

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def good_requests(records: Iterable[RequestRecord], slo_tbt_s: float, slo_ttft_s: float | None) -> set[int]:
    return {r.index for r in records if is_good(r, slo_tbt_s, slo_ttft_s)}


def window_stats(records: Sequence[RequestRecord], good: set[int], start: float, end: float) -> WindowStats:
    """Tokens, gaps and first tokens whose time falls in [start, end)."""
    span = max(end - start, 1e-9)
    tokens = good_tokens = started = 0
    window_gaps: list[float] = []
    first_tokens: list[float] = []
    for record in records:
        times = record.token_times_s
        inside = [t for t in times if start <= t < end]
        if not inside:
            continue
        tokens += len(inside)
        if record.index in good:
            good_tokens += len(inside)
        window_gaps += [gap for t, gap in zip(times[1:], gaps(times), strict=True) if start <= t < end]
        if start <= times[0] < end:
            started += 1
            first = ttft(record)
            if first is not None:
                first_tokens.append(first)
    return WindowStats(tbt_p99_ms=_ms(percentile(window_gaps, 99)), ttft_p99_ms=_ms(percentile(first_tokens, 99)),
                       throughput_tok_s=tokens / span, goodput_tok_s=good_tokens / span, tokens=tokens,
                       requests_started=started)


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 2) if seconds is not None else None


def phase_stats(records: Sequence[RequestRecord], good: set[int],
                bounds: Sequence[tuple[float, float]]) -> list[WindowStats]:
    return [window_stats(records, good, start, end) for start, end in bounds]


# --- across runs ---------------------------------------------------------------------------------------------------

def oracle(static_runs: Mapping[str, Sequence[Mapping[str, Any]]], durations: Sequence[float]) -> dict[str, Any]:
    """Per phase, the static config with the highest goodput; the oracle's goodput over the whole run; and each
    static config's worst loss against the per-phase best."""
    if not static_runs:
        return {}
    best = []
    for number in range(len(durations)):
        label, stats = max(((label, phases[number]) for label, phases in static_runs.items()),
                           key=lambda item: item[1]["goodput_tok_s"])
        best.append({"phase": number, "config": label, "goodput_tok_s": stats["goodput_tok_s"]})
    total = sum(b["goodput_tok_s"] * d for b, d in zip(best, durations, strict=True)) / sum(durations)
    losses = {}
    for label, phases in static_runs.items():
        per_phase = [1.0 - p["goodput_tok_s"] / b["goodput_tok_s"] if b["goodput_tok_s"] > 0 else 0.0
                     for p, b in zip(phases, best, strict=True)]
        losses[label] = {"worst_phase": max(range(len(per_phase)), key=per_phase.__getitem__),
                         "worst_loss": round(max(per_phase), 4), "loss_by_phase": [round(x, 4) for x in per_phase]}
    return {"best_by_phase": best, "goodput_tok_s": total, "static_losses": losses}


def config_stats(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per config (the runs' `config_label`, in first-run order) over its repeats: the whole run's and each phase's
    goodput as mean, min, max and spread = (max - min) / mean (0 when the mean is 0)."""
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        grouped.setdefault(run["config_label"], []).append(run)
    return {label: {"static": repeats[0]["static"], "repeats": len(repeats),
                    "goodput_tok_s": _over([r["goodput_tok_s"] for r in repeats]),
                    "goodput_per_server_s": _over([r["goodput_per_server_s"] for r in repeats]),
                    "phases": [_over([r["phases"][n]["goodput_tok_s"] for r in repeats])
                               for n in range(len(repeats[0]["phases"]))]}
            for label, repeats in grouped.items()}


def _over(values: Sequence[float]) -> dict[str, float]:
    mean = sum(values) / len(values)
    low, high = min(values), max(values)
    return {"mean": mean, "min": low, "max": high, "spread": round((high - low) / mean, 4) if mean > 0 else 0.0}


def oracle_by_mean(configs: Mapping[str, Mapping[str, Any]], durations: Sequence[float]) -> dict[str, Any]:
    """`oracle` over the static configs' per-phase mean goodputs: with one repeat each, the same as `oracle`."""
    return oracle({label: [{"goodput_tok_s": p["mean"]} for p in c["phases"]]
                   for label, c in configs.items() if c["static"]}, durations)


def spread(configs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Each config's spread per phase, and per phase the config with the largest: how far apart two runs of one
    config can be, the margin below which a difference between configs is not measured."""
    by_config = {label: [p["spread"] for p in c["phases"]] for label, c in configs.items()}
    phases = len(next(iter(by_config.values()), []))
    largest = []
    for number in range(phases):
        label = max(by_config, key=lambda name: by_config[name][number])
        largest.append({"phase": number, "config": label, "spread": by_config[label][number]})
    return {"by_config": by_config, "largest_by_phase": largest}


def versus(goodput: float, best: Mapping[str, Any]) -> float | None:
    """A goodput as a fraction of an oracle's (None without an oracle or when its goodput is 0)."""
    return round(goodput / best["goodput_tok_s"], 4) if best and best["goodput_tok_s"] > 0 else None


def per_server_second(good_tokens: float, server_seconds: float) -> float:
    """Good tokens per second of a server process (one replica: on a cluster, one GPU's second): the loop's
    replica decisions are judged by this against static server counts; 0 when no server ran."""
    return round(good_tokens / server_seconds, 4) if server_seconds > 0 else 0.0


def run_goodput(phases: Sequence[Mapping[str, Any]], durations: Sequence[float]) -> float:
    return sum(p["goodput_tok_s"] * d for p, d in zip(phases, durations, strict=True)) / sum(durations)


def loop_targets(intervals: Sequence[Mapping[str, Any]], phases_of_intervals: Sequence[int], target_ms: float,
                 ttft_limit_ms: float | None, settle_intervals: int = 3) -> dict[str, Any]:
    """Convergence, steadiness and the TTFT guard of one loop run (see the module docstring)."""
    decided = next((i for i, interval in enumerate(intervals) if "warm_up" not in interval["decision"]["actions"]), 0)
    to_slo = next((i - decided for i, interval in enumerate(intervals)
                   if i >= decided and (interval["client"]["tbt_p99_ms"] or float("inf")) <= target_ms), None)
    steady: list[Mapping[str, Any]] = []
    seen: dict[int, int] = {}
    for interval, phase in zip(intervals, phases_of_intervals, strict=True):
        seen[phase] = seen.get(phase, 0) + 1
        if seen[phase] > settle_intervals:
            steady.append(interval)
    changes = sum(1 for interval in steady if interval["decision"]["changed"])
    by_phase: dict[int, int | None] = {}
    for number, (interval, phase) in enumerate(zip(intervals, phases_of_intervals, strict=True)):
        if phase not in by_phase:
            by_phase[phase] = None
            first = number
        if by_phase[phase] is None and (interval["client"]["tbt_p99_ms"] or float("inf")) <= target_ms:
            by_phase[phase] = number - first
    reversals = 0
    direction_in_phase: dict[int, int] = {}
    for interval, phase in zip(intervals, phases_of_intervals, strict=True):
        if interval["decision"]["changed"]:
            step = interval["decision"]["to"]["chunk_size"] - interval["chunk_size"]
            direction = (step > 0) - (step < 0)
            if direction:  # a policy switch alone moves no chunk
                reversals += direction_in_phase.get(phase, direction) != direction
                direction_in_phase[phase] = direction
    ttft_hurt = []
    last_change = None
    for number, interval in enumerate(intervals):
        ttft_ms = interval["client"]["ttft_p99_ms"]
        if ttft_limit_ms is not None and ttft_ms is not None and ttft_ms > ttft_limit_ms and last_change == "down":
            ttft_hurt.append(number + 1)
        if interval["decision"]["changed"]:
            last_change = "down" if interval["decision"]["to"]["chunk_size"] < interval["chunk_size"] else "up"
    return {
        "intervals_to_slo": to_slo,
        "intervals_to_slo_by_phase": [by_phase[p] for p in sorted(by_phase)],
        "steady_intervals": len(steady),
        "steady_changes": changes,
        "changes_per_10_intervals": round(10 * changes / len(steady), 2) if steady else None,
        "reversals_within_phases": reversals,
        "ttft_over_limit_after_shrink": ttft_hurt,
    }
