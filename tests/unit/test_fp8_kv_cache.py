"""The FP8 (e4m3) KV cache: K/V written as e4m3(x / scale) with a scale per kv head and read back times it, by the
torch reference and by the Triton kernels (KV write, fused rope + KV write, paged attention) under the
interpreter; the engine's cache holds more tokens in the same memory, and says so at start-up.

As in test_kernels.py, the Triton side runs in a subprocess started with TRITON_INTERPRET=1 (this file run as a
script) and hands back plain numbers; the checks are here. Caches start poisoned with NaN (NaN in e4m3 too), so
an unmasked read of a slot nobody wrote shows.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch

from metronome.kernels.torch_ref import TorchBackend, from_cache, to_cache
from metronome_testing.random_batch import make_paged_batch

FP8 = torch.float8_e4m3fn
# (name, q_lens, ctx_lens, block_size, n_kv_heads, group, head_dim, num_splits, window, apart)
CASES = [("mixed", (1, 37, 1, 5), (300, 20, 0, 63), 16, 2, 4, 64, None, None, None),
         ("mixed_apart", (1, 1, 1, 37, 1, 5), (300, 90, 4, 20, 0, 63), 16, 2, 4, 64, None, None, True),
         ("decodes_split", (1, 1), (700, 90), 32, 1, 8, 128, 2, None, None),
         ("window", (1, 30, 1), (200, 50, 9), 16, 2, 2, 64, None, 40, None)]


def _fp8_batch(case):
    name, q_lens, ctx_lens, block_size, n_kv_heads, group, head_dim, _, _, _ = case
    batch = make_paged_batch(list(q_lens), list(ctx_lens), block_size, n_kv_heads, group, head_dim,
                             seed=zlib.crc32(name.encode()))
    g = torch.Generator().manual_seed(len(name))
    k_scale = (0.012 + 0.01 * torch.rand(n_kv_heads, generator=g)).float()  # K/V ~ N(0, 1): 448 * s > 5σ
    v_scale = (0.012 + 0.01 * torch.rand(n_kv_heads, generator=g)).float()
    flat = batch.k_cache.shape[0] * block_size
    k8 = to_cache(batch.k_cache.view(flat, n_kv_heads, head_dim), FP8, k_scale).view(batch.k_cache.shape)
    v8 = to_cache(batch.v_cache.view(flat, n_kv_heads, head_dim), FP8, v_scale).view(batch.v_cache.shape)
    return batch, k8, v8, k_scale, v_scale


def _torch_fp8(case):
    batch, k8, v8, k_scale, v_scale = _fp8_batch(case)
    backend = TorchBackend()
    backend.write_kv(batch.key, batch.value, k8, v8, batch.meta.slot_mapping, k_scale, v_scale)
    out = backend.attention(batch.q, k8, v8, batch.meta, case[6] ** -0.5, window=case[8], k_scale=k_scale,
                            v_scale=v_scale)
    return batch, k8, v8, k_scale, v_scale, out


def _triton_case(case) -> dict:
    from metronome.kernels.triton_attention import paged_attention
    from metronome.kernels.triton_kv_write import write_kv_triton

    batch, k8, v8, k_scale, v_scale, expected = _torch_fp8(case)
    _, tk8, tv8, _, _ = _fp8_batch(case)
    write_kv_triton(batch.key, batch.value, tk8, tv8, batch.meta.slot_mapping, k_scale, v_scale)
    got = paged_attention(batch.q, tk8, tv8, batch.meta, case[6] ** -0.5, num_splits=case[7], window=case[8],
                          k_scale=k_scale, v_scale=v_scale, apart=case[9])
    return {"cache_equal": torch.equal(tk8.view(torch.uint8), k8.view(torch.uint8))
            and torch.equal(tv8.view(torch.uint8), v8.view(torch.uint8)),
            "rel": ((got.double() - expected.double()).norm() / expected.double().norm()).item(),
            "finite": bool(torch.isfinite(got).all())}


def _rope_case() -> dict:
    """rope_write_kv into an FP8 cache against the torch path (rotary, then the reference write)."""
    from metronome.kernels.triton_fused import rope_write_kv
    from metronome.server.models.config import ModelConfig
    from metronome.server.models.rope import RotaryEmbedding

    heads, kv_heads, head_dim, tokens, page, blocks = 4, 2, 32, 9, 8, 6
    config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=heads * head_dim, intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False,
                         bos_token_id=None, eos_token_ids=(0,))
    rotary = RotaryEmbedding(config)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = torch.randperm(blocks * page, generator=g)[:tokens]
    slots[2] = -1
    scales = torch.tensor([0.01, 0.02]), torch.tensor([0.015, 0.005])
    caches = [torch.full((blocks, page, kv_heads, head_dim), float("nan")).to(FP8) for _ in range(4)]
    cos, sin = rotary.tables(torch.device("cpu"), torch.float32)
    rope_write_kv(qkv, positions, slots, cos, sin, caches[0], caches[1], heads, kv_heads, k_scale=scales[0],
                  v_scale=scales[1])
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    _, k_rot = rotary(positions, q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim))
    TorchBackend().write_kv(k_rot, v.reshape(tokens, kv_heads, head_dim), caches[2], caches[3], slots, *scales)
    return {"equal": all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                         for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))}


def _greedy_tokens(attention_backend: str) -> list[list[int]]:
    """An engine with FP8 weights and an FP8 KV cache; with triton, the fused kernels too (norm and SiLU·mul
    quantising for the next layer, rope + FP8 K/V write, FP8 attention)."""
    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.sampling import SamplingParams

    engine = EngineCore.from_config(
        EngineConfig(model="random:tiny", device="cpu", dtype="float32", attention_backend=attention_backend,
                     num_kv_blocks=64, kv_cache_dtype="fp8", quantization="fp8"),
        SchedulerConfig(chunk_size=16, queue_policy="fcfs"))
    engine.loaded.model.fused = attention_backend == "triton"
    ids = [engine.add_request(list(range(5, 5 + n)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
           for n in (5, 21)]
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished():
        events, _ = engine.step()
        for event in events:
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
    return [tokens[rid] for rid in ids]


def _run_all() -> dict:
    return {"cases": {c[0]: _triton_case(c) for c in CASES}, "rope": _rope_case(),
            "engine": {"torch": _greedy_tokens("torch"), "triton": _greedy_tokens("triton")}}


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, f"triton interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torch_fp8_cache_is_the_dequantised_cache(case):
    """Attention over the FP8 cache equals attention over a float32 cache holding its dequantised values, and what
    was written comes back within e4m3's rounding."""
    batch, k8, v8, k_scale, v_scale, out = _torch_fp8(case)
    flat = (-1, k8.shape[2], k8.shape[3])
    k_deq = from_cache(k8.view(flat), k_scale).view(k8.shape)
    v_deq = from_cache(v8.view(flat), v_scale).view(v8.shape)
    expected = TorchBackend().attention(batch.q, k_deq, v_deq, batch.meta, case[6] ** -0.5, window=case[8])
    assert torch.equal(out, expected)
    # every K/V value came back within e4m3's rounding of what was written (3 mantissa bits, or the subnormal step)
    for cache, rows, scale in ((k_deq, batch.key, k_scale), (v_deq, batch.value, v_scale)):
        stored = cache.view(flat)[batch.meta.slot_mapping]
        bound = torch.maximum(rows.abs() * 2 ** -4, 2 ** -10 * scale[None, :, None])
        assert bool(((stored - rows).abs() <= bound * 1.0001).all())


def test_fp8_cache_needs_its_scales():
    batch, k8, v8, k_scale, v_scale = _fp8_batch(CASES[0])
    with pytest.raises(ValueError, match="needs k_scale"):
        TorchBackend().attention(batch.q, k8, v8, batch.meta, 1.0)
    with pytest.raises(ValueError, match="one per kv head"):
        TorchBackend().write_kv(batch.key, batch.value, k8, v8, batch.meta.slot_mapping, k_scale[:1], v_scale)
    with pytest.raises(ValueError, match="for an FP8 cache"):
        TorchBackend().write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping,
                                k_scale, v_scale)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_fp8_cache_matches_the_torch_reference(results, case):
    got = results["cases"][case[0]]
    assert got["cache_equal"], "the Triton KV write rounds differently from the reference"
    assert got["finite"]
    assert got["rel"] < 1e-5, got


def test_fused_rope_write_quantises_like_the_reference(results):
    assert results["rope"]["equal"]


def test_triton_engine_with_fp8_weights_and_kv_equals_the_torch_path(results):
    assert results["engine"]["triton"] == results["engine"]["torch"]
    assert all(len(tokens) == 4 for tokens in results["engine"]["torch"])


def _engine(kv_cache_dtype: str, dtype: str = "bfloat16"):
    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore

    return EngineCore.from_config(
        EngineConfig(model="random:tiny", device="cpu", dtype=dtype, attention_backend="torch", seed=2,
                     kv_cache_memory_gb=0.02, kv_cache_dtype=kv_cache_dtype),
        SchedulerConfig(chunk_size=16, queue_policy="fcfs"))


def test_engine_fp8_cache_doubles_the_blocks_and_serves():
    from metronome.server.engine.sampling import SamplingParams

    plain, fp8 = _engine("auto"), _engine("fp8")
    assert plain.runner.kv_caches[0][0].dtype == torch.bfloat16 and fp8.runner.kv_caches[0][0].dtype == FP8
    assert fp8.block_manager.num_blocks // 2 == plain.block_manager.num_blocks  # same bytes, half per block
    assert "float8_e4m3fn, scales calibrated" in fp8.startup_summary()
    scales = fp8.loaded.model.model.layers[0].self_attn.kv_scales
    assert set(scales) == {"k_scale", "v_scale"} and scales["k_scale"].dtype == torch.float32
    outputs = []
    for engine in (plain, fp8):
        ids = [engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=6, temperature=0.0,
                                                                         ignore_eos=True)) for n in (9, 40)]
        done = {rid: [] for rid in ids}
        while engine.has_unfinished():
            events, _ = engine.step()
            for event in events:
                if event.token_id >= 0:
                    done[event.request_id].append(event.token_id)
        outputs.append([done[rid] for rid in ids])
    assert all(len(tokens) == 6 for tokens in outputs[1])


def test_kv_cache_dtype_refusals():
    from metronome.contract.errors import InvalidRequestError
    from metronome.server.engine.kv_cache import kv_cache_dtype

    with pytest.raises(InvalidRequestError, match="bf16 needs a bfloat16 model"):
        kv_cache_dtype("bf16", torch.float32, "torch")
    with pytest.raises(InvalidRequestError, match="not flash_attn"):
        kv_cache_dtype("fp8", torch.bfloat16, "flash_attn")
    assert kv_cache_dtype("auto", torch.float16, "triton") == torch.float16
    assert kv_cache_dtype("fp8", torch.float32, "torch") == FP8


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(_run_all()))


def test_checkpoint_kv_scales_are_the_caches(tmp_path):
    import json as json_module

    from fp8_checkpoints import write_fp8_checkpoint
    from safetensors.torch import load_file, save_file
    from test_fp8_checkpoint_layouts import TINY
    from test_loaders import save_hf_model
    from transformers import LlamaConfig

    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore

    hf_model = save_hf_model(tmp_path, LlamaConfig(**TINY, tie_word_embeddings=False, bos_token_id=1,
                                                   eos_token_id=2))
    write_fp8_checkpoint(tmp_path, hf_model, "ct-channel")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for layer in range(TINY["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.01 * (layer + 1))
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.02, 0.03])  # per kv head
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json_module.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    (tmp_path / "config.json").write_text(json_module.dumps(config))
    engine = EngineCore.from_config(
        EngineConfig(model=f"hf-dir:{tmp_path}", device="cpu", dtype="float32", attention_backend="torch",
                     num_kv_blocks=64, kv_cache_dtype="fp8"), SchedulerConfig(chunk_size=16))
    assert "scales checkpoint" in engine.startup_summary()
    scales = engine.loaded.model.model.layers[1].self_attn.kv_scales
    assert torch.equal(scales["k_scale"], torch.tensor([0.02, 0.02]))
    assert torch.equal(scales["v_scale"], torch.tensor([0.02, 0.03]))
