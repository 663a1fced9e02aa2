"""The FastAPI app: OpenAI-compatible routes plus health, readiness, metrics and the effective config.

`create_app(engine, state)` owns the engine's lifetime through the ASGI lifespan: it starts the engine and the
config watcher, marks the server ready, and shuts both down on exit.

What one client sends must not slow the others' streams: request bodies are size-limited while they stream in
(body_limit.py), and prompts are tokenized and chat templates rendered on worker threads after a size check
(tokenization.py), so the event loop only ever does work proportional to the body it accepted.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from metronome.server.api.body_limit import BodyLimit
from metronome.server.api.generation import run_request
from metronome.server.api.http_errors import error_response, install_error_handlers
from metronome.server.api.metrics import CONTENT_TYPE
from metronome.server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    now_unix,
)
from metronome.server.api.responses import ChatShaper, CompletionShaper
from metronome.server.api.state import ServerState
from metronome.server.api.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_TOKENIZER_WORKERS
from metronome.server.api.tokenization import TokenizerPool
from metronome.server.engine.sampling import SamplingParams
from metronome.contract.errors import (
    EngineDrainingError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelNotFoundError,
)

log = logging.getLogger("metronome.api")


# Below this a temperature only overflows the softmax; like vLLM, treat it as greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5


def sampling_params(body, max_tokens: int) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=body.stop_strings(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
    )


def create_app(engine, state: ServerState, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS) -> FastAPI:
    metrics = state.metrics
    lifecycle = state.lifecycle
    tokenizer_pool = TokenizerPool(engine.tokenizer, engine.max_model_len, workers=tokenizer_workers,
                                   max_pending=engine.core.config.max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        watch_task = asyncio.create_task(state.watcher.run()) if state.watcher is not None else None
        lifecycle.ready = True
        try:
            yield
        finally:
            lifecycle.ready = False
            if watch_task is not None:
                watch_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch_task
            await engine.shutdown()
            tokenizer_pool.shutdown()

    app = FastAPI(title="Metronome", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app, on_reject=metrics.on_rejected)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, on_reject=metrics.on_rejected)

    def admit(body) -> None:
        """Checks before the engine sees the request; counted here because the engine never will."""
        if not lifecycle.accepting:
            raise EngineDrainingError("the server is shutting down and takes no new requests"
                                      if lifecycle.draining else "the server is not ready yet")
        if body.model is not None and body.model != state.served_model_name:
            raise ModelNotFoundError(
                f"model {body.model!r} is not served here; this server serves {state.served_model_name!r}")
        try:
            body.check_supported()
        except InvalidRequestError:
            metrics.on_rejected("invalid")
            raise

    async def tokenized(work):
        """Await a TokenizerPool call; its refusals are counted here (the engine never sees them)."""
        try:
            return await work
        except InvalidRequestError:
            metrics.on_rejected("invalid")
            raise
        except EngineOverloadedError:
            metrics.on_rejected("overloaded")
            raise

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        admit(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            prompt = await tokenized(tokenizer_pool.encode(prompt))
        params = sampling_params(body, max_tokens=body.max_tokens if body.max_tokens is not None else 16)
        shaper = CompletionShaper(state.served_model_name)
        return await run_request(engine, lifecycle, request, prompt, params, shaper, body.stream,
                                 body.include_usage_in_stream())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        admit(body)
        prompt = await tokenized(tokenizer_pool.render_chat(body.template_messages(), body.add_generation_prompt))
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:  # OpenAI's default: as much as the context allows
            max_tokens = max(engine.max_model_len - len(prompt), 1)
        params = sampling_params(body, max_tokens=max_tokens)
        shaper = ChatShaper(state.served_model_name)
        return await run_request(engine, lifecycle, request, prompt, params, shaper, body.stream,
                                 body.include_usage_in_stream())

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=state.served_model_name, created=now_unix(), max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    def engine_dead() -> bool:
        """Started, yet the step thread is gone: only a restart helps (liveness fails)."""
        return lifecycle.ready and not engine.is_running

    @app.get("/health")
    async def health():
        if engine_dead():
            return error_response(503, "the engine thread has stopped", code="engine_stopped")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if lifecycle.accepting and not engine_dead():
            return {"status": "ready"}
        reason = "draining" if lifecycle.draining else "engine_stopped" if engine_dead() else "starting"
        return error_response(503, f"not ready: {reason}", code=reason)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.refresh(engine.stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/config")
    async def config() -> JSONResponse:
        # `scheduler` is the config handed to the engine; `engine_scheduler` what the engine reports running
        # (they differ only until the next step boundary).
        body = state.config.as_json()
        body["engine_scheduler"] = engine.stats().scheduler.snake_dict()
        return JSONResponse(body)

    return app
