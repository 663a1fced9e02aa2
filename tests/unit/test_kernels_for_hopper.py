"""The Triton kernels of an FP8 decode step compile for Hopper (sm_90), as a launch on an H100 / H200 would compile
them, on this GPU-less machine (metronome_testing.sm90): each fits its shared memory, none spills registers, and
the small-M GEMMs stream their weights through shared memory (cp.async) rather than through registers. Run in a
subprocess, as the interpreter tests are: the compile-only driver never leaks into the test process.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest

ROWS = [1, 64]  # a batch of one, and the most rows the small-M GEMM takes (down_proj then splits K: SPLIT_TILES)


def _compile_all() -> dict:
    from metronome_testing.sm90 import compiling_for_sm90, fp8_decode_layer

    out = {}
    for rows in ROWS:
        with compiling_for_sm90() as compiled:
            fp8_decode_layer(rows)
        out[str(rows)] = [_plain(c) for c in compiled]
    down_proj = compiled[-1]  # at 64 rows its K is split over two programs
    ptx = down_proj.kernel.asm["ptx"]
    out["split"] = {**_plain(down_proj), "ptx": [line.strip() for line in ptx.splitlines() if "atom." in line]}
    out["promotion"] = {str(every): _promotion_adds(every) for every in (None, 128)}
    return out


def _promotion_adds(every: int | None) -> dict:
    """The first small-M GEMM of a 16-row layer compiled with triton_fp8.PROMOTE_EVERY = every: its spills and
    how many float32 adds its PTX has (the promotion's: the chained accumulation has none)."""
    from metronome.kernels import triton_fp8
    from metronome_testing.sm90 import compiling_for_sm90, fp8_decode_layer

    triton_fp8.PROMOTE_EVERY = every
    try:
        with compiling_for_sm90() as compiled:
            fp8_decode_layer(16)
    finally:
        triton_fp8.PROMOTE_EVERY = None
    gemm = next(c for c in compiled if c.name == "_fp8_skinny")
    return {"spilled": gemm.spilled, "adds": len(re.findall(r"\badd(\.rn)?\.f32\b", gemm.kernel.asm["ptx"]))}


def _plain(kernel) -> dict:
    return {f.name: getattr(kernel, f.name) for f in fields(kernel) if f.name != "kernel"}


@pytest.fixture(scope="module")
def compiled() -> dict:
    # no interpreter, and Triton's FP-fusion default left to what importing metronome.kernels sets
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"compiling for sm_90 failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("rows", ROWS)
def test_the_fp8_decode_kernels_compile_for_hopper(compiled, rows):
    from metronome_testing.sm90 import SM90_SHARED_LIMIT

    kernels = compiled[str(rows)]
    # qkv, o, gate_up and down as small-M GEMMs, the norms, rope with the KV write, the row quantisation of
    # o_proj's input, SiLU·mul
    assert [k["name"] for k in kernels] == ["_add_rms_norm_fp8", "_fp8_skinny", "_rope_write_kv", "_quantize_rows",
                                            "_fp8_skinny", "_add_rms_norm_fp8", "_fp8_skinny", "_silu_mul_fp8",
                                            "_fp8_skinny"]
    for kernel in kernels:
        assert kernel["shared"] <= SM90_SHARED_LIMIT, kernel
        assert kernel["spilled"] == 0, kernel
        assert kernel["fp_fusion"], kernel  # as every kernel was timed, whatever Triton's own default
        if kernel["name"] == "_fp8_skinny":
            assert kernel["async_copies"] > 0, kernel


@pytest.mark.parametrize("preset", [None, "0"])
def test_importing_the_kernels_keeps_fp_fusion_on_unless_the_user_chose(monkeypatch, preset):
    """Triton 3.10 stops contracting multiplies and adds into FMAs by default; the kernels were timed with it, so
    importing metronome.kernels sets that default, and leaves a value the user set alone."""
    import importlib

    import metronome.kernels

    if preset is None:
        monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    else:
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", preset)
    importlib.reload(metronome.kernels)
    assert os.environ["TRITON_DEFAULT_FP_FUSION"] == (preset or "1")


def test_split_k_compiles_with_an_ordered_arrival(compiled):
    """down_proj at 64 rows (split K): the fix-up's arrival is one acquire-release atomic (the partial sums of the
    other program visible to the last one), and the split kernel still streams through shared memory without
    spilling."""
    got = compiled["split"]
    assert got["spilled"] == 0 and got["async_copies"] > 0, got
    assert any("atom.global.gpu.acq_rel.add" in line for line in got["ptx"]), got["ptx"]


def test_promoting_the_fp8_accumulation_compiles_its_float32_adds(compiled):
    """Off by default (Hopper's chained FP8 accumulation: no float32 add in the K loop); PROMOTE_EVERY = 128 adds
    the tensor cores' partial sums into float32 (two adds a 256-column K step) without spilling."""
    chained, promoted = compiled["promotion"]["None"], compiled["promotion"]["128"]
    assert chained["adds"] == 0 and promoted["adds"] > 0, compiled["promotion"]
    assert promoted["spilled"] == 0


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
