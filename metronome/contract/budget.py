"""The prefill budget: how many prompt tokens one engine step may carry under a scheduler config, and how a tuned
budget is laid out on the fields each queue policy reads. Written once, for every reader of the number: the
engine's queues, the server's `metronome_chunk_size` gauge, the operator's controller and ConfigMap writer, and
the InferenceService's status, printer columns and `lastDecision`.

- `fcfs`, `sjf`: the budget is `chunk_size`.
- `split`: short prompts wait in their own queue, are served first and are admitted whole within
  `short_chunk_size`; long prompts advance by at most `long_chunk_size` in what is left of the step. A step
  therefore carries at most max(`short_chunk_size`, `long_chunk_size`) prefill tokens: that is the budget, and
  `chunk_size` is not read.

A tuned budget B lands on `chunk_size` under every policy (so a later policy switch keeps it) and, under `split`,
on both lanes: long prompts advance by B, and short prompts are admitted whole within max(B, the short-prompt
threshold). Both lanes share the one budget the controller's step model predicts for — short prompts first,
long ones fill the rest — and split keeps its shape: short ≥ long and short ≥ the threshold (the CRD's own
rule). The budget of the result is B whenever B ≥ the threshold, which is split's floor in the controller. A
seeded split with lanes of different sizes (the CRD's defaults, 2048 short and 512 long: a budget of 2048) is
served as given until the budget is first tuned; `split_sizes` names its two sizes ("2048/512") for the views
that show them.
"""
from __future__ import annotations

from typing import Any

from metronome.contract.config import QueuePolicy, SchedulerConfig, validate_scheduler
from metronome.contract.metric_names import LANES


def prefill_budget(scheduler: SchedulerConfig) -> int:
    """Prefill tokens one step may carry under the config's queue policy: the number the engine enforces."""
    if QueuePolicy(scheduler.queue_policy) is QueuePolicy.SPLIT:
        return max(scheduler.short_chunk_size, scheduler.long_chunk_size)
    return scheduler.chunk_size


def lane_budgets(scheduler: SchedulerConfig) -> dict[str, int]:
    """Per prompt lane (metric_names.LANES: short, long), the prefill tokens a prompt of that lane may advance in
    one step: split's two sizes, or the one budget both lanes share under fcfs and sjf."""
    if QueuePolicy(scheduler.queue_policy) is QueuePolicy.SPLIT:
        sizes = (scheduler.short_chunk_size, scheduler.long_chunk_size)
    else:
        sizes = (scheduler.chunk_size, scheduler.chunk_size)
    return dict(zip(LANES, sizes, strict=True))


def split_sizes(scheduler: SchedulerConfig) -> str | None:
    """'2048/512' (short/long) under split when the two lanes differ; None when one number says it all."""
    short, long = (lane_budgets(scheduler)[lane] for lane in LANES)
    if QueuePolicy(scheduler.queue_policy) is not QueuePolicy.SPLIT or short == long:
        return None
    return f"{short}/{long}"


def with_budget(scheduler: SchedulerConfig, budget: int, policy: QueuePolicy | str,
                source: str = "the prefill budget") -> SchedulerConfig:
    """`scheduler` serving `budget` under `policy`, laid out as the module docstring says; every other field as
    given. Raises ConfigError (naming `source`) when the result is not a valid scheduler config."""
    fields: dict[str, Any] = {**scheduler.snake_dict(), "queue_policy": QueuePolicy(policy).value,
                              "chunk_size": budget}
    if QueuePolicy(policy) is QueuePolicy.SPLIT:
        fields["long_chunk_size"] = budget
        fields["short_chunk_size"] = max(budget, scheduler.short_prompt_threshold)
    return validate_scheduler(fields, source=source)
