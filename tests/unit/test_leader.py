"""Leader election's pure rules (operator/leader.py): who takes the Lease when, and what is written."""
from __future__ import annotations

import pytest

from metronome.operator.leader import ACQUIRE, RENEW, WAIT, LeaseRecord, LeaseTimes, next_spec, plan

TIMES = LeaseTimes(duration_s=8, renew_deadline_s=5, retry_period_s=1)


def record(holder, transitions=0, acquired="2026-12-01T09:00:00.000000Z"):
    return LeaseRecord(holder=holder, duration_s=8, acquire_time=acquired, renew_time=acquired,
                       transitions=transitions, resource_version="7")


def test_a_free_or_missing_lease_is_taken_and_ones_own_is_renewed():
    assert plan(None, "a", 0) == ACQUIRE
    assert plan(record(None), "a", 0) == ACQUIRE
    assert plan(record("a"), "a", 100) == RENEW


def test_another_holder_is_waited_for_until_it_has_been_silent_a_whole_lease():
    assert plan(record("b"), "a", 0) == WAIT
    assert plan(record("b"), "a", 7.9) == WAIT
    assert plan(record("b"), "a", 8.0) == ACQUIRE


def test_a_takeover_counts_a_transition_and_a_renewal_keeps_the_acquire_time():
    taken = next_spec(record("b", transitions=3), "a", TIMES, "2026-12-01T09:01:00.000000Z")
    assert taken == {"holderIdentity": "a", "leaseDurationSeconds": 8, "acquireTime": "2026-12-01T09:01:00.000000Z",
                     "renewTime": "2026-12-01T09:01:00.000000Z", "leaseTransitions": 4}
    renewed = next_spec(record("a", transitions=4), "a", TIMES, "2026-12-01T09:02:00.000000Z")
    assert renewed["acquireTime"] == "2026-12-01T09:00:00.000000Z" and renewed["leaseTransitions"] == 4
    assert next_spec(None, "a", TIMES, "t")["leaseTransitions"] == 0
    assert next_spec(record(None, transitions=2), "a", TIMES, "t")["leaseTransitions"] == 2  # released, not taken


@pytest.mark.parametrize(("duration", "deadline", "retry"), [(10, 10, 2), (10, 2, 2), (10, 5, 0)])
def test_times_that_would_let_two_replicas_act_at_once_are_refused(duration, deadline, retry):
    with pytest.raises(ValueError, match="--lease"):
        LeaseTimes(duration, deadline, retry)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_writes_are_fenced_once_the_last_renewal_is_older_than_the_renew_deadline():
    from metronome.operator.k8s import LeadershipLost
    from metronome.operator.leader import LeaderElector, Leadership

    clock = Clock()
    elector = LeaderElector("ns", "lease", "a", TIMES, api_client=object(), clock=clock)
    fence = Leadership(elector)
    with pytest.raises(LeadershipLost):
        fence.check()  # never held
    elector.last_renewed = clock.now
    fence.check()
    clock.now += TIMES.renew_deadline_s - 0.1
    fence.check()
    clock.now += 0.2  # paused past the deadline (SIGSTOP): no write leaves before a renewal succeeds
    with pytest.raises(LeadershipLost):
        fence.check()
    elector.last_renewed = clock.now
    elector.lost = True  # lost for good: a renewal does not reopen the fence
    with pytest.raises(LeadershipLost):
        fence.check()
    Leadership().check()  # standalone: always allowed
