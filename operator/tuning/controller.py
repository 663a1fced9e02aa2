"""The SLO controller: one pure function from (observation, current config, spec, now) to a Decision.

Order of the rules, first match wins:
1. autotune off → hold (status still gets SLO fields); no observation or too few TBT samples → hold, no data.
2. settling → hold: within `cooldown_seconds` of the last change, while more or fewer pods report than the
   replicas wanted or pods still report an older config generation (either for at most `settle_timeout_seconds`
   after the last change), or while the observation window still holds samples from before the last pod
   *applied* the change (each pod's config_applied time, a new pod's start; the write time when unknown): a real
   kubelet projects a ConfigMap 30-90 s after it is written.
3. queue policy switching (if enabled): to `split` when long prompts are a large share (≥ long_share_on, from the
   server's per-lane prompt counts) and short requests' TBT p99 (the TBT histogram's short lane; the overall p99
   when the server does not split it out) is over target; back to the resource's own policy when the share falls
   to ≤ long_share_off. The gap between the two is the hysteresis. No switch to split while the budget is under
   the short-prompt threshold (split would raise it), nor while p99 TBT is over FAR_OVER_TARGET × the target and
   a chunk rule would change the chunk: the chunk goes first (a switch would cost a settling window).
3b. prefill guard: when prefill is the bottleneck — TTFT p99 over its limit while requests wait for prefill
   (queued for admission, or admitted beyond the one prompt a pod (a lane) prefills at a time), or
   the waiting queue grew by `queue_growth_limit` or more over the window while TTFT p99 is unknown (no limit, no
   data) or above QUEUE_TTFT_SHARE of its limit — the budget is never shrunk: it grows
   (the model's largest chunk within the TBT budget; without a fit ×multiplicative_up while p99 × multiplicative_up
   stays within the policy's aim — target·margin for `model`, the target for `multiplicative` — else the chunk
   scaled by aim / (p99 / target), rounded down, when that is at least one token more) when TBT is under target;
   over target
   `model` still shrinks as far as its prefill floor (below), which keeps prefill fed; otherwise it holds
   (more replicas if `scale_replicas`, rule 6, unless the queue is draining or the step model says the replicas
   there carry the offered load; else `slo_unreachable` while an SLO is broken).
4. deadband → hold while deadband_low ≤ p99 / target ≤ upper, where upper is deadband_high (0.95) for
   `model`, which aims at target·margin (0.9) inside the band, and 1.0 for `multiplicative`.
5. chunk size, by policy:
   - `model`: under the deadband while first tokens are on time (TTFT p99 within QUEUE_TTFT_SHARE of its limit,
     the queue not growing) → hold: a larger budget buys no throughput the arrivals do not already get. Else
     fit step ≈ a + b·tokens (+ m for mixed steps, decode and mixed points told apart by the step
     metrics' kind), calibrate p99 = k·(a + m + b·(D + C)) on the current observation, take the largest multiple
     of `chunk_granularity` with predicted p99 ≤ target·margin, but never below the chunk whose prefill
     throughput C / step(D + C) covers `prefill_headroom` × the prompt tokens per second per pod. Never moves
     against what was observed (shrinks only above the band, grows only below it). When the fit is poor (too few
     points, r² low, slope ≤ 0, no spread in tokens per step) it scales the chunk by target·margin / p99 while
     over target (never below the chunk that meets it, as a step has a fixed part), and otherwise falls back to
     `multiplicative`.
   - `multiplicative`: the background report's rule: ×0.9 when p99 TBT is over target and throughput above its
     floor, else ×1.1.
   Every proposal is capped (at most ×max_step_up, ÷max_step_down per decision) and clamped to the bounds;
   a current size outside the bounds (the bounds were edited) is first brought inside them, uncapped.
6. chunk already at its floor and the SLO still violated → under `split`, whose floor is the short-prompt
   threshold, `fcfs` with the smaller chunk a rule asked for (when policy switching is on); else, if
   `scale_replicas`, nobody else sets the replicas (`replicas_owner`: an HPA, a ScaledObject) and below the
   maximum, as many replicas as the step model says the offered load needs (replicas.py; at least one more; while
   requests waited all window and without a fit, the served prefill rate sizes it), held while pods of the last
   scale-up are still missing; else `slo_unreachable` with a reason (the handler sets a condition and an Event).
7. replicas down, before any chunk change (the chunk is retuned for the load each remaining replica carries):
   every reading records a recommendation (the smallest count predicted to carry scale_down_headroom × the
   offered load; minReplicas for an idle service, whose too few samples are no data otherwise); while the SLO
   holds, prefill keeps up and no other rule asks the servers to carry less, replicas go down to the largest
   recommendation of the last scale_down_stabilization_seconds, once the readings (`recent`) cover that window.
Advise mode computes the same decision and records it as a proposal without acting.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from metronome.contract.config import QueuePolicy
from metronome.operator.spec_error import SpecError
from metronome.operator.tuning.decision import ActionKind, CurrentConfig, Decision
from metronome.operator.tuning.observation import Observation
from metronome.operator.tuning.replicas import (
    Recommendation,
    ReplicaEstimate,
    is_idle,
    model_replicas,
    offered_load,
    saturated_replicas,
    stabilized_count,
    utilization_replicas,
)
from metronome.operator.tuning.settings import AutotuneMode, AutotuneSpec, TuningPolicy
from metronome.operator.tuning.step_model import (
    FitError,
    StepFit,
    calibrate_p99_factor,
    fit_problem,
    fit_step_time,
    largest_chunk_within,
    predict_tbt_p99,
    smallest_chunk_for_prefill,
)

METRICS_UNAVAILABLE = "metrics unavailable"


@dataclass(frozen=True)
class _Proposal:
    chunk_size: int
    queue_policy: str
    replicas: int
    reason: str
    actions: tuple[ActionKind, ...]
    policy_used: str = "none"
    slo_unreachable: bool = False
    predicted_tbt_p99_s: float | None = None
    fit_r_squared: float | None = None
    wanted_replicas: int | None = None  # the count a scale-up would have chosen where the loop may not scale


FAR_OVER_TARGET = 2.0  # p99 TBT / target above which a chunk change goes before a queue-policy switch
# A growing queue means starved prefill only once first tokens are late: while TTFT p99 is at most this share of
# its limit, a handful more waiting requests is a transient (a phase start; on the H200 a growth of 6 at TTFT
# 480 ms of 2 s held a chunk over the TBT target for a lost interval), and the next window shows it if it lasts.
QUEUE_TTFT_SHARE = 0.5


def decide(observation: Observation | None, current: CurrentConfig, spec: AutotuneSpec, now: float,
           recent: Sequence[Recommendation] = ()) -> Decision:
    """The next step for one service. Pure: same inputs, same Decision. `recent`: the replica recommendations of
    earlier readings (Decision.recommended_replicas with their times), which a scale-down must agree with.
    Raises SpecError without an SLO."""
    if spec.tbt_p99_target_s is None:
        raise SpecError("spec.slo.tbtP99Ms is required for autotuning")
    if observation is None:
        return _no_data(current, METRICS_UNAVAILABLE if spec.mode is not AutotuneMode.OFF
                        else f"autotune is off; {METRICS_UNAVAILABLE}")
    tbt = observation.tbt_p99_s
    if tbt is None or not math.isfinite(tbt) or observation.sample_count < spec.min_samples:
        no_data = _no_data(current, f"{METRICS_UNAVAILABLE}: {observation.sample_count} TBT samples in the "
                                    f"{observation.window_seconds:.0f} s window (need {spec.min_samples})")
        return _idle(observation, current, spec, now, recent) or no_data
    ratio = tbt / spec.tbt_p99_target_s
    ttft_ok = (spec.ttft_p99_target_s is None or observation.ttft_p99_s is None
               or observation.ttft_p99_s <= spec.ttft_p99_target_s)
    observed = dict(slo_met=ratio <= 1.0 and ttft_ok, tbt_ratio=ratio)
    if spec.mode is AutotuneMode.OFF:
        return _hold(current, f"autotune is off; {_tbt_text(tbt, spec)}", **observed)

    waiting = _settling_reason(observation, current, spec, now)
    if waiting is not None:
        return _hold(current, waiting, **observed)
    switch = _policy_switch(observation, current, spec)
    chunk = _prefill_guard(observation, current, spec, ratio) or _tune_chunk(observation, current, spec, ratio)
    # Far over target the chunk is the coarse knob: a policy switch first would cost a whole settling window.
    chunk_first = ratio > FAR_OVER_TARGET and chunk.chunk_size != current.chunk_size
    proposal = switch if switch is not None and not chunk_first else chunk
    recommended = _recommendation(observation, current, spec, proposal, healthy=observed["slo_met"])
    # On the way down replicas go first: the chunk is retuned for the load each remaining replica then carries.
    down = _scale_down(observation, current, spec, proposal, recommended, recent, now)
    return _finish(down or proposal, current, spec, observed, recommended.replicas)


# --- rule 2: let the last change take effect before judging it -------------------------------------------------

def _settling_reason(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, now: float) -> str | None:
    if current.last_change_time is None:
        return None
    since = now - current.last_change_time
    if since < spec.cooldown_seconds:
        return f"cooldown: last change {since:.0f} s ago, next change allowed after {spec.cooldown_seconds:.0f} s"
    if since < obs.window_seconds:
        return (f"settling: the {obs.window_seconds:.0f} s window still holds samples from before the last "
                f"change ({since:.0f} s ago)")
    pending = _replicas_pending(obs, current, spec, now)
    if pending is not None:
        # The pods that report are not the ones that will share the load: a new replica still starting leaves
        # the window with the old ones' queue (a chunk cut from there is wrong once it serves), one leaving
        # still holds the requests it drains.
        return f"settling: {pending}"
    lagging = sorted(pod for pod, generation in obs.pod_generations.items() if generation < current.generation)
    if lagging and since < spec.settle_timeout_seconds:
        return (f"settling: {len(lagging)}/{len(obs.pod_generations)} pods not yet on config generation "
                f"{current.generation} ({', '.join(lagging[:3])})")
    applied = [obs.config_applied_at[pod] for pod, generation in obs.pod_generations.items()
               if generation >= current.generation and pod in obs.config_applied_at]
    if applied and not lagging and now - max(applied) < obs.window_seconds:
        return (f"settling: the {obs.window_seconds:.0f} s window still holds samples from before the last pod "
                f"applied generation {current.generation} ({now - max(applied):.0f} s ago)")
    return None


# --- rule 3: queue policy switching ------------------------------------------------------------------------------

def _policy_switch(obs: Observation, current: CurrentConfig, spec: AutotuneSpec) -> _Proposal | None:
    share = obs.long_prompt_share
    if not spec.policy_switching or share is None:
        return None
    split = QueuePolicy.SPLIT.value
    target = spec.tbt_p99_target_s
    if current.queue_policy != split:
        short_tbt = obs.short_tbt_p99_s if obs.short_tbt_p99_s is not None else obs.tbt_p99_s
        which = "short requests' p99 TBT" if obs.short_tbt_p99_s is not None else "p99 TBT"
        # Split admits short prompts whole, so below the threshold it would raise the step budget: no switch.
        fits = current.chunk_size >= current.short_prompt_threshold
        if share >= spec.long_share_on and short_tbt is not None and short_tbt > target and fits:
            return _Proposal(
                current.chunk_size, split, current.replicas,
                f"long prompts are {share:.0%} of requests (≥ {spec.long_share_on:.0%}) and {which} "
                f"{short_tbt * 1e3:.1f} ms > {target * 1e3:.1f} ms: give short prompts their own queue",
                (ActionKind.POLICY_SWITCH,), policy_used="policy-switch")
    elif spec.base_queue_policy != split and share <= spec.long_share_off:
        return _Proposal(
            current.chunk_size, spec.base_queue_policy, current.replicas,
            f"long prompts down to {share:.0%} of requests (≤ {spec.long_share_off:.0%}): back to "
            f"{spec.base_queue_policy}", (ActionKind.POLICY_SWITCH,), policy_used="policy-switch")
    return None


# --- rule 3b: never starve prefill -------------------------------------------------------------------------------

def waiting_for_prefill(obs: Observation, queue_policy: str) -> float:
    """Mean requests in line for the prefill budget over the window, all pods: those waiting for admission, and
    admitted ones beyond the prompt each pod prefills at a time (one a lane: split prefills a short and a long
    prompt side by side). Under a large max_num_seqs a load step is admitted at once, and its prompts queue for the
    budget inside the batch, where requests_waiting does not see them."""
    pods = max(len(obs.pod_generations), 1)
    lanes = 2 if queue_policy == "split" else 1
    beyond = max((obs.prefilling_requests or 0.0) - pods * lanes, 0.0)
    return (obs.waiting_requests or 0.0) + beyond


def _prefill_bottleneck(obs: Observation, current: CurrentConfig, spec: AutotuneSpec) -> str | None:
    """Why prefill cannot keep up (TTFT over its limit, a growing queue), or None."""
    why = []
    limit, waiting = spec.ttft_p99_target_s, waiting_for_prefill(obs, current.queue_policy)
    # Slow first tokens with nobody waiting come from long steps (which a smaller chunk helps), not from prefill.
    if limit is not None and obs.ttft_p99_s is not None and obs.ttft_p99_s > limit and waiting > 0:
        why.append(f"TTFT p99 {obs.ttft_p99_s * 1e3:.0f} ms > limit {limit * 1e3:.0f} ms with {waiting:.1f} "
                   "requests waiting for prefill on average")
    growth = obs.waiting_growth
    share = _ttft_share(obs, spec)
    late = share is None or share > QUEUE_TTFT_SHARE
    if growth is not None and growth >= spec.queue_growth_limit and late:
        why.append(f"the queue grew by {growth:.0f} waiting requests in {obs.window_seconds:.0f} s")
    return " and ".join(why) or None


def _prefill_guard(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, ratio: float) -> _Proposal | None:
    why = _prefill_bottleneck(obs, current, spec)
    if why is None or not spec.min_chunk <= current.chunk_size <= spec.max_chunk:
        return None
    tbt = obs.tbt_p99_s
    assert tbt is not None  # checked by decide()
    basis = f"prefill is the bottleneck ({why}); {_tbt_text(tbt, spec)}"
    wanted, how, fit = None, "", None
    if ratio < 1.0:
        if spec.policy is TuningPolicy.MODEL:
            fit = _usable_fit(obs, spec)
        if fit is not None:
            decode_batch = obs.decode_batch_size if obs.decode_batch_size is not None else fit.token_min
            factor = calibrate_p99_factor(fit, tbt, decode_batch, current.chunk_size)
            best = largest_chunk_within(fit, decode_batch, factor, spec.tbt_p99_target_s * spec.margin,
                                        spec.chunk_granularity)
            wanted, how = best, f"model fit {fit.describe()}: largest chunk within the TBT budget {best}"
        else:
            wanted, how = _step_toward_aim(current.chunk_size, spec, ratio)
    if wanted is not None and wanted > current.chunk_size:
        granularity = spec.chunk_granularity if fit is not None else 1
        chunk = _bounded(wanted, current.chunk_size, spec, granularity, _floor(spec, current))
        if chunk > current.chunk_size:
            return _Proposal(chunk, current.queue_policy, current.replicas,
                             f"{basis}: TBT has room, growing the budget ({how}){_cap_note(wanted, chunk, spec, 0)}",
                             (ActionKind.CHUNK_UP,), policy_used="prefill-guard",
                             fit_r_squared=fit.r_squared if fit is not None else None)
    if ratio > 1.0 and spec.policy is TuningPolicy.MODEL:
        # The model never shrinks below the chunk whose prefill throughput covers the demand (with headroom):
        # a budget far above that floor is not what keeps prefill fed.
        shrink, _ = _model_step(obs, current, spec, ratio)
        if shrink is not None and shrink.chunk_size < current.chunk_size:
            return replace(shrink, reason=f"{basis}, but chunk {current.chunk_size} is above what prefill needs: "
                                          f"{shrink.reason}")
    shrank = -(obs.waiting_growth or 0.0)
    if ratio <= 1.0 and shrank >= spec.queue_growth_limit:
        # Prefill outruns the arrivals (a backlog from before the last change draining): more replicas would not
        # serve the requests already queued sooner.
        return _hold_proposal(current, f"{basis}, but the queue shrank by {shrank:.0f} in "
                                       f"{obs.window_seconds:.0f} s: prefill is catching up", "prefill-guard")
    room = (f"no room left under the TBT target ({ratio:.0%} of it)" if ratio < 1.0
            else "TBT is over target too")
    basis = f"{basis}: {room}, not shrinking the budget"
    return _scale_up(obs, current, spec, basis, "prefill-guard", fit, unless_model_disagrees=True)


def _step_toward_aim(chunk: int, spec: AutotuneSpec, ratio: float) -> tuple[int | None, str]:
    """Without a usable fit: the chunk a step up may take, and how it was chosen; None when not one more token
    keeps p99 TBT within the aim. p99 is taken as proportional to the chunk near the operating point, as the
    proportional shrink takes it: ×multiplicative_up when that stays within the aim, else as far as the aim.
    All-or-nothing held a starved prefill forever wherever p99 sat between aim / multiplicative_up and the aim.
    Rounded down, so the predicted p99 is at most the aim, which no shrink rule acts on (they start above
    deadband_high for `model`, above the target for `multiplicative`). Never past ×multiplicative_up: a larger
    chunk also admits more decodes (on the H200 ×1.1 from 256 raised p99 from 19.5 to 24.5 ms)."""
    within = chunk * _aim(spec) / ratio if ratio > 0 else math.inf  # the chunk at which p99 reaches the aim
    full = max(chunk + 1, int(round(chunk * spec.multiplicative_up)))
    wanted = full if within >= full else int(math.floor(within))
    if wanted <= chunk:
        return None, ""
    if wanted == full:
        return wanted, f"×{spec.multiplicative_up:g}"
    return wanted, f"×{within / chunk:.2f}, toward the aim of {_aim(spec):.0%} of the target"


def _aim(spec: AutotuneSpec) -> float:
    """The share of the TBT target a policy steers to: `model` keeps `margin` of slack for the load to move in
    (a step up to 97 % of a 22 ms target at a growing queue was 111 % one interval later on the H200), the
    report's ×0.9/×1.1 rule has none."""
    return spec.margin if spec.policy is TuningPolicy.MODEL else 1.0


def _usable_fit(obs: Observation, spec: AutotuneSpec) -> StepFit | None:
    try:
        fit = _fit(obs)
    except FitError:
        return None
    return fit if fit_problem(fit, spec.min_fit_points, spec.min_fit_r2, spec.min_fit_token_spread) is None else None


def _fit(obs: Observation) -> StepFit:
    """The step-time fit of the observation's points; decode and mixed steps apart when the server tells them."""
    samples = obs.step_samples
    kinds = [s.mixed for s in samples] if any(s.kind for s in samples) else None
    return fit_step_time([s.tokens_per_step for s in samples], [s.step_seconds for s in samples],
                         [s.steps for s in samples], kinds)


# --- rules 4-6: chunk size ---------------------------------------------------------------------------------------

def _tune_chunk(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, ratio: float) -> _Proposal:
    tbt = obs.tbt_p99_s
    assert tbt is not None  # checked by decide()
    model = spec.policy is TuningPolicy.MODEL
    if not spec.min_chunk <= current.chunk_size <= spec.max_chunk:
        chunk = max(spec.min_chunk, min(spec.max_chunk, current.chunk_size))
        kind = ActionKind.CHUNK_DOWN if chunk < current.chunk_size else ActionKind.CHUNK_UP
        return _Proposal(chunk, current.queue_policy, current.replicas,
                         f"chunk {current.chunk_size} is outside the bounds [{spec.min_chunk}, {spec.max_chunk}] → "
                         f"{chunk}", (kind,), policy_used="bounds")
    upper = spec.deadband_high if model else 1.0
    if spec.deadband_low <= ratio <= upper:
        return _hold_proposal(current, f"{_tbt_text(tbt, spec)}: inside the deadband "
                                       f"[{spec.deadband_low:.0%}, {upper:.0%}] of target, no change")
    fallback_note = ""
    if model and ratio < spec.deadband_low:
        on_time = _first_tokens_on_time(obs, spec)
        if on_time is not None:
            return _hold_proposal(current, f"{_tbt_text(tbt, spec)}, under the deadband, but {on_time}: a larger "
                                           "budget would only lengthen the steps", "model")
    if model:
        proposal, problem = _model_step(obs, current, spec, ratio)
        if proposal is not None:
            return proposal
        if ratio > 1.0:
            return _proportional_step(obs, current, spec, f"model fit unusable ({problem}), proportional fallback: ")
        fallback_note = f"model fit unusable ({problem}), multiplicative fallback: "
        if spec.deadband_low <= ratio <= 1.0:
            return _hold_proposal(current, f"{fallback_note}{_tbt_text(tbt, spec)} is within target, no change",
                                  "multiplicative")
    return _multiplicative_step(obs, current, spec, ratio, fallback_note)


def _first_tokens_on_time(obs: Observation, spec: AutotuneSpec) -> str | None:
    """Why prefill needs no larger budget (TTFT p99 within QUEUE_TTFT_SHARE of its limit, the queue not
    growing), or None when that is unknown. Under target with first tokens on time the arrivals, not the server,
    set the throughput: a larger chunk buys none and costs every stream TBT (on the H200 the `model` loop crept
    282→413 through a light phase and lost the next one to it)."""
    share = _ttft_share(obs, spec)
    if share is None or share > QUEUE_TTFT_SHARE:
        return None
    if obs.waiting_growth is not None and obs.waiting_growth >= spec.queue_growth_limit:
        return None
    return (f"first tokens are on time (TTFT p99 {obs.ttft_p99_s * 1e3:.0f} ms ≤ {QUEUE_TTFT_SHARE:.0%} of "
            f"{spec.ttft_p99_target_s * 1e3:.0f} ms)")


def _ttft_share(obs: Observation, spec: AutotuneSpec) -> float | None:
    """TTFT p99 as a share of its limit; None without a limit or TTFT samples."""
    if spec.ttft_p99_target_s is None or obs.ttft_p99_s is None:
        return None
    return obs.ttft_p99_s / spec.ttft_p99_target_s


def _proportional_step(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, note: str) -> _Proposal:
    """Over target without a usable fit: scale the chunk by target·margin / p99. A step costs a + b·tokens with
    a ≥ 0, so this never shrinks below the chunk that meets the target; ×0.9 would take a dozen intervals from
    five times the target."""
    tbt = obs.tbt_p99_s
    assert tbt is not None
    floor = spec.min_throughput_tokens_per_s
    if floor is not None and obs.output_tokens_per_s <= floor:
        return _multiplicative_step(obs, current, spec, tbt / spec.tbt_p99_target_s, note)
    factor = spec.tbt_p99_target_s * spec.margin / tbt
    wanted = int(current.chunk_size * factor)
    chunk = min(_bounded(wanted, current.chunk_size, spec, spec.chunk_granularity, _floor(spec, current)),
                current.chunk_size)
    reason = f"{note}{_tbt_text(tbt, spec)}: ×{factor:.2f}"
    if chunk >= current.chunk_size:
        return _at_floor(obs, current, spec, reason, "model-proportional", None, wanted, spec.chunk_granularity)
    return _Proposal(chunk, current.queue_policy, current.replicas,
                     f"{reason} → {chunk}{_cap_note(wanted, chunk, spec, _floor(spec, current))}",
                     (ActionKind.CHUNK_DOWN,), policy_used="model-proportional")


def _model_step(obs: Observation, current: CurrentConfig, spec: AutotuneSpec,
                ratio: float) -> tuple[_Proposal | None, str]:
    try:
        fit = _fit(obs)
    except FitError as exc:
        return None, str(exc)
    problem = fit_problem(fit, spec.min_fit_points, spec.min_fit_r2, spec.min_fit_token_spread)
    if problem is not None:
        return None, problem
    tbt = obs.tbt_p99_s
    assert tbt is not None
    # Without a running-sequence gauge, the lightest window's tokens per step bound the decode batch from above.
    decode_batch = obs.decode_batch_size if obs.decode_batch_size is not None else fit.token_min
    factor = calibrate_p99_factor(fit, tbt, decode_batch, current.chunk_size)
    budget = spec.tbt_p99_target_s * spec.margin
    best = largest_chunk_within(fit, decode_batch, factor, budget, spec.chunk_granularity)
    basis = (f"model fit {fit.describe()}, decode batch {decode_batch:.0f}, p99 factor {factor:.2f}; "
             f"{_tbt_text(tbt, spec)}")
    violated = ratio > 1.0

    def blocked(why: str, wanted: int | None = None) -> _Proposal:
        # Cannot shrink: a capacity problem only once the SLO is actually broken (`wanted`: see _at_floor).
        if violated:
            return _at_floor(obs, current, spec, why, "model", fit, wanted, spec.chunk_granularity)
        return _hold_proposal(current, f"{why}; the SLO still holds, no change", "model", fit)

    def predicted(chunk: int) -> float:
        return predict_tbt_p99(fit, decode_batch, chunk, factor)

    if ratio > spec.deadband_high:
        floor = spec.min_throughput_tokens_per_s
        if floor is not None and obs.output_tokens_per_s < floor:
            return blocked(f"{basis}; throughput {obs.output_tokens_per_s:.0f} tokens/s is "
                                            f"below its floor {floor:.0f}: a smaller chunk would cut it further"), ""
        pods = max(1, len(obs.pod_generations) or current.replicas)
        demand = (obs.prompt_tokens_per_s or 0.0) / pods * spec.prefill_headroom
        prefill_floor = smallest_chunk_for_prefill(fit, decode_batch, demand, spec.chunk_granularity, spec.max_chunk)
        # None: the fit says no chunk keeps up, which the observation (no TTFT or queue alarm, rule 3b) denies;
        # the observed guard then protects prefill on its own.
        prefill_floor = prefill_floor if prefill_floor is not None else spec.chunk_granularity
        if prefill_floor >= current.chunk_size:
            return blocked(f"{basis}; prefill of {demand:.0f} prompt tokens/s per pod (×{spec.prefill_headroom:g} "
                           f"headroom) needs chunk ≥ {prefill_floor}: not shrinking"), ""
        if best is not None and best < current.chunk_size:
            wanted = best
            why = (f"predicted p99 TBT {predicted(best) * 1e3:.1f} ms ≤ {budget * 1e3:.1f} ms at chunk {best}"
                   + (f"; prefill needs chunk ≥ {prefill_floor}" if prefill_floor > best else ""))
        elif best is None:
            wanted = _floor(spec, current)
            why = (f"no chunk is predicted under {budget * 1e3:.1f} ms (even {spec.chunk_granularity} gives "
                   f"{predicted(spec.chunk_granularity) * 1e3:.1f} ms): heading for the floor")
        else:
            # The calibrated model says the current size fits, the observation says it does not: trust the
            # observation and step down as the baseline would.
            wanted = int(current.chunk_size * spec.multiplicative_down)
            why = (f"model predicts {predicted(current.chunk_size) * 1e3:.1f} ms at the current chunk but "
                   f"{tbt * 1e3:.1f} ms was observed: stepping down ×{spec.multiplicative_down:g}")
        wanted = max(wanted, prefill_floor)
        chunk = min(_bounded(wanted, current.chunk_size, spec, spec.chunk_granularity, _floor(spec, current)),
                    current.chunk_size)
        if chunk >= current.chunk_size:
            return blocked(f"{basis}; {why}", wanted), ""
        return _Proposal(chunk, current.queue_policy, current.replicas,
                         f"{basis}; {why}{_cap_note(wanted, chunk, spec, _floor(spec, current))}",
                         (ActionKind.CHUNK_DOWN,),
                         policy_used="model", predicted_tbt_p99_s=predicted(chunk),
                         fit_r_squared=fit.r_squared), ""

    if best is None or best <= current.chunk_size:
        largest = "none" if best is None else str(best)
        return _hold_proposal(current, f"{basis}; no room to grow: largest chunk predicted under "
                                       f"{budget * 1e3:.1f} ms is {largest}", "model", fit), ""
    chunk = _bounded(best, current.chunk_size, spec, spec.chunk_granularity, _floor(spec, current))
    if chunk <= current.chunk_size:
        return _hold_proposal(current, f"{basis}; chunk {current.chunk_size} already at the ceiling "
                                       f"{spec.max_chunk}", "model", fit), ""
    return _Proposal(chunk, current.queue_policy, current.replicas,
                     f"{basis}; predicted p99 TBT {predicted(best) * 1e3:.1f} ms ≤ {budget * 1e3:.1f} ms at chunk "
                     f"{best}{_cap_note(best, chunk, spec, _floor(spec, current))}", (ActionKind.CHUNK_UP,),
                     policy_used="model",
                     predicted_tbt_p99_s=predicted(chunk), fit_r_squared=fit.r_squared), ""


def _multiplicative_step(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, ratio: float,
                         note: str) -> _Proposal:
    tbt = obs.tbt_p99_s
    assert tbt is not None
    floor = spec.min_throughput_tokens_per_s
    above_floor = floor is None or obs.output_tokens_per_s > floor
    if ratio > 1.0 and above_floor:
        factor, rule = spec.multiplicative_down, "over target with throughput above its floor"
    elif ratio > 1.0:
        factor, rule = spec.multiplicative_up, (f"over target but throughput {obs.output_tokens_per_s:.0f} tokens/s "
                                                f"is not above its floor {floor:.0f}")
    else:
        factor, rule = spec.multiplicative_up, "under target"
    wanted = int(round(current.chunk_size * factor))
    if wanted == current.chunk_size:  # small sizes: always move by at least one token
        wanted += 1 if factor > 1 else -1
    chunk = _bounded(wanted, current.chunk_size, spec, 1, _floor(spec, current))
    reason = f"{note}{_tbt_text(tbt, spec)}, {rule}: ×{factor:g}"
    if chunk == current.chunk_size:
        if ratio > 1.0 and factor < 1:
            return _at_floor(obs, current, spec, reason, "multiplicative", None, wanted, 1)
        return _hold_proposal(current, f"{reason}, but chunk {current.chunk_size} is at its bound",
                              "multiplicative")
    kind = ActionKind.CHUNK_DOWN if chunk < current.chunk_size else ActionKind.CHUNK_UP
    return _Proposal(chunk, current.queue_policy, current.replicas, f"{reason} → {chunk}", (kind,),
                     policy_used="multiplicative")


def _at_floor(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, basis: str, policy_used: str,
              fit: StepFit | None, wanted: int | None = None, granularity: int = 1) -> _Proposal:
    """The budget cannot shrink further: leave `split` for fcfs when only split's floor is in the way (`wanted`:
    the budget the rule asked for), else add replicas or report the SLO unreachable."""
    r2 = fit.r_squared if fit is not None else None
    escape = _leave_split_floor(current, spec, wanted, granularity)
    if escape is not None:
        return _Proposal(escape, QueuePolicy.FCFS.value, current.replicas,
                         f"{basis}; split keeps the budget at its short-prompt threshold {_floor(spec, current)}: "
                         f"fcfs with chunk {escape}", (ActionKind.CHUNK_DOWN, ActionKind.POLICY_SWITCH),
                         policy_used=policy_used, fit_r_squared=r2)
    where = f"chunk {current.chunk_size} cannot go lower (floor {_floor(spec, current)}) and the SLO is violated"
    return _scale_up(obs, current, spec, f"{basis}; {where}", policy_used, fit)


# --- replicas ----------------------------------------------------------------------------------------------------

def _replicas_fixed(current: CurrentConfig, spec: AutotuneSpec) -> str | None:
    """Why the loop may not change the replica count at all, or None."""
    if current.replicas_owner is not None:
        return f"replicas are managed by {current.replicas_owner}"
    if not spec.scale_replicas:
        return "scaleReplicas is off"
    return None


def _replicas_pending(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, now: float) -> str | None:
    """Why the last change's replica count has not settled (pods still starting or leaving), or None. A count that
    never settles (pods that cannot schedule) stops blocking settle_timeout_seconds after the last change."""
    reporting = len(obs.pod_generations)
    if not reporting or reporting == current.replicas or current.last_change_time is None:
        return None
    if now - current.last_change_time >= spec.settle_timeout_seconds:
        return None
    return f"{reporting} pod(s) report where {current.replicas} replica(s) are wanted"


def _capacity_fit(obs: Observation, spec: AutotuneSpec) -> StepFit | None:
    return _usable_fit(obs, spec) if obs.tbt_p99_s is not None else None


def _estimate(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, headroom: float) -> ReplicaEstimate | None:
    """What the offered load (× headroom) needs: by the step model when its fit is usable, else by busy time."""
    load = offered_load(obs, current.replicas)
    fit = _capacity_fit(obs, spec)
    if fit is not None:
        tbt = obs.tbt_p99_s
        assert tbt is not None
        decode_batch = obs.decode_batch_size if obs.decode_batch_size is not None else fit.token_min
        factor = calibrate_p99_factor(fit, tbt, decode_batch, current.chunk_size)
        estimate = model_replicas(fit, factor, load.scaled(headroom), _floor(spec, current), spec,
                                  spec.tbt_p99_target_s * _aim(spec), current.max_num_seqs)
        if estimate is not None:
            return estimate if headroom == 1 else replace(
                estimate, basis=f"with ×{headroom:g} the observed load, {estimate.basis}")
    return utilization_replicas(obs, load, spec, headroom)


def _scale_up(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, basis: str, policy_used: str,
              fit: StepFit | None, unless_model_disagrees: bool = False) -> _Proposal:
    """No chunk meets the SLO: as many replicas as the step model says the offered load needs (at least one more,
    at most the maximum), or why not (then the SLO is unreachable). `unless_model_disagrees`: hold when the step
    model says the replicas there are carry the offered load (a queue that grew by a handful in one window is
    noise to it, and a replica is a GPU)."""
    r2 = fit.r_squared if fit is not None else None
    why = _replicas_fixed(current, spec)
    if why is None and current.replicas >= spec.max_replicas:
        return _Proposal(current.chunk_size, current.queue_policy, current.replicas,
                         f"{basis}; replicas already at the maximum {spec.max_replicas}: SLO unreachable",
                         (ActionKind.SLO_UNREACHABLE,), policy_used=policy_used, slo_unreachable=True,
                         fit_r_squared=r2)
    estimate = _estimate(obs, current, spec, 1.0)
    modelled = estimate is not None and estimate.predicted_tbt_p99_s is not None
    if unless_model_disagrees and modelled and estimate.enough and estimate.replicas <= current.replicas:
        return _hold_proposal(current, f"{basis}; but {estimate.basis}: not adding replicas for it", policy_used,
                              fit)
    if not modelled:
        estimate = saturated_replicas(obs, offered_load(obs, current.replicas), spec)
    target, how = current.replicas + 1, "one more"
    if estimate is not None and estimate.replicas > target:
        target, how = estimate.replicas, estimate.basis
    target = max(current.replicas, min(spec.max_replicas, target))
    if why is not None:  # the count is still what the desired-replicas metric reports
        needs = f" (the load needs {target})" if target > current.replicas else ""
        return _Proposal(current.chunk_size, current.queue_policy, current.replicas,
                         f"{basis}; {why}{needs}: SLO unreachable", (ActionKind.SLO_UNREACHABLE,),
                         policy_used=policy_used, slo_unreachable=True, fit_r_squared=r2, wanted_replicas=target)
    predicted = estimate.predicted_tbt_p99_s if estimate is not None and estimate.replicas == target else None
    return _Proposal(current.chunk_size, current.queue_policy, target,
                     f"{basis}: replicas {current.replicas}→{target} ({how})", (ActionKind.SCALE_UP,),
                     policy_used="scale", fit_r_squared=r2, predicted_tbt_p99_s=predicted)


def _recommendation(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, proposal: _Proposal,
                    healthy: bool) -> ReplicaEstimate:
    """This reading's replica recommendation: a scale-up's count; never below the current count while the SLO is
    broken or prefill lags; else what the load needs with the scale-down headroom (the current count when
    nothing can tell)."""
    lowest = max(1, spec.min_replicas)
    top = max(lowest, spec.max_replicas)
    if max(proposal.replicas, proposal.wanted_replicas or 0) > current.replicas:
        return ReplicaEstimate(max(proposal.replicas, proposal.wanted_replicas or 0), True, "scaling up")
    estimate = _estimate(obs, current, spec, spec.scale_down_headroom)
    if estimate is None:
        return ReplicaEstimate(min(top, max(lowest, current.replicas)), True, "nothing to size replicas by")
    if not healthy or _prefill_bottleneck(obs, current, spec) is not None:
        return replace(estimate, replicas=max(estimate.replicas, min(top, current.replicas)))
    return estimate


def _scale_down(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, proposal: _Proposal,
                recommended: ReplicaEstimate, recent: Sequence[Recommendation], now: float) -> _Proposal | None:
    """Fewer replicas when every recommendation of the stabilization window agrees, the SLO holds, prefill keeps
    up and no other rule wants the servers to carry less (a chunk shrink, a policy switch, a scale-up)."""
    if recommended.replicas >= current.replicas or _replicas_fixed(current, spec) is not None:
        return None
    if proposal.actions not in ((ActionKind.HOLD,), (ActionKind.CHUNK_UP,)):
        return None
    if _replicas_pending(obs, current, spec, now) is not None:
        return None
    window = spec.scale_down_stabilization_seconds
    target = stabilized_count(recent, recommended.replicas, now, window)
    if target is None or target >= current.replicas:
        return None
    target = max(target, spec.min_replicas, 1)
    agreed = f"; every recommendation of the last {window:.0f} s is ≤ {target}" if window > 0 else ""
    return _Proposal(current.chunk_size, current.queue_policy, target,
                     f"{recommended.basis}{agreed}: replicas {current.replicas}→{target}", (ActionKind.SCALE_DOWN,),
                     policy_used="scale",
                     predicted_tbt_p99_s=recommended.predicted_tbt_p99_s)


def _idle(obs: Observation, current: CurrentConfig, spec: AutotuneSpec, now: float,
          recent: Sequence[Recommendation]) -> Decision | None:
    """No traffic at all (too few TBT samples, nothing arriving, pods reporting): the load needs minReplicas. The
    recommendation is recorded; replicas go down once the stabilization window agrees. None: not idle."""
    if spec.mode is AutotuneMode.OFF or not is_idle(obs) or _settling_reason(obs, current, spec, now) is not None:
        return None
    lowest = max(1, spec.min_replicas)
    idle = ReplicaEstimate(lowest, True, f"no requests in the {obs.window_seconds:.0f} s window")
    hold = _hold_proposal(current, f"{idle.basis}: nothing to tune by")
    down = _scale_down(obs, current, spec, hold, idle, recent, now)
    decision = _finish(down or hold, current, spec, {}, lowest)
    if down is None:
        return replace(decision, actions=(ActionKind.NO_DATA,), metrics_available=False)
    return decision


# --- helpers -----------------------------------------------------------------------------------------------------

def _leave_split_floor(current: CurrentConfig, spec: AutotuneSpec, wanted: int | None,
                       granularity: int) -> int | None:
    """The fcfs budget to take when a rule wants less than split's floor allows, or None. Split admits short
    prompts whole within the short-prompt threshold, so under it no chunk below the threshold shortens a step;
    fcfs chunks every prompt, down to the bounds' minimum. Never while policy switching is off (the resource's
    policy is then fixed); rule 3 does not switch back to split while the budget is under the threshold."""
    if wanted is None or not spec.policy_switching or current.queue_policy != QueuePolicy.SPLIT.value:
        return None
    if wanted >= _floor(spec, current):
        return None
    chunk = _bounded(wanted, current.chunk_size, spec, granularity, spec.min_chunk)
    return chunk if chunk < current.chunk_size else None


def _floor(spec: AutotuneSpec, current: CurrentConfig) -> int:
    """The smallest budget that changes anything: split admits short prompts whole, so its budget never goes
    below the short-prompt threshold."""
    if current.queue_policy == QueuePolicy.SPLIT.value:
        return min(spec.max_chunk, max(spec.min_chunk, current.short_prompt_threshold))
    return spec.min_chunk


def _bounded(wanted: float, current: int, spec: AutotuneSpec, granularity: int, floor: int) -> int:
    """Cap the move to [current / max_step_down, current * max_step_up], round down to the granularity
    (not below the cap), then clamp to [floor, max_chunk], which win over the cap."""
    low_cap = current / spec.max_step_down
    high_cap = current * spec.max_step_up
    capped = min(max(wanted, low_cap), high_cap)
    chunk = int(math.floor(capped / granularity)) * granularity
    if chunk < low_cap:
        chunk = int(math.ceil(low_cap / granularity)) * granularity
    return max(floor, min(spec.max_chunk, chunk))


def _cap_note(wanted: int, chunk: int, spec: AutotuneSpec, floor: int) -> str:
    if chunk == wanted:
        return f" → {chunk}"
    if chunk in (floor, spec.max_chunk):
        return f" → {chunk} (bound)"
    return f" → {chunk} (at most ×{spec.max_step_up:g} / ÷{spec.max_step_down:g} per interval)"


def _tbt_text(tbt: float, spec: AutotuneSpec) -> str:
    return f"p99 TBT {tbt * 1e3:.1f} ms vs target {spec.tbt_p99_target_s * 1e3:.1f} ms"


def _hold_proposal(current: CurrentConfig, reason: str, policy_used: str = "none",
                   fit: StepFit | None = None) -> _Proposal:
    return _Proposal(current.chunk_size, current.queue_policy, current.replicas, reason, (ActionKind.HOLD,),
                     policy_used=policy_used, fit_r_squared=fit.r_squared if fit is not None else None)


def _hold(current: CurrentConfig, reason: str, **observed) -> Decision:
    return Decision(chunk_size=current.chunk_size, queue_policy=current.queue_policy, replicas=current.replicas,
                    reason=reason, changed=False, actions=(ActionKind.HOLD,), **observed)


def _no_data(current: CurrentConfig, reason: str) -> Decision:
    return replace(_hold(current, reason), actions=(ActionKind.NO_DATA,), metrics_available=False)


def _finish(p: _Proposal, current: CurrentConfig, spec: AutotuneSpec, observed: dict,
            recommended_replicas: int | None = None) -> Decision:
    differs = (p.chunk_size, p.queue_policy, p.replicas) != (current.chunk_size, current.queue_policy,
                                                             current.replicas)
    advisory = spec.mode is AutotuneMode.ADVISE
    return Decision(
        chunk_size=p.chunk_size, queue_policy=p.queue_policy, replicas=p.replicas,
        reason=f"advise only: {p.reason}" if advisory and differs else p.reason,
        changed=differs and not advisory, actions=p.actions, policy_used=p.policy_used, advisory=advisory,
        proposed_change=differs, slo_unreachable=p.slo_unreachable,
        predicted_tbt_p99_s=p.predicted_tbt_p99_s, fit_r_squared=p.fit_r_squared,
        recommended_replicas=recommended_replicas, **observed)
