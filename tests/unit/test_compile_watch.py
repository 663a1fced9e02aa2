"""The compile counter: Triton's post-compile hook counts variants, compiles after `mark_ready` are counted apart
(and logged), and /metrics exports them as a counter that only rises.

No kernel compiles on the CPU (the interpreter runs Python), so the hook is called here the way Triton calls it.
"""
from __future__ import annotations

import logging

import pytest

from metronome.contract import metric_names as names
from metronome.contract.config import SchedulerConfig
from metronome.kernels import compile_watch
from metronome.server.api.metrics import ServerMetrics
from metronome.server.engine.outputs import EngineStats

knobs = pytest.importorskip("triton.knobs")


def _compile_event(name: str) -> None:
    class Fn:  # what Triton passes as `fn` (JitFunctionInfo)
        pass

    fn = Fn()
    fn.name = name
    knobs.runtime.jit_post_compile_hook(key="k", repr=name, fn=fn, compile={}, is_manual_warmup=False,
                                        already_compiled=False)


def test_compiles_after_ready_are_counted_and_logged(caplog):
    assert compile_watch.install() and compile_watch.install()  # idempotent
    before = compile_watch.count()
    _compile_event("_paged_attention")
    assert compile_watch.count() == before + 1
    compile_watch.mark_ready()
    assert compile_watch.after_ready() == 0
    with caplog.at_level(logging.WARNING, logger="metronome.kernels.compile_watch"):
        _compile_event("_rope_write_kv")
    assert compile_watch.after_ready() == 1 and compile_watch.count() == before + 2
    assert "_rope_write_kv" in caplog.text and "after the engine was ready" in caplog.text


def test_the_metric_counts_only_new_compiles():
    metrics = ServerMetrics("m")

    def stats(compiles: int) -> EngineStats:
        return EngineStats(num_running=0, num_waiting={}, num_prefilling=0, kv_usage_ratio=0.0, kv_blocks_total=1,
                           kv_blocks_free=1, kv_blocks_leaked=0, preemptions_total=0, scheduler=SchedulerConfig(),
                           kernel_compiles_after_ready=compiles)

    value = lambda: metrics.registry.get_sample_value(names.KERNEL_COMPILES_AFTER_READY, {"model": "m"})  # noqa: E731
    assert value() == 0
    metrics.refresh(stats(0))
    assert value() == 0
    metrics.refresh(stats(2))
    metrics.refresh(stats(2))  # refreshed again at scrape time: no double count
    assert value() == 2
    metrics.refresh(stats(3))
    assert value() == 3
