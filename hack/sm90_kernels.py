"""What the Triton kernels of an FP8 decode step use on a Hopper GPU, compiled here without one: registers and
spilled bytes a thread, shared memory a block, and whether the GEMMs' software pipeline streams through shared
memory (cp.async), per kernel of one Llama-3-8B layer at each batch size.

    python3 -m hack.sm90_kernels                     # batches 1, 16 and 64
    python3 -m hack.sm90_kernels --batches 1

Nothing runs: each launch compiles with the specialisation a real one gets (metronome_testing.sm90) and returns.
Use the Triton version of the GPU machine for its numbers (its wheel first on PYTHONPATH); the compiler, not the
machine, decides them.
"""
from __future__ import annotations

import argparse
import sys

from metronome_testing.sm90 import SM90_SHARED_LIMIT, compiling_for_sm90, fp8_decode_layer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")], default=[1, 16, 64],
                        metavar="N,N")
    args = parser.parse_args(argv)
    import triton

    print(f"triton {triton.__version__}, sm_90")
    print(f"{'batch':>5}  {'kernel':<20} {'regs':>4} {'spill B':>7} {'shared B':>8} {'cp.async':>8}")
    for rows in args.batches:
        with compiling_for_sm90() as compiled:
            fp8_decode_layer(rows)
        for kernel in compiled:
            over = "  over the limit" if kernel.shared > SM90_SHARED_LIMIT else ""
            print(f"{rows:>5}  {kernel.name:<20} {kernel.registers:>4} {kernel.spilled:>7} {kernel.shared:>8} "
                  f"{kernel.async_copies:>8}{over}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
