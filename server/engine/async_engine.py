"""The engine's step loop on a background thread, with one asyncio stream per request.

The thread runs steps while there is work and sleeps on a condition when idle (no busy-spin). Requests,
aborts and reconfigurations from the event loop are queued as commands and applied by the thread between steps.
Token events travel back through loop.call_soon_threadsafe, one call per step. The request path (validation,
refusals counted, the stream, the abort of a stream left early) is the front ends' common one (front_end.py).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import EngineDrainingError
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.front_end import EngineFrontEnd
from metronome.server.engine.observers import EngineObserver, notify_step
from metronome.server.engine.outputs import TokenEvent
from metronome.server.engine.request_limits import check_waiting
from metronome.server.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine(EngineFrontEnd):
    def __init__(self, core: EngineCore, observers: Seq[EngineObserver] = ()):
        super().__init__(core, core.stats(), observers)
        self.core = core
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._pending_adds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

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

    # --- requests (generate, abort, stats: front_end.py) ---------------------------------------------------
    def reconfigure(self, cfg: SchedulerConfig) -> None:
        """Thread-safe; applied by the engine thread at the next step boundary."""
        self._submit(lambda: self.core.reconfigure(cfg))

    @property
    def max_waiting(self) -> int:
        return self.core.config.max_waiting

    def check_grammar(self, grammar) -> None:
        """Compile a grammar into the engine's cache (any thread); InvalidRequestError when it does not compile."""
        self.core.check_grammar(grammar)

    # --- plumbing ------------------------------------------------------------------------------------------
    def _refusal(self) -> EngineDrainingError | None:
        if self._thread is None or self._stopping:
            return EngineDrainingError("the engine is not running")
        return None

    def _prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        return self.core.prepare_request(prompt, params)

    def _check_capacity(self) -> None:
        check_waiting(self.core.scheduler.num_waiting + self._pending_adds, self.core.config.max_waiting)

    def _enqueue(self, token_ids: list[int], params: SamplingParams, request_id: str, arrival: float) -> None:
        with self._cond:
            self._pending_adds += 1
        self._submit(lambda: self._add(token_ids, params, request_id, arrival))

    def _abort(self, request_id: str) -> None:
        self._submit(lambda: self.core.abort(request_id))

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
