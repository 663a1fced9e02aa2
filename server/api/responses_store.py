"""The responses kept for `previous_response_id`: bounded, in memory, per API server process.

Each kept response holds only what it added to the conversation (its input items as chat messages and its
output as an assistant message) and the id of the response it continued; the whole conversation is the chain
of those, oldest first. The store keeps at most `max_responses` responses and `max_chars` characters of message
text, dropping the least recently used; reading a conversation touches every response of its chain, so a chain
in use is not broken from behind. A response that is not kept (never stored, `store: false`, dropped, or made by
another API server process) is a clear 400 for the request that names it.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

from metronome.contract.errors import InvalidRequestError

DEFAULT_MAX_RESPONSES = 4096
DEFAULT_MAX_CHARS = 64 << 20


@dataclass(frozen=True)
class Kept:
    previous: str | None  # the response this one continued
    messages: tuple[dict, ...]  # what this response added: its input and its output, as chat messages
    chars: int


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_chars: int = DEFAULT_MAX_CHARS):
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, response_id: str, previous: str | None, messages: list[dict]) -> None:
        chars = sum(_chars(message) for message in messages)
        with self._lock:
            if chars > self.max_chars:
                return  # larger than the whole store: a later request naming it gets the not-kept 400
            self._kept[response_id] = Kept(previous, tuple(messages), chars)
            self._chars += chars
            while len(self._kept) > self.max_responses or self._chars > self.max_chars:
                _, dropped = self._kept.popitem(last=False)
                self._chars -= dropped.chars

    def conversation(self, response_id: str) -> list[dict]:
        """The chat messages of the conversation up to and including `response_id`'s output."""
        chain: list[tuple[str, Kept]] = []
        with self._lock:
            current: str | None = response_id
            while current is not None:
                kept = self._kept.get(current)
                if kept is None:
                    what = "is not kept here" if current == response_id else f"continues {current!r}, which is not"
                    raise InvalidRequestError(
                        f"previous response {response_id!r} {what} (responses are kept in memory, the most recent "
                        "ones only, by the server process that made them, unless store was false); send the whole "
                        "conversation as input instead", param="previous_response_id")
                chain.append((current, kept))
                current = kept.previous
            chain.reverse()
            for kept_id, _ in chain:  # oldest first, so that the response named is the most recently used
                self._kept.move_to_end(kept_id)
        return [dict(message) for _, kept in chain for message in kept.messages]


def _chars(message: dict) -> int:
    calls = message.get("tool_calls") or []
    return len(message.get("content") or "") + sum(len(c["function"]["arguments"]) + 64 for c in calls)
