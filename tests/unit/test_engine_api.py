"""EngineCore behaviour on an exact integer model (engine_fakes): outputs, KV addressing under chunking, prefix
caching and preemption, stop conditions, typed validation errors, aborts and step stats."""
from __future__ import annotations

import random

import pytest
from engine_fakes import expected_greedy, fake_engine

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import EngineOverloadedError, InvalidRequestError
from metronome.server.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 126) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("chunk", [1, 5, 64, 4096])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_is_exact_for_any_chunk_and_block_size(chunk, block_size):
    engine = fake_engine(block_size=block_size, chunk_size=chunk, queue_policy="fcfs", num_kv_blocks=4096 // block_size)
    ps = prompts(6, seed=chunk + block_size)
    results = engine.generate(ps, GREEDY)
    for p, r in zip(ps, results):
        assert r.token_ids == expected_greedy(p, 12)
        assert r.finish_reason == "length"
    engine.check_no_leaks()
    assert engine.stats().kv_blocks_leaked == 0


@pytest.mark.parametrize("policy", ["fcfs", "split", "sjf"])
def test_policies_produce_the_same_outputs(policy):
    engine = fake_engine(queue_policy=policy, chunk_size=16, short_prompt_threshold=20, short_chunk_size=32,
                         long_chunk_size=8)
    ps = prompts(8, seed=3)
    assert [r.token_ids for r in engine.generate(ps, GREEDY)] == [expected_greedy(p, 12) for p in ps]


def test_prefix_cache_hits_share_blocks_and_stay_exact():
    engine = fake_engine(block_size=4, chunk_size=64)
    shared = list(range(40))
    first = engine.generate([shared + [1, 2, 3]], GREEDY)[0]
    engine.add_request(shared + [9, 9], GREEDY, request_id="hit")
    seq = engine._seqs["hit"]
    engine.step()
    assert seq.num_cached_tokens == 40  # ten full blocks reused
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == expected_greedy(shared + [9, 9], 12)
    assert first.token_ids == expected_greedy(shared + [1, 2, 3], 12)
    same = engine.generate([shared], GREEDY)[0]  # a whole-prompt hit still recomputes its last block
    assert same.token_ids == expected_greedy(shared, 12)
    engine.check_no_leaks()


def test_preemption_under_kv_pressure_keeps_outputs_exact():
    engine = fake_engine(num_kv_blocks=24, block_size=4, chunk_size=32, queue_policy="fcfs")
    ps = prompts(6, seed=5, lo=10, hi=20)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    results = engine.generate(ps, params)
    assert engine.stats().preemptions_total > 0
    assert [r.token_ids for r in results] == [expected_greedy(p, 30) for p in ps]
    engine.check_no_leaks()
    assert engine.block_manager.num_free_blocks == 24


def test_stop_token_eos_and_ignore_eos():
    engine = fake_engine()
    p = [5, 6, 7]
    out = expected_greedy(p, 8)
    r = engine.generate([p], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(out[3],)))[0]
    assert r.token_ids == out[:4] and r.finish_reason == "stop"
    engine.eos_token_ids = frozenset({out[0]})  # make the model's first token an EOS for this prompt
    stopped = engine.generate([p], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert stopped.token_ids == out[:1] and stopped.finish_reason == "stop" and stopped.text == ""
    ignored = engine.generate([p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert ignored.token_ids == out and ignored.finish_reason == "length"


def test_stop_string_is_trimmed_and_never_streamed():
    engine = fake_engine()
    p = [10, 20, 30]
    out = expected_greedy(p, 10)
    full_text = "".join(chr(t) for t in out)
    stop = full_text[4:6]
    engine.add_request(p, SamplingParams(max_tokens=10, temperature=0.0, stop=(stop,)), request_id="s")
    streamed = []
    while engine.has_unfinished():
        events, _ = engine.step()
        streamed += [e for e in events if e.request_id == "s"]
    cut = full_text.index(stop)
    assert "".join(e.text for e in streamed) == full_text[:cut]
    assert streamed[-1].finished and streamed[-1].finish_reason == "stop"
    assert [e.index for e in streamed] == list(range(len(streamed)))


def test_seeded_sampling_is_deterministic_and_batch_independent():
    engine = fake_engine()
    p = [1, 2, 3, 4]
    params = SamplingParams(max_tokens=10, temperature=5.0, top_k=20, top_p=0.9, seed=1234)
    alone = engine.generate([p], params)[0].token_ids
    crowd = engine.generate([p, [7, 7], [8, 9, 10]], [params, SamplingParams(max_tokens=10, temperature=3.0),
                                                      SamplingParams(max_tokens=10, temperature=3.0, seed=5)])
    assert crowd[0].token_ids == alone
    other = engine.generate([p], SamplingParams(max_tokens=10, temperature=5.0, top_k=20, top_p=0.9, seed=99))
    assert other[0].token_ids != alone  # 10 draws over ~20 candidates: a collision has negligible probability


BAD = [
    ("", GREEDY, "prompt", "empty"),
    ([], GREEDY, "prompt", "empty"),
    ([1, 500], GREEDY, "prompt", "token ids"),
    (list(range(100)) * 3, GREEDY, "prompt", "context"),
    ([1, 2], SamplingParams(max_tokens=299), "max_tokens", "exceeds"),
    ([1], SamplingParams(temperature=-0.5), "temperature", ">= 0"),
    ([1], SamplingParams(top_p=0.0), "top_p", "(0, 1]"),
    ([1], SamplingParams(top_p=1.5), "top_p", "(0, 1]"),
    ([1], SamplingParams(max_tokens=0), "max_tokens", "positive"),
    ([1], SamplingParams(max_tokens=-3), "max_tokens", "positive"),
    ([1], SamplingParams(top_k=-2), "top_k", "top_k"),
    ([1], SamplingParams(stop=("",)), "stop", "empty"),
]


@pytest.mark.parametrize("prompt,params,param,words", BAD)
def test_bad_input_raises_typed_error_without_changing_state(prompt, params, param, words):
    engine = fake_engine(max_model_len=300)
    engine.add_request([3, 4], GREEDY, request_id="existing")
    before = (engine.stats(), dict(engine._seqs))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt, params)
    assert info.value.param == param
    assert words in str(info.value)
    assert (engine.stats(), dict(engine._seqs)) == before


def test_duplicate_request_id_and_overload():
    engine = fake_engine(max_waiting=2)
    engine.add_request([1], GREEDY, request_id="a")
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([1], GREEDY, request_id="a")
    assert info.value.param == "request_id"
    engine.add_request([2], GREEDY)
    with pytest.raises(EngineOverloadedError, match="overloaded"):
        engine.add_request([3], GREEDY)
    assert engine.scheduler.num_waiting == 2


def test_abort_frees_blocks_and_emits_abort_event():
    engine = fake_engine(chunk_size=8)
    engine.add_request(list(range(40)), GREEDY, request_id="long")
    engine.add_request([1, 2], GREEDY, request_id="short")
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort("long")
    engine.abort("unknown")  # no-op
    events, _ = engine.step()
    aborts = [e for e in events if e.finish_reason == "abort"]
    assert [(e.request_id, e.finished) for e in aborts] == [("long", True)]
    while engine.has_unfinished():
        engine.step()
    engine.check_no_leaks()
    assert engine.block_manager.num_used_blocks == 0


def test_step_stats_count_tokens_and_latencies():
    engine = fake_engine(chunk_size=16)
    for i in range(3):
        engine.add_request([i + 1] * 10, SamplingParams(max_tokens=5, temperature=0.0))
    totals = dict(prompt=0, generated=0, gaps=0, ttft=0, e2e=0)
    while engine.has_unfinished():
        events, stats = engine.step()
        assert stats.num_tokens == stats.num_prefill_tokens + stats.num_decode_tokens
        assert stats.generated_tokens == len([e for e in events if e.token_id >= 0])
        assert 0 <= stats.scheduler_overhead_s <= stats.duration_s
        totals["prompt"] += stats.new_prompt_tokens
        totals["generated"] += stats.generated_tokens
        totals["gaps"] += len(stats.token_gaps_s)
        totals["ttft"] += len(stats.first_token_latencies_s)
        totals["e2e"] += len(stats.finished_e2e_s)
    assert totals == dict(prompt=30, generated=15, gaps=12, ttft=3, e2e=3)


def test_reconfigure_mid_run_changes_chunking_but_not_outputs():
    engine = fake_engine(chunk_size=4, queue_policy="fcfs")
    ps = prompts(6, seed=11, lo=20, hi=50)
    ids = [engine.add_request(p, GREEDY) for p in ps]
    seqs = [engine._seqs[i] for i in ids]
    engine.step()
    engine.reconfigure(SchedulerConfig(queue_policy="split", short_prompt_threshold=30, short_chunk_size=40,
                                       long_chunk_size=9))
    _, stats = engine.step()
    assert stats.num_prefill_tokens <= 40
    engine.reconfigure(SchedulerConfig(queue_policy="sjf", chunk_size=3))
    while engine.has_unfinished():
        _, stats = engine.step()
        assert stats.num_prefill_tokens <= 3
    assert engine.stats().scheduler.queue_policy.value == "sjf"
    assert [s.output_token_ids for s in seqs] == [expected_greedy(p, 12) for p in ps]


def test_stall_free_long_prompt_joins_eight_decodes_within_budget():
    engine = fake_engine(num_kv_blocks=1024, block_size=16, chunk_size=256, queue_policy="fcfs")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    decoders = [engine.add_request([i + 1] * (5 + i), params) for i in range(8)]
    while any(engine._seqs[r].num_output_tokens == 0 for r in decoders):
        engine.step()
    long_id = engine.add_request(list(range(100)) * 20, SamplingParams(max_tokens=3, temperature=0.0))
    long_seq = engine._seqs[long_id]
    while long_seq.num_output_tokens == 0:
        events, stats = engine.step()
        assert stats.num_decode_tokens == 8  # every running decode rides along
        assert {e.request_id for e in events} >= set(decoders)
        assert stats.num_prefill_tokens <= 256 and stats.num_tokens <= 8 + 256
    while engine.has_unfinished():
        engine.step()
    assert long_seq.output_token_ids == expected_greedy(list(range(100)) * 20, 3)
    engine.check_no_leaks()


def test_sampler_filters_top_k_and_top_p():
    import torch

    from metronome.server.engine.sampler import Sampler

    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.5, 0.25, 0.15, 0.1], [0.5, 0.25, 0.15, 0.1]]))
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.7),
              SamplingParams(temperature=1.0, top_p=0.75)]
    probs = Sampler.probabilities(logits, params)
    assert torch.allclose(probs[0], torch.tensor([2 / 3, 1 / 3, 0, 0]))
    assert torch.allclose(probs[1], torch.tensor([2 / 3, 1 / 3, 0, 0]))  # 0.5 + 0.25 covers 0.7
    assert (probs[2] > 0).tolist() == [True, True, False, False]  # 0.75 reached exactly by the top two
    sampler = Sampler(torch.device("cpu"), seed=0)
    draws = sampler.sample(logits.repeat(100, 1)[:100], [params[0]] * 100, [None] * 100).tokens
    assert set(draws) <= {0, 1} and len(set(draws)) == 2
    greedy = sampler.sample(logits[:2], [SamplingParams(temperature=0.0), params[0]], [None, None]).tokens
    assert greedy[0] == 0


def test_finish_at_max_model_len():
    engine = fake_engine(max_model_len=20)
    r = engine.generate([[1] * 10], SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert len(r.token_ids) == 10 and r.finish_reason == "length"
