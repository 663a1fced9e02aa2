"""A simulated fleet of chunked-prefill servers behind a round-robin Service, for the controller's replica tests.

Each server is a GPU-like engine: a step carries every running decode (one token each) and up to `chunk` prompt
tokens, first come first served, and costs a + b·tokens (+ m when it carries prompt tokens) with a little noise.
Poisson arrivals are dealt round-robin to the servers that are ready (a new one becomes ready `startup_s` after it
is added); a server that is removed first drains: it gets no new requests, finishes every one it holds, and
reports until it is empty, as a terminating pod with a preStop hook and a drain does. Nothing is ever dropped, so
every request that arrived either finished or is still in some server.

`Fleet.observe` reports what the operator's PromQL would over the last window: p99 TBT and TTFT interpolated from
the shared buckets, output and prompt tokens per second, finished requests per second, running decodes per pod,
the waiting queue (its time mean and its growth over the window), one (tokens, seconds) point per pod, step kind
and sub-window, and each reporting pod's config generation and when it applied it.
"""
from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from metronome.contract.histogram import histogram_quantile
from metronome.contract.metric_names import TBT_BUCKETS, TTFT_BUCKETS
from metronome.operator.tuning.observation import Observation, StepSample

SUB_WINDOW_S = 5.0


@dataclass(frozen=True)
class Hardware:
    a: float = 0.010  # a decode step's fixed cost
    b: float = 20e-6  # per token
    m: float = 0.002  # the extra fixed cost of a step that carries prompt tokens
    noise: float = 0.03  # relative standard deviation of a step's time


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second, all servers together
    long_fraction: float = 0.0
    long_prompt: tuple[int, int] = (2800, 3200)
    short_prompt: tuple[int, int] = (2800, 3200)
    output: tuple[int, int] = (100, 156)


@dataclass
class _Request:
    arrival: float
    prompt_left: int
    output: int


@dataclass
class _Window:
    tbt: list = field(default_factory=lambda: [0] * (len(TBT_BUCKETS) + 1))  # per bucket (the last: +Inf)
    ttft: list = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    prompt_tokens: int = 0
    output_tokens: int = 0
    finished: int = 0
    decode_time: float = 0.0  # running decodes integrated over time
    waiting_time: float = 0.0  # waiting requests integrated over time
    points: dict = field(default_factory=dict)  # (pod, sub-window, kind) → [tokens, seconds, steps]


def _cumulative(counts: list, bounds: tuple[float, ...]) -> list[tuple[float, float]]:
    total, out = 0, []
    for bound, count in zip((*bounds, math.inf), counts):
        total += count
        out.append((bound, total))
    return out


class Server:
    def __init__(self, name: str, hardware: Hardware, rng: random.Random, ready_at: float):
        self.name, self.hw, self.rng = name, hardware, rng
        self.ready_at = ready_at
        self.applied_at = ready_at  # when it applied the config it serves (a new server: when it started)
        self.draining = False
        self.now = ready_at
        self.steps = 0
        self.waiting: deque[_Request] = deque()
        self.decode_ends: list[int] = []

    @property
    def empty(self) -> bool:
        return not self.waiting and not self.decode_ends

    def run(self, chunk: int, end: float, arrivals: list[_Request], window: _Window, window_start: float) -> None:
        """Serve until `end`, admitting each of `arrivals` (in time order) when its time comes."""
        pending = deque(arrivals)
        self.now = max(self.now, window_start)
        while self.now < end:
            while pending and pending[0].arrival <= self.now:
                self.waiting.append(pending.popleft())
            decodes, budget, prefilled, first = len(self.decode_ends), chunk, 0, []
            while self.waiting and budget > 0:
                head = self.waiting[0]
                take = min(head.prompt_left, budget)
                head.prompt_left, budget, prefilled = head.prompt_left - take, budget - take, prefilled + take
                if head.prompt_left:
                    break
                first.append(self.waiting.popleft())
            tokens = decodes + prefilled
            if tokens == 0:
                self.now = min(pending[0].arrival if pending else end, end)
                continue
            duration = (self.hw.a + self.hw.b * tokens + (self.hw.m if prefilled else 0.0)) * max(
                0.5, self.rng.gauss(1.0, self.hw.noise))
            self.now += duration
            self.steps += 1
            window.tbt[bisect.bisect_left(TBT_BUCKETS, duration)] += decodes
            for request in first:
                window.ttft[bisect.bisect_left(TTFT_BUCKETS, self.now - request.arrival)] += 1
                heapq.heappush(self.decode_ends, self.steps + request.output - 1)
            window.prompt_tokens += prefilled
            window.output_tokens += decodes + len(first)
            window.decode_time += decodes * duration
            window.waiting_time += max(0, len(self.waiting) - (1 if prefilled and self.waiting else 0)) * duration
            point = window.points.setdefault((self.name, int((self.now - window_start) // SUB_WINDOW_S),
                                              "mixed" if prefilled else "decode"), [0.0, 0.0, 0])
            point[0], point[1], point[2] = point[0] + tokens, point[1] + duration, point[2] + 1
            while self.decode_ends and self.decode_ends[0] <= self.steps:
                heapq.heappop(self.decode_ends)
                window.finished += 1
        for request in pending:  # arrived in the last instant of the window
            self.waiting.append(request)


class Fleet:
    def __init__(self, workload: Workload, hardware: Hardware = Hardware(), seed: int = 0, replicas: int = 1,
                 startup_s: float = 10.0):
        self.workload, self.hw = workload, hardware
        self.rng = random.Random(seed)
        self.startup_s = startup_s
        self.now = 0.0
        self.next_arrival = self.rng.expovariate(workload.rate)
        self.servers: list[Server] = []
        self._names = 0
        self._turn = 0
        self.arrived = 0
        self.finished = 0
        for _ in range(replicas):
            self._add(ready_at=0.0)

    # --- replicas -------------------------------------------------------------------------------------------------

    def _add(self, ready_at: float) -> None:
        self.servers.append(Server(f"pod-{self._names}", self.hw, random.Random(self.rng.random()), ready_at))
        self._names += 1

    @property
    def replicas(self) -> int:
        """Servers not draining (ready or starting): what the Deployment's spec.replicas asks for."""
        return sum(1 for s in self.servers if not s.draining)

    def scale_to(self, replicas: int) -> None:
        """Start servers (ready after startup_s) or drain the newest ones."""
        while self.replicas < replicas:
            self._add(ready_at=self.now + self.startup_s)
        live = [s for s in self.servers if not s.draining]
        for server in live[replicas:]:
            server.draining = True

    def reconfigure(self) -> None:
        """A new config generation reaches every server now (a server still starting reads it as it starts)."""
        for server in self.servers:
            server.applied_at = max(self.now, server.ready_at)

    def set_rate(self, rate: float) -> None:
        if rate != self.workload.rate:
            self.workload = Workload(rate, self.workload.long_fraction, self.workload.long_prompt,
                                     self.workload.short_prompt, self.workload.output)
            self.next_arrival = self.now + self.rng.expovariate(rate)

    @property
    def in_flight(self) -> int:
        return sum(len(s.waiting) + len(s.decode_ends) for s in self.servers)

    # --- time -----------------------------------------------------------------------------------------------------

    def _arrivals(self, end: float) -> list[_Request]:
        load, out = self.workload, []
        while self.next_arrival < end:
            long = self.rng.random() < load.long_fraction
            low, high = load.long_prompt if long else load.short_prompt
            out.append(_Request(self.next_arrival, self.rng.randint(low, high), self.rng.randint(*load.output)))
            self.next_arrival += self.rng.expovariate(load.rate)
        return out

    def run(self, chunk: int, seconds: float) -> tuple[_Window, dict[str, int]]:
        """Serve `seconds` at `chunk`; returns the window and each server's waiting queue at its start."""
        start, end = self.now, self.now + seconds
        window = _Window()
        waiting_start = {s.name: len(s.waiting) for s in self.servers}
        dealt: dict[str, list[_Request]] = {s.name: [] for s in self.servers}
        for request in self._arrivals(end):
            ready = [s for s in self.servers if not s.draining and s.ready_at <= request.arrival]
            if not ready:  # every server still starting: the first to be ready takes it
                ready = sorted((s for s in self.servers if not s.draining), key=lambda s: s.ready_at)[:1]
            server = ready[self._turn % len(ready)]
            self._turn += 1
            dealt[server.name].append(request)
            self.arrived += 1
        for server in self.servers:
            server.run(chunk, end, dealt[server.name], window, start)
        self.finished += window.finished
        self.servers = [s for s in self.servers if not (s.draining and s.empty)]
        self.now = end
        return window, waiting_start

    def observe(self, window: _Window, waiting_start: dict[str, int], generation: int,
                seconds: float) -> Observation:
        def p99(counts: list, bounds: tuple[float, ...]) -> float | None:
            value = histogram_quantile(0.99, _cumulative(counts, bounds))
            return None if math.isnan(value) else value

        reporting = [s for s in self.servers if s.ready_at <= self.now]
        pods = max(1, len(reporting))
        waiting_end = sum(len(s.waiting) for s in self.servers)
        return Observation(
            window_seconds=seconds, sample_count=sum(window.tbt), tbt_p99_s=p99(window.tbt, TBT_BUCKETS),
            ttft_p99_s=p99(window.ttft, TTFT_BUCKETS), output_tokens_per_s=window.output_tokens / seconds,
            prompt_tokens_per_s=window.prompt_tokens / seconds, requests_per_s=window.finished / seconds,
            decode_batch_size=window.decode_time / seconds / pods,
            step_samples=tuple(StepSample(t / n, s / n, n, pod, kind) for (pod, _, kind), (t, s, n)
                               in sorted(window.points.items())),
            pod_generations={s.name: generation for s in reporting},
            config_applied_at={s.name: s.applied_at for s in reporting},
            waiting_requests=window.waiting_time / seconds,
            waiting_growth=float(waiting_end - sum(waiting_start.values())))
