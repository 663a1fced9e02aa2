"""A tensor-parallel worker (ranks 1..N-1): `python -m metronome.server.engine.tp_worker RANK PORT DEVICE CONFIG`,
started by tp_launch.WorkerPool. It loads its shard, reports how many KV blocks fit, then runs every step rank 0
sends (tp_channel.py) with its own KV cache (its KV heads only, in rank 0's KV groups) until SHUTDOWN or until its
pipe closes.
It never samples: the logits it helps all-gather are rank 0's to use.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading


def _exit_when_orphaned(parent: int) -> None:
    """If rank 0 dies while this rank sits in a collective (NCCL waits until its timeout), leave at once."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        threading.Event().wait(0.5)


def main(argv: list[str]) -> int:
    rank, port, device_name, config_json = int(argv[0]), int(argv[1]), argv[2], argv[3]
    commands = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints must not corrupt the reply pipe
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; rank 0 decides

    import torch
    import torch.distributed as dist

    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.kv_cache import allocate_kv_cache, bytes_per_block, kv_cache_dtype, plan_num_blocks
    from metronome.server.engine.kv_layout import kv_layout
    from metronome.server.engine.tp_channel import (
        SET_NUM_BLOCKS,
        SHUTDOWN,
        STEP,
        ChannelClosed,
        encode_reply,
        read_message,
        unpack_payload,
    )
    from metronome.server.engine.tp_launch import COLLECTIVE_TIMEOUT, HOST, check_in_key, share_cpu_threads
    from metronome.server.models import load_model
    from metronome.server.models.parallel import TPContext
    from metronome.server.models.quant.kv_scales import install_kv_scales

    config = EngineConfig(**json.loads(config_json))
    world = config.tensor_parallel_size
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        share_cpu_threads(world)
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(check_in_key(rank), "1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        loaded = load_model(config.model, dtype=config.dtype, device=device_name,
                            attention_backend=config.attention_backend, seed=config.seed,
                            block_size=config.block_size, tensor_parallel=TPContext(rank, world, None),
                            quantization=config.quantization)
        model, plan = loaded.model, loaded.model.plan
        if hasattr(model, "set_moe_backend"):  # the experts run as rank 0's do
            model.set_moe_backend(config.moe_backend)
        layers = loaded.config.num_hidden_layers
        layout = kv_layout(loaded.config.layer_windows or (None,) * layers)  # the KV groups, as rank 0's
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, loaded.dtype, model.attention_backend.name)
        if kv_dtype == torch.float8_e4m3fn:  # calibrating runs a forward pass: in step with rank 0's
            install_kv_scales(loaded, config.block_size)
        per_block = bytes_per_block(layout.group_size, config.block_size, plan.num_kv_heads, plan.head_dim,
                                    kv_dtype)
        replies.write(encode_reply(plan_num_blocks(config, per_block, device)))
        command, num_blocks, _ = read_message(commands)
        if command != SET_NUM_BLOCKS:
            return 0 if command == SHUTDOWN else 2
        # + 1: the scratch block ModelRunner keeps for padded CUDA-graph rows, so the caches match rank 0's.
        pairs = allocate_kv_cache(layout.group_size, num_blocks + 1, config.block_size, plan.num_kv_heads,
                                  plan.head_dim, kv_dtype, device)
        kv_caches = [pairs[slot] for slot in layout.layer_slot]
        with torch.inference_mode():
            while True:
                command, _, header = read_message(commands)
                if command != STEP:
                    return 0 if command == SHUTDOWN else 2
                payload = torch.empty(header.payload_numel, dtype=torch.int64, device=device)
                dist.broadcast(payload, src=0)
                input_ids, positions, metas, sample_rows = unpack_payload(payload, header)
                meta = metas[0] if len(metas) == 1 else [metas[group] for group in layout.layer_group]
                hidden = model.forward(input_ids, positions, kv_caches, meta)
                if header.num_sample:
                    model.compute_logits(hidden.index_select(0, sample_rows))
    except ChannelClosed:
        return 0  # rank 0 went away between steps
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Leave without the interpreter's teardown: gloo's threads outlive destroy_process_group, and C++ static
    # destructors then abort the process ("terminate called without an active exception") when the host is busy.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
