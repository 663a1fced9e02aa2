"""Models on CUDA: random real-size presets build fast on the device without CPU copies, and a Hugging Face
folder model matches transformers through the Triton attention backend.

Run on the GPU machine only: `pytest -q -s tests/gpu/test_models_gpu.py` (never part of CI).
"""
from __future__ import annotations

import resource
import time

import pytest
import torch

from metronome.kernels import get_backend
from metronome.kernels.metadata import AttentionMetadata
from metronome.server.models import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class DeviceCache:
    """Paged KV caches on the model's device; sequence b owns a contiguous run of blocks."""

    def __init__(self, loaded, num_seqs: int, max_len: int, block_size: int = 16):
        config, self.device, self.block_size = loaded.config, loaded.device, block_size
        self.per_seq = -(-max_len // block_size)
        shape = (num_seqs * self.per_seq, block_size, config.num_key_value_heads, config.head_dim)
        self.kv = [(torch.zeros(shape, dtype=loaded.dtype, device=self.device),
                    torch.zeros(shape, dtype=loaded.dtype, device=self.device))
                   for _ in range(config.num_hidden_layers)]
        self.tables = torch.arange(num_seqs * self.per_seq, dtype=torch.int32, device=self.device).view(num_seqs, -1)

    def metadata(self, seqs: list[int], starts: list[int], q_lens: list[int]) -> AttentionMetadata:
        seq_lens = [s + q for s, q in zip(starts, q_lens)]
        slots = [b * self.per_seq * self.block_size + p for b, s, e in zip(seqs, starts, seq_lens) for p in range(s, e)]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        as_int = dict(dtype=torch.int32, device=self.device)
        return AttentionMetadata(cu_seqlens_q=torch.tensor(cu, **as_int), seq_lens=torch.tensor(seq_lens, **as_int),
                                 block_tables=self.tables[seqs],
                                 slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
                                 max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), q_lens_host=list(q_lens),
                                 seq_lens_host=seq_lens)

    def run(self, model, seqs, starts, tokens: list[torch.Tensor]) -> torch.Tensor:
        """One forward pass: sequence seqs[i] brings tokens[i] at positions starts[i]...; returns its logits."""
        ids = torch.cat(tokens).to(self.device)
        positions = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, tokens)]).to(self.device)
        with torch.inference_mode():
            hidden = model(ids, positions, self.kv, self.metadata(seqs, starts, [len(t) for t in tokens]))
            return model.compute_logits(hidden)


def run_mixed_batch(loaded, q_lens: list[int], ctx_lens: list[int], seed: int = 0) -> torch.Tensor:
    """Cache each sequence's context alone, then one mixed pass with every sequence's new tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, loaded.config.vocab_size, (c + q,), generator=gen) for c, q in zip(ctx_lens, q_lens)]
    cache = DeviceCache(loaded, len(q_lens), max(c + q for c, q in zip(ctx_lens, q_lens)))
    for b, c in enumerate(ctx_lens):
        if c:
            cache.run(loaded.model, [b], [0], [tokens[b][:c]])
    seqs = list(range(len(q_lens)))
    return cache.run(loaded.model, seqs, ctx_lens, [t[c:] for t, c in zip(tokens, ctx_lens)])


def test_random_llama3_8b_builds_on_device_and_runs():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loaded = load_model("random:llama-3-8b", device="cuda", attention_backend="triton", seed=1)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    peak = torch.cuda.max_memory_allocated()
    rss_growth_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 2**20
    print(f"\nrandom:llama-3-8b bf16: built in {seconds:.1f} s, weights {weights / 2**30:.1f} GiB, "
          f"GPU peak {peak / 2**30:.1f} GiB, CPU RSS growth {rss_growth_gib:.2f} GiB")
    assert loaded.dtype == torch.bfloat16
    assert peak < weights * 1.05  # no float32 staging copy on the GPU
    assert rss_growth_gib < 2  # no CPU copy of the weights
    logits = run_mixed_batch(loaded, q_lens=[300, 1, 1, 17], ctx_lens=[0, 900, 31, 4])
    assert torch.isfinite(logits).all() and 0.05 < logits.std().item() < 20
    loaded.model.set_attention_backend(get_backend("torch"))
    reference = run_mixed_batch(loaded, q_lens=[300, 1, 1, 17], ctx_lens=[0, 900, 31, 4])
    # bf16 through 32 random layers: kernels that round differently drift apart a little; a bug would not be
    # "a little" (relative RMS of a wrong attention is ~1).
    relative_rms = ((logits - reference).norm() / reference.norm()).item()
    print(f"triton vs torch attention through the 8B model (bf16): relative RMS logit diff {relative_rms:.3f}")
    assert relative_rms < 0.1


def test_hf_folder_on_cuda_matches_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    torch.backends.cuda.matmul.allow_tf32 = False
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                         rope_theta=500000.0)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(tmp_path)
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>").save_pretrained(tmp_path)

    loaded = load_model(str(tmp_path), device="cuda", dtype="float32", attention_backend="triton")
    ids = torch.randint(3, 512, (1000,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = reference.cuda()(ids[None].cuda()).logits[0].float()
    cache = DeviceCache(loaded, 1, 1000)
    cache.run(loaded.model, [0], [0], [ids[:600]])  # a chunk, then the rest on top of the cached context
    got = torch.cat([cache.run(loaded.model, [0], [600], [ids[600:999]]),
                     cache.run(loaded.model, [0], [999], [ids[999:]])])
    expected = expected[600:]
    diff = (got - expected).abs().max().item()
    print(f"\nHF folder on CUDA fp32 (triton attention) vs transformers: max |logit diff| {diff:.2e}")
    assert diff < 1e-3
