"""Per-request sampling parameters and their validation (no torch: the HTTP layer imports this cheaply)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from metronome.contract.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", param="max_tokens")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}", param="temperature"
            )
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}", param="top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", param="seed")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a tuple of strings", param="stop")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", param="stop")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError("stop_token_ids must be a tuple of non-negative integers", param="stop_token_ids")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
