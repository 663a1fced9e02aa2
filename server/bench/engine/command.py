"""`metronome bench engine`: the in-process engine against the hardware floor and against transformers.

One run, one JSON: device copy bandwidth and matmul peak (measured; bf16, and FP8 on GPUs with FP8 tensor
cores), decode step time per batch size vs the HBM floor, prefill tokens/s vs the matmul peak, host/scheduler share
of a step, output tokens/s with the KV cache full vs its floor (saturation.py), the long-short workload per chunk
size and rate (capacity = highest rate with TBT p99 <= SLO), and transformers' continuous batching on the same
batch of requests. `targets` compares the numbers with the engine's goals (TARGETS); it reports, it does not assert.
With `--quantization fp8` / `--kv-cache-dtype fp8` the floors count FP8 weights (and their scales) and an FP8 KV
cache at their byte widths, and prefill is held against the FP8 matmul peak measured in the same run.

Every size is a flag, so `--model random:tiny --device cpu` with tiny sizes runs in seconds (the CPU smoke test).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import sys
from typing import Any

from metronome.contract.errors import InvalidRequestError, MetronomeError
from metronome.server.bench.engine import gpu_state, sections
from metronome.server.bench.load.inprocess import sampler_for_engine
from metronome.server.bench.load.results import RunEntry, environment, write_json
from metronome.server.bench.load.run_output import args_config, plot_entries
from metronome.server.bench.load.runner import StopRule
from metronome.server.bench.load.workloads import LongShortSpec, WorkloadSpec, iter_requests, take
from metronome.server.engine.flags import engine_config_from_args, scheduler_from_args

SECTIONS = ("device", "decode", "prefill", "saturation", "longshort", "hf")

# The engine's goals on the H200, each against its physical floor or its peer: (key, description, comparison,
# threshold).
TARGETS = (
    ("decode_b64_ratio_to_floor", "decode step at batch 64 / HBM floor", "<=", 1.3),
    ("decode_b1_ratio_to_floor", "decode step at batch 1 / HBM floor", "<=", 1.35),
    ("prefill_share_of_matmul_peak", "prefill FLOP/s / measured matmul peak", ">=", 0.6),
    ("chunk512_tbt_p99_ms_at_highest_rate", "TBT p99 with chunk 512 at the highest rate (ms)", "<=", 30.0),
    ("chunk512_throughput_cost_vs_unchunked", "throughput lost by chunk 512 vs unchunked", "<=", 0.10),
    ("chunk512_capacity_ratio_vs_unchunked", "capacity (rate at TBT p99 <= SLO), chunk 512 / unchunked", ">=", 2.0),
    ("output_tokens_per_s_ratio_vs_transformers", "output tok/s on the same batch / transformers", ">=", 10.0),
    ("host_overhead_share_b64", "host/scheduler time share of a decode step at batch 64", "<=", 0.10),
)


class EngineBenchArgsError(MetronomeError):
    """Flags that cannot work together."""


def _find(rows: list[dict], key: str, value: Any) -> dict | None:
    return next((r for r in rows if r.get(key) == value), None)


def target_values(doc: dict[str, Any]) -> dict[str, float | None]:
    """The measured value behind each target, where the run measured it. Pure."""
    decode = doc.get("decode") or []
    capacity = (doc.get("longshort") or {}).get("capacity") or []
    b64, b1 = _find(decode, "batch", 64), _find(decode, "batch", 1)
    c512 = _find(capacity, "chunk_size", 512)
    batch = (doc.get("batch_comparison") or {})
    return {
        "decode_b64_ratio_to_floor": (b64 or {}).get("ratio_to_floor"),
        "decode_b1_ratio_to_floor": (b1 or {}).get("ratio_to_floor"),
        "prefill_share_of_matmul_peak": (doc.get("prefill") or {}).get("share_of_matmul_peak"),
        "chunk512_tbt_p99_ms_at_highest_rate": (c512 or {}).get("tbt_p99_ms_at_highest_rate"),
        "chunk512_throughput_cost_vs_unchunked": (c512 or {}).get("throughput_cost_vs_unchunked"),
        "chunk512_capacity_ratio_vs_unchunked": (c512 or {}).get("capacity_ratio_vs_unchunked"),
        "output_tokens_per_s_ratio_vs_transformers": batch.get("output_tokens_per_s_ratio"),
        "host_overhead_share_b64": (b64 or {}).get("scheduler_overhead_share"),
    }


def evaluate_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    values = target_values(doc)
    out = []
    for key, description, op, threshold in TARGETS:
        value = values.get(key)
        met = None if value is None else (value <= threshold if op == "<=" else value >= threshold)
        out.append({"key": key, "description": description, "target": f"{op} {threshold:g}", "value": value,
                    "met": met})
    return out


def _resolve_device(name: str) -> Any:
    from metronome.server.models.device import resolve_device

    try:
        return resolve_device(name)
    except InvalidRequestError as exc:
        raise EngineBenchArgsError(f"{exc}; for a CPU smoke run pass --device cpu --model random:tiny with small "
                                   "sizes (see docs/bench.md)") from None


def _check_args(args: argparse.Namespace) -> list[str]:
    chosen = [s.strip() for s in args.sections]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise EngineBenchArgsError(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    if args.plot and "longshort" not in chosen:
        raise EngineBenchArgsError("--plot draws the longshort section's runs: add longshort to --sections")
    modes = {v for v in args.mixed_overlap_variants or () if v != "off"}
    if len(modes) > 1:
        raise EngineBenchArgsError(f"--mixed-overlap-variants: one mode besides off per engine, got {sorted(modes)}")
    if args.saturation_max_requests is None:
        from metronome.server.engine.cuda_graphs import CAPTURE_SIZES

        args.saturation_max_requests = CAPTURE_SIZES[-1]  # every batch up to it can replay a decode graph
    return chosen


def _engine_sections(args: argparse.Namespace, chosen: list[str], doc: dict[str, Any]) -> None:
    """Everything that needs our engine; the engine is released when this returns (before transformers runs)."""
    from metronome.server.engine.engine import EngineCore
    from metronome.server.engine.serving_process import freeze_startup_heap, shorten_gil_switch

    max_num_seqs = max([scheduler_from_args(args).max_num_seqs, *args.batch_sizes])  # room for every batch
    # Decode CUDA graphs are captured at start-up for batches up to the starting max_num_seqs: saturation's batch
    # must be covered then (the sections reconfigure max_num_seqs later, which captures nothing).
    startup_seqs = max(max_num_seqs, args.saturation_max_requests if "saturation" in chosen else 0)
    if {"longshort", "hf"} & set(chosen):
        # These send the same seeded prompts once per chunk size (and rate): with prefix caching every run after
        # the first finds them cached and measures the cache (the H200 batch at chunk 512 after 2048: TTFT 42 ms).
        args.enable_prefix_caching = False
    if args.mixed_overlap_variants and "longshort" in chosen:
        # its graphs are captured at start; each run switches it on or off (_check_args: one mode besides off)
        args.mixed_overlap = next((v for v in args.mixed_overlap_variants if v != "off"), "off")
    core = EngineCore.from_config(engine_config_from_args(args), scheduler_from_args(args, max_num_seqs=startup_seqs))
    # As `serve` runs it: a frozen start-up heap and, on a GPU, a short GIL switch interval (the long-short load
    # runs on an event loop beside the engine thread); without them the runs' TBT tails had collections and
    # 5 ms GIL waits that a server never sees.
    switch_interval = sys.getswitchinterval()
    gil = shorten_gil_switch(core.runner.device.type)
    frozen = freeze_startup_heap()
    config = core.loaded.config
    dtype = core.loaded.dtype
    dtype_bytes = byte_widths(core)
    sampler = sampler_for_engine(core)
    doc["model"] = {
        "name": core.model_name, "dtype": str(dtype).replace("torch.", ""), "device": str(core.loaded.device),
        "tensor_parallel_size": core.config.tensor_parallel_size,
        "prefix_caching": core.config.enable_prefix_caching,
        "parameters": config.num_parameters(), "kv_blocks": core.block_manager.num_blocks,
        "quantization": None if core.loaded.quantization is None else core.loaded.quantization.describe(),
        "kv_cache_dtype": str(core.runner.kv_caches[0][0].dtype).replace("torch.", ""),
        "bytes_per_element": dataclasses.asdict(dtype_bytes),
        "block_size": core.block_manager.block_size, "max_model_len": core.max_model_len,
        "weights_read_per_decode_step_bytes": sections.model_math.weights_read_per_decode_step(config, dtype_bytes),
        "kv_bytes_per_token": sections.model_math.kv_bytes_per_token(config, dtype_bytes),
        # "cuda_graphs" when decode steps replay captured graphs, else "eager: <why>"
        "execution_mode": getattr(core, "execution_mode", "eager"),
        "cuda_graph_capture_s": getattr(core.runner, "graph_capture_s", None),
        # decode batches above the largest size replay no decode graph (piecewise graphs or eager instead)
        "max_num_seqs_at_start": startup_seqs,
        "decode_graph_sizes": getattr(getattr(core.runner, "graphs", None), "sizes", None),
        "mixed_overlap": core.overlap_mode,
        "serving_process": {"frozen_objects": frozen, "gil_switch_interval_s": sys.getswitchinterval(),
                            "gil_switch_shortened": gil},
        "attention": core.attention_description if hasattr(core, "attention_description") else None,
    }
    device_info = doc.get("device") or {}
    bandwidth = device_info.get("copy", {}).get("bandwidth_bytes_per_s")
    progress = not args.no_progress
    gpu = gpu_state.gpu_target(core.loaded.device)
    if "decode" in chosen:
        with gpu_state.watch(gpu) as state:
            doc["decode"] = sections.decode_section(core, args.batch_sizes, args.context, args.decode_steps, sampler,
                                                    args.seed, args.prefill_chunk, bandwidth, dtype_bytes)
        _record_gpu_state(doc, "decode", state)
    if "prefill" in chosen:  # against the peak of the GEMMs this model runs: FP8 layers, FP8 tensor cores
        peak_key = "fp8_matmul_tflops" if core.loaded.quantization is not None else "matmul_tflops"
        with gpu_state.watch(gpu) as state:
            doc["prefill"] = sections.prefill_section(core, args.prefill_prompt_len, args.prefill_prompts,
                                                      args.prefill_chunk, sampler, args.seed,
                                                      device_info.get(peak_key))
        doc["prefill"]["matmul_peak"] = peak_key
        _record_gpu_state(doc, "prefill", state)
    if "saturation" in chosen:
        from metronome.server.bench.engine.saturation import saturation_section

        with gpu_state.watch(gpu) as state:
            doc["saturation"] = saturation_section(core, args.saturation_prompt_len, args.saturation_output_len,
                                                   args.saturation_max_requests, args.saturation_chunk_size,
                                                   sampler, args.seed, bandwidth, dtype_bytes)
        _record_gpu_state(doc, "saturation", state)
    spec = WorkloadSpec(name="long-short", long_short=LongShortSpec(
        long_fraction=args.long_fraction, long_prompt_len=args.long_prompt_len,
        short_prompt_len=args.short_prompt_len, output_len=args.output_len))
    if "hf" in chosen:
        requests = take(iter_requests(spec, sampler, args.seed), args.hf_requests)
        doc["_hf_batch"] = ([list(r.prompt_token_ids) for r in requests], [r.kind for r in requests], config, dtype,
                            core.loaded.device)
    if "longshort" in chosen or "hf" in chosen:
        stop = StopRule(num_requests=args.num_requests or (None if args.duration else 200),
                        duration_s=args.duration, drain_timeout_s=args.drain_timeout)
        runs, batches = asyncio.run(sections.longshort_section(
            core, spec, sampler, args.chunk_sizes if "longshort" in chosen else [],
            args.rates if "longshort" in chosen else [], args.longshort_policy,
            max_num_seqs, stop, args.seed, args.slo_tbt_ms, progress,
            args.hf_requests if "hf" in chosen else None, args.batch_chunk_size, args.warmup_requests,
            args.mixed_overlap_variants))
        if "longshort" in chosen:
            doc["longshort"] = {"policy": args.longshort_policy, "slo_tbt_ms": args.slo_tbt_ms,
                                "capacity": sections.capacity_table(runs, args.slo_tbt_ms),
                                "runs": [r.to_dict(include_records=not args.no_records) for r in runs]}
            if args.mixed_overlap_variants:
                doc["longshort"]["overlap_comparison"] = sections.overlap_comparison(runs)
            doc["_runs"] = runs
        if batches:  # the first chunk size is the compared one (the throughput config); the others stand beside it
            doc["batch_comparison"] = {
                "chunk_size": batches[0].params["chunk_size"], "metronome": batches[0].to_dict(include_records=False),
                "metronome_other_chunks": [b.to_dict(include_records=False) for b in batches[1:]]}
    doc["model"]["kernel_compiles_after_ready"] = core.stats().kernel_compiles_after_ready  # 0: no stall
    core.close()  # tensor-parallel workers, if any
    del core
    # The engine's memory must be collectable again before transformers loads its copy of the model.
    gc.unfreeze()
    sys.setswitchinterval(switch_interval)


def _record_gpu_state(doc: dict[str, Any], section: str, state: dict[str, Any]) -> None:
    """The GPU's clocks, power and temperature during a section (gpu_state.watch), where it was watched."""
    if state:
        doc.setdefault("gpu_state", {})[section] = state


def byte_widths(core: Any) -> sections.model_math.ByteWidths:
    """Bytes per element of what this engine's decode step reads (FP8 linear weights and their scales, an FP8 KV
    cache), from the loaded model and the allocated cache."""
    from metronome.server.models.moe import StackedExperts
    from metronome.server.models.quant.fp8_linear import Fp8Linear

    dtype = core.loaded.dtype.itemsize
    kv = core.runner.kv_caches[0][0].element_size()
    modules = list(core.loaded.model.modules())
    layers = [m for m in modules if isinstance(m, Fp8Linear)]
    linear, scales_per_row = dtype, 0.0
    if layers:
        linear = 1
        rows = sum(layer.out_features for layer in layers)
        scales_per_row = sum(layer.weight_scale.numel() for layer in layers) / rows
    experts = [m for m in modules if isinstance(m, StackedExperts) and m.fp8]
    expert_width, expert_scales = None, 0.0
    if experts:
        rows = sum(m.gate_up_scale.shape[0] * (m.gate_up_scale.shape[1] + m.down_scale.shape[1]) for m in experts)
        expert_width = 1
        expert_scales = sum(m.gate_up_scale.numel() + m.down_scale.numel() for m in experts) / rows
    return sections.model_math.ByteWidths(dtype, linear, kv, scales_per_row, expert_width, expert_scales)


def _hf_section(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    from metronome.server.bench.engine.hf_peer import HFPeerError, run_hf_batch

    prompts, kinds, config, dtype, device = doc.pop("_hf_batch")
    try:
        result = run_hf_batch(config, prompts, kinds, args.output_len, device, dtype, args.hf_attn, args.hf_timeout,
                              args.seed)
    except HFPeerError as exc:
        result = {"error": str(exc)}
    comparison = doc.setdefault("batch_comparison", {})
    comparison["transformers"] = result
    compare_batches(comparison)


def compare_batches(comparison: dict[str, Any]) -> None:
    """Our output tok/s and TBT p99 over transformers', for the compared chunk size and each other one. Pure."""
    result = comparison.get("transformers") or {}
    theirs = result.get("output_tokens_per_s")
    their_p99 = (result.get("summary") or {}).get("tbt", {}).get("p99_ms")
    if not comparison.get("metronome"):
        return
    entries = [comparison["metronome"], *comparison.get("metronome_other_chunks", [])]
    by_chunk, p99_by_chunk = {}, {}
    for entry in entries:
        summary, chunk = entry.get("summary") or {}, sections.chunk_label((entry.get("params") or {}).get(
            "chunk_size", 0))
        if theirs and summary.get("output_tokens_per_s"):
            by_chunk[chunk] = summary["output_tokens_per_s"] / theirs
        p99_by_chunk[chunk] = (summary.get("tbt") or {}).get("p99_ms")
    compared = sections.chunk_label(comparison.get("chunk_size", 0))
    if compared in by_chunk:
        comparison["output_tokens_per_s_ratio"] = by_chunk[compared]
        comparison["output_tokens_per_s_ratio_by_chunk"] = by_chunk
    our_p99 = p99_by_chunk.get(compared)
    if their_p99 is not None and our_p99 is not None:
        comparison["tbt_p99_ms"] = {"metronome": our_p99, "transformers": their_p99, "lower": our_p99 < their_p99,
                                    "metronome_by_chunk": p99_by_chunk}


def _print(doc: dict[str, Any]) -> None:
    from rich.table import Table

    from metronome.server.bench.load.report import console, runs_table

    out = console()
    if "device" in doc:
        d = doc["device"]
        fp8 = f", fp8 {d['fp8_matmul_tflops']:.1f} TFLOP/s" if "fp8_matmul_tflops" in d else ""
        out.print(f"device: copy {d['bandwidth_gb_per_s']:.1f} GB/s (read+write), "
                  f"matmul {d['matmul']['dtype']} {d['matmul']['size']}³ {d['matmul_tflops']:.1f} TFLOP/s{fp8}")
    if doc.get("decode"):
        table = Table(title="decode step (pure decode, context as given)")
        for name in ("batch", "step ms", "floor ms", "ratio", "tok/s", "host ms", "host share"):
            table.add_column(name, justify="right")
        for row in doc["decode"]:
            if "skipped" in row:
                table.add_row(str(row["batch"]), "skipped", row["skipped"], "", "", "", "")
                continue
            table.add_row(str(row["batch"]), f"{row['step_ms_median']:.2f}",
                          f"{row['floor_ms']:.2f}" if "floor_ms" in row else "-",
                          f"{row['ratio_to_floor']:.2f}" if "ratio_to_floor" in row else "-",
                          f"{row['tokens_per_s']:.0f}", f"{row['scheduler_overhead_ms_median']:.2f}",
                          f"{100 * row['scheduler_overhead_share']:.1f}%")
        out.print(table)
    if doc.get("prefill"):
        p = doc["prefill"]
        share = f", {100 * p['share_of_matmul_peak']:.0f}% of matmul peak" if "share_of_matmul_peak" in p else ""
        out.print(f"prefill: {p['tokens_per_s']:.0f} tokens/s, {p['achieved_tflops']:.2f} TFLOP/s{share} "
                  f"({p['prompts']} x {p['prompt_len']} tokens, chunk {p['chunk_size']})")
    if doc.get("_runs"):
        out.print(runs_table(doc["_runs"], title="long-short per chunk size and rate"))
        table = Table(title=f"capacity at TBT p99 <= {doc['longshort']['slo_tbt_ms']:g} ms")
        for name in ("chunk", "capacity req/s", "max out tok/s", "TBT p99 @ top rate", "tput cost", "capacity ×"):
            table.add_column(name, justify="right")
        for row in doc["longshort"]["capacity"]:
            cost, ratio = row.get("throughput_cost_vs_unchunked"), row.get("capacity_ratio_vs_unchunked")
            table.add_row(row["label"], "-" if row["capacity_rate"] is None else f"{row['capacity_rate']:g}",
                          f"{row['max_output_tokens_per_s']:.0f}",
                          "-" if row["tbt_p99_ms_at_highest_rate"] is None else
                          f"{row['tbt_p99_ms_at_highest_rate']:.1f}",
                          "-" if cost is None else f"{100 * cost:.0f}%", "-" if ratio is None else f"{ratio:.2f}")
        out.print(table)
    comparison_rows = (doc.get("longshort") or {}).get("overlap_comparison")
    if comparison_rows:
        table = Table(title="mixed-step overlap: off vs on, each (chunk, rate) run back to back")
        for name in ("chunk", "rate", "TBT p99 off", "TBT p99 on", "p99 drop", "tok/s off", "tok/s on"):
            table.add_column(name, justify="right")
        for row in comparison_rows:
            drop = row["tbt_p99_reduction"]
            table.add_row(sections.chunk_label(row["chunk_size"]), f"{row['rate']:g}",
                          *(("-" if v is None else f"{v:.1f}") for v in (row["tbt_p99_ms_off"], row["tbt_p99_ms_on"])),
                          "-" if drop is None else f"{100 * drop:.0f}%", f"{row['output_tokens_per_s_off']:.0f}",
                          f"{row['output_tokens_per_s_on']:.0f}")
        out.print(table)
    if doc.get("saturation"):
        _print_saturation(out, doc["saturation"])
    for section, state in (doc.get("gpu_state") or {}).items():
        out.print(f"{section}: {gpu_state.describe(state)}")
    comparison = doc.get("batch_comparison")
    if comparison:
        ours = ", ".join(f"{e['summary']['output_tokens_per_s']:.0f} out tok/s at chunk "
                         f"{sections.chunk_label(e['params']['chunk_size'])}"
                         for e in [comparison["metronome"], *comparison.get("metronome_other_chunks", [])])
        theirs = comparison.get("transformers", {})
        out.print(f"same batch: metronome {ours} (compared: the first); transformers "
                  + (f"{theirs['output_tokens_per_s']:.0f} out tok/s" if "output_tokens_per_s" in theirs
                     else f"- ({theirs.get('error', 'skipped')})"))
    table = Table(title="engine targets (reported, not asserted)")
    for name in ("target", "goal", "measured", "met"):
        table.add_column(name)
    for t in doc.get("targets", []):
        value = t["value"]
        table.add_row(t["description"], t["target"], "-" if value is None else f"{value:.3g}",
                      "-" if t["met"] is None else ("yes" if t["met"] else "NO"))
    out.print(table)


def _print_saturation(out: Any, sat: dict[str, Any]) -> None:
    part, whole = sat["decode_part"], sat["whole_run"]
    line = (f"saturation: {sat['requests']} requests x ({sat['prompt_len']} + {sat['output_len']}) tokens, chunk "
            f"{sat['chunk_size']}: {whole['output_tokens_per_s']:.0f} out tok/s over the run "
            f"({whole['seconds']:.1f} s)")
    if part.get("steps"):
        line += (f"; decode part {part['output_tokens_per_s']:.0f} tok/s, mean batch {part['mean_batch']:.0f}, "
                 f"{part['mean_kv_tokens_read']:.0f} KV tokens/step")
        if "floor_tokens_per_s" in part:
            line += f", floor {part['floor_tokens_per_s']:.0f} tok/s (x{part['ratio_to_floor']:.2f})"
        line += f"; steps {part['forward']}"
    out.print(line)
    for note in sat["notes"]:
        out.print(f"saturation: {note}")


def _plot(doc: dict[str, Any], path: str, slo: float) -> None:
    from metronome.server.bench.load.plots import plot_runs

    runs: list[RunEntry] = doc.get("_runs") or []
    plot_runs(plot_entries(runs, lambda r: f"chunk {sections.chunk_label(r.params['chunk_size'])}"), path, slo,
              title=f"{doc['model']['name']}: long-short, TBT p99 vs throughput per chunk size")


def main(args: argparse.Namespace) -> int:
    chosen = _check_args(args)
    device = _resolve_device(args.device)
    args.device = str(device)
    doc: dict[str, Any] = {"kind": "engine", "config": args_config(args)}
    if "device" in chosen:
        doc["device"] = sections_device(device, args)
    _engine_sections(args, chosen, doc)
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    hf_timed_out = False
    if "hf" in chosen and not args.skip_hf:
        _hf_section(args, doc)
        hf_timed_out = bool(doc["batch_comparison"]["transformers"].get("timed_out"))
    doc.pop("_hf_batch", None)
    doc["environment"] = environment()
    doc["targets"] = evaluate_targets(doc)
    _print(doc)
    runs = doc.pop("_runs", None)
    if args.out:
        write_json(args.out, doc)
    if args.plot:
        doc["_runs"] = runs
        _plot(doc, args.plot, args.slo_tbt_ms)
    if hf_timed_out:  # transformers' worker thread is still running and cannot be stopped: leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def sections_device(device: Any, args: argparse.Namespace) -> dict[str, Any]:
    from metronome.server.bench.engine.device_peaks import device_section

    return device_section(device, args.copy_mb, args.matmul_size, args.reps)

