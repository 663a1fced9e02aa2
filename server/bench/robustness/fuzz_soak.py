"""`metronome bench fuzz`: a soak of fuzzed requests over every route; no response may be a 5xx.

Bodies are valid requests with one or more fields swapped for hostile values (lone surrogates, NaN and
Infinity, booleans and floats as token ids, huge and negative numbers, wrong types, nesting), bodies of the kind
agent frameworks send (tools, forced calls, structured outputs, /v1/responses, JSON schemas at their edges:
server/api/fuzz_bodies.py), or raw bytes that
are not a request at all (invalid UTF-8, truncated or deeply nested JSON, the wrong content type); the GET routes
and wrong methods and paths are mixed in. Every reply is checked: below 500; a 4xx from the API carries an
OpenAI-style `{"error": {"message", "type", ...}}`; a 200 stream ends with `data: [DONE]`. At the end the server
must be idle with no KV block leaked. The unit test tests/unit/test_api_fuzz.py runs the same idea in-process,
small; this is the long run whose numbers go into docs/perf/.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from metronome.server.api.fuzz_bodies import agent_body, stream_ended

SURROGATES = ["\ud800", "\udfff", "a\udc00b", "\ud83d"]
HOSTILE_VALUES = [None, True, False, 0, -1, 2**31, 2**64, 2**70, -(2**63), 1e308, 5e-324, 0.5, float("nan"),
                  float("inf"), float("-inf"), "", "x" * 300, *SURROGATES, [], [None], [True, False], {}, {"a": 1},
                  [[1, 2], [3]], ["a", "b"], [1.5], [10**9], [-1]]
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                     "stop_token_ids", "ignore_eos", "stream", "stream_options", "n", "presence_penalty",
                     "frequency_penalty", "logit_bias", "user", "echo", "best_of", "logprobs", "suffix", "unknown"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "echo", "best_of", "suffix")] + [
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt"]
GET_ROUTES = ["/v1/models", "/health", "/ready", "/metrics", "/v1/config"]


@dataclass
class Probe:
    method: str
    path: str
    content: bytes | None = None
    content_type: str = "application/json"


@dataclass
class FuzzResult:
    requests: int
    seconds: float
    statuses: dict[str, int]
    server_errors: int
    bad_error_bodies: int
    bad_streams: int
    transport_errors: dict[str, int]
    kv_blocks_leaked: float | None
    requests_running_after: float | None
    examples: list[dict] = field(default_factory=list)  # the first few failures, for the report


def probe(rng: random.Random, model: str | None) -> Probe:
    """One fuzzed request."""
    roll = rng.random()
    if roll < 0.08:
        return Probe(rng.choice(["GET", "DELETE", "PUT"]), rng.choice(GET_ROUTES + ["/v1/completions", "/nope"]))
    if roll < 0.2:
        return Probe("POST", rng.choice(["/v1/completions", "/v1/chat/completions"]), raw_junk(rng),
                     rng.choice(["application/json", "application/json", "text/plain", ""]))
    if roll < 0.5:  # what agent frameworks send: tools, structured outputs, /v1/responses (server/api/fuzz_bodies.py)
        path, body = agent_body(rng, model if rng.random() < 0.95 else None)
        return Probe("POST", path, json.dumps(body).encode())
    chat = rng.random() < 0.5
    body = valid_chat(rng) if chat else valid_completion(rng)
    if model is not None and rng.random() < 0.9:
        body["model"] = model
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        name = rng.choice(CHAT_FIELDS if chat else COMPLETION_FIELDS)
        body[name] = hostile_value(rng, name)
    text = json.dumps(body)  # NaN/Infinity as Python writes them; surrogates as \\u escapes
    return Probe("POST", "/v1/chat/completions" if chat else "/v1/completions", text.encode())


def valid_completion(rng: random.Random) -> dict:
    prompt = (rng.choice(["Hello", "The capital of France is", "1 2 3"]) if rng.random() < 0.5
              else [rng.randrange(300, 500) for _ in range(rng.randrange(1, 12))])
    return {"prompt": prompt, "max_tokens": rng.randrange(1, 6), "stream": rng.random() < 0.4,
            "temperature": rng.choice([0, 0.7, 1.0])}


def valid_chat(rng: random.Random) -> dict:
    return {"messages": [{"role": "user", "content": rng.choice(["hi", "tell me a joke", "2+2?"])}],
            "max_tokens": rng.randrange(1, 6), "stream": rng.random() < 0.4}


def hostile_value(rng: random.Random, name: str):
    if name == "messages" and rng.random() < 0.6:
        message = {"role": rng.choice(["user", "system", "assistant", "robot", ""]),
                   "content": rng.choice([rng.choice(HOSTILE_VALUES),
                                          [{"type": "text", "text": rng.choice(SURROGATES)}],
                                          [{"type": "image_url", "text": "x"}]])}
        return [message] * rng.randrange(0, 3)
    if rng.random() < 0.1:  # nested junk
        return {"k": [rng.choice(HOSTILE_VALUES) for _ in range(3)], "\ud800": 1}
    return rng.choice(HOSTILE_VALUES)


def raw_junk(rng: random.Random) -> bytes:
    kind = rng.randrange(7)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    if kind == 1:
        return b'{"prompt": "\xff\xfe invalid utf-8", "max_tokens": 2}'
    if kind == 2:
        return b'{"prompt": "truncated'
    if kind == 3:
        depth = rng.choice([100, 5000, 100_000])
        return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == 4:
        return json.dumps(rng.choice([[], "text", 3, None, [{"prompt": "a"}]])).encode()
    if kind == 5:
        return b""
    return b'{"prompt": "a", "prompt": [1, 2], "max_tokens": 1}'  # duplicate keys


def check(probe_: Probe, response: httpx.Response) -> str | None:
    """None when the reply is acceptable, else what is wrong with it."""
    status = response.status_code
    if status >= 500:
        return f"status {status}"
    api = probe_.path.startswith("/v1/") and probe_.method == "POST"
    if status >= 400 and probe_.method != "HEAD":
        try:
            error = response.json()["error"]
            if not (isinstance(error["message"], str) and error["message"].strip() and error["type"]):
                return "error body without message/type"
        except (ValueError, KeyError, TypeError):
            return "error body is not OpenAI-shaped"
    if api and status == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
        if not stream_ended(probe_.path, response.text):
            return "stream did not end as its API ends one"
    return None


async def soak(url: str, model: str | None, requests: int, concurrency: int, seed: int) -> FuzzResult:
    rng = random.Random(seed)
    if model is None:  # the served name, so that most requests get past the model check
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    probes = [probe(rng, model) for _ in range(requests)]
    statuses: Counter = Counter()
    transport: Counter = Counter()
    failures: list[dict] = []
    counts = Counter()
    queue: asyncio.Queue = asyncio.Queue()
    for item in probes:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        started = time.monotonic()
        async def worker() -> None:
            while not queue.empty():
                item = queue.get_nowait()
                headers = {"content-type": item.content_type} if item.content_type else {}
                try:
                    response = await client.request(item.method, url + item.path, content=item.content,
                                                    headers=headers)
                except httpx.HTTPError as error:
                    transport[type(error).__name__] += 1
                    continue
                statuses[str(response.status_code)] += 1
                problem = check(item, response)
                if problem is not None:
                    counts["server_errors" if problem.startswith("status") else
                           "bad_streams" if "stream" in problem else "bad_error_bodies"] += 1
                    if len(failures) < 10:
                        failures.append({"problem": problem, "method": item.method, "path": item.path,
                                         "body": (item.content or b"")[:300].decode("utf-8", "backslashreplace"),
                                         "reply": response.text[:300]})

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.monotonic() - started
        leaked, running = await idle_gauges(client, url)
    return FuzzResult(requests=requests, seconds=round(seconds, 1), statuses=dict(sorted(statuses.items())),
                      server_errors=counts["server_errors"], bad_error_bodies=counts["bad_error_bodies"],
                      bad_streams=counts["bad_streams"], transport_errors=dict(transport),
                      kv_blocks_leaked=leaked, requests_running_after=running, examples=failures)


async def idle_gauges(client: httpx.AsyncClient, url: str) -> tuple[float | None, float | None]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict = {}
    for _ in range(100):
        text = (await client.get(url + "/metrics")).text
        values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        if values.get("metronome_requests_running", 0) == 0:
            break
        await asyncio.sleep(0.1)
    return values.get("metronome_kv_blocks_leaked"), values.get("metronome_requests_running")


def run_command(args) -> int:
    """`metronome bench fuzz` (flags: cli.py)."""
    from metronome.server.bench.robustness.isolation import machine_info

    if args.url:
        result = asyncio.run(soak(args.url.rstrip("/"), args.model, args.requests, args.concurrency, args.seed))
        serve_args = None
    else:
        from metronome.server.bench.robustness.local_server import local_server

        serve_args = ["--model", args.model, "--device", "cpu", *args.serve_arg]
        with local_server(serve_args) as url:
            result = asyncio.run(soak(url, None, args.requests, args.concurrency, args.seed))
    ok = (result.server_errors == 0 and result.bad_error_bodies == 0 and result.bad_streams == 0
          and result.kv_blocks_leaked == 0)
    print(f"{result.requests} fuzzed requests in {result.seconds}s: statuses {result.statuses}; "
          f"5xx {result.server_errors}, malformed errors {result.bad_error_bodies}, broken streams "
          f"{result.bad_streams}, transport errors {result.transport_errors}; KV blocks leaked "
          f"{result.kv_blocks_leaked}, running after {result.requests_running_after}: {'PASS' if ok else 'FAIL'}")
    for example in result.examples:
        print(f"  {example}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"command_args": {"requests": args.requests, "concurrency": args.concurrency,
                                        "seed": args.seed, "url": args.url, "model": args.model,
                                        "serve_args": serve_args},
                       "machine": machine_info(), **asdict(result)}, handle, indent=2)
            handle.write("\n")
    return 0 if ok else 1
