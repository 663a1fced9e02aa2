"""Qwen3, Gemma 3 (with and without logit softcapping) and Phi-3 (LongRoPE, partial rotary) against transformers,
fp32 on the CPU: tiny random models made with transformers' config classes, saved as safetensors and loaded by
both. Prompts cross the layers' sliding window (20 tokens; Phi-3's 24). For Phi-3 they also cross its original
context (64): prompts longer than it turn with LongRoPE's long factors from the start, and generations that cross
it are recomputed with them, as transformers does.

- logits of a whole prompt equal transformers' within 1e-4;
- the engine's greedy tokens equal transformers' generate() for 8 prompts x 32 tokens, for chunk sizes that do
  not divide the window (7, 13) and unchunked, block sizes 4 and 16, prefix caching off, cold and warm.

A divergence is accepted only where transformers' top-2 logits at that step are within 1e-4 (a near tie that
summation order may break either way); nothing after it is compared.
"""
from __future__ import annotations

import pytest
import torch
from family_models import FAMILIES, VOCAB, save_hf_model
from test_model_exact import PagedCache

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams
from metronome.server.models import load_model

NEW_TOKENS = 32
TIE = 1e-4
PROMPT_LENS = [3, 9, 19, 21, 33, 47, 70, 90]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_model(folder, FAMILIES[request.param]())
    ours = load_model(f"hf-dir:{folder}", dtype="float32", device="cpu", attention_backend="torch")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENS]
    reference = [hf_generate(hf_model, p) for p in prompts]
    return request.param, hf_model, ours, prompts, reference


def hf_generate(hf_model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([step[0].float() for step in out.logits])


def assert_same_greedy(label: str, reference, got: list[list[int]]) -> None:
    for b, ((want, steps), have) in enumerate(zip(reference, got)):
        if want == have:
            continue
        i = next(k for k, (x, y) in enumerate(zip(want, have)) if x != y)
        top2 = steps[i].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE, f"{label}: prompt {b} diverges at token {i} ({want[i]} vs {have[i]}), top-2 gap {gap:.3g}"


def engine(loaded, chunk: int, block_size: int, prefix: bool) -> EngineCore:
    config = EngineConfig(device="cpu", block_size=block_size, num_kv_blocks=4096 // block_size,
                          enable_prefix_caching=prefix)
    return EngineCore(loaded, config, SchedulerConfig(chunk_size=chunk, queue_policy="fcfs", max_num_seqs=64))


def test_prefill_logits_match_transformers(family):
    name, hf_model, ours, prompts, _ = family
    ids = prompts[-1]
    cache = PagedCache(ours.config, 1, len(ids))
    positions = torch.arange(len(ids))
    switch = ours.model.long_rope_from
    if switch is not None and len(ids) > switch:  # LongRoPE: a sequence this long reads the long-factor rows
        positions = positions + ours.model.rope_long_offset
    with torch.inference_mode():
        hidden = ours.model(torch.tensor(ids), positions, cache.kv, cache.metadata([0], [len(ids)]))
        mine = ours.model.compute_logits(hidden)
        expected = hf_model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(mine, expected, rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("chunk,block_size,prefix", [(100_000, 16, True), (7, 4, True), (13, 16, False)])
def test_engine_greedy_matches_transformers(family, chunk, block_size, prefix):
    name, _, ours, prompts, reference = family
    core = engine(ours, chunk, block_size, prefix)
    results = core.generate(prompts, GREEDY)
    assert_same_greedy(f"{name} chunk {chunk} block {block_size}", reference, [r.token_ids for r in results])
    core.check_no_leaks()
    if prefix:  # again on the warm prefix cache: hits cover prompts longer than the window
        seqs = [core._seqs[core.add_request(p, GREEDY)] for p in prompts]
        while core.has_unfinished():
            core.step()
        assert any(s.num_cached_tokens >= 2 * block_size for s in seqs)
        assert_same_greedy(f"{name} chunk {chunk} block {block_size} warm", reference,
                           [s.output_token_ids for s in seqs])
        core.check_no_leaks()


@pytest.mark.parametrize("name,num_kv_blocks", [("gemma3", 48), ("mistral", 12)])
def test_a_long_prompt_runs_in_a_cache_smaller_than_its_context(name, num_kv_blocks, tmp_path):
    """600 tokens of context in a cache that could not hold them if window layers kept every block: the full
    layers' group holds every token (38 blocks of 16), window groups only their window; the output is
    still transformers'."""
    config = FAMILIES[name]()
    config.max_position_embeddings = 1024
    hf_model = save_hf_model(tmp_path, config)
    ours = load_model(f"hf-dir:{tmp_path}", dtype="float32", device="cpu", attention_backend="torch")
    prompt = torch.randint(3, VOCAB, (590,), generator=torch.Generator().manual_seed(9)).tolist()
    want = hf_generate(hf_model, prompt)
    core = EngineCore(ours, EngineConfig(device="cpu", block_size=16, num_kv_blocks=num_kv_blocks, watermark=0.0),
                      SchedulerConfig(chunk_size=23, queue_policy="fcfs"))
    assert core.block_manager.max_admissible_tokens() >= len(prompt) + NEW_TOKENS
    seq = core._seqs[core.add_request(prompt, GREEDY)]
    peak = 0
    while core.has_unfinished():
        core.step()
        peak = max(peak, core.block_manager.num_used_blocks)
    assert_same_greedy(f"{name} long prompt", [want], [seq.output_token_ids])
    assert peak <= num_kv_blocks < len(core.block_manager.windows) * -(-(len(prompt) + NEW_TOKENS) // 16)
    core.check_no_leaks()


def test_the_text_model_of_a_multimodal_gemma3_checkpoint_loads(tmp_path):
    """A `gemma3` (image-text) folder: its text_config and `language_model.*` weights are served, the vision tower
    is skipped; text-only logits equal Gemma3ForConditionalGeneration's."""
    from family_models import gemma3_config, write_tokenizer
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=gemma3_config().to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=5, boi_token_index=6, eoi_token_index=7)
    torch.manual_seed(0)
    hf_model = Gemma3ForConditionalGeneration(config).eval()
    hf_model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    ours = load_model(f"hf-dir:{tmp_path}", dtype="float32", device="cpu", attention_backend="torch")
    assert ours.config.architecture == "gemma3"
    ids = list(range(10, 60))
    cache = PagedCache(ours.config, 1, len(ids))
    with torch.inference_mode():
        hidden = ours.model(torch.tensor(ids), torch.arange(len(ids)), cache.kv, cache.metadata([0], [len(ids)]))
        expected = hf_model(input_ids=torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(ours.model.compute_logits(hidden), expected, rtol=0, atol=1e-4)
