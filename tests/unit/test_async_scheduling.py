"""Async scheduling (one step of lookahead) against the synchronous engine, on the CPU.

The context-sum model (engine_fakes.py) makes every output an exact function of the request's own context read
back through the paged KV cache, so the two engines must emit exactly the same events per request, whatever the
batching: same token ids, texts, indices and finish reasons, for greedy and seeded sampling, stop tokens, stop
strings, max_tokens, aborts in the middle and preemption, over chunk sizes, block sizes and prefix caching on and
off; the metrics count the same tokens; no KV block is leaked and all are free at the end. Recorded CUDA graphs
(decode and piecewise) check that a token still in flight reaches the static input buffers on the device.
"""
from __future__ import annotations

import argparse
import random

import pytest
from engine_fakes import EOS, attach_recorded_graphs, expected_greedy, fake_loaded

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import InvalidRequestError
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.cuda_graphs import capture_recorded
from metronome.server.engine.engine import EngineCore, async_scheduling_enabled
from metronome.server.engine.flags import add_engine_flags, engine_config_from_args
from metronome.server.engine.sampler import needs_sync
from metronome.server.engine.sampling import Grammar, SamplingParams


def make_engine(mode: str, block_size: int = 4, prefix: bool = True, num_kv_blocks: int = 512,
                **scheduler) -> EngineCore:
    config = EngineConfig(model="fake", device="cpu", block_size=block_size, num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=prefix, max_waiting=1000, async_scheduling=mode)
    engine = EngineCore(fake_loaded(), config, SchedulerConfig(**{"queue_policy": "fcfs", **scheduler}))
    assert engine.async_scheduling == (mode == "on")
    return engine


def workload(seed: int, count: int = 24) -> list[tuple[list[int], SamplingParams]]:
    """Prompts (some sharing prefixes) with greedy and seeded requests, stop tokens, stop strings, EOS on or off."""
    rng = random.Random(seed)
    shared = [rng.randrange(0, 126) for _ in range(12)]
    requests = []
    for i in range(count):
        prompt = [rng.randrange(0, 126) for _ in range(rng.randint(1, 40))]
        if i % 3 == 0:
            prompt = shared + prompt
        max_tokens = rng.randint(1, 24)
        greedy = expected_greedy(prompt, max_tokens)
        kind = i % 6
        params = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=i % 2 == 0)
        if kind == 1:  # a seeded draw: the request's own generator
            params.update(temperature=0.8, top_k=20, seed=1000 + i)
        elif kind == 2 and max_tokens > 3:  # a stop token met in the middle
            params.update(stop_token_ids=(greedy[max_tokens // 2],))
        elif kind == 3 and max_tokens > 4:  # a stop string over two tokens
            params.update(stop=("".join(chr(t) for t in greedy[2:4]),))
        elif kind == 4:
            params.update(temperature=1.5, seed=2000 + i, stop_token_ids=(5, 17, 60))
        requests.append((prompt, SamplingParams(**params)))
    return requests


def run(engine: EngineCore, requests, abort_after: dict[int, int] | None = None, late: int = 0):
    """Step to completion. The last `late` requests arrive after the first steps; request i is aborted once it
    has emitted abort_after[i] tokens. Returns ({request: [event fields]}, totals of the step stats)."""
    abort_after = abort_after or {}
    events: dict[str, list[tuple]] = {}
    totals = dict(generated=0, first=0, gaps=0, finished=0, preemptions=0, lookahead_steps=0)
    emitted: dict[str, int] = {}

    def add(i: int) -> None:
        prompt, params = requests[i]
        rid = engine.add_request(prompt, params, request_id=f"r{i}")
        events[rid], emitted[rid] = [], 0
        if abort_after.get(i) == 0:
            engine.abort(rid)

    for i in range(len(requests) - late):
        add(i)
    step = 0
    while engine.has_unfinished() or step < 3:
        if step == 3:
            for i in range(len(requests) - late, len(requests)):
                add(i)
        out, stats = engine.step()
        step += 1
        totals["generated"] += stats.generated_tokens
        totals["first"] += len(stats.first_token_latencies_s)
        totals["gaps"] += len(stats.token_gaps_s)
        totals["finished"] += len(stats.finished_e2e_s)
        totals["preemptions"] += stats.num_preemptions
        totals["lookahead_steps"] += engine.in_flight
        for e in out:
            events[e.request_id].append((e.token_id, e.text, e.index, e.finished, e.finish_reason,
                                         e.completion_tokens))
            if e.token_id >= 0:
                emitted[e.request_id] += 1
                i = int(e.request_id[1:])
                if not e.finished and emitted[e.request_id] == abort_after.get(i):
                    engine.abort(e.request_id)
        assert step < 10_000, "the engine did not finish"
    engine.check_no_leaks()
    assert not engine.live_sequences()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for rid, evs in events.items():
        assert evs and evs[-1][3] and sum(e[3] for e in evs) == 1, f"{rid}: exactly one final event, last"
    return events, totals


def compare(requests, abort_after=None, late=0, **engine_args):
    sync_events, sync_totals = run(make_engine("off", **engine_args), requests, abort_after, late)
    async_events, async_totals = run(make_engine("on", **engine_args), requests, abort_after, late)
    assert async_events == sync_events
    assert sync_totals["lookahead_steps"] == 0 and async_totals["lookahead_steps"] > 0
    for key in ("generated", "first", "gaps", "finished"):  # nothing of a dropped row reaches the metrics
        assert async_totals[key] == sync_totals[key], key
    return sync_events, sync_totals, async_totals


@pytest.mark.parametrize("chunk_size", [1, 5, 32, 1 << 20])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix", [True, False])
def test_async_emits_exactly_the_synchronous_events(chunk_size, block_size, prefix):
    requests = workload(seed=chunk_size * 7 + block_size + prefix)
    events, _, _ = compare(requests, late=6, block_size=block_size, prefix=prefix, chunk_size=chunk_size,
                           max_num_seqs=16, num_kv_blocks=4096 // block_size)
    reasons = {e[4] for evs in events.values() for e in evs if e[3]}
    assert reasons >= {"length", "stop"}
    for (prompt, params), rid in zip(requests, events):  # greedy requests that ran to their length: the model's
        tokens = [e[0] for e in events[rid]]
        if params.is_greedy and events[rid][-1][4] == "length":
            assert tokens == expected_greedy(prompt, params.max_tokens)


def test_aborts_in_the_middle_free_everything_and_change_nothing_else():
    requests = workload(seed=11, count=20)
    requests = [(p, SamplingParams(max_tokens=20, temperature=sp.temperature, seed=sp.seed, ignore_eos=True))
                for p, sp in requests]
    abort_after = {0: 0, 1: 1, 2: 2, 5: 7, 9: 19, 12: 3, 19: 0}  # 0: aborted while waiting
    events, _, _ = compare(requests, abort_after=abort_after, late=4, chunk_size=16, max_num_seqs=8)
    for i, n in abort_after.items():
        evs = events[f"r{i}"]
        assert [e[0] for e in evs[:-1]] == [e[0] for e in evs if e[0] >= 0] and len(evs) - 1 == n
        assert evs[-1][4] == "abort" and evs[-1][0] == -1


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_under_a_small_kv_cache_is_exact(prefix):
    rng = random.Random(5)
    requests = [([rng.randrange(0, 126) for _ in range(rng.randint(8, 30))],
                 SamplingParams(max_tokens=rng.randint(10, 40), temperature=0.0 if i % 2 else 0.9,
                                seed=None if i % 2 else i, ignore_eos=True, stop_token_ids=(3,)))
                for i in range(16)]
    _, sync_totals, async_totals = compare(requests, late=4, block_size=4, prefix=prefix, num_kv_blocks=48,
                                           chunk_size=24, max_num_seqs=12)
    assert sync_totals["preemptions"] > 0 and async_totals["preemptions"] > 0


@pytest.mark.parametrize("special", [dict(repetition_penalty=1.3), dict(logprobs=2)])
def test_requests_that_need_their_tokens_on_the_host_run_synchronously(special):
    penalised = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **special)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [([7, 8, 9, i], penalised if i == 2 else plain) for i in range(5)]
    compare(requests[:2])  # plain only: lookahead
    engine = make_engine("on")
    ids = [engine.add_request(p, sp) for p, sp in requests]
    logprobs = []
    while engine.has_unfinished():
        events, _ = engine.step()
        logprobs += [e.logprobs for e in events if e.request_id == ids[2]]
        assert not engine.in_flight or ids[2] not in engine._seqs  # synchronous while the special one lives
    assert len(logprobs) == 12 and all((lp is not None) == ("logprobs" in special) for lp in logprobs)
    sync_events, _ = run(make_engine("off"), requests)
    async_events, totals = run(make_engine("on"), requests)
    assert async_events == sync_events and totals["lookahead_steps"] == 0
    assert needs_sync(SamplingParams(repetition_penalty=1.3)) and needs_sync(SamplingParams(logprobs=2))
    assert needs_sync(SamplingParams(grammar=Grammar("json_object")))
    assert not needs_sync(plain) and not needs_sync(SamplingParams(logit_bias=((3, 5.0),), seed=1))


def test_a_request_in_flight_when_a_synchronous_one_arrives():
    """Lookahead ends by reading the step in flight first; the outputs do not change."""
    engine = make_engine("on")
    first = engine.add_request([1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {first: []}
    for _ in range(4):
        for e in engine.step()[0]:
            tokens[e.request_id].append(e.token_id)
    assert engine.in_flight
    second = engine.add_request([4, 5], SamplingParams(max_tokens=6, temperature=0.0, presence_penalty=0.5,
                                                       ignore_eos=True))
    tokens[second] = []
    while engine.has_unfinished():
        for e in engine.step()[0]:
            tokens[e.request_id].append(e.token_id)
        assert not engine.in_flight
    assert tokens[first] == expected_greedy([1, 2, 3], 10)
    assert tokens[second] == expected_greedy([4, 5], 6)  # penalties change nothing on this model's peaks
    engine.check_no_leaks()


def test_length_limited_rows_are_not_scheduled_past_their_last_token():
    """A sequence whose last token is in flight is not computed again: with nothing but max_tokens ending the
    requests, async scheduling computes exactly the synchronous engine's tokens."""
    rng = random.Random(2)
    requests = [([rng.randrange(0, 126) for _ in range(rng.randint(1, 20))],
                 SamplingParams(max_tokens=rng.randint(1, 15), temperature=0.0, ignore_eos=True)) for _ in range(10)]
    computed = {}
    for mode in ("off", "on"):
        engine = make_engine(mode, chunk_size=8)
        for p, sp in requests:
            engine.add_request(p, sp)
        total = 0
        while engine.has_unfinished():
            total += engine.step()[1].num_tokens
        computed[mode] = total
    assert computed["on"] == computed["off"]


def test_finished_sequences_keep_their_blocks_until_the_step_in_flight_is_read():
    engine = make_engine("on", block_size=4)
    rid = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                              stop_token_ids=(expected_greedy([1, 2, 3, 4, 5],
                                                                                              30)[6],)))
    while True:
        events, _ = engine.step()
        if any(e.finished for e in events):
            break
    assert events[-1].finish_reason == "stop" and events[-1].request_id == rid
    (retired,) = engine.scheduler.retiring  # scheduled into the step in flight: blocks kept, not scheduled again
    assert retired.block_table and not engine.scheduler.running and engine.in_flight
    engine.check_no_leaks()
    events, stats = engine.step()
    assert not events and stats.generated_tokens == 0  # its extra row reaches neither the client nor the metrics
    assert not engine.scheduler.retiring and not engine.in_flight and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_tokens_in_flight_reach_the_decode_graphs_static_inputs():
    requests = workload(seed=3, count=12)
    results = {}
    for mode in ("off", "on"):
        engine = make_engine(mode, block_size=4, chunk_size=16, max_num_seqs=12)
        attach_recorded_graphs(engine, [1, 2, 4, 8, 16])
        graph_steps = 0
        for i, (p, sp) in enumerate(requests):
            engine.add_request(p, sp, request_id=f"r{i}")
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
        while engine.has_unfinished():
            events, stats = engine.step()
            graph_steps += stats.cuda_graph
            for e in events:
                tokens[e.request_id].append(e.token_id)
        engine.check_no_leaks()
        assert graph_steps > 0
        results[mode] = tokens
    assert results["on"] == results["off"]


def test_random_tiny_with_decode_and_piecewise_graphs_matches_synchronous_greedy():
    def engine(mode: str) -> EngineCore:
        config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", attention_backend="torch",
                              block_size=16, num_kv_blocks=256, seed=5, async_scheduling=mode)
        core = EngineCore.from_config(config, SchedulerConfig(chunk_size=24, max_num_seqs=16, queue_policy="fcfs"))
        attach_recorded_graphs(core, [2, 8])
        pieces = core.runner.piecewise_runner([16, 32, 64], capture_recorded)
        pieces.capture_all()
        core.runner.attach_pieces(pieces)
        return core

    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 60))] for _ in range(7)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(7)]
    outputs, kinds = {}, {}
    for mode in ("off", "on"):
        core = engine(mode)
        ids = [core.add_request(p, sp) for p, sp in zip(prompts, params)]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        kinds[mode] = set()
        while core.has_unfinished():
            events, stats = core.step()
            if stats.num_tokens:
                kinds[mode].add(stats.forward)
            for e in events:
                tokens[e.request_id].append(e.token_id)
        core.check_no_leaks()
        outputs[mode] = [tokens[rid] for rid in ids]
    assert outputs["on"] == outputs["off"]
    assert kinds["on"] >= {"graph", "piecewise"}


def test_generate_leaves_nothing_in_flight():
    engine = make_engine("on")
    results = engine.generate([[1, 2], [3, 4, 5]], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(
        expected_greedy([1, 2], 5)[1],)))
    assert [r.token_ids for r in results] == [expected_greedy([1, 2], 2), expected_greedy([3, 4, 5], 5)]
    assert not engine.in_flight and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert EOS not in results[1].token_ids


def test_the_flag_and_its_default():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config_from_args(parser.parse_args([])).async_scheduling == "auto"
    assert engine_config_from_args(parser.parse_args(["--async-scheduling", "on"])).async_scheduling == "on"
    with pytest.raises(SystemExit):
        parser.parse_args(["--async-scheduling", "yes"])
    with pytest.raises(InvalidRequestError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes").validate()
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert async_scheduling_enabled("auto", cuda, False) and not async_scheduling_enabled("auto", cpu, False)
    assert async_scheduling_enabled("on", cpu, False) and not async_scheduling_enabled("off", cuda, False)
    assert not async_scheduling_enabled("on", cuda, True)  # tensor parallel: synchronous


def test_a_grammar_request_runs_synchronously_and_stays_valid():
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=128,
                          async_scheduling="on")
    core = EngineCore.from_config(config, SchedulerConfig())
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = core.generate(["free text"], free)[0].token_ids
    ids = [core.add_request("free text", free),
           core.add_request("constrained", SamplingParams(max_tokens=8, grammar=Grammar("regex", r"(yes|no)")))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while core.has_unfinished():
        for e in core.step()[0]:
            if e.token_id >= 0:
                tokens[e.request_id].append(e.token_id)
        assert not core.in_flight or ids[1] not in core._seqs
    assert tokens[ids[0]] == alone
    assert core.tokenizer.decode(tokens[ids[1]]) in {"yes", "no"}
    core.check_no_leaks()


def test_prepare_takes_pending_tokens_from_the_step_in_flight_in_any_row():
    """A decode row, and a recompute chunk that ends in the token in flight (a sequence preempted and admitted
    again before that token was read), each get the in-flight step's id for their row, in any order."""
    import torch

    from metronome.server.engine.model_runner import InFlightTokens
    from metronome.server.engine.scheduler import ScheduledBatch
    from metronome.server.engine.sequence import PENDING, Sequence

    engine = make_engine("on", block_size=4)
    bm = engine.block_manager
    decode = Sequence("decode", [3, 4, 5, PENDING], SamplingParams(), 0.0, 0)
    recompute = Sequence("recompute", [6, 7, 8, 9, 10, PENDING], SamplingParams(), 0.0, 1)
    for seq in (decode, recompute):
        assert bm.allocate(seq, [])
    decode.num_computed_tokens = 3
    batch = ScheduledBatch(entries=[(decode, 1), (recompute, 6)], num_decode_tokens=1, num_prefill_tokens=6)
    in_flight = InFlightTokens(torch.tensor([70, 71, 72]), {recompute: 0, decode: 2})
    inputs = engine.runner.prepare(batch, in_flight)
    assert inputs.input_ids.tolist() == [72, 6, 7, 8, 9, 10, 70]
    with pytest.raises(RuntimeError, match="no step in flight"):
        engine.runner.prepare(batch, None)


@pytest.mark.parametrize("seed", range(16))
def test_random_configurations_emit_the_synchronous_events(seed):
    """Block size, chunk, batch limit, prefix caching, a cache small enough to preempt, late arrivals and aborts,
    drawn together."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    requests = workload(seed, count=rng.randint(3, 30))
    longest = max(len(p) + sp.max_tokens for p, sp in requests)
    num_blocks = max(rng.choice([40, 64, 100, 8192 // block_size]), 2 * (longest // block_size + 3))
    aborts = {i: rng.randint(0, 10) for i in range(len(requests)) if rng.random() < 0.2}
    compare(requests, abort_after=aborts, late=rng.randint(0, len(requests) // 2), block_size=block_size,
            prefix=rng.random() < 0.5, num_kv_blocks=num_blocks, chunk_size=rng.choice([1, 2, 3, 7, 16, 64, 1 << 20]),
            max_num_seqs=rng.choice([1, 2, 4, 8, 32]))
