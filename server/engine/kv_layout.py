"""How a model's layers share the KV cache: KV groups of equal size, one block table per group.

Layers with the same sliding window (None: full attention) go into groups of `group_size` layers, where
group_size divides every window's layer count (their gcd): Gemma 3's 5 local : 1 global layers of a 48-layer model
make one full group and five window groups of 8 layers. Every group uses the same `group_size` KV tensor pairs
(slot j of a group is pair j): a block id means one block of storage in each pair, and the block manager gives
each block to one group at a time, so groups share one pool of equal-sized blocks. A block of a window group is
freed once every query to come is past its window (block_manager.py); full groups keep every block. A model
without windows has one group of all its layers: one block table, as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    group_windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: which KV tensor pair it uses (its place within its group)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def group_size(self) -> int:
        return max(self.layer_slot) + 1


def kv_layout(layer_windows: tuple[int | None, ...]) -> KVLayout:
    """Groups for layers with these windows: full groups first (so group 0 holds every token where any layer
    attends to all of them), then window groups by window size; layers keep their order within a group."""
    if not layer_windows:
        raise ValueError("a model has at least one layer")
    windows = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    members = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in windows}
    size = math.gcd(*(len(layers) for layers in members.values()))
    group_windows: list[int | None] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for window in windows:
        layers = members[window]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer] = len(group_windows)
                layer_slot[layer] = slot
            group_windows.append(window)
    return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot))
