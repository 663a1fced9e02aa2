"""Benchmark workloads: what each request asks for, and when it arrives.

Prompts are token-id lists of exact length, drawn deterministically from the vocabulary by seed (never a special
or end-of-sequence id), so a "2,000-token prompt" is 2,000 tokens on every model and every run. Request contents
and arrival times come from separate random streams: the same seed gives the same requests at every rate, so runs
in a sweep differ only in load.

Pure: no torch, no I/O except reading a user's jsonl file.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from metronome.contract.errors import MetronomeError

WORKLOAD_NAMES = ("long-short", "chat", "shift", "jsonl")


class WorkloadError(MetronomeError, ValueError):
    """A workload that cannot be built: unknown name, bad parameters, or a bad jsonl line (named in the message)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. Exactly one of `prompt_token_ids` / `prompt_text` is set."""

    index: int
    max_tokens: int
    kind: str  # "short" | "long" | "chat" | "jsonl": the class a request is reported under
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None

    @property
    def prompt_len(self) -> int | None:
        """Prompt length in tokens when known before tokenization (always, for synthetic workloads)."""
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else None


@dataclass(frozen=True)
class TokenSampler:
    """Draws prompt token ids uniformly from [low, vocab_size), skipping `excluded` (special / eos ids)."""

    vocab_size: int
    excluded: frozenset[int] = frozenset()
    low: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size <= self.low:
            raise WorkloadError(f"vocabulary size {self.vocab_size} leaves no token ids at or above {self.low}")
        if self.vocab_size - self.low - len([i for i in self.excluded if self.low <= i < self.vocab_size]) < 2:
            raise WorkloadError(f"vocabulary of {self.vocab_size} ids has fewer than 2 ordinary tokens")

    def sample(self, length: int, rng: random.Random) -> tuple[int, ...]:
        out: list[int] = []
        while len(out) < length:
            token = rng.randrange(self.low, self.vocab_size)
            if token not in self.excluded:
                out.append(token)
        return tuple(out)


# --- synthetic workloads -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LongShortSpec:
    """The background report's mix: a few long prompts among many short ones, fixed output length."""

    long_fraction: float = 0.2
    long_prompt_len: int = 2000
    short_prompt_len: int = 50
    output_len: int = 128


@dataclass(frozen=True)
class ChatSpec:
    """Chat-like traffic: lognormal prompt and output lengths (medians and sigmas of the underlying normal)."""

    prompt_median: float = 300.0
    prompt_sigma: float = 1.0
    output_median: float = 150.0
    output_sigma: float = 0.7
    max_prompt_len: int = 4000
    max_output_len: int = 1024


@dataclass(frozen=True)
class ShiftSpec:
    """A short-heavy phase, then a long-heavy phase: the mix changes under a running server."""

    first_long_fraction: float = 0.05
    second_long_fraction: float = 0.5
    shift_after: int = 100  # requests in the first phase
    long_prompt_len: int = 2000
    short_prompt_len: int = 50
    output_len: int = 128


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything a workload needs besides the seed and the vocabulary."""

    name: str = "long-short"
    long_short: LongShortSpec = field(default_factory=LongShortSpec)
    chat: ChatSpec = field(default_factory=ChatSpec)
    shift: ShiftSpec = field(default_factory=ShiftSpec)
    jsonl_path: str | None = None
    output_len_override: int | None = None  # --max-tokens: replaces every request's output length


def _check_fraction(value: float, what: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise WorkloadError(f"{what} must be within [0, 1], got {value}")


def _check_positive(value: float, what: str) -> None:
    if not value >= 1:
        raise WorkloadError(f"{what} must be at least 1, got {value}")


def validate_spec(spec: WorkloadSpec) -> None:
    if spec.name not in WORKLOAD_NAMES:
        raise WorkloadError(f"unknown workload {spec.name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
    ls, sh, ch = spec.long_short, spec.shift, spec.chat
    _check_fraction(ls.long_fraction, "long-short long fraction")
    _check_fraction(sh.first_long_fraction, "shift first-phase long fraction")
    _check_fraction(sh.second_long_fraction, "shift second-phase long fraction")
    for value, what in ((ls.long_prompt_len, "long prompt length"), (ls.short_prompt_len, "short prompt length"),
                        (ls.output_len, "output length"), (sh.long_prompt_len, "long prompt length"),
                        (sh.short_prompt_len, "short prompt length"), (sh.output_len, "output length"),
                        (ch.max_prompt_len, "chat max prompt length"), (ch.max_output_len, "chat max output length"),
                        (ch.prompt_median, "chat prompt median"), (ch.output_median, "chat output median")):
        _check_positive(value, what)
    if sh.shift_after < 0:
        raise WorkloadError(f"shift point must be >= 0, got {sh.shift_after}")
    if ch.prompt_sigma < 0 or ch.output_sigma < 0:
        raise WorkloadError("chat sigmas must be >= 0")
    if spec.output_len_override is not None:
        _check_positive(spec.output_len_override, "--max-tokens")
    if spec.name == "jsonl" and not spec.jsonl_path:
        raise WorkloadError("the jsonl workload needs a file (--jsonl PATH)")


def _lognormal_len(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def _mixed(index: int, rng: random.Random, sampler: TokenSampler, long_fraction: float, long_len: int,
           short_len: int, output_len: int) -> BenchRequest:
    is_long = rng.random() < long_fraction
    length = long_len if is_long else short_len
    return BenchRequest(index=index, max_tokens=output_len, kind="long" if is_long else "short",
                        prompt_token_ids=sampler.sample(length, rng))


def iter_requests(spec: WorkloadSpec, sampler: TokenSampler | None, seed: int) -> Iterator[BenchRequest]:
    """The workload's requests in order. Synthetic workloads are endless; jsonl ends with its file.

    `sampler` may be None only for jsonl files that hold text prompts and token ids (nothing to sample).
    """
    validate_spec(spec)
    if spec.name == "jsonl":
        yield from _override_output(load_jsonl(spec.jsonl_path), spec.output_len_override)  # type: ignore[arg-type]
        return
    if sampler is None:
        raise WorkloadError(f"the {spec.name} workload needs the model's vocabulary size to draw prompts")
    rng = random.Random(f"metronome-bench-content-{seed}")
    index = 0
    while True:
        if spec.name == "long-short":
            ls = spec.long_short
            req = _mixed(index, rng, sampler, ls.long_fraction, ls.long_prompt_len, ls.short_prompt_len, ls.output_len)
        elif spec.name == "shift":
            sh = spec.shift
            fraction = sh.first_long_fraction if index < sh.shift_after else sh.second_long_fraction
            req = _mixed(index, rng, sampler, fraction, sh.long_prompt_len, sh.short_prompt_len, sh.output_len)
        else:  # chat
            ch = spec.chat
            prompt_len = _lognormal_len(rng, ch.prompt_median, ch.prompt_sigma, ch.max_prompt_len)
            output_len = _lognormal_len(rng, ch.output_median, ch.output_sigma, ch.max_output_len)
            req = BenchRequest(index=index, max_tokens=output_len, kind="chat",
                               prompt_token_ids=sampler.sample(prompt_len, rng))
        if spec.output_len_override is not None:
            req = BenchRequest(req.index, spec.output_len_override, req.kind, req.prompt_token_ids, req.prompt_text)
        yield req
        index += 1


def _override_output(requests: list[BenchRequest], max_tokens: int | None) -> Iterator[BenchRequest]:
    for req in requests:
        yield req if max_tokens is None else BenchRequest(req.index, max_tokens, req.kind, req.prompt_token_ids,
                                                          req.prompt_text)


def take(requests: Iterator[BenchRequest], count: int) -> list[BenchRequest]:
    out = []
    for req in requests:
        if len(out) >= count:
            break
        out.append(req)
    return out


# --- arrivals ------------------------------------------------------------------------------------------------------


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Arrival offsets in seconds from the start of a run: exponential gaps of mean 1/rate.

    rate = inf sends everything at offset 0 (a burst: the "same batch" of an offline comparison).
    """
    if not rate > 0:
        raise WorkloadError(f"request rate must be > 0, got {rate}")
    rng = random.Random(f"metronome-bench-arrivals-{seed}")
    t = 0.0
    while True:
        yield t
        if math.isinf(rate):
            continue
        t += rng.expovariate(rate)


# --- user file -----------------------------------------------------------------------------------------------------


def _jsonl_error(path: str, lineno: int, message: str) -> WorkloadError:
    return WorkloadError(f"{path}:{lineno}: {message}")


def parse_jsonl_line(text: str, path: str, lineno: int, index: int) -> BenchRequest:
    """One line: {"prompt": "text" | [ids]} or {"prompt_token_ids": [ids]}, plus "max_tokens" (int >= 1)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _jsonl_error(path, lineno, f"not valid JSON: {exc.msg}") from exc
    if not isinstance(obj, dict):
        raise _jsonl_error(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - {"prompt", "prompt_token_ids", "max_tokens"}
    if unknown:
        raise _jsonl_error(path, lineno, f"unknown field(s) {sorted(unknown)}; allowed: prompt, prompt_token_ids, "
                                         "max_tokens")
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        raise _jsonl_error(path, lineno, "needs exactly one of 'prompt' or 'prompt_token_ids'")
    max_tokens = obj.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _jsonl_error(path, lineno, f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    prompt = obj.get("prompt", obj.get("prompt_token_ids"))
    field_name = "prompt" if "prompt" in obj else "prompt_token_ids"
    if isinstance(prompt, str) and field_name == "prompt":
        if not prompt:
            raise _jsonl_error(path, lineno, "'prompt' is empty")
        return BenchRequest(index=index, max_tokens=max_tokens, kind="jsonl", prompt_text=prompt)
    if not isinstance(prompt, list) or not prompt:
        raise _jsonl_error(path, lineno, f"'{field_name}' must be a non-empty list of token ids"
                                         + (" or a string" if field_name == "prompt" else ""))
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        raise _jsonl_error(path, lineno, f"'{field_name}' must hold only non-negative integers")
    return BenchRequest(index=index, max_tokens=max_tokens, kind="jsonl", prompt_token_ids=tuple(prompt))


def load_jsonl(path: str) -> list[BenchRequest]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text") from exc
    requests: list[BenchRequest] = []
    for lineno, text in enumerate(lines, start=1):
        if text.strip():
            requests.append(parse_jsonl_line(text, path, lineno, len(requests)))
    if not requests:
        raise WorkloadError(f"{path}: no requests (the file is empty)")
    return requests
