"""Workloads of `metronome bench`: exact prompt lengths, determinism, arrival rates, the jsonl file's errors."""
from __future__ import annotations

import itertools
import json
import math
import statistics

import pytest

from metronome.server.bench.load.workloads import (
    ChatSpec,
    LongShortSpec,
    ShiftSpec,
    TokenSampler,
    WorkloadError,
    WorkloadSpec,
    iter_requests,
    load_jsonl,
    poisson_arrivals,
    take,
)

SPECIAL = frozenset({0, 1, 2})
SAMPLER = TokenSampler(vocab_size=512, excluded=SPECIAL)


def test_long_short_prompts_have_exact_lengths_and_no_special_ids():
    requests = take(iter_requests(WorkloadSpec("long-short"), SAMPLER, seed=7), 300)
    assert [r.index for r in requests] == list(range(300))
    for r in requests:
        assert len(r.prompt_token_ids) == (2000 if r.kind == "long" else 50)
        assert r.max_tokens == 128
        assert all(0 <= t < 512 and t not in SPECIAL for t in r.prompt_token_ids)
    longs = sum(r.kind == "long" for r in requests)
    assert 30 <= longs <= 90  # 20 % of 300 = 60; binomial sd ~6.9


def test_same_seed_same_requests_other_seed_other_requests():
    a = take(iter_requests(WorkloadSpec("long-short"), SAMPLER, seed=1), 20)
    b = take(iter_requests(WorkloadSpec("long-short"), SAMPLER, seed=1), 20)
    c = take(iter_requests(WorkloadSpec("long-short"), SAMPLER, seed=2), 20)
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


def test_prompts_are_distinct_so_prefix_caching_does_not_flatter_the_run():
    requests = take(iter_requests(WorkloadSpec("long-short"), SAMPLER, seed=3), 50)
    first_blocks = {r.prompt_token_ids[:16] for r in requests}
    assert len(first_blocks) == 50


def test_custom_lengths_and_output_override():
    spec = WorkloadSpec("long-short", long_short=LongShortSpec(long_fraction=1.0, long_prompt_len=33, output_len=5),
                        output_len_override=9)
    for r in take(iter_requests(spec, SAMPLER, 0), 10):
        assert r.kind == "long" and len(r.prompt_token_ids) == 33 and r.max_tokens == 9


def test_shift_changes_the_mix_at_the_shift_point():
    spec = WorkloadSpec("shift", shift=ShiftSpec(first_long_fraction=0.0, second_long_fraction=1.0, shift_after=40,
                                                 long_prompt_len=100, short_prompt_len=10))
    requests = take(iter_requests(spec, SAMPLER, 0), 80)
    assert all(r.kind == "short" and len(r.prompt_token_ids) == 10 for r in requests[:40])
    assert all(r.kind == "long" and len(r.prompt_token_ids) == 100 for r in requests[40:])


def test_chat_lengths_are_lognormal_within_caps():
    spec = WorkloadSpec("chat", chat=ChatSpec(prompt_median=100, prompt_sigma=1.0, output_median=50,
                                              output_sigma=0.5, max_prompt_len=400, max_output_len=120))
    requests = take(iter_requests(spec, SAMPLER, 0), 400)
    prompt_lens = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert all(1 <= n <= 400 for n in prompt_lens) and all(1 <= n <= 120 for n in outputs)
    assert 70 <= statistics.median(prompt_lens) <= 140  # median of the lognormal = 100
    assert len(set(prompt_lens)) > 50  # spread, not constant


def test_poisson_arrivals_have_the_asked_rate():
    offsets = list(itertools.islice(poisson_arrivals(10.0, seed=0), 4001))
    assert offsets[0] == 0.0
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))
    mean_gap = offsets[-1] / 4000
    assert mean_gap == pytest.approx(0.1, rel=0.08)  # sd of the mean ~1.6 %
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.1)  # exponential: sd = mean


def test_poisson_arrivals_deterministic_burst_and_bad_rate():
    assert list(itertools.islice(poisson_arrivals(3.0, 5), 10)) == list(itertools.islice(poisson_arrivals(3.0, 5), 10))
    assert list(itertools.islice(poisson_arrivals(math.inf, 0), 5)) == [0.0] * 5
    with pytest.raises(WorkloadError):
        next(poisson_arrivals(0.0, 0))


def test_bad_specs_and_samplers_are_rejected():
    with pytest.raises(WorkloadError, match="unknown workload"):
        next(iter_requests(WorkloadSpec("zipf"), SAMPLER, 0))
    with pytest.raises(WorkloadError, match="jsonl"):
        next(iter_requests(WorkloadSpec("jsonl"), SAMPLER, 0))
    with pytest.raises(WorkloadError, match="fraction"):
        next(iter_requests(WorkloadSpec("long-short", long_short=LongShortSpec(long_fraction=1.5)), SAMPLER, 0))
    with pytest.raises(WorkloadError, match="vocabulary"):
        next(iter_requests(WorkloadSpec("long-short"), None, 0))
    with pytest.raises(WorkloadError):
        TokenSampler(vocab_size=3, excluded=SPECIAL)


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_reads_text_ids_and_token_id_prompts(tmp_path):
    path = write_lines(tmp_path / "w.jsonl", [
        json.dumps({"prompt": "hello there", "max_tokens": 4}),
        "",
        json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}),
        json.dumps({"prompt_token_ids": [9, 10], "max_tokens": 1}),
    ])
    requests = load_jsonl(path)
    assert [r.index for r in requests] == [0, 1, 2]
    assert requests[0].prompt_text == "hello there" and requests[0].prompt_token_ids is None
    assert requests[1].prompt_token_ids == (5, 6, 7) and requests[1].max_tokens == 2
    assert requests[2].prompt_token_ids == (9, 10) and requests[2].kind == "jsonl"
    spec = WorkloadSpec("jsonl", jsonl_path=path, output_len_override=3)
    assert [r.max_tokens for r in iter_requests(spec, None, 0)] == [3, 3, 3]  # finite: ends with the file


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"prompt": "x"}), "'max_tokens' must be an integer"),
    (json.dumps({"prompt": "x", "max_tokens": 0}), "'max_tokens' must be an integer"),
    (json.dumps({"prompt": "x", "max_tokens": True}), "'max_tokens' must be an integer"),
    (json.dumps({"prompt": "x", "prompt_token_ids": [1], "max_tokens": 1}), "exactly one of"),
    (json.dumps({"max_tokens": 1}), "exactly one of"),
    (json.dumps({"prompt": "", "max_tokens": 1}), "empty"),
    (json.dumps({"prompt_token_ids": [], "max_tokens": 1}), "non-empty list"),
    (json.dumps({"prompt_token_ids": [1, -2], "max_tokens": 1}), "non-negative integers"),
    (json.dumps({"prompt_token_ids": "abc", "max_tokens": 1}), "non-empty list"),
    (json.dumps({"prompt": "x", "max_tokens": 1, "temperature": 0}), "unknown field"),
])
def test_jsonl_errors_name_the_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok", "max_tokens": 1}), line])
    with pytest.raises(WorkloadError, match=message) as err:
        load_jsonl(path)
    assert f"{path}:2:" in str(err.value)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read"):
        load_jsonl(str(tmp_path / "absent.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(WorkloadError, match="empty"):
        load_jsonl(str(empty))
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(WorkloadError, match="UTF-8"):
        load_jsonl(str(binary))
