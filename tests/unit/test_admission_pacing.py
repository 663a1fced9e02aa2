"""Admission pacing (server/api/admission_pacing.py): the order in which requests start and tokens are written.

Every test drives one event loop and records what ran in which order; none measures time."""
from __future__ import annotations

import asyncio
import threading

import pytest
from api_helpers import build_server_parts

from metronome.server.api.admission_pacing import DELIVERY_HOPS, AdmissionPacer

HTTP = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}


async def _receive():
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message):
    pass


def run(coro):
    """Run on a fresh loop; a pacer that never gives a turn fails here instead of hanging the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def deliver_from_thread(loop: asyncio.AbstractEventLoop, log: list, name: str) -> None:
    """What the engine's reader thread does: one handle per step, which wakes the stream (a second hop) that
    writes the token. Joined before returning, so the handle is queued while the request's work still runs."""
    def put() -> None:
        loop.call_soon(log.append, f"write {name}")  # the stream's task, woken by the queue put

    thread = threading.Thread(target=loop.call_soon_threadsafe, args=(put,))
    thread.start()
    thread.join()


def wave(requests: int, hops: int = DELIVERY_HOPS) -> list[str]:
    """`requests` arriving at once, each handing a token over from another thread during its work: the order in
    which requests started and tokens were written."""
    log: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def app(scope, receive, send):
            log.append(f"start {scope['n']}")
            deliver_from_thread(loop, log, str(scope["n"]))

        pacer = AdmissionPacer(app, hops=hops)
        await asyncio.gather(*(pacer({**HTTP, "n": n}, _receive, _send) for n in range(requests)))
        await asyncio.sleep(0)

    run(main())
    return log


def test_tokens_that_arrive_during_a_requests_work_are_written_before_the_next_request_starts():
    assert wave(5) == [entry for n in range(5) for entry in (f"start {n}", f"write {n}")]


def test_with_one_hop_between_starts_the_token_would_wait_behind_the_next_request():
    """The reason for DELIVERY_HOPS = 2: the same wave with 1 writes each token only after the next start."""
    log = wave(3, hops=1)
    assert DELIVERY_HOPS == 2
    assert log.index("write 0") > log.index("start 1")


def test_a_request_alone_starts_in_the_iteration_it_arrives():
    async def main() -> list[bool]:
        loop = asyncio.get_running_loop()
        seen = []

        async def app(scope, receive, send):
            seen.append(marker.done())

        pacer = AdmissionPacer(app)
        for _ in range(3):
            marker = loop.create_future()
            loop.call_soon(marker.set_result, None)  # runs in the next iteration
            await pacer(HTTP, _receive, _send)
            for _ in range(DELIVERY_HOPS + 1):  # the gap after a start has passed
                await asyncio.sleep(0)
        return seen

    assert run(main()) == [False, False, False]


def test_a_request_right_after_another_waits_only_for_the_gap():
    async def main() -> int:
        iterations = 0

        async def app(scope, receive, send):
            pass

        pacer = AdmissionPacer(app)
        await pacer(HTTP, _receive, _send)
        second = asyncio.ensure_future(pacer(HTTP, _receive, _send))
        while not second.done():
            await asyncio.sleep(0)
            iterations += 1
        return iterations

    assert run(main()) <= DELIVERY_HOPS + 1


def test_requests_start_first_come_first_served():
    started: list[int] = []

    async def main() -> None:
        async def app(scope, receive, send):
            started.append(scope["n"])

        pacer = AdmissionPacer(app)
        await asyncio.gather(*(pacer({**HTTP, "n": n}, _receive, _send) for n in range(10)))

    run(main())
    assert started == list(range(10))


def test_a_waiter_that_is_cancelled_leaves_the_queue_and_the_next_one_takes_its_turn():
    started: list[int] = []

    async def main() -> AdmissionPacer:
        async def app(scope, receive, send):
            started.append(scope["n"])

        pacer = AdmissionPacer(app)
        tasks = [asyncio.ensure_future(pacer({**HTTP, "n": n}, _receive, _send)) for n in range(4)]
        await asyncio.sleep(0)  # all four have arrived: 0 started, 1-3 wait
        assert started == [0] and pacer.waiting == 3
        tasks[1].cancel()
        tasks[2].cancel()
        await asyncio.sleep(0)
        assert pacer.waiting == 1
        await tasks[3]
        for task in tasks[1:3]:
            with pytest.raises(asyncio.CancelledError):
                await task
        return pacer

    pacer = run(main())
    assert started == [0, 3]
    assert pacer.waiting == 0 and not pacer._waiting


def test_a_client_that_left_while_waiting_still_reaches_the_app_which_sees_the_disconnect():
    seen: list[str] = []

    async def main() -> None:
        async def gone():
            return {"type": "http.disconnect"}

        async def app(scope, receive, send):
            seen.append((await receive())["type"])

        pacer = AdmissionPacer(app)
        await asyncio.gather(pacer(HTTP, _receive, _send), pacer(HTTP, gone, _send))

    run(main())
    assert seen == ["http.request", "http.disconnect"]


def test_an_error_in_the_app_propagates_and_the_queue_moves_on():
    started: list[int] = []

    async def main() -> list:
        async def app(scope, receive, send):
            started.append(scope["n"])
            if scope["n"] == 1:
                raise RuntimeError("handler failed")

        pacer = AdmissionPacer(app)
        return await asyncio.gather(*(pacer({**HTTP, "n": n}, _receive, _send) for n in range(3)),
                                    return_exceptions=True)

    results = run(main())
    assert started == [0, 1, 2]
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], RuntimeError) and str(results[1]) == "handler failed"


def test_lifespan_scopes_never_wait():
    async def main() -> list[str]:
        ran = []

        async def app(scope, receive, send):
            ran.append(scope["type"])

        pacer = AdmissionPacer(app)
        waiting = [asyncio.ensure_future(pacer(HTTP, _receive, _send)) for _ in range(3)]
        await asyncio.sleep(0)
        await pacer({"type": "lifespan"}, _receive, _send)  # while two requests wait
        order = list(ran)
        await asyncio.gather(*waiting)
        return order

    assert run(main()) == ["http", "lifespan"]


def test_a_new_event_loop_starts_with_an_empty_queue():
    """A loop that stopped mid-gap never runs its callbacks: the next loop must not wait for them."""
    async def app(scope, receive, send):
        pass

    pacer = AdmissionPacer(app)
    run(pacer(HTTP, _receive, _send))  # leaves a gap whose tick the closed loop never runs
    assert run(pacer(HTTP, _receive, _send)) is None


def test_hops_below_one_are_refused():
    with pytest.raises(ValueError, match="at least 1 loop iteration"):
        AdmissionPacer(lambda *a: None, hops=0)


def test_the_pacer_is_the_apps_outermost_middleware():
    _, _, app = build_server_parts()
    assert app.user_middleware[0].cls is AdmissionPacer
