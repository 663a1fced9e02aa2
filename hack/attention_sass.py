"""The decode attention kernel's machine code for Hopper, compiled here without a GPU: its instruction mix per tile
config and FP8 V read mode, to see what a variant costs before spending device time on timing it.

    python3 -m hack.attention_sass                          # the FP8 cache's read modes at the busy decode tiles
    python3 -m hack.attention_sass --kv bf16 --v-read 0     # one variant
    python3 -m hack.attention_sass --dump /tmp/sass         # also write each variant's TTGIR, PTX and SASS

Triton compiles for sm_90 on any machine (its bundled ptxas and cuobjdump); nothing runs. The decode kernel is
compiled as `paged_attention` launches it for a Llama-3-8B layer (32 query heads over 8 kv heads, head_dim 128,
page 16, no splits). What to read: LDS/STS (shared-memory loads and stores: an 8-bit tile read byte by byte shows
as many LDS), LDSM (ldmatrix), HMMA (tensor-core steps), F2FP/PRMT (conversions and byte shuffles), LDL/STL
(register spills). Counts are static (instructions in the binary, each loop body once per copy the compiler made),
not executed counts: compare variants with each other, not with a time.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

from metronome_testing.sm90 import cuobjdump, registers_and_spills

KEEP = ("LDS", "STS", "LDSM", "LDG", "LDGSTS", "HMMA", "F2FP", "PRMT", "LDL", "STL", "IMAD", "BAR")


def compile_decode(kv: str, decode_block_n: int, num_warps: int, num_stages: int, v_read: int,
                   max_registers: int = 0):
    """The decode-only variant of `_paged_attention` for sm_90, as Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from metronome.kernels import triton_attention as ta

    cache_type = "*fp8e4nv" if kv == "fp8" else "*bf16"
    pointers = {"q_ptr": "*bf16", "k_cache_ptr": cache_type, "v_cache_ptr": cache_type, "out_ptr": "*bf16",
                "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "cu_seqlens_q_ptr": "*i32",
                "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "sinks_ptr": "*bf16",
                "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    constants = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=128, D_PAD=128, PAGE=16, BLOCK_Q=16, BLOCK_M=64, BLOCK_N=64,
                     DECODE_BLOCK_M=16, DECODE_BLOCK_N=decode_block_n, HAS_CHUNKS=False, NUM_SPLITS=1,
                     DOT_PRECISION="tf32", UPCAST_DOT=False, WINDOW=0, SOFTCAP=False, HAS_SINKS=False,
                     KV_FP8=ta.FP8_IN_FP16 if kv == "fp8" else 0, V_READ=v_read if kv == "fp8" else 0)
    fn = ta._paged_attention
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in ("scale_log2", "softcap") else "i32"
        # what a launch specialises: pointers and the cache's strides divisible by 16
        if name in pointers or (name.startswith("stride_") and name != "stride_bt"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **({"maxnreg": max_registers} if max_registers else {})))


def sass_of(kernel) -> str:
    return cuobjdump(kernel, "-sass")


def first_loop(sass: str) -> collections.Counter:
    """The instruction mix of the first loop body (up to the first backward branch): the decode kernel's key
    loop over tiles wholly before the query, the one a long context spends its time in."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)
    for address, opcode, operands in lines:
        target = re.search(r"0x([0-9a-f]+)", operands)
        if opcode.startswith("BRA") and target and int(target.group(1), 16) < int(address, 16):
            start, end = int(target.group(1), 16), int(address, 16)
            return collections.Counter(op.split(".")[0] for a, op, _ in lines if start <= int(a, 16) <= end)
    return collections.Counter()


def instruction_mix(sass: str) -> collections.Counter:
    """Opcode (without modifiers) -> count, over the instructions of a cuobjdump listing."""
    opcodes = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    return collections.Counter(op.split(".")[0] for op in opcodes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument("--v-read", type=int, action="append", help="V read mode(s) (default: every mode)")
    parser.add_argument("--decode-block-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=2)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--max-registers", type=lambda text: [int(c) for c in text.split(",")], default=[0],
                        metavar="N,N", help="register caps a thread (ptxas .maxnreg; 0: the compiler's choice)")
    parser.add_argument("--dump", help="a folder for each variant's ttgir, ptx and sass")
    args = parser.parse_args(argv)
    from metronome.kernels import triton_attention as ta
    modes = args.v_read or ([ta.V_AS_LOADED, ta.V_ASM, ta.V_CONVERTED_FIRST] if args.kv == "fp8"
                            else [ta.V_AS_LOADED])
    print(f"decode tiles: {args.decode_block_n} keys, {args.warps} warps, {args.stages} stages, {args.kv} cache")
    print("regs: registers a thread (cap), stack: spill bytes a thread; loop: instructions of the first key loop")
    print(f"{'v_read':>6} {'regs':>9} {'stack':>5} {'smem':>7} {'total':>6} {'loop':>5} {'lp LDL':>6} "
          + " ".join(f"{op:>6}" for op in KEEP))
    for mode in modes:
        for cap in args.max_registers:
            kernel = compile_decode(args.kv, args.decode_block_n, args.warps, args.stages, mode, cap)
            sass = sass_of(kernel)
            mix, loop = instruction_mix(sass), first_loop(sass)
            registers, stack = registers_and_spills(kernel)
            print(f"{mode:>6} {registers:>4} ({cap or '-':>3}) {stack:>5} {kernel.metadata.shared:>7} "
                  f"{sum(mix.values()):>6} {sum(loop.values()):>5} {loop.get('LDL', 0):>6} "
                  + " ".join(f"{mix.get(op, 0):>6}" for op in KEEP))
            if args.dump:
                out = Path(args.dump)
                out.mkdir(parents=True, exist_ok=True)
                stem = f"decode_{args.kv}_{args.decode_block_n}_{args.warps}w{args.stages}s_v{mode}_r{cap}"
                for ext in ("ttgir", "ptx"):
                    (out / f"{stem}.{ext}").write_text(kernel.asm[ext])
                (out / f"{stem}.sass").write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
