"""The MoE expert paths on CUDA: the fused Triton kernels and torch's grouped GEMM against the reference loop at
real model shapes (bf16), every family's block against transformers' on the GPU with the hidden routing cases,
CUDA-graph replay against eager, and no Triton compile for a new routing or a new token count of a known tile
class. gpt-oss's pieces on CUDA: attention sinks in the Triton kernel against the torch reference at its shapes,
and the float32-scaled RMSNorm. Whole tiny MoE models in the engine: decode graphs and piecewise graphs give the
eager engine's greedy tokens, and nothing compiles after ready; the real-size random:qwen3-30b-a3b builds on the
device and decodes with graphs.

Run on the GPU machine only: `pytest -q -s tests/gpu/test_moe_gpu.py` (never part of CI).
"""
from __future__ import annotations

import random

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.kernels.triton_moe import choose_tiles, fused_experts
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams
from metronome.server.models.moe_config import MoeSpec
from metronome.server.models.moe_experts import (
    ExpertWeights,
    experts_grouped_mm,
    experts_reference,
    grouped_mm_available,
)
from metronome_testing.moe_cases import CASES, FAMILIES, build_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (name, experts, top_k, hidden, expert size, gpt-oss activation and biases)
SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768, False), ("gpt-oss-20b", 32, 4, 2880, 2880, True),
          ("mixtral-8x7b", 8, 2, 4096, 14336, False)]
PATHS = ["triton"] + (["grouped_mm"] if grouped_mm_available() else [])


def _spec(experts, top_k, inter, gpt_oss) -> MoeSpec:
    if gpt_oss:
        return MoeSpec(experts, top_k, inter, topk_before_softmax=True, weights_in_model_dtype=True,
                       router_bias=True, expert_bias=True, activation="swiglu_clamped",
                       checkpoint_layout="interleaved_transposed")
    return MoeSpec(experts, top_k, inter, weights_in_model_dtype=True)


def _layer(experts, hidden, inter, gpt_oss, seed=0) -> ExpertWeights:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*size):
        return (torch.randn(*size, generator=g, device="cuda") * 0.02).to(torch.bfloat16)

    return ExpertWeights(randn(experts, 2 * inter, hidden), randn(experts, hidden, inter),
                         randn(experts, 2 * inter) if gpt_oss else None, randn(experts, hidden) if gpt_oss else None)


def _routing(tokens, experts, top_k, hidden, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g, device="cuda"), -1).to(torch.bfloat16)
    return x, weights, ids


def _run(path, x, layer: ExpertWeights, weights, ids, spec):
    if path == "grouped_mm":
        return experts_grouped_mm(x, layer, weights, ids, spec)
    return fused_experts(x, layer.gate_up, layer.down, weights, ids, spec.activation, spec.swiglu_alpha,
                         spec.swiglu_limit, layer.gate_up_bias, layer.down_bias)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_fused_paths_match_the_reference_at_model_shapes(shape):
    name, experts, top_k, hidden, inter, gpt_oss = shape
    spec = _spec(experts, top_k, inter, gpt_oss)
    layer = _layer(experts, hidden, inter, gpt_oss)
    for tokens in (1, 2, 4, 7, 64, 256, 1000):  # up to 4 (by the experts): one row block a pair
        x, weights, ids = _routing(tokens, experts, top_k, hidden, tokens)
        expected = experts_reference(x, layer, weights, ids, spec)
        for path in PATHS:
            got = _run(path, x, layer, weights, ids, spec)
            error = _rel(got, expected)
            print(f"{name} T={tokens} {path}: relative error {error:.2e}")
            assert torch.isfinite(got).all() and got.dtype == torch.bfloat16
            assert error < 1e-2, (name, tokens, path, error)


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["rows", "blocks"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=[s[0] for s in SHAPES[:2]])
def test_fused_fp8_experts_match_the_reference_on_their_dequantised_weights(shape, block):
    """e4m3 experts (an FP8 checkpoint's, per row or per 128 x 128 block) on bf16 activations: the fused kernels
    against the reference loop on the same weights dequantised to bf16."""
    from metronome.kernels.triton_moe import Fp8ExpertScales
    from metronome.server.models.quant import fp8

    name, experts, top_k, hidden, inter, gpt_oss = shape
    spec = _spec(experts, top_k, inter, gpt_oss)
    layer = _layer(experts, hidden, inter, gpt_oss)
    quantised, scales, dequantised = [], [], []
    for stacked in (layer.gate_up, layer.down):
        pairs = [fp8.quantize_per_block(m.float(), block) if block else fp8.quantize_per_channel(m.float())
                 for m in stacked]
        q = torch.stack([p[0] for p in pairs])
        rows = torch.stack([p[1].repeat_interleave(block[0], 0)[:stacked.shape[1]] if block else p[1][:, None]
                            for p in pairs]).contiguous()
        width = block[1] if block else stacked.shape[2]
        quantised.append(q)
        scales.append(rows)
        dequantised.append(fp8.dequantize(q, rows.repeat_interleave(width, -1)[..., :stacked.shape[2]])
                           .to(torch.bfloat16))
    reference_layer = ExpertWeights(*dequantised, layer.gate_up_bias, layer.down_bias)
    fp8_scales = Fp8ExpertScales(scales[0], scales[1], block[1] if block else 0)
    for tokens in (1, 2, 64, 1000):
        x, weights, ids = _routing(tokens, experts, top_k, hidden, tokens)
        expected = experts_reference(x, reference_layer, weights, ids, spec)
        got = fused_experts(x, *quantised, weights, ids, spec.activation, spec.swiglu_alpha, spec.swiglu_limit,
                            layer.gate_up_bias, layer.down_bias, fp8_scales=fp8_scales)
        error = _rel(got, expected)
        print(f"{name} fp8 {block} T={tokens}: relative error {error:.2e}")
        assert torch.isfinite(got).all() and error < 1e-2, (name, block, tokens, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_match_transformers_on_the_gpu_with_the_hidden_routing_cases(family, dtype):
    for case, tokens in CASES:
        _, ours, x, expected = build_case(family, case, tokens, dtype, device="cuda")
        with torch.no_grad():
            for path in ["reference"] + PATHS:
                if path == "grouped_mm" and dtype == torch.float32:
                    continue  # torch's grouped GEMM takes bf16 on CUDA
                got = ours.run(x, path)
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                assert _rel(got, expected) < tol, (family, case, path)


@pytest.mark.parametrize("tokens", [64, 4], ids=["aligned", "pair-blocks"])
@pytest.mark.parametrize("path", PATHS)
def test_graph_replay_equals_eager(path, tokens):
    """Captured once on static buffers, replayed after the inputs (and so the routing) change in place: the
    same numbers as an eager call on the new inputs."""
    _, experts, top_k, hidden, inter, gpt_oss = SHAPES[0]
    spec = _spec(experts, top_k, inter, gpt_oss)
    layer = _layer(experts, hidden, inter, gpt_oss)
    x, weights, ids = _routing(tokens, experts, top_k, hidden, 1)
    _run(path, x, layer, weights, ids, spec)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(path, x, layer, weights, ids, spec)
    for seed in (2, 3):
        new_x, new_weights, new_ids = _routing(tokens, experts, top_k, hidden, seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _run(path, x, layer, weights, ids, spec)), seed


def test_no_triton_compile_for_new_routings_or_token_counts_of_a_known_tile_class():
    from metronome.kernels import compile_watch

    if not compile_watch.install():
        pytest.skip("this Triton has no compile hook")
    _, experts, top_k, hidden, inter, gpt_oss = SHAPES[0]
    spec = _spec(experts, top_k, inter, gpt_oss)
    layer = _layer(experts, hidden, inter, gpt_oss)
    assert choose_tiles(40, top_k, experts, True) == choose_tiles(64, top_k, experts, True)
    x, weights, ids = _routing(64, experts, top_k, hidden, 1)
    _run("triton", x, layer, weights, ids, spec)
    torch.cuda.synchronize()
    compiled = compile_watch.count()
    for tokens, seed in ((64, 5), (40, 6), (63, 7)):
        x, weights, ids = _routing(tokens, experts, top_k, hidden, seed)
        _run("triton", x, layer, weights, ids, spec)
    torch.cuda.synchronize()
    assert compile_watch.count() == compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_sinks_in_the_triton_kernel_match_the_torch_reference_at_gpt_oss_shapes(dtype):
    """64 query heads over 8 kv heads of 64, window 128 and full layers, decodes long enough to split the keys."""
    from metronome.kernels import get_backend
    from metronome_testing.random_batch import make_paged_batch

    q_lens, ctx = [1] * 6 + [300, 1, 77], [4000, 60, 127, 128, 129, 2500, 900, 3, 0]
    batch = make_paged_batch(q_lens, ctx, 16, 8, 8, 64, dtype=dtype, seed=3, device="cuda")
    sinks = (torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3).to("cuda", dtype)
    for window in (128, None):
        outs = {}
        for name in ("torch", "triton"):
            backend = get_backend(name)
            k, v = batch.k_cache.clone(), batch.v_cache.clone()
            backend.write_kv(batch.key, batch.value, k, v, batch.meta.slot_mapping)
            outs[name] = backend.attention(batch.q, k, v, batch.meta, 0.125, window=window, sinks=sinks)
        error = _rel(outs["triton"], outs["torch"])
        print(f"{dtype} window {window}: sinks, triton vs torch relative error {error:.2e}")
        assert error < (1e-4 if dtype == torch.float32 else 1e-2)


def test_float_scaled_norm_rounds_once_like_gpt_oss():
    from metronome.kernels.triton_fused import add_rms_norm
    from metronome.server.models.layers import RMSNorm

    g = torch.Generator(device="cuda").manual_seed(0)
    norm = RMSNorm(2880, 1e-5, float_scale=True).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(2880, generator=g, device="cuda"))
    x = torch.randn(64, 2880, generator=g, device="cuda").to(torch.bfloat16)
    expected = norm(x)
    differing = {}
    for float_scale in (True, False):
        got = add_rms_norm(None, x.clone(), norm.weight, norm.eps, float_scale=float_scale)
        differing[float_scale] = (got != expected).float().mean().item()
    print(f"elements differing from gpt-oss's norm: float-scaled kernel {differing[True]:.2%}, "
          f"Llama-style kernel {differing[False]:.2%}")
    assert differing[True] < 0.01 and differing[True] < differing[False] / 4


def _moe_engine(preset: str, cuda_graphs: bool, dtype: str, backend: str) -> EngineCore:
    config = EngineConfig(model=f"random:{preset}", device="cuda", dtype=dtype, attention_backend="triton",
                          block_size=16, num_kv_blocks=2048, seed=11, cuda_graphs=cuda_graphs, moe_backend=backend)
    return EngineCore.from_config(config, SchedulerConfig(chunk_size=512, max_num_seqs=16, queue_policy="fcfs"))


def _greedy(engine: EngineCore, prompts, max_tokens):
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
           for p, m in zip(prompts, max_tokens)]
    tokens = {rid: [] for rid in ids}
    forwards = []
    while engine.has_unfinished():
        events, stats = engine.step()
        if stats.num_tokens:
            forwards.append((stats.forward, stats.kind))
        for event in events:
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
    engine.check_no_leaks()
    return [tokens[rid] for rid in ids], forwards


@pytest.mark.parametrize("preset,dtype,backend", [("tiny-gpt-oss", "float32", "triton"),
                                                  ("tiny-qwen3-moe", "float32", "triton"),
                                                  ("tiny-mixtral", "bfloat16", "grouped_mm")])
def test_moe_models_in_graphs_match_eager_and_compile_nothing_after_ready(preset, dtype, backend):
    if backend == "grouped_mm" and not grouped_mm_available():
        pytest.skip("this torch has no grouped_mm")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(lo, lo + 300))] for lo in (1, 20, 300, 700, 5)]
    max_tokens = [6 + 5 * i for i in range(len(prompts))]
    eager = _moe_engine(preset, False, dtype, backend)
    expected, _ = _greedy(eager, prompts, max_tokens)
    assert eager.stats().kernel_compiles_after_ready == 0, "eager start-up left a variant uncompiled"
    del eager
    graphed = _moe_engine(preset, True, dtype, backend)
    assert graphed.execution_mode == "cuda_graphs", graphed.execution_mode
    outputs, forwards = _greedy(graphed, prompts, max_tokens)
    assert {f for f, kind in forwards if kind == "decode"} == {"graph"}
    assert {f for f, kind in forwards if kind == "mixed"} == {"piecewise"}
    same = sum(a == b for a, b in zip(outputs, expected))
    print(f"{preset} {dtype} {backend}: {same} of {len(prompts)} greedy outputs equal eager's")
    assert same >= len(prompts) - 1  # padded shapes may move one near-tie
    assert graphed.stats().kernel_compiles_after_ready == 0


def test_the_reference_backend_runs_eager_on_cuda():
    engine = _moe_engine("tiny-qwen3-moe", True, "float32", "reference")
    assert engine.execution_mode.startswith("eager") and "routing on the host" in engine.execution_mode


def test_random_qwen3_30b_a3b_builds_on_device_and_decodes_in_graphs():
    config = EngineConfig(model="random:qwen3-30b-a3b", device="cuda", attention_backend="triton", seed=1,
                          max_model_len=4096)
    engine = EngineCore.from_config(config, SchedulerConfig(chunk_size=2048, max_num_seqs=64, queue_policy="fcfs"))
    assert engine.execution_mode == "cuda_graphs", engine.execution_mode
    prompts = [[(7 * i + j) % 150000 + 3 for j in range(100 + 40 * i)] for i in range(8)]
    outputs, forwards = _greedy(engine, prompts, [16] * len(prompts))
    assert all(len(o) == 16 for o in outputs)
    assert {f for f, kind in forwards if kind == "decode"} == {"graph"}
    assert engine.stats().kernel_compiles_after_ready == 0
