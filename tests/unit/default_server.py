"""A real `metronome serve` with the default model (SmolLM2-135M-Instruct) for the client-library tests, and
the pieces they share: a recorder of what a library sends, and the prompt the server renders for it.

The model is tiny: the tests assert protocol behaviour (a call comes back as a call whose arguments fit the
schema, results reach the prompt), never answer quality. One server per test module.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from api_helpers import free_port, wait_until

MODEL = "smollm2-135m-instruct"
KEY = "sk-clients"


@dataclass
class Served:
    url: str
    log: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@contextlib.contextmanager
def default_server(folder: Path, *extra: str):
    """`metronome serve` on 127.0.0.1 with the default model on the CPU, until the block ends."""
    port = free_port()
    log_path = folder / "serve.log"
    cmd = [str(Path(sys.executable).with_name("metronome")), "serve", "--device", "cpu", "--host", "127.0.0.1",
           "--port", str(port), "--api-key", KEY, "--max-model-len", "4096", "--log-level", "info", *extra]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url) or process.poll() is not None, timeout=240, what="metronome serve ready")
        assert process.poll() is None, log_path.read_text()
        yield Served(url, log_path)
    finally:
        process.terminate()
        process.wait(timeout=60)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Recorder:
    """httpx clients (sync and async) that keep the JSON body of every POST a client library sends."""

    bodies: list[tuple[str, dict]] = field(default_factory=list)

    def _record(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.bodies.append((request.url.path, json.loads(request.read() or b"null")))

    async def _record_async(self, request: httpx.Request) -> None:
        self._record(request)

    def client(self) -> httpx.Client:
        return httpx.Client(timeout=300, event_hooks={"request": [self._record]})

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=300, event_hooks={"request": [self._record_async]})

    def sent(self, path_end: str) -> list[dict]:
        return [body for path, body in self.bodies if path.endswith(path_end)]


def rendered_prompt(served: Served, body: dict) -> str:
    """The prompt text the server renders for a chat body or a Responses body (without previous_response_id)."""
    if "input" in body:
        from metronome.server.api.responses_request import ResponsesRequest

        chat = ResponsesRequest.model_validate(body).chat_request([])
        body = {"messages": [m.model_dump(exclude_none=True) for m in chat.messages],
                "tools": [t.as_dict() for t in chat.tools or []] or None}
    reply = httpx.post(served.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=60, json={
        "messages": body["messages"], "tools": body.get("tools"), "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    return "".join(reply.json()["token_strs"])


def tool_call_text(name: str, arguments: str) -> str:
    """A call as a template without tool support shows it to the model (tool_prompt.call_text)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": json.loads(arguments)}) + "\n</tool_call>"


def tool_result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"
