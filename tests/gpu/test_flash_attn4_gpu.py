"""FlashAttention-4 (`flash_attn.cute`) on the GPU against the torch reference: paged caches of several page sizes,
GQA groups, chunked and mixed batches, sliding windows, softcap and learned sinks, in bf16; an engine with
`--attention-backend flash_attn` serving a mixed workload with its mixed steps on piecewise graphs; the per-class
backend routing a mixed batch to FA4 and a captured decode to Triton.

Run on the GPU machine with FA4 installed (hack/gpu_mixed.sh carries its wheels): skipped where it is absent or
the GPU is older than Hopper.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from metronome.kernels.flash_attn_backend import MIN_CAPABILITY, fa4_importable
from metronome_testing.random_batch import make_paged_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < MIN_CAPABILITY,
                       reason="FA4 needs compute capability 9.0 or newer"),
    pytest.mark.skipif(not fa4_importable(), reason="FlashAttention-4 (flash_attn.cute) is not installed"),
]

# (name, q_lens, ctx_lens, block_size, n_kv_heads, group, head_dim)
SHAPES = [
    ("llama3_mixed_chunk512", [1] * 31 + [512], [100 + 61 * i for i in range(31)] + [1536], 16, 8, 4, 128),
    ("llama3_decode_b64_2k", [1] * 64, [2047 - 13 * i for i in range(64)], 16, 8, 4, 128),
    ("llama3_chunks_page128", [300, 77, 129], [0, 1000, 63], 128, 8, 4, 128),
    ("gqa7_d64_page64", [33, 1, 1], [500, 700, 5], 64, 2, 7, 64),
    ("gemma_d256", [1, 1, 40], [900, 31, 200], 16, 1, 4, 256),
]


def _reference_and_fa4(shape, window=None, softcap=None, sinks=False):
    from metronome.kernels import get_backend

    name, q_lens, ctx_lens, block_size, n_kv, group, head_dim = shape
    # Unused cache rows hold a large finite value, not NaN: with pages of one key tile (128) FA4 loads whole pages
    # by TMA and masks the rows past a sequence's end, and 0 x NaN would still be NaN (the engine's cache starts
    # zeroed and only ever holds finite K/V). A masking error still shows: those rows would dominate.
    batch = make_paged_batch(q_lens, ctx_lens, block_size, n_kv, group, head_dim, dtype=torch.bfloat16,
                             device="cuda", seed=len(name), poison=1000.0)
    flash, reference = get_backend("flash_attn"), get_backend("torch")
    flash.write_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    sink = torch.randn(n_kv * group, device="cuda") if sinks else None
    scale = 1.0 / math.sqrt(head_dim)
    got = flash.attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window=window, softcap=softcap,
                          sinks=sink)
    expected = reference.attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window=window,
                                   softcap=softcap, sinks=sink)
    return got.float(), expected.float()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_fa4_matches_the_reference(shape):
    got, expected = _reference_and_fa4(shape)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window,softcap,sinks", [(64, None, False), (None, 30.0, False), (128, None, True)])
def test_fa4_windows_softcap_and_sinks_match_the_reference(window, softcap, sinks):
    got, expected = _reference_and_fa4(SHAPES[0], window=window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_per_class_routing_sends_a_mixed_batch_to_fa4_and_captured_decodes_to_triton():
    from metronome.kernels import get_backend
    from metronome.kernels.attention_choice import parse_table

    table = parse_table({"choice": {"mixed": "flash_attn", "decode_medium": "flash_attn"},
                         "measured": {"date": "test"}})
    auto = get_backend("auto", table=table)
    q = torch.zeros(3, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    batch = make_paged_batch([1, 1, 40], [30, 5, 0], 16, 8, 4, 128, dtype=torch.bfloat16, device="cuda", seed=1)
    assert auto.backend_for(batch.q, batch.k_cache, batch.meta) is auto.flash
    decodes = make_paged_batch([1] * 20, [30] * 20, 16, 8, 4, 128, dtype=torch.bfloat16, device="cuda", seed=2)
    assert auto.backend_for(decodes.q, decodes.k_cache, decodes.meta) is auto.flash
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chosen = auto.backend_for(decodes.q, decodes.k_cache, decodes.meta)
    assert chosen is auto.triton  # inside a capture
    assert auto.backend_for(q.float(), k.float(), batch.meta) is auto.triton  # fp32: FA4 has no kernels


def test_an_engine_on_fa4_serves_mixed_steps_on_piecewise_graphs():
    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.sampling import SamplingParams

    def engine(backend: str) -> EngineCore:
        config = EngineConfig(model="random:tiny", device="cuda", dtype="bfloat16", attention_backend=backend,
                              block_size=16, num_kv_blocks=2048, seed=3, enable_prefix_caching=False)
        return EngineCore.from_config(config, SchedulerConfig(chunk_size=256, max_num_seqs=16, queue_policy="fcfs"))

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 600))] for _ in range(10)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    fa4 = engine("flash_attn")
    assert fa4.execution_mode.startswith("cuda_graphs: mixed steps only"), fa4.execution_mode
    got = [r.token_ids for r in fa4.generate(prompts, params)]
    expected = [r.token_ids for r in engine("triton").generate(prompts, params)]
    # bf16 through two kernels that round differently: a random model's near-ties may flip a token now and then.
    assert sum(g == e for g, e in zip(got, expected)) >= len(expected) - 2, (got, expected)
