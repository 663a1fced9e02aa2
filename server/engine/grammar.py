"""Constrained decoding (response_format, forced tool calls) through llguidance, applied as a logits mask.

One `Grammars` per engine owns llguidance's view of the tokenizer (built once, on a background thread at engine
start: ~0.5 s for a 49k vocabulary) and a cache of compiled grammars: a request's grammar is compiled and
checked when the request is prepared (a bad schema is a 400 before anything runs), and the engine thread only
deep-copies the compiled matcher.

Per step, `mask(...)` runs on the host right after the forward was launched, so on a GPU it overlaps the
forward: llguidance writes one bit per token for each constrained row into a pinned int32 buffer (its Rust
executor, several rows in parallel, GIL released), the buffer goes to the device without blocking, and the
sampler applies it with one masked_fill. The host never waits for the device here; the matchers advance with the
sampled ids the step hands back anyway.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
from typing import Any

import torch

from metronome.contract.errors import InvalidRequestError
from metronome.server.engine.sampling import Grammar

log = logging.getLogger(__name__)

# JSON without free whitespace: a small model can otherwise pad forever between tokens.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 128
SERIAL_ROWS = 4  # up to this many constrained rows, filling one by one beats the executor's thread hand-off


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar for a Grammar; InvalidRequestError when the source is not what its kind needs."""
    import llguidance

    try:
        if grammar.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if grammar.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(_json_schema(grammar.source), defaults=JSON_OPTIONS)
        if grammar.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(grammar.source)
        return llguidance.LLMatcher.grammar_from_lark(lark_source(grammar.source))
    except InvalidRequestError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:  # refusals of what the client sent
        raise InvalidRequestError(f"cannot compile the {grammar.kind} constraint: {exc}",
                                  param="response_format") from None


def lark_source(source: str) -> str:
    """A Lark grammar as it is, a GBNF/EBNF one (`root ::= ...`, the dialect of xgrammar and llama.cpp) in Lark."""
    if "::=" not in source:
        return source
    from llguidance.gbnf_to_lark import gbnf_to_lark

    return gbnf_to_lark(source)


def _json_schema(source: str) -> dict:
    """The schema as llguidance takes it: an object. The boolean schemas of JSON Schema are valid too: `true`
    admits any JSON value (the empty schema), `false` none, which no output can satisfy."""
    try:
        schema = json.loads(source)
    except ValueError as exc:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param="response_format") from None
    except RecursionError:
        raise InvalidRequestError("the JSON schema nests too deeply", param="response_format") from None
    if schema is True:
        return {}
    if schema is False:
        raise InvalidRequestError("the JSON schema is `false`, which no value satisfies", param="response_format")
    if not isinstance(schema, dict):
        raise InvalidRequestError("the JSON schema must be an object or a boolean", param="response_format")
    return schema


def byte_level_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]):
    """llguidance's tokenizer for ByteTokenizer (random-weight models): id 3 + b is byte b; ids past 258 repeat
    bytes, which llguidance sees as distinct tokens of the same spelling."""
    import llguidance

    class Wrapped:
        def __init__(self):
            self.eos_token_id = eos_ids[0]
            self.bos_token_id = tokenizer.bos_token_id
            self.special_token_ids = sorted(tokenizer.special_ids)
            self.tokens = [tokenizer.special_text(i).encode() if i in tokenizer.special_ids
                           else bytes(((i - tokenizer.BYTE_OFFSET) % 256,)) for i in range(vocab_size)]

        def __call__(self, text: bytes) -> list[int]:
            return [b + tokenizer.BYTE_OFFSET for b in text]

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), n_vocab=vocab_size, eos_token=eos_ids)


def build_lltokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]):
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos_ids)
    return byte_level_tokenizer(tokenizer, vocab_size, eos_ids)


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int], device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.words = (vocab_size + 31) // 32
        self._tokenizer = tokenizer
        self._eos = sorted(eos_ids)
        self._lock = threading.Lock()
        self._ll: Any = None
        self._error: Exception | None = None
        self._ready = threading.Event()
        self._compiled: collections.OrderedDict[Grammar, Any] = collections.OrderedDict()
        self._executor: Any = None
        self._buffer: torch.Tensor | None = None
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        threading.Thread(target=self._build, name="metronome-grammar-tokenizer", daemon=True).start()

    @staticmethod
    def available() -> bool:
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return False
        return True

    def _build(self) -> None:
        try:
            self._ll = build_lltokenizer(self._tokenizer, self.vocab_size, self._eos)
        except Exception as exc:  # reported to the first request that needs a grammar
            log.warning("constrained decoding unavailable: %s", exc)
            self._error = exc
        finally:
            self._ready.set()

    def _lltokenizer(self):
        self._ready.wait()
        if self._ll is None:
            raise InvalidRequestError(f"constrained decoding is not available for this tokenizer: {self._error}",
                                      param="response_format")
        return self._ll

    def check(self, grammar: Grammar) -> None:
        """Compile (or find compiled) `grammar`; InvalidRequestError naming response_format when it is invalid."""
        self._compiled_matcher(grammar)

    def matcher(self, grammar: Grammar):
        """A fresh matcher for one request."""
        return self._compiled_matcher(grammar).deep_copy()

    def _compiled_matcher(self, grammar: Grammar):
        import llguidance

        with self._lock:
            found = self._compiled.get(grammar)
            if found is not None:
                self._compiled.move_to_end(grammar)
                return found
        try:
            matcher = llguidance.LLMatcher(self._lltokenizer(), grammar_text(grammar), log_level=0)
        except (ValueError, TypeError, RecursionError) as exc:
            raise InvalidRequestError(f"cannot compile the {grammar.kind} constraint: {exc}",
                                      param="response_format") from None
        if matcher.is_error():
            raise InvalidRequestError(f"cannot compile the {grammar.kind} constraint: {matcher.get_error()}",
                                      param="response_format")
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def mask(self, rows: list[int], matchers: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row indices, bool allowed [len(rows), vocab]) on the device for the next token of each matcher."""
        import llguidance
        import llguidance.torch as lltorch

        count = len(rows)
        if self._buffer is None or self._buffer.shape[0] < count:
            pin = self.device.type == "cuda"
            self._buffer = torch.empty((max(count, 8), self.words), dtype=torch.int32, pin_memory=pin)
        bits = self._buffer[:count]  # reused: the previous step's copy has completed (its tokens were read back)
        if count <= SERIAL_ROWS:
            for index, matcher in enumerate(matchers):
                lltorch.fill_next_token_bitmask(matcher, bits, index)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            lltorch.fill_next_token_bitmask_par(self._executor, list(zip(matchers, range(count))), bits)
        on_device = bits.to(self.device, non_blocking=True)
        allowed = ((on_device.unsqueeze(-1) >> self._shifts) & 1).view(count, -1)[:, :self.vocab_size].bool()
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return index, allowed


def advance(matcher: Any, token: int) -> bool:
    """Feed the sampled token; True when the grammar is complete (or broken) and the request must end."""
    if not matcher.consume_token(token):
        # The error quotes the whole grammar: its head says enough.
        log.warning("grammar refused sampled token %d: %.300s", token, matcher.get_error())
        return True
    return matcher.is_stopped()
