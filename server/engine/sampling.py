"""Per-request sampling parameters and their validation (no torch: the HTTP layer imports this cheaply)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from metronome.contract.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound for a logit_bias value (either sign)
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output text, compiled by grammar.py: `kind` "json_object" (any JSON object),
    "json_schema" (`source` = the schema as JSON text), "regex" or "lark" (`source` = the grammar)."""

    kind: str
    source: str = ""

    KINDS = ("json_object", "json_schema", "regex", "lark")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p * the most likely one
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # [0.01, 100]: divides positive (multiplies negative) logits of prompt+output
    # tokens; the bounds keep scaled logits finite (1e-55 would turn them into inf)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the k most likely
    grammar: Grammar | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def changes_logits(self) -> bool:
        """Anything that edits the model's logits before the choice (greedy included)."""
        return self.uses_penalties or bool(self.logit_bias) or self.grammar is not None

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}", param="max_tokens"
            )
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}", param="temperature"
            )
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}", param="top_k"
            )
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}", param=name)
        if not _is_real(self.repetition_penalty) or not (MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100.0):
            raise InvalidRequestError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}",
                                      param="repetition_penalty")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
            if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}",
                                          param="logit_bias")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}",
                                      param="logprobs")
        if self.grammar is not None and self.grammar.kind not in Grammar.KINDS:
            raise InvalidRequestError(f"unknown grammar kind {self.grammar.kind!r}; one of {', '.join(Grammar.KINDS)}",
                                      param="response_format")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
