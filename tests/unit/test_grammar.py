"""Grammar-constrained decoding through the engine: random weights sample only what the grammar allows."""
from __future__ import annotations

import json

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import InvalidRequestError
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import Grammar, SamplingParams

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "pick", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def core() -> EngineCore:
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=128)
    return EngineCore.from_config(config, SchedulerConfig())


def test_json_schema_output_parses_and_fits_the_schema(core):
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=seed, grammar=grammar) for seed in range(6)]
    results = core.generate([f"prompt {i}" for i in range(6)], params)
    for result in results:
        value = json.loads(result.text)
        assert result.finish_reason == "stop"
        assert set(value) == {"ok", "pick", "n"} and isinstance(value["ok"], bool)
        assert value["pick"] in {"red", "green", "blue"} and 0 <= value["n"] <= 99
    core.check_no_leaks()


def test_constrained_and_free_requests_share_a_batch(core):
    grammar = Grammar("regex", r"(yes|no)")
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    greedy_alone = core.generate(["free text"], free)[0].token_ids
    results = core.generate(["free text", "constrained"], [free, SamplingParams(max_tokens=8, grammar=grammar)])
    assert results[0].token_ids == greedy_alone  # the other row's mask does not touch this row
    assert results[1].text in {"yes", "no"} and results[1].finish_reason == "stop"


def test_json_object_is_an_object(core):
    results = core.generate(["x"], SamplingParams(max_tokens=300, temperature=0.0,
                                                  grammar=Grammar("json_object")))
    if results[0].finish_reason == "stop":
        assert isinstance(json.loads(results[0].text), dict)
    else:  # random weights may nest until the limit; the text is still an object's prefix
        assert results[0].text.startswith("{")


def test_bad_schemas_are_rejected_before_anything_runs(core):
    with pytest.raises(InvalidRequestError) as caught:
        core.prepare_request("x", SamplingParams(grammar=Grammar("json_schema", "{not json")))
    assert caught.value.param == "response_format"
    with pytest.raises(InvalidRequestError):
        core.prepare_request("x", SamplingParams(grammar=Grammar("json_schema", json.dumps({"type": "nonsense"}))))


def test_the_mask_allows_exactly_what_the_matcher_allows(core):
    matcher = core.grammars.matcher(Grammar("regex", r"ab"))
    rows, allowed = core.grammars.mask([3], [matcher])
    assert rows.tolist() == [3] and allowed.shape == (1, core.vocab_size)
    a = core.tokenizer.encode("a", add_special_tokens=False)[0]
    assert allowed[0, a] and allowed[0].sum() == (allowed[0] & (torch.arange(core.vocab_size) % 256 ==
                                                                 a % 256)).sum()


def test_many_rows_fill_in_parallel_like_one_by_one(core):
    """Above SERIAL_ROWS the executor fills the rows; each row equals its own single-row mask."""
    from metronome.server.engine.grammar import SERIAL_ROWS

    grammars = [Grammar("regex", r"[0-9]+"), Grammar("regex", r"(yes|no)"), Grammar("json_object")]
    matchers = [core.grammars.matcher(grammars[i % 3]) for i in range(SERIAL_ROWS + 3)]
    rows, allowed = core.grammars.mask(list(range(len(matchers))), matchers)
    for i, matcher in enumerate(matchers):
        assert torch.equal(allowed[i], core.grammars.mask([0], [matcher])[1][0])
