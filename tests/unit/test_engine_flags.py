"""One definition of the engine and scheduler flags: serve, generate and bench parse them alike, with one set of
defaults, into the EngineConfig and SchedulerConfig they describe."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from metronome.contract.config import ConfigError, QueuePolicy, SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.flags import (
    ENGINE_FLAGS,
    SCHEDULER_FLAGS,
    add_engine_flags,
    engine_config_from_args,
    scheduler_from_args,
)

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def parser_of(command: str) -> tuple[argparse.ArgumentParser, list[str]]:
    from metronome.cli import build_parser

    prefix = {"serve": ["serve"], "generate": ["generate", "--prompt", "x"], "bench": ["bench", "run"],
              "bench engine": ["bench", "engine"]}[command]
    return build_parser(), prefix


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "bench engine"])
def test_every_command_builds_the_engine_config_the_flags_say(command):
    parser, prefix = parser_of(command)
    args = parser.parse_args([*prefix, "--model", "random:tiny", "--block-size", "32", "--num-kv-blocks", "64",
                              "--no-prefix-caching", "--enforce-eager", "--max-waiting", "7", "--device", "cpu",
                              "--tensor-parallel-size", "2", "--queue-policy", "fcfs", "--chunk-size", "unchunked"])
    config = engine_config_from_args(args)
    assert (config.model, config.block_size, config.num_kv_blocks, config.max_waiting, config.device) == \
        ("random:tiny", 32, 64, 7, "cpu")
    assert (config.enable_prefix_caching, config.cuda_graphs, config.tensor_parallel_size) == (False, False, 2)
    scheduler = scheduler_from_args(args)
    assert (scheduler.queue_policy, scheduler.chunk_size) == (QueuePolicy.FCFS, 1 << 20)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_defaults_are_the_config_classes_defaults(command):
    parser, prefix = parser_of(command)
    args = parser.parse_args(prefix)
    assert engine_config_from_args(args) == EngineConfig()
    assert scheduler_from_args(args) == SchedulerConfig()  # queue policy split, the server's default


def test_bench_overrides_only_what_it_documents():
    parser, prefix = parser_of("bench")
    config = engine_config_from_args(parser.parse_args(prefix))
    assert config == dataclasses.replace(EngineConfig(), max_waiting=100_000)
    args = parser.parse_args(["bench", "engine", "--seed", "5"])
    config = engine_config_from_args(args)
    assert (config.model, config.device, config.seed) == ("random:llama-3-8b", "cuda", 5)  # --seed: engine too
    assert scheduler_from_args(args).chunk_size == 2048


def test_every_row_names_a_real_field():
    assert {f.dest for f in ENGINE_FLAGS} <= FIELDS
    assert {f.dest for f in SCHEDULER_FLAGS} <= set(SchedulerConfig.model_fields)
    choices = next(f.choices for f in SCHEDULER_FLAGS if f.dest == "queue_policy")
    assert choices == tuple(p.value for p in QueuePolicy)
    with pytest.raises(ValueError, match="no such flag"):
        add_engine_flags(argparse.ArgumentParser(), skip=("blok_size",))


def test_bad_values_name_the_flag(capsys):
    parser, prefix = parser_of("serve")
    with pytest.raises(SystemExit):
        parser.parse_args([*prefix, "--block-size", "0"])
    assert "--block-size: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([*prefix, "--queue-policy", "lifo"])
    assert "--queue-policy" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--chunk-size must be >= 1, got 0"):
        scheduler_from_args(parser.parse_args([*prefix, "--chunk-size", "0"]))
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(256\)"):
        scheduler_from_args(parser.parse_args([*prefix, "--max-num-batched-tokens", "8"]))


def test_auto_device_is_resolved_in_one_place(monkeypatch):
    import torch

    from metronome.contract.errors import InvalidRequestError
    from metronome.server.models.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(InvalidRequestError, match="no CUDA device"):
        resolve_device("cuda")
    assert resolve_device("cuda:1", check_available=False) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    with pytest.raises(InvalidRequestError, match="unknown device"):
        resolve_device("tpu")
