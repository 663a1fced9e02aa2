"""How many replicas the offered load needs, and when fewer may serve it: the replica half of the controller. Pure.

The offered load is what arrived over the window, not only what was served: the servers count prompt tokens as
they compute them, so while the queue grows the served rate understates the demand. Arrivals ≈ finished requests
per second + the queue's growth per second, each arrival bringing the window's mean prompt and output tokens.

Capacity comes from the step model (step_model.py). Spread over R replicas, each carries λo = output tokens/s / R
and λp = headroom · prompt tokens/s / R. A replica's decodes advance one token per step, so its decode batch is
D = λo · s (Little's law) for a step time s; its prefill keeps pace when a step carries C = λp · s prompt tokens.
A step that carries both costs s = a + m + b · (D + C), so

    s = (a + m) / (1 - b · (λo + λp))

which exists while b · (λo + λp) < 1 (the replica is not saturated). The chunk is then C = λp · s (never below
the floor the policy allows, which lengthens the step: s = (a + m + b · C) / (1 - b · λo)), and the p99 TBT that
follows is k · s with the observation's calibrated factor k. R replicas serve the load when that chunk fits under
the ceiling, the decode batch D = λo · s fits in the servers' max_num_seqs (past it requests wait whole for a slot:
their first tokens come late while every TBT looks fine) and k · s stays within the budget; the answer is the
smallest such R within the bounds.

Without a usable fit the replicas' busy share of time stands in: the step samples' seconds per window and pod,
which fewer replicas would share out as busy · pods / R.

Scaling down waits for agreement (as the HPA's stabilization window): the loop scales down only to the largest
count recommended by every reading of the last `scale_down_stabilization_seconds`, and only once its readings
cover that whole window (so a restarted operator, whose memory is empty, waits a full window).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from metronome.operator.tuning.observation import Observation
from metronome.operator.tuning.settings import AutotuneSpec
from metronome.operator.tuning.step_model import StepFit

IDLE_REQUESTS_PER_WINDOW = 1.0  # fewer requests than this over a whole window, none waiting: the service is idle


@dataclass(frozen=True)
class OfferedLoad:
    """What arrived over the window, all pods together (per second)."""

    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    pods: int  # pods that reported over the window

    def scaled(self, factor: float) -> OfferedLoad:
        return OfferedLoad(self.requests_per_s * factor, self.prompt_tokens_per_s * factor,
                           self.output_tokens_per_s * factor, self.pods)

    def describe(self) -> str:
        return (f"{self.requests_per_s:.2f} req/s, {self.prompt_tokens_per_s:.0f} prompt and "
                f"{self.output_tokens_per_s:.0f} output tokens/s over {self.pods} pod(s)")


def offered_load(obs: Observation, replicas: int) -> OfferedLoad:
    """The window's arrivals: served plus what the queue gained (see the module docstring)."""
    pods = max(1, len(obs.pod_generations) or replicas)
    finished = max(0.0, obs.requests_per_s or 0.0)
    queued = max(0.0, obs.waiting_growth or 0.0) / obs.window_seconds
    prompt = max(0.0, obs.prompt_tokens_per_s or 0.0)
    output = max(0.0, obs.output_tokens_per_s)
    mean_prompt = obs.mean_prompt_tokens if obs.mean_prompt_tokens is not None else (
        prompt / finished if finished > 0 else 0.0)
    mean_output = output / finished if finished > 0 else 0.0
    return OfferedLoad(finished + queued, prompt + queued * mean_prompt, output + queued * mean_output, pods)


def is_idle(obs: Observation) -> bool:
    """Pods report but nothing arrives: fewer than IDLE_REQUESTS_PER_WINDOW requests over the window, no queue."""
    if not obs.pod_generations:
        return False
    arrived = (obs.requests_per_s or 0.0) * obs.window_seconds
    return arrived < IDLE_REQUESTS_PER_WINDOW and not (obs.waiting_requests or 0.0) > 0 and (
        obs.output_tokens_per_s * obs.window_seconds < IDLE_REQUESTS_PER_WINDOW)


@dataclass(frozen=True)
class ReplicaEstimate:
    """The smallest replica count within the bounds that serves a load, by the step model or by busy time."""

    replicas: int
    enough: bool  # False: even the maximum is predicted short (replicas is then the maximum)
    basis: str  # how it was reached, in words
    predicted_tbt_p99_s: float | None = None  # at `replicas`, when the step model was used
    chunk: int | None = None  # the chunk that prediction assumes


def model_prediction(fit: StepFit, factor: float, load: OfferedLoad, replicas: int, floor_chunk: int,
                     spec: AutotuneSpec, max_batch: int | None = None) -> tuple[float, int] | None:
    """(predicted p99 TBT, chunk) with the load spread over `replicas`, or None when a replica would saturate,
    prefill would need a chunk above the ceiling or the decode batch would exceed `max_batch` (max_num_seqs; None:
    no cap) (module docstring)."""
    b, fixed = fit.slope_s_per_token, fit.step_seconds(0.0, mixed=True)
    output = load.output_tokens_per_s / replicas
    prompt = load.prompt_tokens_per_s * spec.prefill_headroom / replicas
    room = 1.0 - b * (output + prompt)
    if room <= 0 or fixed <= 0:
        return None
    step = fixed / room
    granularity = spec.chunk_granularity
    chunk = max(floor_chunk, int(math.ceil(prompt * step / granularity - 1e-9)) * granularity)
    if chunk > spec.max_chunk:
        return None
    step = (fixed + b * chunk) / (1.0 - b * output)
    if max_batch is not None and output * step > max_batch:
        return None
    return factor * step, chunk


def model_replicas(fit: StepFit, factor: float, load: OfferedLoad, floor_chunk: int, spec: AutotuneSpec,
                   budget_s: float, max_batch: int | None = None) -> ReplicaEstimate | None:
    """The smallest R in [min_replicas, max_replicas] whose prediction is within `budget_s`; the maximum, not
    enough, when none is; None when not even an empty step fits the budget (k · (a + m) > budget: what the
    observation's p99 says is then not what replicas change)."""
    if factor * fit.step_seconds(0.0, mixed=True) > budget_s:
        return None
    lowest = max(1, spec.min_replicas)
    for replicas in range(lowest, max(lowest, spec.max_replicas) + 1):
        predicted = model_prediction(fit, factor, load, replicas, floor_chunk, spec, max_batch)
        if predicted is not None and predicted[0] <= budget_s:
            tbt, chunk = predicted
            return ReplicaEstimate(replicas, True, f"the step model predicts p99 TBT {tbt * 1e3:.1f} ms ≤ "
                                                   f"{budget_s * 1e3:.1f} ms at chunk {chunk} with {replicas} "
                                                   f"replica(s) for {load.describe()}", tbt, chunk)
    top = max(lowest, spec.max_replicas)
    predicted = model_prediction(fit, factor, load, top, floor_chunk, spec, max_batch)
    capped = f", or more requests each than max_num_seqs {max_batch}" if max_batch is not None else ""
    at_top = f"p99 TBT {predicted[0] * 1e3:.1f} ms" if predicted is not None else f"saturated replicas{capped}"
    return ReplicaEstimate(top, False, f"the step model predicts {at_top} even with the maximum {top} replica(s) "
                                       f"for {load.describe()}", predicted[0] if predicted else None,
                           predicted[1] if predicted else None)


def saturated_replicas(obs: Observation, load: OfferedLoad, spec: AutotuneSpec) -> ReplicaEstimate | None:
    """Without a fit, while requests waited for prefill all window: what the pods prefilled is what they can, so
    the offered prompt tokens (× prefill_headroom) over each pod's served rate is the count (None when nothing
    waited or nothing was prefilled)."""
    served = obs.prompt_tokens_per_s or 0.0
    if served <= 0 or not (obs.waiting_requests or 0.0) > 0:
        return None
    per_pod = served / load.pods
    demand = load.prompt_tokens_per_s * spec.prefill_headroom
    lowest = max(1, spec.min_replicas)
    top = max(lowest, spec.max_replicas)
    needed = max(lowest, math.ceil(demand / per_pod - 1e-9))
    return ReplicaEstimate(min(top, needed), needed <= top,
                           f"each pod prefills {per_pod:.0f} tokens/s with requests waiting, and "
                           f"{load.prompt_tokens_per_s:.0f} arrive (×{spec.prefill_headroom:g} headroom)")


def busy_share(obs: Observation) -> float | None:
    """The share of the window a pod spent in steps, on average over the pods (None without step samples)."""
    if not obs.step_samples:
        return None
    busy = sum(s.steps * s.step_seconds for s in obs.step_samples)
    pods = max(1, len({s.pod for s in obs.step_samples}), len(obs.pod_generations))
    return busy / obs.window_seconds / pods


def utilization_replicas(obs: Observation, load: OfferedLoad, spec: AutotuneSpec,
                         headroom: float) -> ReplicaEstimate | None:
    """Without a fit: the smallest R ≥ min_replicas whose projected busy share, busy · pods · headroom / R, stays
    under spec.scale_down_max_utilization (None without step samples)."""
    share = busy_share(obs)
    if share is None:
        return None
    demand = share * load.pods * headroom
    lowest = max(1, spec.min_replicas)
    top = max(lowest, spec.max_replicas)
    replicas = min(top, max(lowest, math.ceil(demand / spec.scale_down_max_utilization - 1e-9)))
    enough = demand / replicas <= spec.scale_down_max_utilization
    return ReplicaEstimate(replicas, enough, f"pods busy {share:.0%} of the time: {replicas} replica(s) would be "
                                             f"{demand / replicas:.0%} busy with ×{headroom:g} the load "
                                             f"(at most {spec.scale_down_max_utilization:.0%})")


# --- stabilization ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recommendation:
    """One reading's replica recommendation (what the load needs with the scale-down headroom), kept between
    readings by the caller (TunerMemory, bench loop) and handed back to the controller."""

    time: float
    replicas: int


def stabilized_count(recent: Sequence[Recommendation], latest: int, now: float, window_s: float) -> int | None:
    """The largest recommendation of the last `window_s` seconds (the latest included), or None while the readings
    do not yet cover the whole window."""
    inside = [r.replicas for r in recent if now - r.time <= window_s]
    covered = window_s <= 0 or any(now - r.time >= window_s for r in recent)
    if not covered:
        return None
    return max([latest, *inside])


def prune(recent: Sequence[Recommendation], now: float, window_s: float) -> tuple[Recommendation, ...]:
    """What a memory needs to keep: the readings inside the window, and the newest one at or before its start
    (which proves the window is covered)."""
    older = [r for r in recent if now - r.time >= window_s]
    kept = [r for r in recent if now - r.time < window_s]
    return tuple(([max(older, key=lambda r: r.time)] if older else []) + kept)
