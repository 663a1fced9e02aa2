"""Paged KV cache bookkeeping: which block holds what, who shares it, and which free blocks still hold a
reusable prefix.

Blocks are fixed-size runs of token slots. A sequence's block table lists its blocks in order. A block that is
full and computed gets a chained hash, hash(parent block's hash, its token ids), and is findable by it: a new
sequence whose prompt starts with the same tokens shares those blocks (reference counts) instead of recomputing
them. Freed blocks keep their hash and stay findable until reused; reuse takes the least recently freed block
first, and blocks without a hash before any cached one.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from metronome.server.engine.sequence import Sequence

_ROOT_HASH = 0x6D6574726F6E6F6D  # parent hash of a sequence's first block


class KVCacheError(RuntimeError):
    """The block bookkeeping is inconsistent (a bug, never user input)."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, watermark: float = 0.01):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Kept free at admission so that running decodes can always grow by a block (no admission deadlock).
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 and num_blocks > 1 else 0
        self.ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_key: list[tuple | None] = [None] * num_blocks  # (parent hash, token ids): exact hit check
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # front = evict first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._total_refs = 0  # sum of ref_counts, kept so the leak metric costs O(live sequences)

    # --- capacity ------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage_ratio(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def max_admissible_tokens(self) -> int:
        """Longest token run one sequence can ever hold (admission needs the watermark left free)."""
        return (self.num_blocks - self.watermark_blocks) * self.block_size

    # --- prefix cache --------------------------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of seq's tokens. Never the whole token list: at least the last
        token is recomputed so the step that finishes the prompt produces logits."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        tokens = seq.token_ids
        hits: list[int] = []
        parent = _ROOT_HASH
        for i in range(max_blocks):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            h = hash(key)
            block = self._cached.get(h)
            if block is None or self._block_key[block] != key:
                break
            hits.append(block)
            parent = h
        return hits

    # --- allocation ----------------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, prefix_blocks: list[int]) -> bool:
        """Give seq blocks for all its tokens (the prefix hits shared, the rest fresh); False if that would eat
        into the watermark. Sets seq.block_table and seq.num_computed_tokens."""
        if seq.block_table:
            raise KVCacheError(f"{seq.request_id}: allocate() on a sequence that already holds blocks")
        needed = blocks_for_tokens(seq.num_tokens, self.block_size)
        fresh = needed - len(prefix_blocks)
        revived = sum(1 for b in prefix_blocks if self.ref_counts[b] == 0)  # hits that sit in the free list
        if fresh + revived > len(self._free) - self.watermark_blocks:
            return False
        for b in prefix_blocks:  # take the hits first so that fresh allocation cannot evict them
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1
        table = list(prefix_blocks)
        table.extend(self._pop_free() for _ in range(fresh))
        seq.block_table = table
        self._total_refs += len(table)
        seq.block_hashes = [self._block_hash[b] for b in prefix_blocks]  # type: ignore[misc]
        seq.num_computed_tokens = len(prefix_blocks) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        return True

    def blocks_to_grow(self, seq: Sequence) -> int:
        """Blocks seq needs so that every one of its tokens has a slot."""
        return max(0, blocks_for_tokens(seq.num_tokens, self.block_size) - len(seq.block_table))

    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_to_grow(seq) <= len(self._free)

    def append_slots(self, seq: Sequence) -> bool:
        """Grow seq's table to cover its tokens (decode growth; may use the watermark). False if out of blocks."""
        grow = self.blocks_to_grow(seq)
        if grow > len(self._free):
            return False
        seq.block_table.extend(self._pop_free() for _ in range(grow))
        self._total_refs += grow
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Its tail is freed first so that, among cached blocks, prefixes are evicted last."""
        for b in reversed(seq.block_table):
            count = self.ref_counts[b] - 1
            if count < 0:
                raise KVCacheError(f"block {b} freed more often than allocated (by {seq.request_id})")
            self.ref_counts[b] = count
            if count == 0:
                self._free[b] = None
                if self._block_hash[b] is None:
                    self._free.move_to_end(b, last=False)  # nothing to keep: reuse it first
        self._total_refs -= len(seq.block_table)
        seq.block_table = []

    def mark_computed(self, seq: Sequence) -> None:
        """Register seq's newly full and computed blocks in the prefix cache."""
        bs = self.block_size
        hashes = seq.block_hashes
        if not self.enable_prefix_caching or seq.num_computed_tokens // bs <= len(hashes):
            return
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        tokens = seq.token_ids
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            h = hash(key)
            hashes.append(h)
            block = seq.block_table[i]
            if self._block_hash[block] is None and h not in self._cached:
                self._block_hash[block] = h
                self._block_key[block] = key
                self._cached[h] = block

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._block_hash[block]
        if h is not None:  # evict: the cached prefix in this block is gone
            if self._cached.get(h) == block:
                del self._cached[h]
            self._block_hash[block] = None
            self._block_key[block] = None
        self.ref_counts[block] = 1
        return block

    # --- leak check ----------------------------------------------------------------------------------------
    def find_inconsistencies(self, live_seqs: Iterable[Sequence]) -> list[str]:
        owners = Counter(b for seq in live_seqs for b in seq.block_table)
        problems = []
        for b in range(self.num_blocks):
            count, owned = self.ref_counts[b], owners.get(b, 0)
            if count != owned:
                problems.append(f"block {b}: refcount {count}, owned by {owned} live sequence(s)")
            if (count == 0) != (b in self._free):
                problems.append(f"block {b}: refcount {count} but {'' if b in self._free else 'not '}in the free list")
        return problems

    def count_leaked(self, live_seqs: Iterable[Sequence]) -> int:
        """Block references held beyond what live sequences own: the kv_blocks_leaked metric. O(live sequences),
        cheap enough for every step; find_inconsistencies() is the exhaustive check."""
        owned = sum(len(seq.block_table) for seq in live_seqs)
        return max(0, self._total_refs - owned)

    def check_no_leaks(self, live_seqs: Iterable[Sequence]) -> None:
        problems = self.find_inconsistencies(live_seqs)
        if problems:
            shown = "; ".join(problems[:10])
            raise KVCacheError(f"KV block bookkeeping is inconsistent ({len(problems)} problems): {shown}")
