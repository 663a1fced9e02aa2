"""A watch outlives the removal of its kind's CRD.

kopf starts a watch when a CRD appears (prometheus-operator's PodMonitor, KEDA's ScaledObject) and stops it when
its observer sees the CRD go. When the CRD is deleted, the API server ends the open watch; if kopf reconnects
before its observer has seen the deletion, the new request gets 404, the watcher task fails, and kopf's
orchestrator re-raises that failure, which ends the whole operator: uninstalling prometheus-operator would
restart Metronome's operator, and a new leader starting while a CRD is terminating would die at once.

`tolerate_unserved_kinds` wraps kopf's watch stream so that a 404 means "not served now": the stream waits and
reconnects (the listing of a kind served again is delivered as usual), and the orchestrator cancels it when
the observer drops the kind. Every other error goes on to kopf unchanged.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

FIRST_PAUSE_S = 1.0
MAX_PAUSE_S = 30.0


def reconnect_pauses(first_s: float = FIRST_PAUSE_S, max_s: float = MAX_PAUSE_S) -> Iterator[float]:
    """1, 2, 4 ... seconds between attempts while a kind is not served, then every `max_s`."""
    pause = first_s
    while True:
        yield pause
        pause = min(pause * 2, max_s)


def tolerant_watch(watch: Callable[..., AsyncIterator[Any]], not_found: type[Exception],
                   pauses: Callable[[], Iterator[float]] = reconnect_pauses) -> Callable[..., AsyncIterator[Any]]:
    """`watch` (kopf's infinite_watch), reconnecting after `not_found` instead of failing."""

    async def watch_while_served(*, resource: Any, **kwargs: Any) -> AsyncIterator[Any]:
        waits = pauses()
        missing = False
        while True:
            try:
                async for event in watch(resource=resource, **kwargs):
                    if missing:
                        log.info("%s is served again; watching it", resource)
                        missing = False
                        waits = pauses()
                    yield event
                return
            except not_found:
                if not missing:
                    log.info("%s is not served (its CRD was removed); the watch resumes if it comes back", resource)
                    missing = True
            await asyncio.sleep(next(waits))

    watch_while_served.wrapped_watch = watch  # type: ignore[attr-defined]
    return watch_while_served


def tolerate_unserved_kinds(pauses: Callable[[], Iterator[float]] = reconnect_pauses) -> None:
    """Install the tolerant stream in kopf, where its watcher looks it up (once: a second call keeps the first)."""
    from kopf._cogs.clients import errors, watching

    if hasattr(watching.infinite_watch, "wrapped_watch"):
        return
    watching.infinite_watch = tolerant_watch(watching.infinite_watch, errors.APINotFoundError, pauses)
