"""Driving an EngineCore by hand in tests, on the CPU and on the GPU alike."""
from __future__ import annotations

from typing import Any


def run_to_completion(core: Any, prompts, params) -> tuple[list[list[int]], list[str]]:
    """Each request's generated tokens and each step's forward kind, until every request finished."""
    ids = [core.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    kinds: list[str] = []
    while core.has_unfinished():
        events, stats = core.step()
        if stats.num_tokens:
            kinds.append(stats.forward)
        for e in events:
            if e.token_id >= 0:
                tokens[e.request_id].append(e.token_id)
    core.check_no_leaks()
    return [tokens[rid] for rid in ids], kinds
