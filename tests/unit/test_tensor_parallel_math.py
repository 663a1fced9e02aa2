"""Tensor parallelism without processes: which heads, rows and columns each rank owns, the errors for models
that cannot be split, the random-weight stream, the step protocol, devices, and the command-line plumbing."""
from __future__ import annotations

import argparse
import io
from dataclasses import replace

import pytest
import torch

from metronome.contract.errors import InvalidRequestError
from metronome.kernels.metadata import AttentionMetadata
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.tp_channel import (
    SHUTDOWN,
    STEP,
    ChannelClosed,
    StepHeader,
    encode_command,
    encode_reply,
    encode_step,
    pack_payload,
    read_message,
    read_reply,
    unpack_payload,
)
from metronome.server.engine.tp_launch import rank_devices
from metronome.server.models.parallel import kv_rows, local_config, plan_shards, q_rows, shard_for, vocab_rows
from metronome.server.models.presets import preset_config

LLAMA3_8B = preset_config("llama-3-8b")  # 32 query heads, 8 KV heads, MLP 14336, vocab 128256


def _small(**fields):
    base = dict(num_attention_heads=12, num_key_value_heads=4, head_dim=8, hidden_size=96, intermediate_size=48,
                vocab_size=101)
    return replace(preset_config("tiny"), **{**base, **fields})


@pytest.mark.parametrize("tp, q_heads, kv_heads, replicas", [(1, 32, 8, 1), (2, 16, 4, 1), (4, 8, 2, 1),
                                                             (8, 4, 1, 1), (16, 2, 1, 2), (32, 1, 1, 4)])
def test_llama3_8b_head_split(tp, q_heads, kv_heads, replicas):
    plan = plan_shards(LLAMA3_8B, tp)
    assert (plan.num_heads, plan.num_kv_heads, plan.kv_replicas) == (q_heads, kv_heads, replicas)
    assert plan.intermediate_size * tp == 14336
    assert plan.vocab_per_rank * tp >= 128256 > (plan.vocab_per_rank - 1) * tp


def test_smollm2_cannot_be_split_two_ways_but_three_ways_works():
    """SmolLM2-135M has 9 query heads and 3 KV heads: 2 divides neither, 3 splits both (3 q + 1 KV per rank)."""
    smollm2 = preset_config("smollm2-135m")
    with pytest.raises(InvalidRequestError, match="9 attention heads") as info:
        plan_shards(smollm2, 2)
    assert info.value.param == "tensor_parallel_size" and "valid sizes: 1, 3" in str(info.value)
    plan = plan_shards(smollm2, 3)
    assert (plan.num_heads, plan.num_kv_heads, plan.intermediate_size) == (3, 1, 512)


def test_kv_heads_that_neither_divide_nor_are_a_multiple_are_rejected():
    with pytest.raises(InvalidRequestError, match="4 KV heads"):
        plan_shards(_small(num_attention_heads=12, num_key_value_heads=4), 6)
    with pytest.raises(InvalidRequestError, match="MLP width 50"):
        plan_shards(_small(intermediate_size=50), 4)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidRequestError):
            plan_shards(_small(), bad)


@pytest.mark.parametrize("heads, kv, tp", [(12, 4, 1), (12, 4, 2), (12, 4, 4), (12, 4, 12), (12, 2, 6), (32, 8, 16),
                                           (8, 1, 4), (9, 3, 3)])
def test_every_rank_holds_the_kv_heads_of_its_query_heads(heads, kv, tp):
    """GQA: query head h reads KV head h // (heads / kv). Each rank must own exactly those KV heads, in order."""
    plan = plan_shards(_small(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=48 * tp), tp)
    hd = plan.head_dim
    owned_q = []
    for rank in range(tp):
        q_start, q_len = q_rows(plan, rank)
        kv_start, kv_len = kv_rows(plan, rank)
        q_heads = list(range(q_start // hd, (q_start + q_len) // hd))
        kv_heads = list(range(kv_start // hd, (kv_start + kv_len) // hd))
        owned_q += q_heads
        group = heads // kv
        needed = sorted({h // group for h in q_heads})
        assert kv_heads == needed
        # and locally the same rule holds: local q head i reads local kv head i // (local heads / local kv)
        local_group = plan.num_heads // plan.num_kv_heads
        assert [kv_heads[i // local_group] for i in range(len(q_heads))] == [h // group for h in q_heads]
    assert owned_q == list(range(heads))


def test_vocab_rows_cover_the_vocabulary_once_with_padding_at_the_end():
    plan = plan_shards(_small(vocab_size=10, num_attention_heads=4, num_key_value_heads=4, intermediate_size=8), 4)
    assert plan.vocab_per_rank == 3
    assert [vocab_rows(plan, r) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]


def test_shards_put_back_together_are_the_full_tensors():
    config = _small(num_attention_heads=4, num_key_value_heads=2, intermediate_size=12, vocab_size=11)
    tp = 2
    plan = plan_shards(config, tp)
    g = torch.Generator().manual_seed(0)
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(config.q_size, config.hidden_size, generator=g),
        "model.layers.0.self_attn.k_proj.bias": torch.randn(config.kv_size, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(config.hidden_size, config.q_size, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, config.hidden_size, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(config.hidden_size, 12, generator=g),
        "model.embed_tokens.weight": torch.randn(11, config.hidden_size, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(config.hidden_size, generator=g),
        "model.layers.0.mlp.down_proj.bias": torch.randn(config.hidden_size, generator=g),
    }
    dims = {"o_proj.weight": 1, "down_proj.weight": 1}
    for name, tensor in full.items():
        parts = [shard_for(name, tensor, plan, r) for r in range(tp)]
        if name.endswith("layernorm.weight") or name.endswith("down_proj.bias"):
            assert all(p is tensor for p in parts)  # replicated, not copied
            continue
        dim = next((d for suffix, d in dims.items() if name.endswith(suffix)), 0)
        joined = torch.cat(parts, dim=dim)
        if name == "model.embed_tokens.weight":
            assert joined.shape[0] == 12 and torch.equal(joined[11], torch.zeros(config.hidden_size))
            joined = joined[:11]
        assert torch.equal(joined, tensor), name


def test_replicated_kv_heads_are_identical_on_their_ranks():
    config = _small(num_attention_heads=8, num_key_value_heads=2, intermediate_size=16)
    plan = plan_shards(config, 4)
    k = torch.arange(config.kv_size * 3, dtype=torch.float32).view(config.kv_size, 3)
    parts = [shard_for("model.layers.1.self_attn.k_proj.weight", k, plan, r) for r in range(4)]
    assert torch.equal(parts[0], parts[1]) and torch.equal(parts[2], parts[3])
    assert torch.equal(torch.cat([parts[0], parts[2]]), k)


def test_local_config_is_one_ranks_shape():
    local = local_config(LLAMA3_8B, plan_shards(LLAMA3_8B, 4))
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim) == (8, 2, 128)
    assert (local.intermediate_size, local.vocab_size, local.hidden_size) == (3584, 32064, 4096)


def test_random_weight_stream_is_the_tp1_random_model():
    """TP ranks cut their shards out of exactly the weights `random:<preset>` gives at TP=1."""
    from metronome.server.models import load_model
    from metronome.server.models.parallel_model import random_full_weights

    loaded = load_model("random:tiny", dtype="float32", device="cpu", attention_backend="torch", seed=5)
    streamed = dict(random_full_weights(loaded.config, 5, torch.device("cpu"), torch.float32))
    params = dict(loaded.model.named_parameters())
    layer = "model.layers.1"
    qkv = torch.cat([streamed[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([streamed[f"{layer}.mlp.gate_proj.weight"], streamed[f"{layer}.mlp.up_proj.weight"]])
    assert torch.equal(qkv, params[f"{layer}.self_attn.qkv_proj.weight"])
    assert torch.equal(gate_up, params[f"{layer}.mlp.gate_up_proj.weight"])
    for name in ("model.embed_tokens.weight", "lm_head.weight", f"{layer}.self_attn.o_proj.weight",
                 "model.norm.weight"):
        assert torch.equal(streamed[name], params[name]), name
    extra = sum(2 if "qkv_proj" in n else 1 if "gate_up_proj" in n else 0 for n in params)
    assert len(streamed) == len(params) + extra  # q,k,v (3 for 1) and gate,up (2 for 1)


# ---- the step protocol -------------------------------------------------------------------------------------------

def _meta() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    q_lens, seq_lens = [3, 1], [7, 20]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([[4, 9], [1, 2]], dtype=torch.int32),
        slot_mapping=torch.tensor([68, 69, 70, 35], dtype=torch.int64), max_seqlen_q=3, max_seqlen_k=20,
        q_lens_host=q_lens, seq_lens_host=seq_lens)
    return torch.tensor([11, 12, 13, 14]), torch.tensor([4, 5, 6, 19]), meta, torch.tensor([2, 3])


def test_step_header_and_payload_round_trip():
    from metronome.server.engine.tp_channel import header_of

    input_ids, positions, meta, rows = _meta()
    window_group = replace(meta, block_tables=meta.block_tables + 30, slot_mapping=meta.slot_mapping + 7)
    header = header_of(input_ids, [meta, window_group], rows)
    stream = io.BytesIO(encode_step(header) + encode_command(SHUTDOWN))
    command, tokens, received = read_message(stream)
    assert (command, tokens, received) == (STEP, 4, header)
    assert read_message(stream)[0] == SHUTDOWN
    with pytest.raises(ChannelClosed):
        read_message(stream)
    payload = pack_payload(input_ids, positions, [meta, window_group], rows)
    assert payload.numel() == header.payload_numel and payload.dtype == torch.int64
    ids2, pos2, metas, rows2 = unpack_payload(payload, received)
    assert torch.equal(ids2, input_ids) and torch.equal(pos2, positions) and torch.equal(rows2, rows)
    assert len(metas) == 2  # a KV group each: its own slots and block table, the same lengths
    for sent, meta2 in zip((meta, window_group), metas):
        for field in ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping"):
            assert torch.equal(getattr(meta2, field), getattr(sent, field)), field
            assert getattr(meta2, field).dtype == getattr(sent, field).dtype, field
        assert (meta2.q_lens_host, meta2.seq_lens_host, meta2.max_seqlen_q, meta2.max_seqlen_k) == \
            ([3, 1], [7, 20], 3, 20)


def test_ready_reply_and_a_closed_pipe():
    assert read_reply(io.BytesIO(encode_reply(1234))) == 1234
    with pytest.raises(ChannelClosed):
        read_reply(io.BytesIO(encode_reply(5)[:9]))
    assert StepHeader(2, 1, 3, 1, 2, 9, [2], [9]).payload_numel == 3 * 2 + 1 + 2 + 1 + 3
    assert StepHeader(2, 1, 3, 1, 2, 9, [2], [9], num_groups=2).payload_numel == 4 * 2 + 1 + 2 + 1 + 2 * 3


# ---- devices, config and the command lines ---------------------------------------------------------------------

def test_rank_devices():
    assert rank_devices("cpu", 3) == [torch.device("cpu")] * 3
    if torch.cuda.device_count() < 2:
        with pytest.raises(InvalidRequestError, match="needs 2 GPUs"):
            rank_devices("cuda", 2)
    with pytest.raises(InvalidRequestError):
        rank_devices("tpu", 2)


def test_engine_config_accepts_tp_sizes_and_rejects_bad_ones():
    EngineConfig(tensor_parallel_size=4).validate()
    for bad in (0, -1, 2.0):
        with pytest.raises(InvalidRequestError) as info:
            EngineConfig(tensor_parallel_size=bad).validate()
        assert info.value.param == "tensor_parallel_size"


def test_an_indivisible_model_fails_before_any_worker_starts(monkeypatch):
    import subprocess

    from metronome.server.engine.engine import EngineCore

    def no_spawn(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(subprocess, "Popen", no_spawn)
    with pytest.raises(InvalidRequestError, match="9 attention heads"):
        EngineCore.from_config(EngineConfig(model="random:smollm2-135m", device="cpu", tensor_parallel_size=2))


@pytest.mark.parametrize("module", ["metronome.server.api.serve_cli", "metronome.server.generate_cli"])
def test_cli_flag(module):
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(module).configure(parser)
    extra = ["--prompt", "x"] if module.endswith("generate_cli") else []
    assert parser.parse_args(extra).tensor_parallel_size == 1
    assert parser.parse_args([*extra, "--tensor-parallel-size", "4"]).tensor_parallel_size == 4


@pytest.mark.parametrize("gpus, expected", [(0, 1), (1, 1), (2, 2), (8, 8)])
def test_operator_maps_gpus_to_the_tp_size(gpus, expected):
    from metronome.operator import builders
    from metronome.operator.spec import parse_service
    from metronome.server.api import serve_cli
    body = {"apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u", "generation": 1},
            "spec": {"model": {"source": "random:llama-3-8b"}, "resources": {"gpus": gpus}}}
    deployment = builders.deployment(parse_service(body))
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    serve_cli.configure(parser)
    assert parser.parse_args(args[1:]).tensor_parallel_size == expected


def test_bench_engine_flag():
    from metronome.server.bench import cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["engine", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2


def test_every_family_splits_two_ways():
    from metronome.server.models.parallel import plan_shards
    from metronome.server.models.presets import preset_config

    for name in ("llama-3-8b", "mistral-7b", "qwen2-7b", "qwen3-8b", "gemma-3-12b", "phi-4-mini", "qwen3-30b-a3b",
                 "mixtral-8x7b", "gpt-oss-20b"):
        config = preset_config(name)
        plan = plan_shards(config, 2)
        assert plan.num_heads == config.num_attention_heads // 2, name
