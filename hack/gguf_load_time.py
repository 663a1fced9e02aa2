"""Time a GGUF file's load as the server's loader does it: header, then every tensor read from the memory map and
dequantised to float32 on one torch thread. Prints one JSON object per run (header, dequantise and total
seconds, seconds and element counts per ggml type) and the minimum over the runs.

    .venv/bin/python hack/gguf_load_time.py [FILE.gguf] [--runs 3] [--reference]

FILE defaults to the Gemma 3 270M Q4_K_M file the tests use. With --reference, also times the gguf package's
numpy dequantiser on the same tensors, for comparison. Run it from the repository root as a file (not with -m).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from math import prod

import numpy as np
import torch

from metronome.server.models.gguf_dequant import dequantize, tensor_nbytes, type_name
from metronome.server.models.gguf_file import GGUFFile
from metronome.server.models.packaged_gguf import GEMMA3_270M_Q4_K_M, packaged_gguf_path


def one_run(path: str, reference: bool) -> dict:
    started = time.perf_counter()
    reader = GGUFFile(path)
    header = time.perf_counter() - started
    seconds: dict[str, float] = defaultdict(float)
    elements: dict[str, int] = defaultdict(int)
    reference_seconds = 0.0
    for tensor in reader.tensors:
        kind = type_name(tensor.ggml_type)
        shape = tuple(reversed(tensor.shape))
        begun = time.perf_counter()
        raw = reader.raw(tensor, tensor_nbytes(tensor.ggml_type, prod(tensor.shape)))
        dequantize(raw, tensor.ggml_type, shape).contiguous()
        seconds[kind] += time.perf_counter() - begun
        elements[kind] += prod(tensor.shape)
        if reference:
            from gguf.constants import GGMLQuantizationType
            from gguf.quants import dequantize as gguf_dequantize

            begun = time.perf_counter()
            gguf_dequantize(np.array(raw).reshape(shape[0], -1) if len(shape) > 1 else np.array(raw),
                            GGMLQuantizationType(tensor.ggml_type))
            reference_seconds += time.perf_counter() - begun
    total = time.perf_counter() - started
    result = {"file": path, "tensors": len(reader.tensors), "header_s": round(header, 4),
              "dequantise_s": round(sum(seconds.values()), 3), "total_s": round(total - reference_seconds, 3),
              "per_type": {kind: {"s": round(seconds[kind], 3), "elements": elements[kind]} for kind in seconds}}
    if reference:
        result["gguf_reference_s"] = round(reference_seconds, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", help="a .gguf file (default: Gemma 3 270M Q4_K_M from its packages)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reference", action="store_true", help="also time gguf's numpy dequantiser")
    args = parser.parse_args()
    path = args.file or str(packaged_gguf_path(GEMMA3_270M_Q4_K_M))
    torch.set_num_threads(1)  # as gguf_loader.gguf_weights does
    runs = [one_run(path, args.reference) for _ in range(args.runs)]
    for run in runs:
        print(json.dumps(run))
    print(json.dumps({"min_total_s": min(run["total_s"] for run in runs),
                      "min_dequantise_s": min(run["dequantise_s"] for run in runs)}))


if __name__ == "__main__":
    main()
