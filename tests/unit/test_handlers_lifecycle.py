"""What the operator registers with kopf: watches only — no change handler (no progress or last-handled
annotations an old leader could leave behind), no timer or daemon (kopf would force a finalizer onto every
object) — every child kind and the server pods selected on the server by the operator's own label, and API
errors retried for as long as the API server is away."""
from __future__ import annotations

import itertools

import kopf

from metronome.operator import builders, handlers, kinds
from metronome.operator.options import OperatorOptions


def registry() -> kopf.OperatorRegistry:
    reg = kopf.OperatorRegistry()
    handlers.register(reg, OperatorOptions())
    return reg


def test_only_watches_are_registered():
    reg = registry()
    assert reg._spawning.get_all_handlers() == []  # timers and daemons: each would force a finalizer
    assert reg._changing.get_all_handlers() == []  # create/update/resume/field: kopf's progress annotations


def test_every_child_kind_and_the_pods_are_watched_by_the_operators_label_and_other_autoscalers_whole():
    watched = {(h.selector.group, h.selector.plural): h for h in registry()._watching.get_all_handlers()}
    expected = {(kind.group, kind.plural)
                for kind in (kinds.INFERENCE_SERVICE, *kinds.WATCHED, *kinds.SCALERS, kinds.CRD)}
    assert set(watched) == expected
    for kind in kinds.WATCHED:
        assert watched[kind.group, kind.plural].labels == {builders.LABEL_MANAGED_BY: builders.MANAGED_BY}
    for kind in kinds.SCALERS:  # the user's HPAs and ScaledObjects carry no label of the operator's
        assert not watched[kind.group, kind.plural].labels
    settings = kopf.OperatorSettings()
    handlers.configure_settings(settings)
    for kind in kinds.WATCHED:
        (selector,) = [value for key, value in settings.watching.label_selectors.items()
                       if (key.group, key.version, key.any_name) == (kind.group, kind.version, kind.plural)]
        assert selector == "app.kubernetes.io/managed-by=metronome-operator"


def test_only_the_crds_of_optional_children_are_followed():
    assert handlers._optional_crd(name=kinds.POD_MONITOR.crd)
    assert handlers._optional_crd(name=kinds.PROMETHEUS_RULE.crd)
    assert handlers._optional_crd(name=kinds.SCALED_OBJECT.crd)  # KEDA installed after the operator
    assert not handlers._optional_crd(name="certificates.cert-manager.io")


def test_api_errors_are_retried_without_end_and_afresh_for_each_request():
    backoffs = handlers.RetryForever()
    first = list(itertools.islice(backoffs, 10))
    assert first == [1, 1, 2, 3, 5, 8, 13, 15, 15, 15]
    assert list(itertools.islice(backoffs, 3)) == [1, 1, 2]  # a new request starts from the beginning
