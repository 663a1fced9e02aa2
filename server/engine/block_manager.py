"""Paged KV cache bookkeeping: which block holds what, who shares it, which free blocks still hold a reusable
prefix, and which blocks a sliding window has left behind.

Blocks are fixed-size runs of token slots, all from one pool. The model's layers come in KV groups of equal size
(kv_layout.py): all layers in one group for a plain model; for a model with sliding-window layers, groups of full
layers and groups of window layers. A sequence has one block table per group, and a block serves one group at a
time. A full group holds a block for every token, allocated when the sequence is admitted. A window group
(window W) holds only what queries still to come can see: blocks are given as the tokens to compute need them,
and a block whose every position is behind the window of the next token to compute (position < c - W + 1) is
freed at once (its table entry becomes -1), so a window group's cache does not grow with the context.

Prefix caching: a block that is full and computed gets a chained hash, hash(parent block's hash, its token ids),
and is findable under (group, hash): a new sequence whose prompt starts with the same tokens shares those blocks
(reference counts) instead of recomputing them. A hit of L blocks needs all L in every full group but, in a window
group, only the blocks that the first token to compute (position L * block_size) can still see; a prefix whose
window blocks were evicted is cut back until every group can serve it. Freed blocks keep their hash and stay
findable until reused; reuse takes the least recently freed block first, and blocks without a hash before any
cached one.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from metronome.server.engine.sequence import Sequence

_ROOT_HASH = 0x6D6574726F6E6F6D  # parent hash of a sequence's first block
_LONG_ROPE_ROOT_HASH = hash((_ROOT_HASH, "long rope"))  # ... of a sequence whose KV uses LongRoPE's long factors


def _root(seq: Sequence) -> int:
    """KV computed with another rope is another prefix: its chain starts from another root."""
    return _LONG_ROPE_ROOT_HASH if seq.rope_long else _ROOT_HASH
FREED = -1  # a window group's table entry for a block left behind the window


class KVCacheError(RuntimeError):
    """The block bookkeeping is inconsistent (a bug, never user input)."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class PrefixHit(list):
    """The cached blocks a new sequence can share: as a list, the first group's blocks (for a single full group,
    every hit); `tables` has one list per group (FREED where a window group needs no block)."""

    def __init__(self, blocks: list[int], tables: list[list[int]] | None = None, num_blocks: int | None = None):
        super().__init__(blocks)
        self.tables = tables if tables is not None else [list(blocks)]
        self.num_blocks = len(blocks) if num_blocks is None else num_blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, watermark: float = 0.01,
                 group_windows: tuple[int | None, ...] = (None,)):
        """group_windows: one entry per KV group, its sliding window (None: full attention)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if not group_windows:
            raise ValueError("at least one KV group")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(group_windows)
        self.full_groups = [g for g, w in enumerate(self.windows) if w is None]
        self.window_groups = [g for g, w in enumerate(self.windows) if w is not None]
        # Kept free at admission so that running decodes can always grow by a block (no admission deadlock).
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 and num_blocks > 1 else 0
        self.ref_counts = [0] * num_blocks
        self._block_hash: list[tuple[int, int] | None] = [None] * num_blocks  # (group, chained hash)
        self._block_key: list[tuple | None] = [None] * num_blocks  # (group, parent hash, token ids): exact check
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # front = evict first
        self._cached: dict[tuple[int, int], int] = {}  # (group, block hash) -> block id
        self._total_refs = 0  # sum of ref_counts, kept so the leak metric costs O(live sequences)

    # --- capacity ------------------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.windows)

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

    def window_reserve(self, group: int) -> int:
        """Blocks a window group holds for a sequence at most between two one-token steps: the window and one."""
        return blocks_for_tokens(self.windows[group] - 1, self.block_size) + 2

    def blocks_held(self, num_tokens: int, step_tokens: int = 1) -> int:
        """Blocks a sequence of num_tokens tokens holds at most while steps compute step_tokens of it at a time:
        every token in full groups, a window and a step in window groups (for capacity planning)."""
        tokens = blocks_for_tokens(num_tokens, self.block_size)
        held = len(self.full_groups) * tokens
        for g in self.window_groups:
            held += min(tokens, blocks_for_tokens(self.windows[g] - 1 + step_tokens, self.block_size) + 1)
        return held

    def max_admissible_tokens(self) -> int:
        """Longest token run one sequence can ever hold (admission needs the watermark left free); window groups
        hold a window's worth, full groups every token. Without full groups, any length (the context limit is
        the model's)."""
        usable = self.num_blocks - self.watermark_blocks - sum(self.window_reserve(g) for g in self.window_groups)
        if not self.full_groups:
            return 1 << 62 if usable >= 0 else 0
        return max(0, usable // len(self.full_groups)) * self.block_size

    # --- prefix cache --------------------------------------------------------------------------------------
    def _first_live_block(self, group: int, next_position: int) -> int:
        """The first block a query at next_position or later can see in this group."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, next_position - window + 1) // self.block_size

    def lookup_prefix(self, seq: Sequence) -> PrefixHit:
        """Cached blocks matching the start of seq's tokens, every group able to serve them. Never the whole
        token list: at least the last token is recomputed so the step that finishes the prompt produces logits."""
        if not self.enable_prefix_caching:
            return PrefixHit([], [[] for _ in self.windows], 0)
        bs = self.block_size
        tokens = seq.token_ids
        keys: list[tuple[int, tuple]] = []  # (chained hash, (parent, tokens)) per block
        parent = _root(seq)
        for i in range((seq.num_tokens - 1) // bs):
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            parent = hash(key)
            keys.append((parent, key))
        limit = len(keys)
        for g in self.full_groups:
            limit = min(limit, self._run_of_hits(g, keys, 0, limit))
        for length in range(limit, -1, -1):
            tables = self._hit_tables(keys, length)
            if tables is not None:
                return PrefixHit(tables[0][:length] if self.windows[0] is None else [], tables, length)
        raise AssertionError("unreachable: a hit of length 0 always fits")

    def _cached_block(self, group: int, keys: list[tuple[int, tuple]], i: int) -> int | None:
        h, key = keys[i]
        block = self._cached.get((group, h))
        if block is None or self._block_key[block] != (group, *key):
            return None
        return block

    def _run_of_hits(self, group: int, keys: list[tuple[int, tuple]], start: int, limit: int) -> int:
        n = start
        while n < limit and self._cached_block(group, keys, n) is not None:
            n += 1
        return n

    def _hit_tables(self, keys: list[tuple[int, tuple]], length: int) -> list[list[int]] | None:
        """Every group's blocks for a hit of `length` blocks, or None if some window group lacks one it needs."""
        tables = []
        for g in range(self.num_groups):
            first = self._first_live_block(g, length * self.block_size)
            table = [FREED] * first
            for i in range(first, length):
                block = self._cached_block(g, keys, i)
                if block is None:
                    return None
                table.append(block)
            tables.append(table)
        return tables

    # --- allocation ----------------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, prefix: list[int] | PrefixHit, max_new_tokens: int | None = None) -> int:
        """Give seq its blocks: the prefix hits shared, fresh ones for every token in full groups and for the
        next tokens to compute (at most max_new_tokens, default all) in window groups. Returns how many tokens
        the first step may compute (0: it does not fit without eating into the watermark, nothing taken). Sets
        seq.block_tables and seq.num_computed_tokens."""
        if seq.block_tables:
            raise KVCacheError(f"{seq.request_id}: allocate() on a sequence that already holds blocks")
        hit = prefix if isinstance(prefix, PrefixHit) else PrefixHit(list(prefix))
        if len(hit.tables) != self.num_groups:
            raise KVCacheError(f"{seq.request_id}: a prefix hit for {len(hit.tables)} groups, not {self.num_groups}")
        start = hit.num_blocks * self.block_size
        wanted = seq.num_tokens - start if max_new_tokens is None else min(max_new_tokens, seq.num_tokens - start)
        shared = [b for table in hit.tables for b in table if b != FREED]
        revived = sum(1 for b in set(shared) if self.ref_counts[b] == 0)  # hits that sit in the free list
        full_fresh = len(self.full_groups) * (blocks_for_tokens(seq.num_tokens, self.block_size) - hit.num_blocks)
        room = len(self._free) - self.watermark_blocks - revived - full_fresh
        tables = [list(t) for t in hit.tables]
        granted = self._fit_window_growth(tables, start, wanted, room)
        if granted < min(1, wanted) or room < 0:
            return 0
        for b in shared:  # take the hits first so that fresh allocation cannot evict them
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1
        self._total_refs += len(shared)
        seq.block_tables = tables
        for g in self.full_groups:
            self._extend(tables[g], blocks_for_tokens(seq.num_tokens, self.block_size))
        for g in self.window_groups:
            self._extend(tables[g], blocks_for_tokens(start + granted, self.block_size))
        seq.block_hashes = [self._block_hash[b][1] for b in hit.tables[0][:hit.num_blocks]] \
            if self.windows[0] is None else self._chain_hashes(seq, hit.num_blocks)
        seq.num_computed_tokens = start
        seq.num_cached_tokens = start
        return granted

    def _chain_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        bs, tokens, hashes = self.block_size, seq.token_ids, []
        parent = _root(seq)
        for i in range(num_blocks):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def _window_blocks_needed(self, tables: list[list[int]], end_token: int) -> int:
        """Fresh blocks the window groups need so that every token before end_token has a slot."""
        want = blocks_for_tokens(end_token, self.block_size)
        return sum(max(0, want - len(tables[g])) for g in self.window_groups)

    def _fit_window_growth(self, tables: list[list[int]], start: int, wanted: int, room: int) -> int:
        """The most tokens (<= wanted) from `start` whose window-group blocks fit in `room` free blocks."""
        if not self.window_groups or wanted <= 0:
            return wanted
        if self._window_blocks_needed(tables, start + wanted) <= room:
            return wanted
        lo, hi = 0, wanted  # the largest n with its blocks in room
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._window_blocks_needed(tables, start + mid) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _extend(self, table: list[int], length: int) -> None:
        grow = length - len(table)
        if grow > 0:
            table.extend(self._pop_free() for _ in range(grow))
            self._total_refs += grow

    def release_behind_windows(self, seq: Sequence) -> None:
        """Free the window-group blocks no query from seq.num_computed_tokens on can see."""
        for g in self.window_groups:
            table = seq.block_tables[g]
            dead = min(self._first_live_block(g, seq.num_computed_tokens), len(table))
            for i in range(dead - 1, -1, -1):
                if table[i] == FREED:
                    break  # everything before it is freed already
                self._release(table[i], seq)
                table[i] = FREED

    def reserve(self, seq: Sequence, num_tokens: int) -> int:
        """Slots for the next num_tokens tokens of a running sequence's prefill (window groups grow; full groups
        have every slot already), after freeing what fell behind its windows. Returns how many of them fit
        (fewer when free blocks run short; 0: none)."""
        if not self.window_groups:
            return num_tokens
        self.release_behind_windows(seq)
        start = seq.num_computed_tokens
        granted = self._fit_window_growth(seq.block_tables, start, num_tokens, len(self._free))
        for g in self.window_groups:
            self._extend(seq.block_tables[g], blocks_for_tokens(start + granted, self.block_size))
        return granted

    def blocks_to_grow(self, seq: Sequence) -> int:
        """Blocks seq needs so that every one of its tokens has a slot (every group)."""
        want = blocks_for_tokens(seq.num_tokens, self.block_size)
        return sum(max(0, want - len(table)) for table in seq.block_tables)

    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_to_grow(seq) <= len(self._free)

    def append_slots(self, seq: Sequence) -> bool:
        """Grow seq's tables to cover its tokens (decode growth; may use the watermark), after freeing what fell
        behind its windows. False if out of blocks."""
        self.release_behind_windows(seq)
        if self.blocks_to_grow(seq) > len(self._free):
            return False
        want = blocks_for_tokens(seq.num_tokens, self.block_size)
        for table in seq.block_tables:
            self._extend(table, want)
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Its tail is freed first so that, among cached blocks, prefixes are evicted last."""
        for table in seq.block_tables:
            for b in reversed(table):
                if b != FREED:
                    self._release(b, seq)
        seq.block_tables = []

    def _release(self, block: int, seq: Sequence) -> None:
        count = self.ref_counts[block] - 1
        if count < 0:
            raise KVCacheError(f"block {block} freed more often than allocated (by {seq.request_id})")
        self.ref_counts[block] = count
        self._total_refs -= 1
        if count == 0:
            self._free[block] = None
            if self._block_hash[block] is None:
                self._free.move_to_end(block, last=False)  # nothing to keep: reuse it first

    def mark_computed(self, seq: Sequence) -> None:
        """Register seq's newly full and computed blocks in the prefix cache (every group that still holds them)."""
        bs = self.block_size
        hashes = seq.block_hashes
        if not self.enable_prefix_caching or seq.num_computed_tokens // bs <= len(hashes):
            return
        full = min(seq.num_computed_tokens // bs, blocks_for_tokens(seq.num_tokens, bs))
        tokens = seq.token_ids
        while len(hashes) < full:
            i = len(hashes)
            parent = hashes[-1] if hashes else _root(seq)
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            h = hash(key)
            hashes.append(h)
            for g, table in enumerate(seq.block_tables):
                block = table[i] if i < len(table) else FREED
                if block != FREED and self._block_hash[block] is None and (g, h) not in self._cached:
                    self._block_hash[block] = (g, h)
                    self._block_key[block] = (g, *key)
                    self._cached[(g, h)] = block

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
        owners = Counter(b for seq in live_seqs for table in seq.block_tables for b in table if b != FREED)
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
        owned = sum(len(table) - (table.count(FREED) if self.window_groups else 0)
                    for seq in live_seqs for table in seq.block_tables)
        return max(0, self._total_refs - owned)

    def check_no_leaks(self, live_seqs: Iterable[Sequence]) -> None:
        problems = self.find_inconsistencies(live_seqs)
        if problems:
            shown = "; ".join(problems[:10])
            raise KVCacheError(f"KV block bookkeeping is inconsistent ({len(problems)} problems): {shown}")
