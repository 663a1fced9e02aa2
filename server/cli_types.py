"""argparse value types shared by the sub-commands: a bad value is a usage error that names the flag."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def bounded(convert: Callable[[str], Any], what: str, accept: Callable[[Any], bool], bound: str):
    """An argparse type: `convert` the text, then insist on `accept(value)`; errors quote the value."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


positive_float = bounded(float, "a number", lambda v: v > 0, "> 0")
positive_int = bounded(int, "an integer", lambda v: v >= 1, ">= 1")
nonneg_int = bounded(int, "an integer", lambda v: v >= 0, ">= 0")
nonneg_float = bounded(float, "a number", lambda v: 0 <= v < float("inf"), ">= 0 and finite")
fraction = bounded(float, "a number", lambda v: 0.0 <= v <= 1.0, "within [0, 1]")
open_fraction = bounded(float, "a number", lambda v: 0.0 < v <= 1.0, "within (0, 1]")

UNCHUNKED = 1 << 20  # the largest chunk SchedulerConfig allows: a whole prompt per step
_UNCHUNKED_WORDS = ("unchunked", "none", "inf")


def chunk_tokens(text: str) -> int:
    """A prefill chunk in tokens, or 'unchunked'. Bounds are the scheduler schema's (checked after parsing)."""
    if text.strip().lower() in _UNCHUNKED_WORDS:
        return UNCHUNKED
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer or 'unchunked': {text!r}") from None


def positive_chunk(text: str) -> int:
    """Like chunk_tokens, but a usage error below 1 (for lists and sizes the scheduler schema does not check)."""
    value = chunk_tokens(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'unchunked', got {text}")
    return value
