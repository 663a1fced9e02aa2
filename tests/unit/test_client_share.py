"""The per-client share logic (server/api/client_share.py): identity, fair share, refusals, the ledger."""
from __future__ import annotations

import pytest

from metronome.contract.errors import EngineOverloadedError
from metronome.server.api.client_share import (
    ClientLedger,
    ClientLoad,
    ClientShareExceeded,
    ShareFlags,
    bearer_token,
    client_identity,
    fair_share,
    refusal,
)


def test_identity_precedence_key_then_user_then_address():
    keyed = client_identity("sk-secret", "alice", "10.0.0.1")
    assert keyed.startswith("key:") and "sk-secret" not in keyed
    assert keyed == client_identity("sk-secret", "bob", "10.0.0.2")  # the key decides, not the user field
    assert keyed != client_identity("sk-other", "alice", "10.0.0.1")
    assert client_identity(None, "alice", "10.0.0.1") == "user:alice"
    assert client_identity(None, "", "10.0.0.1") == "addr:10.0.0.1"
    assert client_identity(None, None, None) == "addr:unknown"


def test_bearer_token():
    assert bearer_token("Bearer k1") == "k1"
    assert bearer_token("bearer   k2 ") == "k2"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


@pytest.mark.parametrize(("limit", "per_client", "active", "share"), [
    (16, None, 1, None),  # alone: no per-client cap at all
    (16, 2, 1, None),  # the explicit cap too applies only while others are active
    (16, None, 2, 8),
    (16, None, 3, 5),
    (16, None, 40, 1),  # never 0: every client can get one request in
    (16, 4, 2, 4),  # the flag tightens the fair share
    (16, 12, 2, 8),  # but never loosens it
    (0, None, 2, 0),  # a zero limit stays zero
])
def test_fair_share(limit, per_client, active, share):
    assert fair_share(limit, per_client, active) == share


def test_shares_of_all_active_clients_fit_the_limit():
    for limit in (1, 2, 7, 16, 256):
        for active in range(2, limit + 1):
            assert fair_share(limit, None, active) * active <= limit


def test_refusal_names_the_limit_and_the_flag():
    flags = ShareFlags(max_waiting_per_client=3)
    assert refusal("user:b", ClientLoad(waiting=2), 1, 1, 16, 256, flags) is None
    message = refusal("user:b", ClientLoad(waiting=3), 1, 1, 16, 256, flags)
    assert "share of the waiting queue is 3" in message and "--max-waiting 16" in message
    assert "--max-waiting-per-client 3" in message
    # alone, the same load passes: only the global limits apply
    assert refusal("user:b", ClientLoad(waiting=3), 1, 0, 16, 256, flags) is None


def test_refusal_counts_all_choices_of_a_request():
    flags = ShareFlags()
    assert refusal("c", ClientLoad(), 8, 1, 16, 256, flags) is None
    assert "asks for 9 more" in refusal("c", ClientLoad(), 9, 1, 16, 256, flags)


def test_running_share_counts_waiting_requests_too():
    flags = ShareFlags(max_running_per_client=4)
    assert refusal("c", ClientLoad(waiting=1, running=2), 1, 1, 16, 256, flags) is None
    message = refusal("c", ClientLoad(waiting=1, running=3), 1, 1, 16, 256, flags)
    assert "share of the running requests is 4" in message and "--max-running-per-client 4" in message
    # fair share of --max-num-seqs without the flag: 6 // 2 = 3
    assert "--max-num-seqs 6 / 2" in refusal("c", ClientLoad(running=3), 1, 1, 16, 6, ShareFlags())


def test_long_client_names_are_shortened_in_messages():
    message = refusal("user:" + "x" * 10_000, ClientLoad(waiting=1), 1, 1, 2, 256, ShareFlags())
    assert len(message) < 600 and "x" * 59 + "..." in message


def test_ledger_admits_until_the_share_then_raises_a_429_error():
    ledger = ClientLedger()
    steady = ledger.admit("user:steady", 1, 4, 256)
    holds = [ledger.admit("user:hostile", 1, 4, 256) for _ in range(2)]  # share 4 // 2 = 2
    with pytest.raises(ClientShareExceeded) as caught:
        ledger.admit("user:hostile", 1, 4, 256)
    assert isinstance(caught.value, EngineOverloadedError) and caught.value.retry_after_seconds >= 1
    assert ledger.loads["user:hostile"] == ClientLoad(waiting=2)  # a refusal takes nothing
    holds[0].first_token(0)  # one of them is running now: a waiting slot is free again
    assert ledger.loads["user:hostile"] == ClientLoad(waiting=1, running=1)
    holds.append(ledger.admit("user:hostile", 1, 4, 256))
    steady.release()  # the other client is gone: the hostile one is alone, no cap
    holds += [ledger.admit("user:hostile", 1, 4, 256) for _ in range(3)]
    assert ledger.loads == {"user:hostile": ClientLoad(waiting=5, running=1)}
    for hold in holds:
        hold.release()
    assert ledger.loads == {}


def test_hold_methods_are_idempotent():
    ledger = ClientLedger()
    hold = ledger.admit("c", 3, 16, 256)
    hold.first_token(0)
    hold.first_token(0)
    hold.finish(0)
    hold.finish(0)
    hold.first_token(0)  # a finished job stays finished
    assert ledger.loads["c"] == ClientLoad(waiting=2)
    hold.first_token(1)
    hold.release()
    hold.release()
    assert ledger.loads == {}


def test_a_lone_client_keeps_the_whole_queue():
    ledger = ClientLedger(ShareFlags(max_waiting_per_client=1, max_running_per_client=1))
    holds = [ledger.admit("c", 4, 16, 8) for _ in range(10)]  # 40 jobs: only the engine's limits apply
    assert ledger.loads["c"].waiting == 40
    with pytest.raises(ClientShareExceeded):
        ledger.admit("other", 2, 16, 8)
    ledger.admit("other", 1, 16, 8)
    for hold in holds:
        hold.release()
