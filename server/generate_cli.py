"""`metronome generate`: run prompts concurrently through the engine and print the completions.

    metronome generate --prompt "The capital of France is" --prompt "def fib(n):" --max-tokens 32 --json
"""
from __future__ import annotations

import argparse
import json
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    from metronome.server.engine.flags import add_engine_flags, add_scheduler_flags

    parser.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                        help="a prompt; repeat for several (they run concurrently)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    parser.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                        help="per-request sampling seed (the engine's own seed stays 0)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string; repeatable")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt per line, in order")
    add_engine_flags(parser.add_argument_group("engine"), skip=("seed",))  # --seed above is the requests'
    add_scheduler_flags(parser.add_argument_group("scheduler"))


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
    from metronome.contract.errors import InvalidRequestError
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.flags import engine_config_from_args, scheduler_from_args
    from metronome.server.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    params.validate()  # fail before the (slow) model load
    if any(p == "" for p in args.prompt):
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    scheduler = scheduler_from_args(args)
    config = engine_config_from_args(args)
    engine = EngineCore.from_config(config, scheduler)
    try:
        if args.chat:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompt]
        else:
            prompts = [engine.tokenizer.encode(p) for p in args.prompt]
        return engine.generate(prompts, params), prompts
    finally:
        engine.close()
