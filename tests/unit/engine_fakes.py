"""A model whose next token is an exact integer function of its whole context as read back from the paged KV
cache, so engine tests can check block tables, slot mapping, prefix sharing and preemption with no float noise.

next_token(context) = sum((token + 1) * (position + 1)) mod (VOCAB - 1); token VOCAB - 1 is EOS, never produced.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

VOCAB = 128
EOS = VOCAB - 1


def expected_next(tokens: list[int]) -> int:
    return sum((t + 1) * (p + 1) for p, t in enumerate(tokens)) % (VOCAB - 1)


def expected_greedy(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(expected_next(tokens))
    return tokens[len(prompt):]


class ContextSumModel(torch.nn.Module):
    def forward(self, input_ids, positions, kv_caches, meta):
        k_cache, v_cache = kv_caches[0]
        flat_k = k_cache.view(-1)
        keep = meta.slot_mapping >= 0  # a negative slot is not written (the backends' contract; graph padding)
        flat_k[meta.slot_mapping[keep]] = input_ids[keep].to(flat_k.dtype)  # the "KV write"
        v_cache.view(-1)[meta.slot_mapping[keep]] = positions[keep].to(flat_k.dtype)
        bs = k_cache.shape[1]
        out = torch.empty(input_ids.shape[0], 1, dtype=torch.float64)
        cu = meta.cu_seqlens_q.tolist()
        for b, seq_len in enumerate(meta.seq_lens_host):
            blocks = meta.block_tables[b, : -(-seq_len // bs)].long()
            ctx = k_cache[blocks].reshape(-1)[:seq_len].long()  # read back through the block table
            pos = v_cache[blocks].reshape(-1)[:seq_len].long()
            assert torch.equal(pos, torch.arange(seq_len)), "positions read back from the cache are wrong"
            prefix = torch.cumsum((ctx + 1) * (pos + 1), 0) % (VOCAB - 1)
            q = cu[b + 1] - cu[b]
            out[cu[b]:cu[b + 1], 0] = prefix[seq_len - q:seq_len].double()
        return out

    def compute_logits(self, hidden):
        target = hidden[:, 0].round().long()
        vocab = torch.arange(VOCAB).unsqueeze(0)
        return -(vocab - target.unsqueeze(1)).abs().float()  # peak at the target; a smooth tail for sampling


class CharDecoder:
    def push(self, token_id: int) -> str:
        return chr(token_id)

    def finish(self) -> str:
        return ""


class CharTokenizer:
    eos_token_ids = (EOS,)
    bos_token_id = None
    vocab_size = VOCAB
    name = "chars"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % (VOCAB - 1) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def incremental_decoder(self, skip_special_tokens: bool = True) -> CharDecoder:
        return CharDecoder()


@dataclass
class FakeLoaded:
    name: str
    config: SimpleNamespace
    model: torch.nn.Module
    tokenizer: CharTokenizer
    dtype: torch.dtype
    device: torch.device


def fake_loaded(max_position_embeddings: int = 4096) -> FakeLoaded:
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=1, vocab_size=VOCAB,
                             max_position_embeddings=max_position_embeddings, eos_token_ids=(EOS,))
    return FakeLoaded("fake-context-sum", config, ContextSumModel(), CharTokenizer(), torch.float32,
                      torch.device("cpu"))


def fake_engine(num_kv_blocks: int = 256, block_size: int = 4, prefix_caching: bool = True, max_waiting: int = 64,
                max_model_len: int | None = None, **scheduler):
    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore

    config = EngineConfig(model="fake", device="cpu", block_size=block_size, num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=prefix_caching, max_waiting=max_waiting, max_model_len=max_model_len)
    return EngineCore(fake_loaded(), config, SchedulerConfig(**scheduler))


def attach_recorded_graphs(engine, sizes: list[int]):
    """Decode graphs for `sizes` on a real engine, "captured" by recording (capture_recorded): the bookkeeping of
    graph replay (padding, static inputs, metadata) runs on the CPU."""
    from metronome.server.engine.cuda_graphs import GraphRunner, capture_recorded, single_class

    runner = engine.runner
    graphs = GraphRunner(runner.graph_forward, sizes, runner.mirror.cols, runner.scratch_block, runner.device,
                         single_class(engine.max_model_len), capture_recorded, refresh_host_facts=True,
                         layer_groups=runner.layer_groups)
    graphs.capture_all()
    runner.attach_graphs(graphs)
    return graphs


class RecordingObserver:
    """An EngineObserver that counts steps and keeps rejection reasons."""

    def __init__(self):
        self.steps = 0
        self.rejected: list[str] = []

    def on_step(self, step, stats):
        self.steps += 1

    def on_rejected(self, reason):
        self.rejected.append(reason)


def record_logits(core) -> list[torch.Tensor]:
    """Every step's logits, in step order (the runner's output before sampling)."""
    seen: list[torch.Tensor] = []
    forward = core.runner.forward_logits

    def recording(inputs):
        logits = forward(inputs)
        if logits is not None:
            seen.append(logits.clone())
        return logits

    core.runner.forward_logits = recording
    return seen
