"""The peer: Hugging Face transformers' continuous batching (`generate_batch`) on the same model shape and requests.

A transformers LlamaForCausalLM is built from the same ModelConfig with random weights (the numbers it produces
do not matter, only the work), the long-short batch goes through `generate_batch` at once, greedy, eos disabled
so every request makes exactly `max_new_tokens`. Per-token timestamps (`record_timestamps`, where this
transformers version has it) give TTFT and TBT on the same definitions as our runs.
"""
from __future__ import annotations

import inspect
import threading
import time
from typing import Any

from metronome.contract.errors import MetronomeError
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.stats import summarize


class HFPeerError(MetronomeError):
    """transformers is missing, too old, or its continuous-batching API differs from what this code drives."""


def llama_config_for(model_config: Any, transformers: Any) -> Any:
    """A transformers LlamaConfig with our model's shape (rope settings through whichever API this version has)."""
    if getattr(model_config, "architecture", "llama") not in ("llama", "mistral", "qwen2"):
        raise HFPeerError(f"the transformers peer is a LlamaForCausalLM; {model_config.architecture} layers do other "
                          "work (QK-norm, sandwich norms, windows), so no peer is built for it")
    shape = dict(
        vocab_size=model_config.vocab_size, hidden_size=model_config.hidden_size,
        intermediate_size=model_config.intermediate_size, num_hidden_layers=model_config.num_hidden_layers,
        num_attention_heads=model_config.num_attention_heads, num_key_value_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim, rms_norm_eps=model_config.rms_norm_eps,
        max_position_embeddings=model_config.max_position_embeddings,
        tie_word_embeddings=model_config.tie_word_embeddings, attention_bias=model_config.attention_bias,
        bos_token_id=model_config.bos_token_id,
        eos_token_id=list(model_config.eos_token_ids) or None, pad_token_id=0,
    )
    rope = {"rope_type": "default", "rope_theta": model_config.rope_theta}
    if model_config.rope_scaling:
        rope = {**model_config.rope_scaling, "rope_theta": model_config.rope_theta}
    try:
        return transformers.LlamaConfig(**shape, rope_parameters=rope)  # transformers >= 5
    except TypeError:
        return transformers.LlamaConfig(**shape, rope_theta=model_config.rope_theta,
                                        rope_scaling=model_config.rope_scaling)


def records_from_outputs(outputs: list[Any], kinds: list[str]) -> list[RequestRecord]:
    """GenerationOutput objects (in input order) → records on one clock (perf_counter, from the first creation)."""
    base = min((getattr(o, "created_time", 0.0) for o in outputs), default=0.0)
    records = []
    for i, (out, kind) in enumerate(zip(outputs, kinds)):
        stamps = list(getattr(out, "timestamps", None) or [])
        lifespan = getattr(out, "lifespan", None) or (-1, -1)
        end = stamps[-1] if stamps else (lifespan[1] if lifespan[1] > 0 else None)
        error = getattr(out, "error", None)
        records.append(RequestRecord(
            index=i, kind=kind, max_tokens=len(getattr(out, "generated_tokens", [])),
            prompt_tokens=len(getattr(out, "prompt_ids", []) or []) or None,
            scheduled_s=0.0, sent_s=getattr(out, "created_time", base) - base,
            token_times_s=[t - base for t in stamps], output_tokens=len(getattr(out, "generated_tokens", [])),
            end_s=None if end is None else end - base, finish_reason="length" if error is None else None,
            error=None if error is None else f"transformers: {error}"))
    return records


def _load_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise HFPeerError(f"transformers is not installed ({exc}); install it or pass --skip-hf") from exc
    if not hasattr(transformers.LlamaForCausalLM, "generate_batch"):
        raise HFPeerError(f"transformers {transformers.__version__} has no LlamaForCausalLM.generate_batch "
                          "(continuous batching needs >= 4.53); pass --skip-hf")
    return transformers


def run_hf_batch(model_config: Any, prompts: list[list[int]], kinds: list[str], output_len: int, device: Any,
                 dtype: Any, attn_implementation: str, timeout_s: float, seed: int = 0) -> dict[str, Any]:
    import torch

    transformers = _load_transformers()
    config = llama_config_for(model_config, transformers)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation,
                                                               dtype=dtype)
    except (ValueError, ImportError, TypeError) as exc:
        raise HFPeerError(f"transformers could not build LlamaForCausalLM with attn_implementation="
                          f"{attn_implementation!r}: {exc}") from exc
    model.eval()
    generation_config = transformers.GenerationConfig(max_new_tokens=output_len, do_sample=False,
                                                      eos_token_id=None, pad_token_id=0)
    accepted = inspect.signature(model.generate_batch).parameters
    kwargs: dict[str, Any] = {}
    if "record_timestamps" in accepted:
        kwargs["record_timestamps"] = True
    if "progress_bar" in accepted:
        kwargs["progress_bar"] = False

    box: dict[str, Any] = {}

    def work() -> None:
        try:  # not under inference_mode: the manager's thread updates its static tensors in place
            box["outputs"] = model.generate_batch(prompts, generation_config=generation_config, **kwargs)
        except Exception as exc:  # reported, not raised: the rest of the benchmark stands
            box["error"] = f"{type(exc).__name__}: {exc}"

    t0 = time.perf_counter()
    thread = threading.Thread(target=work, name="hf-generate-batch", daemon=True)
    thread.start()
    thread.join(timeout_s)
    wall_s = time.perf_counter() - t0
    result: dict[str, Any] = {"transformers": transformers.__version__, "attn_implementation": attn_implementation,
                              "num_requests": len(prompts), "max_new_tokens": output_len, "wall_s": wall_s,
                              "timestamps": "record_timestamps" in kwargs, "timed_out": thread.is_alive()}
    if thread.is_alive():
        result["error"] = f"generate_batch did not finish within {timeout_s:g} s"
        return result
    if "error" in box:
        result["error"] = box["error"]
        return result
    outputs_by_id = box["outputs"]
    outputs = list(outputs_by_id.values()) if isinstance(outputs_by_id, dict) else list(outputs_by_id)
    if len(outputs) != len(prompts):
        result["error"] = f"generate_batch returned {len(outputs)} results for {len(prompts)} prompts"
    records = records_from_outputs(outputs, kinds[:len(outputs)])
    failed = [r.error for r in records if r.error is not None]
    if failed:
        result["error"] = f"{len(failed)} of {len(records)} requests failed; first: {failed[0]}"
    summary = summarize(records)
    total = sum(r.output_tokens for r in records)
    # The window from the first request's creation to the last token excludes model warm-up (CUDA graph capture)
    # that generate_batch does before it adds requests; wall_s includes it.
    window = summary.duration_s if summary.duration_s > 0 else wall_s
    result.update({"output_tokens": total, "window_s": window, "output_tokens_per_s": total / window if window else 0.0,
                   "output_tokens_per_s_wall": total / wall_s if wall_s else 0.0, "summary": summary.to_dict()})
    return result
