"""The servers of `metronome bench loop` as the replica loop sees them: a fleet of `metronome serve` processes on
127.0.0.1 that a run scales.

- live: the servers the load goes to (the routes file lists them: routes.py) and that are scraped;
- starting: launched but not ready (no load, no scrapes), as a pod before its readiness probe passes; it joins the
  routes once GET /ready answers, on the config the fleet serves by then;
- draining: out of the routes and still scraped; stopped (SIGTERM: the server's own drain finishes what it
  streams) once ROUTE_GRACE_S has let every client that read the old routes land its request. No request fails.

Each server's launch and exit times are kept, so `server_seconds` is what a span of the run occupied: a server
counts from its launch (start-up included: it holds its GPU) to its exit.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from metronome.contract.config import ServerConfigFile
from metronome.server.bench.loop.routes import write_routes
from metronome.server.bench.loop.servers import LoopServer, LoopServerError, prepare_server, stop_servers, wait_ready

ROUTE_GRACE_S = 2.0  # from leaving the routes to SIGTERM: requests picked from the old list reach the server first


@dataclass
class _Life:
    server: LoopServer
    launched: float  # time.monotonic()
    stopped: float | None = None


class ServerFleet:
    def __init__(self, work_dir: Path, serve_args: tuple[str, ...], env: dict[str, str], timeout_s: float,
                 progress: Callable[[str], None] = print):
        self.work_dir, self.serve_args, self.env, self.timeout_s = work_dir, serve_args, env, timeout_s
        self.progress = progress
        self.routes_path = work_dir / "routes.json"
        self.live: list[LoopServer] = []
        self.starting: list[LoopServer] = []
        self.draining: list[LoopServer] = []
        self.lives: list[_Life] = []
        self.config: ServerConfigFile | None = None
        self._tasks: set[asyncio.Task] = set()
        self._failure: BaseException | None = None

    # --- views ------------------------------------------------------------------------------------------------------

    @property
    def desired(self) -> int:
        """What the loop asked for: live and starting servers (draining ones are on their way out)."""
        return len(self.live) + len(self.starting)

    def scraped(self) -> list[LoopServer]:
        return [*self.live, *self.draining]

    def server_seconds(self, start: float, end: float) -> float:
        """Seconds of server processes alive within [start, end] (time.monotonic())."""
        now = time.monotonic()
        return sum(max(0.0, min(end, life.stopped if life.stopped is not None else now) - max(start, life.launched))
                   for life in self.lives)

    def timeline(self, start: float, end: float) -> list[dict[str, object]]:
        """The servers alive within [start, end]: launch and exit in seconds from `start` (None: still running),
        and the URL the load reached each by."""
        def since(t: float | None) -> float | None:
            return None if t is None else round(t - start, 3)

        return [{"name": life.server.name, "url": life.server.base_url, "launched_s": since(life.launched),
                 "stopped_s": since(life.stopped)} for life in self.lives
                if life.launched < end and (life.stopped is None or life.stopped > start)]

    def check(self) -> None:
        """Raise what went wrong in the background (a server that would not start)."""
        if self._failure is not None:
            raise self._failure

    # --- config -----------------------------------------------------------------------------------------------------

    def write_config(self, config: ServerConfigFile) -> None:
        """Serve `config` on every server that takes load now or will (a starting one reads it as it starts)."""
        self.config = config
        for server in (*self.live, *self.starting):
            server.write_config(config)

    # --- scaling ----------------------------------------------------------------------------------------------------

    def _launch(self) -> LoopServer:
        assert self.config is not None, "write_config first"
        index = len(self.lives)
        server = prepare_server(index, self.work_dir, self.config, self.serve_args, self.env)
        server.start()
        self.lives.append(_Life(server, time.monotonic()))
        return server

    def _route(self) -> None:
        write_routes(self.routes_path, [s.base_url for s in self.live])

    async def start(self, count: int, config: ServerConfigFile) -> None:
        """Bring the fleet to `count` ready servers on `config` and wait for them (the start of a run); extra
        servers are stopped at once (they are idle between runs)."""
        self.write_config(config)
        while len(self.live) > count:
            server = self.live.pop()
            await asyncio.to_thread(self._stop, server)
        new = [self._launch() for _ in range(count - len(self.live))]
        try:
            await asyncio.to_thread(wait_ready, new, self.timeout_s)
        except BaseException:
            await asyncio.to_thread(stop_servers, new)
            raise
        self.live += new
        self._route()

    def scale_to(self, count: int) -> None:
        """Start or drain servers in the background until `count` take load (newest drained first)."""
        while self.desired < count:
            server = self._launch()
            self.starting.append(server)
            self._spawn(self._join(server))
        while self.desired > count and (self.starting or self.live):
            if self.starting:  # not taking load yet: nothing to drain
                server = self.starting.pop()
                self._spawn(asyncio.to_thread(self._stop, server))
                continue
            server = self.live.pop()
            self.draining.append(server)
            self._route()
            self._spawn(self._drain(server))

    def _spawn(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _join(self, server: LoopServer) -> None:
        started = time.monotonic()
        try:
            await asyncio.to_thread(wait_ready, [server], self.timeout_s)
        except LoopServerError as exc:
            self._failure = exc
            return
        if server not in self.starting:
            return  # scaled away while it started
        if self.config is not None:
            server.write_config(self.config)
        self.starting.remove(server)
        self.live.append(server)
        self._route()
        self.progress(f"[fleet] {server.name} ready in {time.monotonic() - started:.0f} s: {len(self.live)} live")

    async def _drain(self, server: LoopServer) -> None:
        await asyncio.sleep(ROUTE_GRACE_S)
        await asyncio.to_thread(self._stop, server)
        self.draining.remove(server)
        self.progress(f"[fleet] {server.name} drained and stopped: {len(self.live)} live")

    def _stop(self, server: LoopServer) -> None:
        server.stop()
        for life in self.lives:
            if life.server is server and life.stopped is None:
                life.stopped = time.monotonic()

    async def settle(self) -> None:
        """Wait for every start and drain under way."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self.check()

    async def close(self) -> None:
        """Stop everything (the end of a run, or of every run with reuse)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        servers = [*self.live, *self.starting, *self.draining]
        self.live, self.starting, self.draining = [], [], []
        await asyncio.to_thread(lambda: [self._stop(s) for s in servers])
