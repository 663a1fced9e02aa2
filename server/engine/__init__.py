"""The chunked-prefill engine, one idea per module, in request order:

sampling.SamplingParams -> sequence.Sequence -> queues (per policy) -> scheduler.Scheduler (stall-free step plan)
-> block_manager.BlockManager (paged KV bookkeeping) -> model_runner.ModelRunner (varlen batch, forward, sampler)
-> engine.EngineCore (the step) -> async_engine.AsyncEngine (background thread, asyncio streams).

Import the modules directly; this package stays import-light (sampling and config need no torch).
"""
