"""Counts the Triton kernel variants this process compiles (or loads from Triton's disk cache), so a server can
show that none was left for serving: a first launch of a new variant stalls its step for up to seconds.

    compile_watch.install()          # once, before the first kernel runs; chains any hook already installed
    ...                              # start-up: capture graphs, warm up
    compile_watch.mark_ready()       # the engine is ready to serve
    compile_watch.after_ready()      # variants compiled since (each one is logged as a warning)
"""
from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_count = 0
_ready_at: int | None = None
_installed: bool | None = None  # None: not tried; False: no Triton (or no hook in this version)


def _name(kwargs: dict[str, Any]) -> str:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or getattr(getattr(fn, "fn", None), "__name__", None)
    return str(name or kwargs.get("repr") or "triton kernel")


def install() -> bool:
    """Hook Triton's post-compile event (idempotent). False where Triton or its hook is missing."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        try:
            from triton import knobs
        except ImportError:
            _installed = False
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            _installed = False
            return False
        previous = runtime.jit_post_compile_hook

        def hook(*args: Any, **kwargs: Any) -> Any:
            global _count
            with _lock:
                _count += 1
                ready = _ready_at is not None
            if ready:
                log.warning("Triton compiled a new variant of %s after the engine was ready: that step stalled "
                            "(start-up warm-up should have covered it)", _name(kwargs))
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        _installed = True
        return True


def count() -> int:
    """Variants compiled in this process since install()."""
    with _lock:
        return _count


def mark_ready() -> None:
    """From now on every compile counts as one after ready (the last engine built in the process sets it)."""
    global _ready_at
    with _lock:
        _ready_at = _count


def after_ready() -> int:
    with _lock:
        return 0 if _ready_at is None else _count - _ready_at
