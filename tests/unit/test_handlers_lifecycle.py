"""What the operator registers with kopf: no timer or daemon (kopf would force a finalizer onto every object),
children watched by the operator's own labels, API errors retried for as long as the API server is away, and
the per-service memory the handlers share."""
from __future__ import annotations

import itertools

import kopf

from metronome.operator import builders, handlers
from metronome.operator.options import OperatorOptions


def registry() -> kopf.OperatorRegistry:
    reg = kopf.OperatorRegistry()
    handlers.register(reg, OperatorOptions())
    return reg


def test_no_handler_needs_a_finalizer_and_nothing_is_polled_per_object():
    reg = registry()
    assert reg._spawning.get_all_handlers() == []  # timers and daemons: each would force a finalizer
    assert not any(h.requires_finalizer for h in reg._changing.get_all_handlers())


def test_owned_deployments_and_configmaps_are_watched_by_the_operators_labels():
    watched = {(h.selector.group, h.selector.plural): h.labels for h in registry()._watching.get_all_handlers()}
    assert set(watched) == {("apps", "deployments"), ("", "configmaps")}
    for labels in watched.values():
        assert labels[builders.LABEL_MANAGED_BY] == builders.MANAGED_BY
        assert labels[builders.LABEL_SERVICE] is kopf.PRESENT


def test_api_errors_are_retried_without_end_and_afresh_for_each_request():
    backoffs = handlers.RetryForever()
    first = list(itertools.islice(backoffs, 10))
    assert first == [1, 1, 2, 3, 5, 8, 13, 15, 15, 15]
    assert list(itertools.islice(backoffs, 3)) == [1, 1, 2]  # a new request starts from the beginning


def test_services_keep_memory_per_object_and_forget_a_recreated_one():
    services = handlers.Services()
    state = services.state("ml", "chat", "uid-1")
    assert services.state("ml", "chat", "uid-1") is state
    assert services.due(now=0.0) == [("ml", "chat")]  # never read: due at once
    state.tuner.next_reading, state.tuner.metrics = 100.0, object()
    assert services.due(now=50.0) == [] and services.due(now=100.0) == [("ml", "chat")]
    assert services.state("ml", "chat", "uid-2") is not state  # same name, new object: a fresh start
    services.forget("ml", "chat")
    assert services.due(now=0.0) == []


def test_the_control_loop_pauses_a_failing_service_with_a_doubling_back_off(monkeypatch):
    calls = []

    def refresh_owner(memo, namespace, name):
        calls.append((namespace, name))
        if len(calls) <= 2:
            raise ConnectionError("API server away")

    monkeypatch.setattr(handlers, "refresh_owner", refresh_owner)
    memo = kopf.Memo(services=handlers.Services())
    memo.services.state("ml", "chat", "uid")  # never read: due
    loop = handlers.ControlLoop(memo, interval_s=1.0)
    for now in (0.0, 0.5, 1.0, 1.5, 2.9, 3.0, 3.5):
        loop.run_once(now)
    # Fails at 0 (pause 1 s) and at 1 (pause 2 s); tried again at 3 and succeeds; then every pass while due.
    assert len(calls) == 4 and loop._failures == {}


def test_an_api_server_away_mid_handler_is_retried_soon_and_other_errors_are_not_hidden():
    import pytest
    import urllib3

    from metronome.operator.k8s import KubeError

    def failing(error):
        @handlers.retried_through_outages
        def handler(**_):
            raise error
        return handler

    away = urllib3.exceptions.MaxRetryError(None, "/api/v1/configmaps", reason="connection refused")
    with pytest.raises(kopf.TemporaryError) as caught:
        failing(away)(body={})
    assert caught.value.delay == handlers.OUTAGE_RETRY_S and "did not answer" in str(caught.value)
    with pytest.raises(kopf.TemporaryError):
        failing(KubeError(503, "Service Unavailable", "starting", "PATCH x"))()
    invalid = KubeError(422, "Unprocessable Entity", "spec.replicas: Invalid value", "PATCH x")
    with pytest.raises(KubeError):  # a request the API server refused stays an error kopf reports in full
        failing(invalid)()
    with pytest.raises(ValueError):
        failing(ValueError("a bug"))()
    assert handlers.reconcile_service.__wrapped__ and handlers.serve_spec_server.__wrapped__  # both are wrapped
