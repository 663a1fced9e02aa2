"""One request whose token cannot be emitted (its detokenizer or grammar raises) ends alone: the others in the
same steps finish untouched, its blocks are freed, and the caller learns which request failed and why."""
from __future__ import annotations

import pytest

from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_failing_request_ends_alone(async_scheduling):
    core = EngineCore.from_config(EngineConfig(model="random:tiny", device="cpu", async_scheduling=async_scheduling))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ids = [core.add_request([300 + i, 301 + i, 302 + i], params) for i in range(4)]
    victim = core._seqs[ids[1]]  # still waiting: no public view lists it before it runs
    push, calls = victim.detokenizer.push, []

    def broken_push(token: int) -> bool:
        calls.append(token)
        if len(calls) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a token the tokenizer cannot decode")
        return push(token)

    victim.detokenizer.push = broken_push
    tokens = {rid: 0 for rid in ids}
    finished, failures = {}, []
    for _ in range(200):
        events, _ = core.step()
        failures += core.take_failures()
        for event in events:
            tokens[event.request_id] += 1
            if event.finished:
                finished[event.request_id] = event.finish_reason
        if not core.has_unfinished():
            break
    assert [(rid, type(exc)) for rid, exc in failures] == [(ids[1], UnicodeDecodeError)]
    assert finished == {rid: "length" for rid in ids if rid != ids[1]}
    assert {rid: n for rid, n in tokens.items() if rid != ids[1]} == {rid: 12 for rid in ids if rid != ids[1]}
    assert tokens[ids[1]] == 2  # the two tokens before the failing one reached the client, nothing after
    assert core.take_failures() == []
    core.check_no_leaks()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
