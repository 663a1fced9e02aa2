"""Readiness, in-flight tracking and graceful drain on SIGTERM.

On the first SIGTERM (or SIGINT) the server stops being ready (/ready → 503, so Kubernetes takes the pod out of
its Service), answers new generation requests with 503, lets the in-flight ones finish for up to
`drain_seconds`, aborts whatever is still running after that (those streams end with finish_reason "abort"),
and only then tells uvicorn to exit; the process then exits 0. A second signal exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("metronome.lifecycle")


@dataclass
class Lifecycle:
    """Shared by the routes (admission, tracking) and the signal handling (drain)."""

    ready: bool = False  # set once the engine runs
    draining: bool = False
    inflight: set[str] = field(default_factory=set)
    _idle: asyncio.Event | None = field(default=None, init=False, repr=False)

    @property
    def accepting(self) -> bool:
        return self.ready and not self.draining

    def begin(self, request_id: str) -> None:
        self.inflight.add(request_id)

    def end(self, request_id: str) -> None:
        self.inflight.discard(request_id)
        if not self.inflight and self._idle is not None:
            self._idle.set()

    def start_draining(self) -> None:
        if not self.draining:
            log.info("draining: %d request(s) in flight", len(self.inflight))
        self.draining = True

    async def drain(self, drain_seconds: float, abort: Callable[[str], Awaitable[None]]) -> bool:
        """Stop admitting, wait for in-flight requests up to `drain_seconds`, then abort the rest.

        Returns True when everything finished on its own."""
        self.start_draining()
        self._idle = asyncio.Event()
        if not self.inflight:
            self._idle.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(drain_seconds, 0.0))
            log.info("drained: all requests finished")
            return True
        except asyncio.TimeoutError:
            remaining = sorted(self.inflight)
            log.warning("drain timeout after %.1fs: aborting %d request(s)", drain_seconds, len(remaining))
            for request_id in remaining:
                try:
                    await abort(request_id)
                except Exception:
                    log.exception("abort of %s failed during drain", request_id)
            # Give the aborted streams a moment to send their final chunk; uvicorn waits for open responses too.
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=5.0)
            except asyncio.TimeoutError:
                pass
            return False


def make_draining_server(config, lifecycle: Lifecycle, drain_seconds: float,
                         abort: Callable[[str], Awaitable[None]]):
    """A uvicorn.Server whose first SIGTERM/SIGINT drains instead of closing the socket at once.

    The socket stays open while draining so that /ready can answer 503 and new requests get a clear 503.
    The signal is not re-raised after shutdown (uvicorn's default), so a drained process exits 0.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        _drain_task: asyncio.Task | None = None

        def handle_exit(self, sig: int, frame) -> None:  # called in the main thread by signal.signal
            if lifecycle.draining or not lifecycle.ready:
                # A second signal, or one before start-up finished: nothing to drain gracefully.
                self.force_exit = lifecycle.draining
                self.should_exit = True
                return
            log.info("received %s: draining for up to %.1fs", signal.Signals(sig).name, drain_seconds)
            lifecycle.start_draining()
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            try:
                await lifecycle.drain(drain_seconds, abort)
            finally:
                self.should_exit = True

    return DrainingServer(config)
