"""What the engine's two front ends share: AsyncEngine (the core on a thread of this process) and ProcessEngine
(the core in a process of its own) take requests from the HTTP event loop the same way.

A request is validated before any event: prepared (tokenized, checked against the limits, its grammar compiled),
its id checked unused, the waiting queue's bound checked; a refusal is counted by the observers ("invalid",
"overloaded") and raised. Then it is queued for the engine and its token events come back through an asyncio queue
of its own; leaving the iteration before the last event (client disconnect, cancel) aborts it, which frees its KV
blocks. Each front end says how it reaches its core: `_refusal`, `_prepare`, `_check_capacity`, `_enqueue`,
`_abort`; and what describes the served model (`_served`: the core itself, or what the engine process reported).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

from metronome.contract.errors import EngineDrainingError, EngineOverloadedError, InvalidRequestError
from metronome.server.engine.observers import EngineObserver, notify_rejected
from metronome.server.engine.outputs import EngineStats, TokenEvent
from metronome.server.engine.sampling import SamplingParams


class EngineFrontEnd(ABC):
    def __init__(self, served: Any, stats: EngineStats, observers: Sequence[EngineObserver] = ()):
        self._served = served  # tokenizer, model_name, max_model_len, vocab_size (fixed for the engine's life)
        self.observers = list(observers)
        self._stats = stats
        self._streams: dict[str, asyncio.Queue] = {}

    # --- requests ------------------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        """Token events of one request. Validation and overload errors raise before any event; leaving the
        iteration early aborts the request."""
        arrival = time.monotonic()
        request_id = request_id or uuid.uuid4().hex
        refusal = self._refusal()
        if refusal is not None:
            raise refusal
        try:
            token_ids = self._prepare(prompt, params)
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            self._check_capacity()
        except InvalidRequestError:
            notify_rejected(self.observers, "invalid")
            raise
        except EngineOverloadedError:
            notify_rejected(self.observers, "overloaded")
            raise
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._enqueue(token_ids, params, request_id, arrival)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def stats(self) -> EngineStats:
        """The snapshot of the engine after its last step or command."""
        return self._stats

    @property
    def tokenizer(self):
        return self._served.tokenizer

    @property
    def model_name(self) -> str:
        return self._served.model_name

    @property
    def max_model_len(self) -> int:
        return self._served.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._served.vocab_size

    # --- how each front end reaches its core -------------------------------------------------------------------
    @abstractmethod
    def _refusal(self) -> EngineDrainingError | None:
        """Why no request is taken now (not started, shutting down, the engine gone), or None."""

    @abstractmethod
    def _prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids once the request passed the engine's checks (InvalidRequestError otherwise)."""

    @abstractmethod
    def _check_capacity(self) -> None:
        """EngineOverloadedError when the waiting queue, counting the adds still on their way, is full."""

    @abstractmethod
    def _enqueue(self, token_ids: list[int], params: SamplingParams, request_id: str, arrival: float) -> None:
        """Hand a validated request to the engine (its stream is registered already)."""

    @abstractmethod
    def _abort(self, request_id: str) -> None:
        """Have the engine drop the request (any thread's call is applied at a step boundary)."""
