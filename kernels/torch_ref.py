"""The `torch` backend: the exact reference for attention over the paged KV cache, and the CPU serving path.

Everything is computed in float32 and cast back to q's dtype. Decodes (q_len 1) of a batch are gathered together
and run as one padded attention call; prefill chunks run one sequence at a time with a bottom-right-aligned causal
mask. Cache entries a query may not see (past a sequence's length, unused blocks, behind a sliding window, whose
blocks may have been freed and reused) are zeroed after the gather, so garbage or NaN in the cache can never leak
into the result through `0 * NaN`. An FP8 (e4m3) cache holds `e4m3(x / scale)` with one float32 scale per kv head
for K and one for V (`k_scale`, `v_scale`): writes quantise, reads multiply back.

Per-layer options are parameters of the call: `window` (a query at position p sees keys p - window + 1 .. p),
`softcap` (scores become softcap * tanh(scores / softcap) before the mask, as transformers applies it) and
`sinks` (a learned logit per head that joins every row's softmax denominator and attends to nothing: gpt-oss).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_attention_inputs, check_write_kv_inputs
from .metadata import AttentionMetadata

FP8_MAX = 448.0


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """[T, n_kv_heads, head_dim] as the cache stores it: cast, or e4m3(x / scale[head]) for an FP8 cache (division
    in float32 and clamping to ±448 first, as the Triton writes do)."""
    if cache_dtype != torch.float8_e4m3fn:
        return x.to(cache_dtype)
    return (x.float() / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def from_cache(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows [..., n_kv_heads, head_dim] → float32 values (times the per-head scale for an FP8 cache)."""
    if rows.dtype != torch.float8_e4m3fn:
        return rows.float()
    return rows.float() * scale.float()[:, None]


def write_kv_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Scatter each new token's K/V into its cache slot; a negative slot means skip that token."""
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, n_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, n_kv_heads, head_dim)
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[keep].long()
    k_rows, v_rows = to_cache(key[keep], k_cache.dtype, k_scale), to_cache(value[keep], v_cache.dtype, v_scale)
    if k_cache.dtype == torch.float8_e4m3fn:  # torch copies FP8 rows by index as bytes only
        flat_k, flat_v, k_rows, v_rows = (t.view(torch.uint8) for t in (flat_k, flat_v, k_rows, v_rows))
    flat_k.index_copy_(0, slots, k_rows)
    flat_v.index_copy_(0, slots, v_rows)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first `num_blocks` blocks of one or more sequences, as token rows.

    block_table [num_blocks_max] → [num_blocks * block_size, n_kv_heads, head_dim];
    block_table [B, num_blocks_max] → [B, num_blocks * block_size, n_kv_heads, head_dim].
    Padding entries of a block table may hold anything; they are clamped to a valid id and masked by the caller.
    """
    ids = block_table[..., :num_blocks].long().clamp(0, cache.shape[0] - 1)
    if cache.dtype == torch.float8_e4m3fn:  # gathered as bytes (torch indexes FP8 tensors on the GPU only)
        return cache.view(torch.uint8)[ids].view(cache.dtype).flatten(-4, -3)
    blocks = cache[ids]  # [..., num_blocks, block_size, n_kv_heads, head_dim]
    return blocks.flatten(-4, -3)


def _expand_kv_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[..., S, n_kv_heads, D] → [..., n_heads, S, D] where query head h reads kv head h // group."""
    x = x.transpose(-3, -2)
    return x.repeat_interleave(group, dim=-3) if group > 1 else x


class TorchBackend:
    name = "torch"
    graph_capture = "none"  # host lists steer its launches (the CPU path)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        check_write_kv_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        write_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor | None = None, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        check_attention_inputs(q, k_cache, v_cache, meta, window, sinks, k_scale, v_scale)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q_lens = meta.q_lens_host
        decodes = [b for b, n in enumerate(q_lens) if n == 1]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        if decodes:
            self._decodes(q, k_cache, v_cache, meta, scale, decodes, starts, out, window, softcap, sinks, k_scale,
                          v_scale)
        for b, q_len in enumerate(q_lens):
            if q_len > 1:
                rows = slice(starts[b], starts[b + 1])
                out[rows] = self._one_sequence(q[rows], k_cache, v_cache, meta.block_tables[b],
                                               meta.seq_lens_host[b], scale, window, softcap, sinks, k_scale,
                                               v_scale)
        return out

    # Launches that depend on nothing but the shapes: one variant, nothing to compile.
    def decode_variant(self, num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
        return 0

    def variant_lengths(self, max_model_len: int) -> list[int]:
        return [max_model_len]

    def warm_up(self, q_shape, k_cache, v_cache, max_model_len: int, windows=(None,), softcap=None,
                sinks=False, dtype: torch.dtype | None = None) -> int:
        return 0

    @staticmethod
    def _one_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_len: int, scale: float, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        q_len, n_heads, _ = q.shape
        block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
        num_blocks = -(-seq_len // block_size)
        # Keys before `first` are behind every query's window: not read (their blocks may be gone).
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        first_block = first // block_size
        k = gather_context(k_cache, block_table[first_block:], num_blocks - first_block)
        v = gather_context(v_cache, block_table[first_block:], num_blocks - first_block)
        offset = first_block * block_size
        k, v = from_cache(k[:seq_len - offset], k_scale), from_cache(v[:seq_len - offset], v_scale)
        # new token i sits at position seq_len - q_len + i and sees positions (p - window, p]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(offset, seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
            seen = mask.any(0)
            k = torch.where(seen[:, None, None], k, 0.0)
            v = torch.where(seen[:, None, None], v, 0.0)
        group = n_heads // n_kv_heads
        k, v = _expand_kv_heads(k, group), _expand_kv_heads(v, group)  # [H, S, D]
        qh = q.float().transpose(0, 1)  # [H, L, D]
        if softcap is not None or sinks is not None:
            o = _explicit(qh, k, v, mask, scale, softcap, sinks)
        elif q_len == seq_len and window is None:  # plain causal: SDPA aligns top-left = bottom-right here
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
        return o.transpose(0, 1).to(q.dtype)

    @staticmethod
    def _decodes(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, decodes: list[int], starts: list[int],
                 out: torch.Tensor, window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """All q_len-1 sequences at once: pad their contexts to the longest and mask the padding."""
        n_heads = q.shape[1]
        block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
        all_decode = len(decodes) == meta.num_seqs
        max_len = max(meta.seq_lens_host[b] for b in decodes)
        num_blocks = -(-max_len // block_size)
        if all_decode:
            rows = None
            tables, seq_lens, qd = meta.block_tables, meta.seq_lens, q
        else:
            idx = torch.tensor(decodes, device=q.device)
            rows = torch.tensor([starts[b] for b in decodes], device=q.device)
            tables, seq_lens, qd = meta.block_tables[idx], meta.seq_lens[idx], q[rows]
        key_pos = torch.arange(num_blocks * block_size, device=q.device)[None, :]
        valid = key_pos < seq_lens[:, None].long()  # [B, S]
        if window is not None:  # the decode at position seq_len - 1 sees keys seq_len - window .. seq_len - 1
            valid &= key_pos >= seq_lens[:, None].long() - window
        k = from_cache(gather_context(k_cache, tables, num_blocks), k_scale)  # [B, S, KVH, D]
        v = from_cache(gather_context(v_cache, tables, num_blocks), v_scale)
        k = torch.where(valid[:, :, None, None], k, 0.0)
        v = torch.where(valid[:, :, None, None], v, 0.0)
        group = n_heads // n_kv_heads
        k, v = _expand_kv_heads(k, group), _expand_kv_heads(v, group)  # [B, H, S, D]
        qh = qd.float()[:, :, None, :]  # [B, H, 1, D]
        if softcap is not None or sinks is not None:
            o = _explicit(qh, k, v, valid[:, None, None, :], scale, softcap, sinks)
        else:
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=valid[:, None, None, :], scale=scale)
        o = o[:, :, 0, :].to(q.dtype)
        if rows is None:
            out.copy_(o)
        else:
            out[rows] = o


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(scores, masked) v in float32, where scores = q k^T * scale, softcapped (softcap * tanh(scores /
    softcap)) when given; with sinks [H], each head's sink logit joins the softmax as one more column, which
    is then dropped (transformers' order: the row's max over keys and sink subtracted first). q is [..., H, L, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs, v)
