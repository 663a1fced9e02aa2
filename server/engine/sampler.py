"""Next-token choice for a batch of logits rows: greedy, temperature, top-k, top-p, per-request seeds.

Vectorised over the batch; an all-greedy batch is one argmax. A seeded request draws from its own
torch.Generator, so its output depends only on its own logits and seed, not on what it was batched with.
"""
from __future__ import annotations

import torch

from metronome.server.engine.sampling import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)  # for unseeded requests
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> list[int]:
        """logits: float32 [N, vocab]; one params/generator per row. Returns N token ids."""
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        probs = self.probabilities(logits, params)
        chosen = torch.empty(len(params), dtype=torch.long, device=logits.device)
        shared_rows = [i for i, (g, gen) in enumerate(zip(greedy, generators)) if not g and gen is None]
        if shared_rows:
            rows = torch.tensor(shared_rows, device=logits.device)
            chosen[rows] = torch.multinomial(probs[rows], 1, generator=self.generator).squeeze(1)
        for i, (g, gen) in enumerate(zip(greedy, generators)):
            if not g and gen is not None:
                chosen[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        if any(greedy):
            rows = torch.tensor([i for i, g in enumerate(greedy) if g], device=logits.device)
            chosen[rows] = logits[rows].argmax(dim=-1)
        return chosen.tolist()

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Softmax of temperature-scaled logits restricted to each row's top-k and top-p (nucleus) set."""
        n, vocab = logits.shape
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                             dtype=logits.dtype, device=logits.device)
        scaled = logits / temps.unsqueeze(1)
        use_k = any(p.uses_top_k for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        if not (use_k or use_p):
            return torch.softmax(scaled, dim=-1)
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        if use_k:
            ks = torch.tensor([min(p.top_k, vocab) if p.uses_top_k else vocab for p in params], device=logits.device)
            sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
        if use_p:
            top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability mass ranked above this token
            drop = (mass_before >= top_ps.unsqueeze(1)) & (ranks > 0)  # always keep the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(scaled, float("-inf")).scatter(1, sorted_idx, sorted_logits)
        return torch.softmax(filtered, dim=-1)
