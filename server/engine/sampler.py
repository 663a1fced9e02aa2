"""Next-token choice for a batch of logits rows.

Order, per row (each step only where the row asks for it): grammar mask, logit_bias, repetition / frequency /
presence penalties — then greedy rows take the argmax, the others temperature, min_p, top-k, top-p and a draw.
Logprobs are the model's own (log-softmax of the raw logits, before any of the above, as vLLM reports them).

Vectorised over the batch; an all-greedy batch with nothing to edit is one argmax, exactly as before. A seeded
request draws from its own torch.Generator, so its output depends only on its own logits and seed, not on what
it was batched with. The only host sync is the one that hands the chosen ids (and requested logprobs) back:
`sample` waits for it; `choose` leaves the ids on the device, and a `PendingSample` copies them to the host
behind the step's work without waiting (async scheduling launches the next step before reading them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from metronome.server.engine.outputs import TokenLogprobs
from metronome.server.engine.sampling import SamplingParams


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # one per row; None where the row asked for none


def _to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A short host list on the device without a host sync: torch.tensor(..., device="cuda") copies from pageable
    memory and then waits for the stream, i.e. for the step still in flight under async scheduling."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def needs_sync(params: SamplingParams) -> bool:
    """Whether a request's next choice depends on the values of its earlier tokens as the host sees them (penalties
    read the history, a grammar's mask follows the text) or reports more than ids (logprobs): its steps cannot be
    launched before the previous step's tokens are read."""
    return params.uses_penalties or params.grammar is not None or params.logprobs is not None


class PendingSample:
    """A step's chosen ids: on the device (`ids`, which the next step can read there) and on their way into pinned
    host memory. `result()` waits for that copy only, not for work queued on the device after it."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        if ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = ids, None

    def result(self) -> SampleResult:
        if self._copied is not None:
            self._copied.synchronize()
        tokens = self._host.tolist()
        return SampleResult(tokens, [None] * len(tokens))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)  # for unseeded requests
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
               histories: list[tuple[list[int], int] | None] | None = None,
               grammar_mask: tuple[torch.Tensor, torch.Tensor] | None = None, plain: bool = False) -> SampleResult:
        """logits: float32 [N, vocab]; one params/generator per row. `histories[i]`: (prompt + output token ids,
        number of prompt tokens) for rows with penalties. `grammar_mask`: (row indices, bool [R, vocab] allowed).
        `plain`: the caller knows no row edits logits or wants logprobs (skips checking each row: at 256 rows
        those checks cost more host time than the argmax)."""
        n = len(params)
        want_logprobs = [] if plain else [i for i, p in enumerate(params) if p.logprobs is not None]
        chosen = self.choose(logits, params, generators, histories, grammar_mask, plain)
        if not want_logprobs:
            return SampleResult(chosen.tolist(), [None] * n)
        return SampleResult(*self._with_logprobs(logits, chosen, params, want_logprobs))

    def choose(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
               histories: list[tuple[list[int], int] | None] | None = None,
               grammar_mask: tuple[torch.Tensor, torch.Tensor] | None = None, plain: bool = False) -> torch.Tensor:
        """The chosen id of every row (int64, on the logits' device); arguments as for `sample`."""
        if not plain and (grammar_mask is not None or any(p.changes_logits for p in params)):
            logits = process_logits(logits, params, histories or [None] * len(params), grammar_mask)
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        return self._draw(logits, params, generators, greedy)

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
              greedy: list[bool]) -> torch.Tensor:
        probs = self.probabilities(logits, params)
        chosen = torch.empty(len(params), dtype=torch.long, device=logits.device)
        shared_rows = [i for i, (g, gen) in enumerate(zip(greedy, generators)) if not g and gen is None]
        if shared_rows:
            rows = _to_device(shared_rows, logits.device)
            chosen[rows] = torch.multinomial(probs[rows], 1, generator=self.generator).squeeze(1)
        for i, (g, gen) in enumerate(zip(greedy, generators)):
            if not g and gen is not None:
                chosen[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        if any(greedy):
            rows = _to_device([i for i, g in enumerate(greedy) if g], logits.device)
            chosen[rows] = logits[rows].argmax(dim=-1)
        return chosen

    @staticmethod
    def _with_logprobs(raw: torch.Tensor, chosen: torch.Tensor, params: list[SamplingParams],
                       rows: list[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
        index = torch.tensor(rows, device=raw.device)
        logprobs = torch.log_softmax(raw[index].float(), dim=-1)
        picked = logprobs.gather(1, chosen[index].unsqueeze(1)).squeeze(1)
        k = max(params[i].logprobs or 0 for i in rows)
        top_values, top_ids = logprobs.topk(k, dim=-1)  # k = 0 gives empty rows
        tokens, picked_l, values_l, ids_l = (t.tolist() for t in (chosen, picked, top_values, top_ids))
        out: list[TokenLogprobs | None] = [None] * len(params)
        for j, i in enumerate(rows):
            want = params[i].logprobs or 0
            out[i] = TokenLogprobs(picked_l[j], tuple(zip(ids_l[j][:want], values_l[j][:want])))
        return tokens, out

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Softmax of temperature-scaled logits restricted to each row's min_p, top-k and top-p (nucleus) set."""
        n, vocab = logits.shape
        temps = _to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], logits.device, logits.dtype)
        scaled = logits / temps.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            min_ps = _to_device([p.min_p for p in params], logits.device, logits.dtype)
            probs = torch.softmax(scaled, dim=-1)
            floor = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
            scaled = scaled.masked_fill(probs < floor, float("-inf"))
        use_k = any(p.uses_top_k for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        if not (use_k or use_p):
            return torch.softmax(scaled, dim=-1)
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        if use_k:
            ks = _to_device([min(p.top_k, vocab) if p.uses_top_k else vocab for p in params], logits.device)
            sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
        if use_p:
            top_ps = _to_device([p.top_p for p in params], logits.device, logits.dtype)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability mass ranked above this token
            drop = (mass_before >= top_ps.unsqueeze(1)) & (ranks > 0)  # always keep the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(scaled, float("-inf")).scatter(1, sorted_idx, sorted_logits)
        return torch.softmax(filtered, dim=-1)


def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   histories: list[tuple[list[int], int] | None],
                   grammar_mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A copy of `logits` with each row's grammar mask, logit_bias and penalties applied (rows that ask for none
    are left exactly as they were)."""
    logits = logits.float().clone()
    device = logits.device
    if grammar_mask is not None:
        rows, allowed = grammar_mask
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < logits.shape[1]]
    if bias:
        rows_b, ids_b, values_b = zip(*bias)
        logits.index_put_((_to_device(rows_b, device), _to_device(ids_b, device)),
                          _to_device(values_b, device, logits.dtype), accumulate=True)
    penal = [i for i, p in enumerate(params) if p.uses_penalties]
    if penal:
        logits[torch.tensor(penal, device=device)] = apply_penalties(
            logits[torch.tensor(penal, device=device)], [params[i] for i in penal], [histories[i] for i in penal])
    return logits


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[tuple[list[int], int] | None]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (CTRL / Hugging Face: positive logits divided, negative
    multiplied), then OpenAI's frequency and presence penalties over the output tokens."""
    rows, vocab = logits.shape
    device = logits.device
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)  # prompt + output
    counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=device)  # output only
    for r, history in enumerate(histories):
        if history is None:
            continue
        tokens, num_prompt = history
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        seen[r, ids] = True
        if len(tokens) > num_prompt:
            out = ids[num_prompt:]
            counts[r].index_add_(0, out, torch.ones(out.numel(), dtype=logits.dtype, device=device))
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device).unsqueeze(1)
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)
