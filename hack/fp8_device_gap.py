"""How far one model's logits move between the GPU and the CPU on the same weights, in bf16 and with FP8 weights:
a check that the CUDA FP8 path computes what the CPU's float32 emulation does, up to summation order.

    python3 -c "import runpy, sys; sys.argv = ['x', '--out', 'gap.json', 'random:gemma-3-270m', 'random:tiny']; \\
                runpy.run_path('hack/fp8_device_gap.py', run_name='__main__')"   # on the GPU machine

(The runpy form keeps the repo root off sys.path at start-up, where its operator/ would shadow the standard
library's.) Per model and dtype: the engine is built on CUDA, its state dict copied into the same engine built on
the CPU, and one 80-token sequence (random token ids, seed 0) prefilled whole on each; reported: mean and largest
|Δ logit| of CUDA (fused element-wise kernels, and with them off) against the CPU, and the largest |logit|.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.models.quant.kv_scales import whole_prefill_scratch

TOKENS = 80


def engine(model: str, device: str, quantization: str | None) -> EngineCore:
    config = EngineConfig(model=model, device=device, dtype="bfloat16",
                          attention_backend="triton" if device == "cuda" else "torch", block_size=16,
                          num_kv_blocks=512, seed=3, cuda_graphs=False, quantization=quantization)
    return EngineCore.from_config(config, SchedulerConfig(chunk_size=2048, max_num_seqs=8, queue_policy="fcfs"))


def logits(core: EngineCore, ids: list[int], fused: bool | None = None) -> torch.Tensor:
    loaded = core.loaded
    loaded.model.fused = fused
    caches, meta = whole_prefill_scratch(loaded.config, len(ids), 16, core.runner.kv_caches[0][0].dtype,
                                         loaded.device)
    tokens = torch.tensor(ids, device=loaded.device)
    with torch.inference_mode():
        hidden = loaded.model(tokens, torch.arange(len(ids), device=loaded.device), caches, meta)
        return loaded.model.compute_logits(hidden).float().cpu()


def gap(model: str, quantization: str | None) -> dict:
    on_cuda = engine(model, "cuda", quantization)
    ids = torch.randint(0, on_cuda.loaded.config.vocab_size, (TOKENS,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    runs = {"cuda": logits(on_cuda, ids), "cuda_unfused": logits(on_cuda, ids, fused=False)}
    on_cpu = engine(model, "cpu", quantization)
    on_cpu.loaded.model.load_state_dict({k: v.cpu() for k, v in on_cuda.loaded.model.state_dict().items()})
    base = logits(on_cpu, ids)
    return {"logit_absmax": base.abs().max().item(),
            **{name: {"mean_abs": (x - base).abs().mean().item(), "max_abs": (x - base).abs().max().item()}
               for name, x in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model specs, e.g. random:gemma-3-270m")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    from metronome.server.bench.load.results import environment

    result = {"environment": environment(), "tokens": TOKENS, "gaps": {}}
    for model in args.models:
        for quantization in (None, "fp8"):
            key = f"{model} {quantization or 'bf16'}"
            result["gaps"][key] = gap(model, quantization)
            print(key, json.dumps(result["gaps"][key]), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
