"""The replica tests' load goes to the ready server with the fewest of its requests in flight, as a least-request
balancer does: round robin's equal arrival rates would pile a closed loop's clients onto a slower server."""
from __future__ import annotations

from metronome_testing.closedloop import LoadSpec, ServiceLoad

A, B, C = "http://127.0.0.1:8001", "http://127.0.0.2:8001", "http://127.0.0.3:8001"


def load_over(servers: list[str], ready: set[str], in_flight: dict[str, int]) -> ServiceLoad:
    load = ServiceLoad(lambda: servers, LoadSpec(), concurrency=4)
    load._ready = ready
    load._in_flight = dict(in_flight)
    return load


def test_the_server_with_fewest_requests_in_flight_takes_the_next():
    load = load_over([A, B, C], {A, B, C}, {A: 5, B: 2, C: 3})
    assert [load._endpoint() for _ in range(3)] == [B, B, B]


def test_ties_take_turns_and_unready_or_removed_servers_get_nothing():
    load = load_over([A, B, C], {A, B}, {A: 1, B: 1, C: 0})  # C is not ready yet
    assert {load._endpoint() for _ in range(4)} == {A, B}
    load = load_over([B], {A, B}, {A: 0, B: 7})  # A's pod was deleted: it left the stand-in's list
    assert load._endpoint() == B
    assert load_over([A], set(), {})._endpoint() is None
