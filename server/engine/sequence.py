"""One request as the engine sees it: its tokens, how many of them have KV in the cache, and its blocks."""
from __future__ import annotations

import enum
from typing import Any

from metronome.server.engine.sampling import SamplingParams

# Placeholder in token_ids for a token the device is still sampling (async scheduling, engine.py): the next step
# reads it on the device; the engine writes the value in when it reads that step's results.
PENDING = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in a queue, no KV blocks
    RUNNING = "running"  # admitted: owns blocks; prefilling or decoding
    FINISHED = "finished"


class Sequence:
    """Token state of one request.

    `token_ids` = prompt + generated tokens. `num_computed_tokens` of them have their KV in the cache; a step
    computes the next `n` of them, and when that reaches the end of `token_ids` the model samples a new token.
    After preemption (recompute) the sequence prefills prompt + generated tokens again. Under async scheduling
    the last entry may be PENDING: sampled by the step in flight, its value not yet read (positions, blocks and
    lengths count it, so all bookkeeping but the token's value is done before it is known).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                 order: int):
        self.request_id = request_id
        self.params = params
        self.arrival_time = arrival_time
        self.order = order  # arrival order (ties and FCFS), stable across preemption and reconfigure
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.prefill_target = self.num_prompt_tokens  # tokens to prefill since (re)admission
        self.block_tables: list[list[int]] = []  # one per KV group (block_manager.py); empty: no blocks held
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full, computed blocks
        self.num_cached_tokens = 0  # prefix-cache hit at the last admission
        # Which rope its KV was computed with, for models whose rope depends on the sequence's length (LongRoPE:
        # long factors for a sequence longer than the original context); set at admission.
        self.rope_long = False
        self.lane: str | None = None  # the scheduler queue/lane this sequence belongs to
        self.finish_reason: str | None = None
        # Output bookkeeping, owned by the engine.
        self.last_token_time: float | None = None
        self.generator: Any = None  # torch.Generator for seeded requests
        self.detokenizer: Any = None  # OutputText: incremental text and stop strings
        self.num_preemptions = 0

    # --- token views -------------------------------------------------------------------------------------
    @property
    def block_table(self) -> list[int]:
        """The first KV group's block table (a model without sliding windows has only that one)."""
        return self.block_tables[0] if self.block_tables else []

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables = [table] if table else []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def max_num_tokens(self) -> int:
        """Prompt + max_tokens: a sequence this long has nothing left to compute (its last token is sampled)."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Still computing the tokens it had when (re)admitted; otherwise it is decoding one token per step."""
        return self.num_computed_tokens < self.prefill_target

    # --- transitions ---------------------------------------------------------------------------------------
    def mark_admitted(self) -> None:
        self.status = SequenceStatus.RUNNING
        self.prefill_target = len(self.token_ids)

    def drop_pending(self) -> None:
        """Forget the token of a step still in flight (the sequence finished or was aborted before it)."""
        tokens = self.token_ids
        while len(tokens) > self.num_prompt_tokens and tokens[-1] == PENDING:
            tokens.pop()

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks were freed; it will prefill prompt + generated tokens again."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_tables = []
        self.block_hashes = []
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"status={self.status.value}, blocks={sum(map(len, self.block_tables))})")
