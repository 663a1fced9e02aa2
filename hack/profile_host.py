"""Host time of engine steps on the CPU: `python hack/profile_host.py [--batch 64] [--steps 60] [--profile]`.

Builds random:tiny (a cheap model: its forward is not what is measured), fills `--batch` sequences, then times
pure decode steps and prints the median host/scheduler time per step (`StepStats.scheduler_overhead_s`: schedule +
input prep + token emission, not the forward) and, with --profile, the functions that take it.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--graphs", action="store_true",
                        help="decode through the CUDA-graph input path (recorded capture: the CPU stand-in)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # the forward is not measured; keep it from crowding the host work on a busy CPU
    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.sampling import SamplingParams

    config = EngineConfig(model="random:tiny", device="cpu", attention_backend="torch", num_kv_blocks=4096)
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=8192, max_num_seqs=args.batch))
    if args.graphs:
        from metronome.server.engine.cuda_graphs import GraphRunner, capture_recorded, capture_sizes, single_class

        runner = core.runner
        graphs = GraphRunner(runner.graph_forward, capture_sizes(args.batch), runner.mirror.cols, runner.scratch_block,
                             runner.device, single_class(core.max_model_len), capture_recorded,
                             refresh_host_facts=True)
        graphs.capture_all()
        runner.attach_graphs(graphs)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 20, temperature=0.0, ignore_eos=True)
    for _ in range(args.batch):
        core.add_request([rng.randrange(3, 500) for _ in range(args.prompt_len)], params)
    while any(s.is_prefilling for s in core.live_sequences()) or len(core.live_sequences()) < args.batch:
        core.step()
    for _ in range(3):
        core.step()
    profiler = cProfile.Profile() if args.profile else None
    overheads = []
    for _ in range(args.steps):
        if profiler:
            profiler.enable()
        _, stats = core.step()
        if profiler:
            profiler.disable()
        assert stats.num_decode_tokens == args.batch and not stats.num_prefill_tokens
        assert stats.cuda_graph == args.graphs
        overheads.append(stats.scheduler_overhead_s)
    print(f"batch {args.batch}: host time per decode step, median {statistics.median(overheads) * 1e3:.3f} ms "
          f"(min {min(overheads) * 1e3:.3f} ms) over {args.steps} steps")
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats("server/(engine|models/tokenizer)", 30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
