"""The engine core in a process of its own, behind the same interface as AsyncEngine (as vLLM V1 puts its
EngineCore behind the API server): the HTTP event loop and the engine's step loop no longer share a GIL, so a
client storming the server with requests does not stretch the other streams' steps.

The API process never loads weights: the engine process (engine_proc_main.py, started with "spawn": CUDA cannot
fork) builds the core and reports what the API side needs (ReadyInfo), the tokenizer included. Requests are
validated here with the same checks the core runs (request_limits.py), on the front ends' common request path
(front_end.py), so refusals raise before any event with the same messages; the queue bound is checked against
the last stats snapshot plus the adds the engine has not acknowledged yet. A writer thread pickles and sends
commands (a long prompt never blocks the event loop on a full pipe); a reader thread receives one message per step
and hands it to the event loop with one call_soon_threadsafe, which delivers the tokens, fails streams, updates the
snapshot and calls the observers.

If the engine process dies, every open stream fails with EngineProcessExited (a 503), is_running turns False
(/health fails, so the kubelet restarts the pod) and new requests are refused.

With several API server processes (`serve --api-servers N`, api_servers.py) one engine process serves N
clients: `launch(clients=N)` keeps channel 0 and leaves the others in `spare_channels` for the main process to
hand to its API workers, each of which wraps its channel with `attach`. Request ids need only be unique per
client. `before_close` (the main process's: wait for the workers) runs before STOP, since the engine must keep
serving the others while they drain.

"spawn" re-imports the parent's main module in the child: a script that launches a ProcessEngine needs the usual
`if __name__ == "__main__":` guard (the `metronome` command and pytest have it).
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import queue
import threading
from collections import deque
from collections.abc import Sequence as Seq

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import EngineDrainingError, InvalidRequestError
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine_proc_main import (
    ABORT,
    ADD,
    FAILED,
    RECONFIGURE,
    STOP,
    ChildSettings,
    ReadyInfo,
    child_main,
)
from metronome.server.engine.front_end import EngineFrontEnd
from metronome.server.engine.observers import notify_step
from metronome.server.engine.outputs import TokenEvent
from metronome.server.engine.request_limits import RequestLimits, check_grammar, check_waiting
from metronome.server.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
STOP_WAIT_S = 10.0  # after STOP, how long the engine process may take to exit before it is terminated
_CLOSE_WRITER = None  # the writer thread's end-of-work marker


class EngineProcessExited(EngineDrainingError):
    """The engine process is gone (killed, crashed, or exited on start-up): a 503 for requests, exit 2 for serve."""


def engine_process_mode(mode: str, device_type: str) -> tuple[bool, str]:
    """(whether the engine core runs in a process of its own, why) for --engine-process `mode` on a device of
    `device_type`: auto means on for CUDA, where steps take a few ms and any GIL wait shows in every stream's
    token gaps; a CPU engine's steps are long enough that the in-process thread costs little."""
    if mode not in MODES:
        raise InvalidRequestError(f"engine process mode must be one of {', '.join(MODES)}, got {mode!r}",
                                  param="engine_process")
    if mode == "auto":
        return device_type == "cuda", f"auto: {device_type}"
    return mode == "on", mode


class ProcessEngine(EngineFrontEnd):
    def __init__(self, info: ReadyInfo, process, commands, replies, observers: Seq = ()):
        """Use `launch` or `attach`; this wires an engine process that has reported ready (`process` is None
        in an API worker, which did not start it)."""
        super().__init__(info, info.stats, observers)
        self.info = info
        self.limits = RequestLimits(info.vocab_size, info.max_model_len, info.kv_capacity_tokens)
        self._process = process
        self._commands = commands
        self._replies = replies
        self._unacked: deque[int] = deque()  # seqs of adds the engine has not reported applying yet
        self._seq = 0
        self._send_lock = threading.Lock()  # seq order == send order, whichever thread sends
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._running = False
        self._closed = False
        self._exit_error: EngineDrainingError | None = None
        self.spare_channels: list[tuple] = []  # launch(clients=N): the (commands, replies) of clients 1..N-1
        self.before_close = None  # called once at the start of close(), before STOP is sent
        self._writer = threading.Thread(target=self._write, name="metronome-engine-writer", daemon=True)
        self._writer.start()
        self.grammars = _grammars(info)
        # Runs before multiprocessing's own exit hook (registered earlier), which would wait for the child forever.
        atexit.register(self.close)

    @classmethod
    def launch(cls, engine_config: EngineConfig, scheduler_config: SchedulerConfig | None = None,
               observers: Seq = (), cpu_threads: int | None = None, clients: int = 1) -> ProcessEngine:
        """Start the engine process and wait until it is ready; its start-up error (a bad model, no memory) is
        raised here as the same exception. `cpu_threads`: torch threads if the engine runs on the CPU; `clients`:
        how many API servers it serves (this one is client 0, the rest go to `spare_channels`)."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = [], []  # per client: (commands, replies) of this side and of the engine's side
        for _ in range(clients):
            commands_in, commands = context.Pipe(duplex=False)
            replies, replies_out = context.Pipe(duplex=False)
            ours.append((commands, replies))
            theirs.append((commands_in, replies_out))
        commands, replies = ours[0]
        settings = ChildSettings(logging.getLogger().getEffectiveLevel(), cpu_threads)
        # Not daemonic, so that the engine may start processes of its own (a daemonic one may not); close() runs
        # at exit and stops it, and it stops by itself when this process dies.
        process = context.Process(target=child_main, name="metronome-engine", daemon=False,
                                  args=(theirs, engine_config, scheduler_config or SchedulerConfig(), settings))
        process.start()
        for channel in theirs:  # the child's ends: closed here so that its exit reads as EOF
            for conn in channel:
                conn.close()
        try:
            import metronome.server.engine.grammar  # noqa: F401 (torch, for _grammars: while the engine loads)

            kind, payload = replies.recv()
        except BaseException as exc:  # it died, or this process is interrupted (Ctrl-C while loading)
            if not isinstance(exc, EOFError):
                process.kill()  # else it would load on, and multiprocessing's exit hook would wait for it
            process.join(STOP_WAIT_S)
            _close_all(ours)
            if isinstance(exc, EOFError):
                raise EngineProcessExited(f"the engine process exited with code {process.exitcode} before it was "
                                          "ready") from None
            raise
        if kind == FAILED:
            process.join(STOP_WAIT_S)
            _close_all(ours)
            raise payload
        engine = cls(payload, process, commands, replies, observers)
        engine.spare_channels = ours[1:]
        return engine

    @classmethod
    def attach(cls, info: ReadyInfo, commands, replies, observers: Seq = ()) -> ProcessEngine:
        """A client of an engine process that another process launched (an API worker of `serve --api-servers`):
        `info` is what it reported ready with, (commands, replies) one of the launcher's `spare_channels`."""
        return cls(info, None, commands, replies, observers)

    # --- lifecycle -----------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._reader is not None:
            return
        if self._closed:
            raise EngineDrainingError("the engine process has been shut down")
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._reader = threading.Thread(target=self._read, name="metronome-engine-reader", daemon=True)
        self._reader.start()

    async def shutdown(self) -> None:
        """Stop the engine process (STOP, then SIGKILL if it hangs); idempotent."""
        await asyncio.to_thread(self.close)
        self._fail_all(EngineDrainingError("the engine shut down"))

    def close(self) -> None:
        """shutdown() without an event loop (e.g. when serving never started)."""
        hook, self.before_close = self.before_close, None
        if hook is not None and not self._closed:
            hook()
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._running = False
            self._seq += 1
            self._outbox.put((STOP, self._seq))
            self._outbox.put(_CLOSE_WRITER)
        atexit.unregister(self.close)
        self._writer.join(STOP_WAIT_S)
        process = self._process
        if process is not None:
            self._stop_process(process)
        if self._reader is not None:
            self._reader.join(5.0)  # its pipe reads EOF now
        self._commands.close()
        self._replies.close()
        for channel in self.spare_channels:  # not handed on (serving never started)
            _close_all([channel])

    @staticmethod
    def _stop_process(process) -> None:
        process.join(STOP_WAIT_S)
        if process.is_alive():  # it ignores SIGTERM (the API process owns shutdown), so: SIGKILL
            log.warning("the engine process did not stop in %.0fs: killing it", STOP_WAIT_S)
            process.kill()
            process.join()

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def pid(self) -> int:
        return self.info.pid

    # --- requests (generate, abort, stats: front_end.py) ---------------------------------------------------
    def reconfigure(self, cfg: SchedulerConfig) -> None:
        """Thread-safe; the engine applies it at its next step boundary."""
        self._send(RECONFIGURE, cfg)

    def check_grammar(self, grammar) -> None:
        """Compile a grammar into this process's cache (any thread); InvalidRequestError when it does not."""
        check_grammar(self.grammars, grammar)

    @property
    def max_waiting(self) -> int:
        return self.info.max_waiting

    # --- plumbing ------------------------------------------------------------------------------------------
    def _refusal(self) -> EngineDrainingError | None:
        if not self._running:
            return self._exit_error or EngineDrainingError("the engine is not running")
        return None

    def _prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        token_ids = self.limits.prepare(prompt, params, self.tokenizer.encode)
        if params.grammar is not None:
            self.check_grammar(params.grammar)
        return token_ids

    def _check_capacity(self) -> None:
        check_waiting(sum(self._stats.num_waiting.values()) + len(self._unacked), self.info.max_waiting)

    def _enqueue(self, token_ids: list[int], params: SamplingParams, request_id: str, arrival: float) -> None:
        self._unacked.append(self._send(ADD, token_ids, params, request_id, arrival))

    def _abort(self, request_id: str) -> None:
        self._send(ABORT, request_id)

    def _send(self, kind: str, *args) -> int:
        with self._send_lock:
            if self._closed:
                return self._seq
            self._seq += 1
            self._outbox.put((kind, self._seq, *args))
            return self._seq

    def _write(self) -> None:
        """Writer thread: send what has queued up as one message (pickling happens here, off the event loop)."""
        while True:
            batch = [self._outbox.get()]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is _CLOSE_WRITER
            if done:
                batch.pop()
            try:
                if batch:
                    self._commands.send(batch)
            except OSError:  # the engine process is gone; the reader reports it
                return
            if done:
                return

    def _read(self) -> None:
        """Reader thread: each message to the event loop in one call; EOF means the engine process exited."""
        loop = self._loop
        while True:
            try:
                message = self._replies.recv()
            except (EOFError, OSError):
                break
            try:
                loop.call_soon_threadsafe(self._on_message, message)
            except RuntimeError:  # the event loop is closed: nobody to deliver to
                return
        was_running, self._running = self._running, False
        if not was_running:  # close() stopped it on purpose
            return
        if self._process is not None:
            self._process.join(STOP_WAIT_S)
            error = EngineProcessExited(f"the engine process exited with code {self._process.exitcode}")
        else:  # an API worker: the main process started it and sees its exit code
            error = EngineProcessExited(f"the engine process {self.info.pid} exited")
        self._exit_error = error
        log.error("%s: failing %d open stream(s)", error, len(self._streams))
        try:
            loop.call_soon_threadsafe(self._fail_all, error)
        except RuntimeError:
            pass

    def _on_message(self, message: tuple) -> None:
        rows, failures, step_stats, stats, acked = message
        streams = self._streams
        for row in streams_first(rows):
            stream = streams.get(row[0])
            if stream is not None:
                stream.put_nowait(TokenEvent(*row))
        for request_id, exc in failures:
            stream = streams.get(request_id)
            if stream is not None:
                stream.put_nowait(exc)
        self._stats = stats
        unacked = self._unacked
        while unacked and unacked[0] <= acked:
            unacked.popleft()
        if step_stats is not None:
            notify_step(self.observers, step_stats, stats)

    def _fail_all(self, exc: Exception) -> None:
        for stream in list(self._streams.values()):
            stream.put_nowait(exc)
        self._streams.clear()
        self._unacked.clear()


def streams_first(rows: list[tuple]) -> list[tuple]:
    """A step's event rows (TokenEvent fields), running streams' next tokens before new requests' first tokens and
    aborts. Each put wakes its response task in this order, and a first token costs its task a response start
    (headers, the first chunk; for a storm's clients, soon their teardown) on the same loop iteration: a wave of
    new requests then waits behind the streams' writes instead of the streams waiting behind the wave."""
    if all(row[3] > 0 and row[1] >= 0 for row in rows):
        return rows
    return [row for row in rows if row[3] > 0 and row[1] >= 0] + [row for row in rows if row[3] <= 0 or row[1] < 0]


def _close_all(channels) -> None:
    for channel in channels:
        for conn in channel:
            conn.close()


def _grammars(info: ReadyInfo):
    """This process's grammar compiler (the engine process has its own): None without llguidance."""
    from metronome.server.engine.grammar import Grammars

    if not Grammars.available():
        return None
    import torch

    return Grammars(info.tokenizer, info.vocab_size, list(info.eos_token_ids), torch.device("cpu"))
