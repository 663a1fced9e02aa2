"""What a request must satisfy before it may enter an engine, as pure checks over a few numbers fixed at engine
start: the vocabulary, the context, the KV capacity of one request and the waiting-queue bound.

One source of truth for both engine fronts: EngineCore.prepare_request runs them next to the core (in-process
AsyncEngine), and ProcessEngine runs them in the API process against the numbers the engine process reported at
start-up, so a request the core would refuse is refused with the same message before it crosses the pipe.
Grammars are compiled by grammar.py's `Grammars` (llguidance and a tokenizer); `check_grammar` is the one place
that says what a missing llguidance means.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from metronome.contract.errors import EngineOverloadedError, InvalidRequestError
from metronome.server.engine.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int  # BlockManager.max_admissible_tokens(): the longest run one request can hold

    def prepare(self, prompt: str | list[int], params: SamplingParams, encode: Callable[[str], list[int]]
                ) -> list[int]:
        """The prompt's token ids once the request passes every check that needs no grammar compiler;
        InvalidRequestError naming the field otherwise. `encode` tokenizes a text prompt."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams", param="params")
        params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            token_ids = list(encode(prompt))
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[0]!r}", param="prompt")
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                      param="prompt")
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        self._check_lengths(len(token_ids), params.max_tokens)
        bad_bias = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad_bias:
            raise InvalidRequestError(
                f"logit_bias token id {bad_bias[0]} is outside the vocabulary of {self.vocab_size}", param="logit_bias")
        return token_ids

    def _check_lengths(self, n: int, max_tokens: int) -> None:
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens but the model's context is {self.max_model_len} tokens "
                "(the prompt must leave room for at least one generated token)", param="prompt")
        if n + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model's context of "
                f"{self.max_model_len} tokens", param="max_tokens")
        capacity = self.kv_capacity_tokens
        if n + max_tokens > capacity:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the KV cache capacity of "
                f"{capacity} tokens for one request", param="prompt" if n > capacity else "max_tokens")


def check_waiting(waiting: int, max_waiting: int) -> None:
    """EngineOverloadedError (HTTP 429) when `waiting` requests already fill the queue bound."""
    if waiting >= max_waiting:
        raise EngineOverloadedError(f"engine overloaded: {waiting} requests waiting (max_waiting {max_waiting}); "
                                    "retry later")


def check_grammar(grammars, grammar) -> None:
    """Compile `grammar` into `grammars`' cache (grammar.Grammars, None without llguidance); InvalidRequestError
    when it does not compile or constrained decoding is unavailable."""
    if grammars is None:
        raise InvalidRequestError("constrained decoding needs the llguidance package (the server extra)",
                                  param="response_format")
    grammars.check(grammar)
