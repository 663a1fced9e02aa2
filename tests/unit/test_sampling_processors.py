"""Penalties, logit_bias, min_p and logprobs against a plain torch reference written row by row, and seeded
draws whose histogram matches the reference distribution."""
from __future__ import annotations

import math

import pytest
import torch

from metronome.server.engine.sampler import Sampler, apply_penalties, process_logits
from metronome.server.engine.sampling import SamplingParams

VOCAB = 12


def reference_processed(logits: torch.Tensor, p: SamplingParams, tokens: list[int], num_prompt: int) -> torch.Tensor:
    """One row, one token at a time: logit_bias, repetition (prompt + output), frequency and presence (output)."""
    row = logits.clone().double()
    for token, bias in p.logit_bias:
        row[token] += bias
    for token in set(tokens):
        row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    output = tokens[num_prompt:]
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """temperature, then min_p relative to the most likely token, then top-k; renormalised."""
    probs = torch.softmax(row / p.temperature, dim=-1)
    keep = probs >= p.min_p * probs.max()
    if p.top_k > 0:
        keep &= probs >= probs.sort(descending=True).values[p.top_k - 1]
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


CASES = [
    (SamplingParams(temperature=1.0, presence_penalty=1.5), [1, 2, 3, 3, 5, 5, 5], 3),
    (SamplingParams(temperature=0.7, frequency_penalty=0.8), [0, 4, 4, 4, 7], 1),
    (SamplingParams(temperature=1.0, repetition_penalty=1.7), [2, 6, 6, 9], 2),
    (SamplingParams(temperature=1.3, frequency_penalty=-0.5, presence_penalty=0.5, repetition_penalty=1.2),
     [1, 1, 8, 8, 8, 10], 2),
    (SamplingParams(temperature=1.0, logit_bias=((3, 2.5), (11, -100.0))), [0], 1),
    (SamplingParams(temperature=1.0, min_p=0.2), [0], 1),
    (SamplingParams(temperature=0.9, min_p=0.05, top_k=5, presence_penalty=0.3), [4, 5, 6], 1),
]


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    return torch.randn(len(CASES), VOCAB, generator=torch.Generator().manual_seed(7)) * 2


def test_processed_logits_equal_the_reference(logits):
    params = [c[0] for c in CASES]
    histories = [(c[1], c[2]) for c in CASES]
    processed = process_logits(logits, params, histories)
    for i, (p, tokens, num_prompt) in enumerate(CASES):
        assert torch.allclose(processed[i].double(), reference_processed(logits[i], p, tokens, num_prompt),
                              atol=1e-5), f"case {i}: {p}"


def test_probabilities_equal_the_reference(logits):
    params = [c[0] for c in CASES]
    processed = process_logits(logits, params, [(c[1], c[2]) for c in CASES])
    probs = Sampler.probabilities(processed, params)
    for i, p in enumerate(params):
        expected = reference_probs(reference_processed(logits[i], p, CASES[i][1], CASES[i][2]), p)
        assert torch.allclose(probs[i].double(), expected, atol=1e-5), f"case {i}: {p}"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_seeded_draws_follow_the_reference_distribution(logits, case):
    """10,000 seeded draws through Sampler.sample: each token's frequency within 5 standard errors of the
    reference probability (and tokens the reference excludes never drawn)."""
    p, tokens, num_prompt = CASES[case]
    draws_n = 10_000
    sampler = Sampler(torch.device("cpu"), seed=123)
    rows = logits[case:case + 1].repeat(draws_n, 1)
    result = sampler.sample(rows, [p] * draws_n, [None] * draws_n, [(tokens, num_prompt)] * draws_n)
    counts = torch.bincount(torch.tensor(result.tokens), minlength=VOCAB).double() / draws_n
    expected = reference_probs(reference_processed(logits[case], p, tokens, num_prompt), p)
    for token in range(VOCAB):
        q = expected[token].item()
        if q == 0:
            assert counts[token] == 0, f"token {token} drawn but excluded"
        else:
            assert abs(counts[token].item() - q) <= 5 * math.sqrt(q * (1 - q) / draws_n) + 1e-9, (token, q)


def test_greedy_with_edits_takes_the_argmax_of_the_edited_logits(logits):
    sampler = Sampler(torch.device("cpu"))
    p = SamplingParams(temperature=0.0, presence_penalty=2.0, logit_bias=((5, 3.0),))
    history = ([0, 1, 2], 1)
    result = sampler.sample(logits[:1], [p], [None], [history])
    assert result.tokens == [int(reference_processed(logits[0], p, *history).argmax())]


def test_rows_without_edits_are_untouched(logits):
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, presence_penalty=2.0)]
    processed = process_logits(logits[:2], params, [None, ([3, 3], 0)])
    assert torch.equal(processed[0], logits[0])
    plain = Sampler(torch.device("cpu")).sample(logits[:2], [SamplingParams(temperature=0.0)] * 2, [None, None])
    assert plain.tokens == logits[:2].argmax(dim=-1).tolist() and plain.logprobs == [None, None]


def test_logprobs_are_the_models_log_softmax(logits):
    sampler = Sampler(torch.device("cpu"))
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0, presence_penalty=2.0)]
    result = sampler.sample(logits[:3], params, [None] * 3, [None, None, ([int(logits[2].argmax())], 0)])
    reference = torch.log_softmax(logits[:3].double(), dim=-1)
    first = result.logprobs[0]
    assert first.logprob == pytest.approx(reference[0, result.tokens[0]].item(), abs=1e-5)
    top = reference[0].topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert result.logprobs[1] is None
    third = result.logprobs[2]  # the raw model logprob of the token the penalty made the argmax
    assert third.top == () and third.logprob == pytest.approx(reference[2, result.tokens[2]].item(), abs=1e-5)


def test_penalties_count_only_output_tokens_for_frequency():
    logits = torch.zeros(1, 4)
    p = SamplingParams(frequency_penalty=1.0)
    out = apply_penalties(logits, [p], [([1, 1, 2, 2, 2], 2)])  # prompt [1, 1], output [2, 2, 2]
    assert out[0].tolist() == [0.0, 0.0, -3.0, 0.0]


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("repetition_penalty", 0.0), ("repetition_penalty", 1e-55),
                                          ("min_p", 1.5), ("logprobs", 21),
                                          ("logit_bias", ((1, 101.0),)), ("logit_bias", ((-1, 1.0),))])
def test_out_of_range_values_name_the_field(field, value):
    from metronome.contract.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**{field: value}).validate()
    assert caught.value.param == field
