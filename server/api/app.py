"""The FastAPI app: OpenAI-compatible routes plus health, readiness, metrics and the effective config.

`create_app(engine, state)` owns the engine's lifetime through the ASGI lifespan: it starts the engine and the
config watcher, marks the server ready, and shuts both down on exit.

What one client sends must not slow the others' streams: request bodies are size-limited while they stream in
(body_limit.py), and prompts are tokenized and chat templates rendered on worker threads after a size check
(tokenization.py), so the event loop only ever does work proportional to the body it accepted. No client may
take the whole waiting queue or all running slots while others are active (client_share.py): over its share a
request gets 429 before it is tokenized. With a prompt-token rate (client_rate.py, opt-in), a request whose
client's bucket lacks its prompt tokens gets 429 once it is tokenized; the bucket is charged after every other
check the server makes and refunded if the engine refuses the request, so a refused request costs no tokens.

Fields the API does not know are logged once each and ignored, unless `strict_openai` (then a 400 names them).
The model answers to its served name, its aliases and the name it was loaded as (e.g. the Hugging Face id).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from metronome import __version__
from metronome.contract.errors import (
    EngineDrainingError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelNotFoundError,
)
from metronome.server.api.admission_pacing import AdmissionPacer
from metronome.server.api.auth import ApiKeyAuth
from metronome.server.api.body_limit import BodyLimit
from metronome.server.api.client_rate import REJECT_REASON as RATE_REJECT_REASON
from metronome.server.api.client_rate import ClientRateExceeded, RateCharge, RateFlags, RateLimiter
from metronome.server.api.client_share import (
    REJECT_REASON,
    ClientHold,
    ClientLedger,
    ClientShareExceeded,
    ShareFlags,
    bearer_token,
    client_identity,
)
from metronome.server.api.error_boundary import ErrorBoundary
from metronome.server.api.generation import Job, run_request
from metronome.server.api.http_errors import error_response, install_error_handlers
from metronome.server.api.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_TOKENIZER_WORKERS
from metronome.server.api.metrics import CONTENT_TYPE
from metronome.server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    now_unix,
)
from metronome.server.api.responses import ChatShaper, CompletionShaper
from metronome.server.api.responses_request import ResponsesRequest, input_messages
from metronome.server.api.responses_shaper import ECHO_DEFAULTS, ResponsesShaper
from metronome.server.api.responses_store import ResponseStore
from metronome.server.api.state import ServerState
from metronome.server.api.token_gaps import TokenGapTimer
from metronome.server.api.tokenization import TokenizerPool
from metronome.server.engine.sampling import Grammar, SamplingParams

log = logging.getLogger("metronome.api")


# Below this a temperature only overflows the softmax; like vLLM, treat it as greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5


def sampling_params(body, max_tokens: int, logprobs: int | None = None, grammar: Grammar | None = None,
                    choice: int = 0) -> SamplingParams:
    """Choice `choice` of n: a seeded request's choices draw with seeds seed, seed + 1, ... (distinct, and each
    reproducible)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=None if body.seed is None else (body.seed + choice) % (1 << 63),
        stop=body.stop_strings(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=body.logit_bias_items(),
        logprobs=logprobs,
        grammar=grammar,
    )


@contextlib.contextmanager
def release_on_error(hold: ClientHold):
    """Give the client's slots back if the request fails before run_request owns them (it releases them then)."""
    try:
        yield
    except BaseException:
        hold.release()
        raise


def create_app(engine, state: ServerState, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS, *, strict_openai: bool = False,
               api_keys: tuple[str, ...] = (), aliases: tuple[str, ...] = (),
               tool_call_parser: str = "auto", shares: ShareFlags = ShareFlags(),
               rates: RateFlags = RateFlags()) -> FastAPI:
    """`aliases`: more names the model answers to; `api_keys`: when any, every route but the probes, /metrics
    and /version needs one (auth.py); `tool_call_parser`: "auto", "qwen2" or "llama3" (tools.py); `shares`: the
    per-client caps (client_share.py); `rates`: the per-client prompt-token rate (client_rate.py)."""
    metrics = state.metrics
    lifecycle = state.lifecycle
    model_names = list(dict.fromkeys([state.served_model_name, *aliases, engine.model_name]))
    unknown_logged: set[str] = set()
    tokenizer_pool = TokenizerPool(engine.tokenizer, engine.max_model_len, workers=tokenizer_workers,
                                   max_pending=engine.max_waiting)
    ledger = ClientLedger(shares)
    store = ResponseStore()
    limiter = RateLimiter.from_flags(rates)

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

    app = FastAPI(title="Metronome", version=__version__, lifespan=lifespan)
    app.state.client_ledger = ledger  # what each client holds now (tests and debugging read it)
    app.state.rate_limiter = limiter  # each client's prompt-token bucket (None: no rate limit)
    install_error_handlers(app, on_reject=metrics.on_rejected)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, on_reject=metrics.on_rejected)
    if api_keys:
        app.add_middleware(ApiKeyAuth, keys=api_keys)  # added late: runs early, before a body is read
    app.add_middleware(ErrorBoundary)  # around everything but the pacer: an unexpected error is a clean 500
    # Added last, so outermost: every request's work, refusals included, waits for its turn (admission_pacing.py).
    app.add_middleware(AdmissionPacer)

    @functools.lru_cache(maxsize=65536)
    def token_text(token: int) -> str:
        return engine.tokenizer.decode([token], skip_special_tokens=False)

    def check_model(name: str | None) -> None:
        if name is not None and name not in model_names:
            raise ModelNotFoundError(
                f"model {name!r} is not served here; this server serves {', '.join(map(repr, model_names))}")

    def check_unknown(body, route: str) -> None:
        if strict_openai and hasattr(body, "vllm_fields") and body.vllm_fields():
            field = body.vllm_fields()[0]
            raise InvalidRequestError(f"{field!r} is a vLLM extension field (this server runs with --strict-openai)",
                                      param=field)
        fields = body.unknown_fields()
        if not fields:
            return
        if strict_openai:
            raise InvalidRequestError(f"unknown field {fields[0]!r} (this server runs with --strict-openai)",
                                      param=fields[0])
        new = [f for f in fields if (route, f) not in unknown_logged]
        if new:
            unknown_logged.update((route, f) for f in new)
            log.warning("%s: ignoring unknown field(s) %s (logged once per field; --strict-openai refuses them)",
                        route, ", ".join(new))

    def admit(body, route: str) -> None:
        """Checks before the engine sees the request; counted here because the engine never will."""
        if not lifecycle.accepting:
            raise EngineDrainingError("the server is shutting down and takes no new requests"
                                      if lifecycle.draining else "the server is not ready yet")
        check_model(body.model)
        try:
            body.check_supported()  # first: an image part is "text only", not an unknown field of a part
            check_unknown(body, route)
        except InvalidRequestError:
            metrics.on_rejected("invalid")
            raise

    def client_of(request: Request, body) -> str:
        key = bearer_token(request.headers.get("authorization")) if api_keys else None
        return client_identity(key, body.user, request.client.host if request.client else None)

    def take_share(client: str, jobs: int) -> ClientHold:
        """The client's slots for `jobs` engine requests, or 429 (counted) when they would pass its share."""
        try:
            return ledger.admit(client, jobs, engine.max_waiting, engine.stats().scheduler.max_num_seqs)
        except ClientShareExceeded:
            metrics.on_rejected(REJECT_REASON)
            raise

    def take_tokens(client: str, prompts: list[list[int]], choices: int) -> RateCharge | None:
        """Charge the client's bucket for every engine request's prompt, or 429 (counted, nothing charged)."""
        if limiter is None:
            return None
        try:
            return limiter.charge(client, sum(len(p) for p in prompts) * choices)
        except ClientRateExceeded:
            metrics.on_rejected(RATE_REJECT_REASON)
            raise

    def gap_timer() -> TokenGapTimer:
        """TBT as clients get it (token_gaps.py), lanes by the threshold the engine runs with now."""
        return TokenGapTimer(metrics.observe_token_gap, engine.stats().scheduler.short_prompt_threshold)

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

    async def compiled(grammar: Grammar | None, param: str = "response_format") -> Grammar | None:
        """Compile on a worker thread (into the engine's cache), not on the event loop."""
        try:
            if grammar is not None:
                await tokenized(tokenizer_pool.call(engine.check_grammar, grammar))
        except InvalidRequestError as exc:
            if param == exc.param:
                raise
            raise InvalidRequestError(str(exc), param=param) from None
        return grammar

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        admit(body, "/v1/completions")
        client = client_of(request, body)
        hold = take_share(client, len(body.prompts()) * body.n)
        with release_on_error(hold):
            return await _completions(body, request, hold, client)

    async def _completions(body: CompletionRequest, request: Request, hold: ClientHold, client: str):
        prompts = [await tokenized(tokenizer_pool.encode(p)) if isinstance(p, str) else p for p in body.prompts()]
        grammar, param = body.constraint()
        grammar = await compiled(grammar, param)
        jobs = [Job(ids, sampling_params(body, max_tokens=body.max_tokens if body.max_tokens is not None else 16,
                                         logprobs=body.logprobs, grammar=grammar, choice=choice), index)
                for index, ids in enumerate(prompts) for choice in range(body.n)]
        echo = None
        if body.echo:
            texts = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in body.prompts()]
            echo = [texts[job.prompt_index] for job in jobs]
        shaper = CompletionShaper(state.served_model_name, token_text, echo=echo)
        charge = take_tokens(client, prompts, body.n)
        return await run_request(engine, lifecycle, request, jobs, shaper, body.stream,
                                 body.include_usage_in_stream(), body.continuous_usage(), hold=hold,
                                 refund=charge.refund if charge is not None else None, gaps=gap_timer())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        admit(body, "/v1/chat/completions")
        client = client_of(request, body)
        hold = take_share(client, body.n)
        with release_on_error(hold):
            return await _chat_completions(body, request, hold, client)

    async def _chat_completions(body: ChatCompletionRequest, request: Request, hold: ClientHold, client: str,
                                shaper_for=None):
        """`shaper_for(tools=..., forced=..., parallel_tool_calls=...)`: the shaper of another API served by
        this chat completion (/v1/responses); by default a ChatShaper."""
        tools = body.active_tools()
        prompt = await tokenized(tokenizer_pool.render_chat(body.template_messages(), body.add_generation_prompt,
                                                            tools or None, body.chat_template_kwargs))
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:  # OpenAI's default: as much as the context allows
            max_tokens = max(engine.max_model_len - len(prompt), 1)
        forced = body.forced_call(tools)
        grammar, param = body.constraint()
        if forced is not None:
            grammar, param = Grammar("json_schema", json.dumps(forced.schema())), "tools"
        grammar = await compiled(grammar, param)
        jobs = [Job(prompt, sampling_params(body, max_tokens=max_tokens, logprobs=body.top_logprobs_count(),
                                            grammar=grammar, choice=choice)) for choice in range(body.n)]
        shape = dict(tools=tools, forced=forced, parallel_tool_calls=body.parallel_tool_calls is not False)
        shaper = (ChatShaper(state.served_model_name, token_text, tool_format=tool_call_parser, **shape)
                  if shaper_for is None else shaper_for(**shape))
        charge = take_tokens(client, [prompt], body.n)
        return await run_request(engine, lifecycle, request, jobs, shaper, body.stream,
                                 body.include_usage_in_stream(), body.continuous_usage(), hold=hold,
                                 refund=charge.refund if charge is not None else None, gaps=gap_timer())

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        admit(body, "/v1/responses")
        history = store.conversation(body.previous_response_id) if body.previous_response_id else []
        chat = body.chat_request(history)
        try:
            chat.check_supported()
        except InvalidRequestError:
            metrics.on_rejected("invalid")
            raise
        client = client_of(request, body)
        hold = take_share(client, 1)

        def keep(response: dict, output: dict) -> None:
            if body.keeps:
                store.keep(response["id"], body.previous_response_id, [*input_messages(body.input), output])

        def shaper_for(**shape) -> ResponsesShaper:
            return ResponsesShaper(state.served_model_name, body.model_dump(include=set(ECHO_DEFAULTS)),
                                   token_text, tool_format=tool_call_parser, on_done=keep, **shape)

        with release_on_error(hold):
            return await _chat_completions(chat, request, hold, client, shaper_for)

    @app.get("/v1/models")
    async def models() -> dict:
        created = now_unix()
        cards = [ModelCard(id=name, created=created, max_model_len=engine.max_model_len, root=engine.model_name)
                 for name in model_names]
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return ModelCard(id=model_id, created=now_unix(), max_model_len=engine.max_model_len,
                         root=engine.model_name).model_dump()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        check_unknown(body, "/tokenize")
        body.check_text()
        for index, message in enumerate(body.messages or []):
            message.check_text_only(f"messages[{index}]")
        if body.messages is not None:
            messages = [m.template_dict() for m in body.messages]
            tools = [t.as_dict() for t in body.tools or []] or None
            tokens = await tokenized(tokenizer_pool.render_chat(messages, body.add_generation_prompt, tools))
        else:
            tokens = await tokenized(tokenizer_pool.encode(body.prompt or ""))
        reply = {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            reply["token_strs"] = [token_text(t) for t in tokens]
        return reply

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        check_unknown(body, "/detokenize")
        bad = [t for t in body.tokens if t >= engine.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary of {engine.vocab_size}",
                                      param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    def engine_dead() -> bool:
        """Started, yet the step thread is gone: only a restart helps (liveness fails)."""
        return lifecycle.ready and not engine.is_running

    @app.get("/health")
    async def health():
        if engine_dead():
            return error_response(503, "the engine has stopped", code="engine_stopped")
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
