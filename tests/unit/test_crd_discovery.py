"""A followed CRD that discovery lists only after its last event: the wrapped kopf processor scans again until the
kinds are listed, then has kopf revise its watches; other CRDs, deletions and CRDs not yet Established cost
nothing extra."""
from __future__ import annotations

import asyncio
import logging

from kopf._cogs.structs import references

from metronome.operator.crd_discovery import listed, rescan_until_served, served_kinds, watch_crds_once_served

FOLLOWED = frozenset({"scaledobjects.keda.sh"})
SCALED_OBJECTS = references.Resource(group="keda.sh", version="v1alpha1", plural="scaledobjects", namespaced=True)
TRIGGER_AUTH = references.Resource(group="keda.sh", version="v1alpha1", plural="triggerauthentications",
                                   namespaced=True)


def crd(plural="scaledobjects", group="keda.sh", established=True, versions=(("v1alpha1", True),)):
    return {"metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "names": {"plural": plural},
                     "versions": [{"name": name, "served": served} for name, served in versions]},
            "status": {"conditions": [{"type": "NamesAccepted", "status": "True"},
                                      {"type": "Established", "status": "True" if established else "False"}]}}


class Discovery:
    """kopf's scan_resources as the API server answers while it catches up: one answer a call, the last repeated."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.scans = []

    async def __call__(self, *, groups, settings, logger):
        self.scans.append(set(groups))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def run(event, discovery, pauses=(0.5, 1.0, 2.0)):
    processed, slept = [], []

    async def process(*, raw_event, settings, **kwargs):
        processed.append((raw_event["type"], kwargs))

    async def sleep(seconds):
        slept.append(seconds)

    wrapped = rescan_until_served(process, discovery, FOLLOWED, pauses, sleep)
    asyncio.run(wrapped(raw_event=event, settings=object(), insights="kopf's"))
    return processed, slept


def test_the_kinds_an_established_crd_serves():
    kinds = served_kinds(crd(versions=(("v1alpha1", True), ("v1beta1", False))))
    assert (kinds.name, kinds.group, kinds.plural, kinds.versions) == (
        "scaledobjects.keda.sh", "keda.sh", "scaledobjects", frozenset({"v1alpha1"}))
    assert served_kinds(crd(established=False)) is None
    assert served_kinds({"spec": {}}) is None
    assert listed(kinds, [TRIGGER_AUTH, SCALED_OBJECTS])
    assert not listed(kinds, [TRIGGER_AUTH])


def test_a_crd_discovery_lists_late_is_scanned_until_it_is_listed(caplog):
    discovery = Discovery([], [], [SCALED_OBJECTS])
    with caplog.at_level(logging.INFO, logger="metronome.operator.crd_discovery"):
        processed, slept = run({"type": "MODIFIED", "object": crd()}, discovery)
    assert discovery.scans == [{"keda.sh"}] * 3
    assert slept == [0.5, 1.0]
    # kopf's own pass, then its pass again once the kind is listed (with every argument kopf gave)
    assert processed == [("MODIFIED", {"insights": "kopf's"})] * 2
    assert "scaledobjects.keda.sh: discovery lists it 1.5 s after its last event" in caplog.text


def test_a_crd_already_listed_costs_one_scan():
    discovery = Discovery([SCALED_OBJECTS])
    processed, slept = run({"type": "ADDED", "object": crd()}, discovery)
    assert (len(discovery.scans), slept, len(processed)) == (1, [], 1)


def test_a_crd_never_listed_is_reported_once_the_pauses_are_spent(caplog):
    with caplog.at_level(logging.WARNING, logger="metronome.operator.crd_discovery"):
        processed, slept = run({"type": "MODIFIED", "object": crd()}, Discovery([TRIGGER_AUTH]))
    assert slept == [0.5, 1.0, 2.0] and len(processed) == 1
    assert "scaledobjects.keda.sh is Established but discovery does not list it 4 s later" in caplog.text


def test_other_crds_deletions_and_unestablished_crds_are_left_to_kopf():
    for event in ({"type": "ADDED", "object": crd(plural="certificates", group="cert-manager.io")},
                  {"type": "DELETED", "object": crd()},
                  {"type": "ADDED", "object": crd(established=False)},
                  {"type": None, "object": crd()}):  # the initial listing
        discovery = Discovery([])
        processed, slept = run(event, discovery)
        assert (discovery.scans, slept, len(processed)) == ([], [], 1), event


def test_installed_once_where_kopf_looks_it_up(monkeypatch):
    from kopf._core.reactor import observation

    original = observation.process_discovered_resource_event
    monkeypatch.setattr(observation, "process_discovered_resource_event", original)
    watch_crds_once_served(FOLLOWED)
    installed = observation.process_discovered_resource_event
    assert installed.wrapped_process is original
    watch_crds_once_served(FOLLOWED)
    assert observation.process_discovered_resource_event is installed
