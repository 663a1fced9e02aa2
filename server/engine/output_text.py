"""Detokenized output of one request: incremental text, stop strings (trimmed) and streaming hold-back.

While a request runs, the last (longest stop string - 1) characters are held back from the stream: they could
still become the start of a stop string, which must never reach the client.
"""
from __future__ import annotations

from typing import Any


class OutputText:
    def __init__(self, decoder: Any, stop: tuple[str, ...]):
        self.decoder = decoder  # has push(token_id) -> str and (optionally) finish() -> str
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters already handed out

    def push(self, token_id: int) -> bool:
        """Add one generated token's text; True if a stop string appeared (the text is cut before it)."""
        return self._append(self.decoder.push(token_id))

    def flush(self) -> bool:
        """The request ends: take the text the decoder held back (an unfinished multi-byte char)."""
        finish = getattr(self.decoder, "finish", None)
        return self._append(finish()) if finish is not None else False

    def _append(self, delta: str) -> bool:
        if not delta:
            return False
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        if not self.stop:
            return False
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back what could start a stop string."""
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
