"""The engine's step loop on a background thread, with one asyncio stream per request.

The thread runs steps while there is work and sleeps on a condition when idle (no busy-spin). Requests,
aborts and reconfigurations from the event loop are queued as commands and applied by the thread between steps.
Token events travel back through loop.call_soon_threadsafe, one call per step. Closing a request's stream early
(client disconnect, cancel) aborts the request, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import EngineDrainingError, EngineOverloadedError, InvalidRequestError
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.observers import EngineObserver, notify_rejected, notify_step
from metronome.server.engine.outputs import EngineStats, TokenEvent
from metronome.server.engine.request_limits import check_waiting
from metronome.server.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, core: EngineCore, observers: Seq[EngineObserver] = ()):
        self.core = core
        self.observers = list(observers)
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._pending_adds = 0
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = core.stats()

    # --- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="metronome-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(thread.join)
        self._thread = None
        for queue in list(self._streams.values()):
            queue.put_nowait(EngineDrainingError("the engine shut down"))
        self._streams.clear()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- requests ------------------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        """Token events of one request. Validation and overload errors raise before any event; leaving the
        iteration early aborts the request."""
        arrival = time.monotonic()
        request_id = request_id or uuid.uuid4().hex
        if self._thread is None or self._stopping:
            raise EngineDrainingError("the engine is not running")
        try:
            token_ids = self.core.prepare_request(prompt, params)
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            self._check_capacity()
        except InvalidRequestError:
            notify_rejected(self.observers, "invalid")
            raise
        except EngineOverloadedError:
            notify_rejected(self.observers, "overloaded")
            raise
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        with self._cond:
            self._pending_adds += 1
        self._submit(lambda: self._add(token_ids, params, request_id, arrival))
        finished = False
        try:
            while True:
                item = await queue.get()
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
                self._submit(lambda: self.core.abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(lambda: self.core.abort(request_id))

    def reconfigure(self, cfg: SchedulerConfig) -> None:
        """Thread-safe; applied by the engine thread at the next step boundary."""
        self._submit(lambda: self.core.reconfigure(cfg))

    def stats(self) -> EngineStats:
        """The snapshot taken by the engine thread after its last step or command."""
        return self._stats

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def max_waiting(self) -> int:
        return self.core.config.max_waiting

    def check_grammar(self, grammar) -> None:
        """Compile a grammar into the engine's cache (any thread); InvalidRequestError when it does not compile."""
        self.core.check_grammar(grammar)

    # --- plumbing ------------------------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        check_waiting(self.core.scheduler.num_waiting + self._pending_adds, self.core.config.max_waiting)

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _add(self, token_ids: list[int], params: SamplingParams, request_id: str, arrival: float) -> None:
        with self._cond:
            self._pending_adds -= 1
        if request_id not in self._streams:  # the client left before the request reached the engine
            return
        self.core.add_prepared(token_ids, params, request_id, arrival)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._commands and not self._stopping and not self.core.has_unfinished():
                    self._cond.wait()
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                try:
                    command()
                except Exception:
                    log.exception("engine command failed")
            if not self.core.has_unfinished():
                self._stats = self.core.stats()
                continue
            try:
                events, step_stats = self.core.step()
            except Exception as exc:  # keep serving: fail the requests in flight, not the process
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            # Tokens go to their streams first; metrics bookkeeping must not delay what clients see.
            if events and self._loop is not None:
                self._loop.call_soon_threadsafe(self._deliver, events)
            failures = self.core.take_failures()
            if failures and self._loop is not None:
                for request_id, exc in failures:
                    self._loop.call_soon_threadsafe(self._fail_streams, [request_id], exc)
            self._stats = stats = self.core.stats()
            notify_step(self.observers, step_stats, stats)

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self._streams.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    def _fail_all(self, exc: Exception) -> None:
        ids = self.core.abort_all()
        self._stats = self.core.stats()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_streams, ids, exc)

    def _fail_streams(self, ids: list[str], exc: Exception) -> None:
        for request_id in ids:
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(exc)
