"""`metronome generate`: JSON lines in prompt order, concurrency-independent greedy output, clean errors."""
from __future__ import annotations

import json

import pytest

from metronome.cli import main

TINY = ["--model", "random:tiny", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        rc = main(["generate", *args])
    except SystemExit as exc:  # argparse errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_lines_in_prompt_order_match_single_prompt_runs(capsys):
    prompts = ["hello there", "a much longer prompt that spans a few blocks of the cache", "x"]
    args = [*TINY, "--max-tokens", "6", "--chunk-size", "7", "--queue-policy", "fcfs", "--json"]  # chunk 7 applies
    rc, out, err = run_cli(capsys, *args, *[a for p in prompts for a in ("--prompt", p)])
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["prompt"] for r in rows] == prompts
    for row in rows:
        assert len(row["token_ids"]) == 6 and row["finish_reason"] == "length"
        assert isinstance(row["text"], str)
    rc, out, _ = run_cli(capsys, *args, "--prompt", prompts[1], "--block-size", "256", "--num-kv-blocks", "4")
    assert rc == 0
    assert json.loads(out)["token_ids"] == rows[1]["token_ids"]  # alone, other block size: same greedy ids


def test_human_readable_output_and_chat(capsys):
    rc, out, err = run_cli(capsys, *TINY, "--max-tokens", "3", "--prompt", "hi", "--chat", "--queue-policy", "sjf")
    assert rc == 0, err
    assert out.startswith("--- [0] 'hi' (3 tokens, length)")


@pytest.mark.parametrize("extra,message", [
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be a positive integer"),
    (["--chunk-size", "0"], "--chunk-size must be >= 1"),
    (["--model", "random:no-such-preset"], "unknown model preset"),
    (["--max-model-len", "8"], "the model's context is 8 tokens"),
])
def test_bad_input_exits_1_with_the_message(capsys, extra, message):
    rc, out, err = run_cli(capsys, *TINY, "--prompt", "hello world", "--max-tokens", "4", *extra)
    assert rc == 1
    assert message in err and "Traceback" not in err
    assert out == ""


def test_empty_prompt_and_argparse_errors(capsys):
    rc, _, err = run_cli(capsys, *TINY, "--prompt", "")
    assert rc == 1 and "prompt must not be empty" in err
    rc, _, err = run_cli(capsys, *TINY, "--prompt", "x", "--max-tokens", "many")
    assert rc == 2 and "invalid int value" in err
    rc, _, err = run_cli(capsys, *TINY)
    assert rc == 2 and "--prompt" in err
