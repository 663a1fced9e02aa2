"""A CRD whose kinds the API's discovery lists only after the CRD's last event.

kopf learns which kinds exist from discovery (/apis): on each event of a CRD (created, Established, changed) it
scans that CRD's group and starts or stops the watches of the kinds it finds. The API server publishes a new group
in discovery on its own schedule; on a loaded control plane a new CRD's last event (its Established condition) can
come before discovery lists the kind, every scan kopf makes then misses it, and nothing scans again until some CRD
of that group changes. KEDA installed after the operator would then go unseen: its ScaledObjects never watched,
a service they scale never told it is managed externally.

`rescan_until_served` wraps kopf's CRD event processor: after an event of an Established CRD that the operator
follows (kinds.OPTIONAL_CRDS), it checks discovery for the CRD's served versions, and while they are missing scans
again after RESCAN_PAUSES_S, then lets kopf revise its watches once they are listed.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

RESCAN_PAUSES_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # about a minute in all


@dataclass(frozen=True)
class ServedKinds:
    name: str  # plural.group, the CRD's name
    group: str
    plural: str
    versions: frozenset[str]


def served_kinds(crd: Mapping[str, Any]) -> ServedKinds | None:
    """The kinds an Established CRD serves; None while it is not Established (its next condition brings another
    event) or where the object is not a readable CRD."""
    spec, status = crd.get("spec") or {}, crd.get("status") or {}
    established = any(c.get("type") == "Established" and c.get("status") == "True"
                      for c in status.get("conditions") or [])
    group, plural = spec.get("group"), (spec.get("names") or {}).get("plural")
    versions = frozenset(v["name"] for v in spec.get("versions") or [] if v.get("served") and v.get("name"))
    if not (established and group and plural and versions):
        return None
    return ServedKinds(f"{plural}.{group}", group, plural, versions)


def listed(kinds: ServedKinds, resources: Iterable[Any]) -> bool:
    """Whether discovery's resources (kopf's Resource: group, version, plural) list every served version."""
    versions = {r.version for r in resources if r.group == kinds.group and r.plural == kinds.plural}
    return kinds.versions <= versions


Scan = Callable[..., Awaitable[Collection[Any]]]


def rescan_until_served(process: Callable[..., Awaitable[None]], scan: Scan, followed: Collection[str],
                        pauses: Iterable[float] = RESCAN_PAUSES_S,
                        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> Callable[..., Awaitable[None]]:
    """kopf's `process` (process_discovered_resource_event) that, for the `followed` CRDs, waits for discovery to
    list an Established CRD's kinds and has kopf revise its watches once it does. `scan`: kopf's scan_resources."""

    async def process_until_served(*, raw_event: Mapping[str, Any], settings: Any, **kwargs: Any) -> None:
        await process(raw_event=raw_event, settings=settings, **kwargs)
        if raw_event.get("type") not in ("ADDED", "MODIFIED"):
            return
        kinds = served_kinds(raw_event.get("object") or {})
        if kinds is None or kinds.name not in followed:
            return
        waited = 0.0
        for pause in (0.0, *pauses):
            if pause:
                await sleep(pause)
                waited += pause
            if listed(kinds, await scan(groups={kinds.group}, settings=settings, logger=log)):
                if waited:
                    log.info("%s: discovery lists it %.1f s after its last event; watching it now", kinds.name, waited)
                    await process(raw_event=raw_event, settings=settings, **kwargs)
                return
        log.warning("%s is Established but discovery does not list it %.0f s later: its objects are not watched "
                    "until a CRD of %s changes", kinds.name, waited, kinds.group)

    process_until_served.wrapped_process = process  # type: ignore[attr-defined]
    return process_until_served


def watch_crds_once_served(followed: Collection[str]) -> None:
    """Install the waiting processor where kopf's resource observer looks it up (once: a second call keeps the
    first)."""
    from kopf._cogs.clients import scanning
    from kopf._core.reactor import observation

    if hasattr(observation.process_discovered_resource_event, "wrapped_process"):
        return
    observation.process_discovered_resource_event = rescan_until_served(
        observation.process_discovered_resource_event, scanning.scan_resources, frozenset(followed))
