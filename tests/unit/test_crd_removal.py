"""A kind whose CRD is deleted under an open watch: kopf's watcher gets 404 on reconnecting. Unpatched, that
failure reaches kopf's orchestrator, which ends the operator; with the tolerant stream the watcher waits and
picks the kind up again when it is served."""
from __future__ import annotations

import asyncio
import logging

import kopf
import pytest
from kopf._cogs.clients import errors, watching
from kopf._cogs.structs import references
from kopf._core.reactor import queueing

from metronome.operator.crd_removal import reconnect_pauses, tolerant_watch, tolerate_unserved_kinds

PODMONITORS = references.Resource(group="monitoring.coreos.com", version="v1", plural="podmonitors",
                                  namespaced=True)
MONITOR = {"type": "ADDED", "object": {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                                       "metadata": {"name": "m", "namespace": "ns", "uid": "u-1",
                                                    "resourceVersion": "7"}}}


def not_found() -> errors.APINotFoundError:
    return errors.APINotFoundError("404 page not found", status=404, headers={})


class ScriptedStream:
    """kopf's infinite_watch as the API server answers after a CRD deletion: each connection either fails with
    the error scripted for it or delivers the events and then stays open."""

    def __init__(self, *connections):
        self.connections = list(connections)
        self.calls = 0

    async def __call__(self, **_):
        self.calls += 1
        outcome = self.connections.pop(0) if self.connections else []
        if isinstance(outcome, Exception):
            raise outcome
        for event in outcome:
            yield event
        await asyncio.Event().wait()  # the stream stays open until cancelled


async def _watch(processor, timeout_s: float = 5.0) -> None:
    await asyncio.wait_for(
        queueing.watcher(namespace="ns", settings=kopf.OperatorSettings(), resource=PODMONITORS, processor=processor),
        timeout_s)


def test_unpatched_kopf_watcher_fails_on_404(monkeypatch):
    # The failure this module exists for: kopf's own watcher lets the 404 out (the orchestrator re-raises it).
    monkeypatch.setattr(watching, "infinite_watch", ScriptedStream(not_found()))

    async def processor(**_):
        pass

    with pytest.raises(errors.APINotFoundError):
        asyncio.run(_watch(processor))


def test_kopf_watcher_waits_out_a_404_and_delivers_the_kind_served_again(monkeypatch, caplog):
    stream = ScriptedStream(not_found(), not_found(), [MONITOR])
    monkeypatch.setattr(watching, "infinite_watch", stream)
    pauses = []

    def short_pauses():
        for pause in reconnect_pauses(first_s=0.01, max_s=0.02):
            pauses.append(pause)
            yield pause

    tolerate_unserved_kinds(short_pauses)
    tolerate_unserved_kinds(short_pauses)  # idempotent: one wrapper, not two
    assert watching.infinite_watch.wrapped_watch is stream
    delivered = []

    async def scenario():
        seen = asyncio.Event()

        async def processor(raw_event, **_):
            delivered.append(raw_event)
            seen.set()

        task = asyncio.create_task(_watch(processor))
        await asyncio.wait_for(seen.wait(), 5)
        task.cancel()  # what kopf's orchestrator does once its observer sees the CRD gone
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="metronome.operator.crd_removal"):
        asyncio.run(scenario())
    assert delivered == [MONITOR]
    assert stream.calls == 3 and pauses == [0.01, 0.02]
    messages = [r.getMessage() for r in caplog.records if r.name == "metronome.operator.crd_removal"]
    assert messages == [f"{PODMONITORS} is not served (its CRD was removed); the watch resumes if it comes back",
                        f"{PODMONITORS} is served again; watching it"]


def test_other_errors_still_reach_kopf():
    async def forbidden(**_):
        raise errors.APIForbiddenError("forbidden", status=403, headers={})
        yield  # an async generator, as kopf's stream is

    async def drain():
        return [event async for event in tolerant_watch(forbidden, errors.APINotFoundError)(resource=PODMONITORS)]

    with pytest.raises(errors.APIForbiddenError):
        asyncio.run(drain())


def test_a_stream_that_ends_ends_the_wrapper():
    async def finite(**_):
        yield 1
        yield 2

    async def drain():
        return [event async for event in tolerant_watch(finite, errors.APINotFoundError)(resource=PODMONITORS)]

    assert asyncio.run(drain()) == [1, 2]


def test_pauses_double_up_to_the_cap():
    pauses = reconnect_pauses(first_s=1.0, max_s=10.0)
    assert [next(pauses) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
