"""Prompt tokenization and chat templating on worker threads, after a size check that costs nothing.

A long prompt tokenized on the event loop stalls every other client's stream for as long as it takes (a 16 MB
prompt stopped all streams for 0.77 s). Here the loop only checks the prompt's length in characters against
what the context could possibly hold, then hands the work to a small thread pool: the tokenizer's encoder is
Rust and releases the GIL (HFTokenizer.encode), so the loop and the engine thread keep running meanwhile.

The size check is exact in one direction only: no token decodes to more characters than the longest
vocabulary entry spells (`Tokenizer.max_chars_per_token`), so a prompt of more than `max_model_len` times that
many characters cannot fit and is refused without tokenizing; anything shorter is tokenized and the engine
checks the real count.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from metronome.contract.errors import EngineOverloadedError, InvalidRequestError
from metronome.server.api.chat_template import render_chat_prompt
from metronome.server.api.limits import DEFAULT_TOKENIZER_WORKERS


class TokenizerPool:
    """`encode` and `render_chat` run on `workers` threads; at most `max_pending` wait at once (then 429)."""

    def __init__(
        self, tokenizer, max_model_len: int, workers: int = DEFAULT_TOKENIZER_WORKERS, max_pending: int = 1024
    ):
        if workers < 1:
            raise ValueError(f"--tokenizer-workers must be >= 1, got {workers}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_pending = max_pending
        self.workers = workers
        self._executor: ThreadPoolExecutor | None = None
        self._pending = 0

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.tokenizer.max_chars_per_token()

    def check_size(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit the context whatever its tokens."""
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{param} has {chars} characters, more than the model's context of {self.max_model_len} tokens "
                f"can hold (a token of this tokenizer spells at most {self.tokenizer.max_chars_per_token()} "
                "characters)", param=param)

    async def encode(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        self.check_size(len(text), "prompt")
        return await self._run(self.tokenizer.encode, text)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                          tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        self.check_size(sum(len(message["content"]) for message in messages), "messages")
        return await self._run(render_chat_prompt, self.tokenizer, messages, add_generation_prompt, tools,
                               template_kwargs)

    async def call(self, fn, *args):
        """Other request preparation that may take a while (compiling a response_format grammar)."""
        return await self._run(fn, *args)

    async def _run(self, fn, *args):
        if self._pending >= self.max_pending:
            raise EngineOverloadedError(f"{self._pending} prompts are waiting to be tokenized; retry later")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="metronome-tokenize")
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._pending -= 1

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
