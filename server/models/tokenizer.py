"""Tokenizers: the one a model ships (through transformers), or a byte-level one for random-weight presets.

Streaming text needs care: one token may carry half of a UTF-8 character, and SentencePiece/BPE decoders
change how a token renders depending on its neighbours. `IncrementalDecoder` decodes a short window of
recent tokens and emits only the text that became final, so that the concatenated deltas equal
`decode(all ids)`. It runs once per generated token on the engine thread, between GPU steps, so it decodes
once per token (not twice); the byte-level tokenizer streams through Python's incremental UTF-8 decoder.
"""
from __future__ import annotations

import codecs
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from metronome.contract.errors import InvalidRequestError, ModelNotFoundError

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDecoder:
    """push(token_id) → the newly final text. Call finish() at the end for text held back (an unfinished char).

    Invariant: "".join(push(t) for t in ids) + finish() == decode(ids).

    The window ids[prefix_offset:] is decoded once per push; the text of its emitted part (ids[prefix_offset:
    read_offset]) is kept from the push that emitted it instead of being decoded again. The window start moves
    up to the last emission point once the window holds more than WINDOW tokens (one extra decode then), so
    decodes stay short.
    """

    WINDOW = 16

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (context that fixes how the next token renders)
        self._read_offset = 0  # tokens before this have been emitted
        self._prefix_text = ""  # == decode(ids[prefix_offset:read_offset])
        self._emitted: list[str] = []

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        full_text = self._decode(self._ids[self._prefix_offset:])
        prefix_text = self._prefix_text
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            delta = full_text[len(prefix_text):]
            end = len(self._ids)
            if end - self._prefix_offset > self.WINDOW:
                self._prefix_offset = self._read_offset
                self._prefix_text = self._decode(self._ids[self._prefix_offset:end])
            else:
                self._prefix_text = full_text
            self._read_offset = end
            self._emitted.append(delta)
            return delta
        return ""

    def finish(self) -> str:
        """The text still held back (e.g. a token sequence that ends inside a UTF-8 character)."""
        emitted = "".join(self._emitted)
        full = self._decode(self._ids)
        tail = full[len(emitted):] if full.startswith(emitted) else ""
        self._emitted.append(tail)
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        return tail


class ByteIncrementalDecoder:
    """ByteTokenizer's streaming decode: each id is one byte, fed to Python's incremental UTF-8 decoder (errors
    "replace", like ByteTokenizer.decode), which holds back an unfinished character by itself. O(1) per token."""

    def __init__(self, tokenizer: ByteTokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        token = int(token_id)
        if token in self._tokenizer.special_ids:
            if self._skip_special:
                return ""
            return self.finish() + self._tokenizer.special_text(token)
        return self._utf8.decode(bytes(((token - ByteTokenizer.BYTE_OFFSET) % 256,)))

    def finish(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


class Tokenizer:
    """The interface the engine and the API use; see HFTokenizer and ByteTokenizer."""

    name: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        raise NotImplementedError

    def chat_template_source(self) -> str | None:
        """The Jinja source of the model's chat template (None when rendering is built in)."""
        return None

    def max_chars_per_token(self) -> int:
        """An upper bound on the characters of text one token stands for (the API's cheap size check)."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Render with the model's own chat template and tokenize (the template writes its own special tokens).
        `tools`: OpenAI-style function definitions, handed to a template that reads them."""
        _check_messages(messages)
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(lambda ids: self.decode(ids, skip_special_tokens=skip_special_tokens))


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InvalidRequestError("each message needs a 'role' and a 'content'", param="messages")


class HFTokenizer(Tokenizer):
    """A transformers tokenizer (from a model folder, or built from a GGUF file's metadata)."""

    def __init__(self, hf_tokenizer: Any, name: str, eos_token_ids: tuple[int, ...] = (),
                 bos_token_id: int | None = None, chat_template: str | None = None):
        self._tok = hf_tokenizer
        self.name = name
        if chat_template and not getattr(hf_tokenizer, "chat_template", None):
            hf_tokenizer.chat_template = chat_template
        own_eos = hf_tokenizer.eos_token_id
        self.eos_token_ids = tuple(dict.fromkeys([*eos_token_ids, *([own_eos] if own_eos is not None else [])]))
        self.bos_token_id = bos_token_id if bos_token_id is not None else hf_tokenizer.bos_token_id
        self.vocab_size = len(hf_tokenizer)

    @property
    def hf_tokenizer(self) -> Any:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The Rust backend's batch encoder releases the GIL (its single-text encode does not), so a long prompt
        # tokenized on a worker thread leaves the event loop and the engine thread running. Same ids as
        # transformers' encode: its post-processor adds the special tokens either way.
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens))
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def max_chars_per_token(self) -> int:
        # Every vocabulary entry is spelled with at least one character per character it decodes to (byte-level
        # BPE: one per byte; SentencePiece: "\u2581" per space; byte fallback "<0x41>" is longer still).
        return self._max_chars_per_token

    @functools.cached_property
    def _max_chars_per_token(self) -> int:
        return max(len(token) for token in self._tok.get_vocab())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces: the text is what the tokens say, and streaming stays consistent with it.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        if not getattr(self._tok, "chat_template", None):
            raise InvalidRequestError(f"model {self.name!r} ships no chat template; send a plain prompt instead",
                                      param="messages")
        return self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **({"tools": tools} if tools else {}))

    def chat_template_source(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None


def load_hf_tokenizer(folder: Path, name: str, eos_token_ids: tuple[int, ...], bos_token_id: int | None,
                      gguf_file: str | None = None, chat_template: str | None = None,
                      gguf_tokenizer_model: str | None = None) -> HFTokenizer:
    """transformers' tokenizer for a local folder (or a GGUF file in it); never touches the network."""
    path = Path(folder) / (gguf_file or "")
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = None
    hf_tokenizer = _cached_hf_tokenizer(str(folder), gguf_file, gguf_tokenizer_model, stamp)
    return HFTokenizer(hf_tokenizer, name, eos_token_ids, bos_token_id, chat_template)


@functools.lru_cache(maxsize=4)
def _cached_hf_tokenizer(folder: str, gguf_file: str | None, gguf_tokenizer_model: str | None, stamp: int | None):
    """Built once per process and file version (engines and tests load the same model many times).

    A GGUF file with a byte-level BPE vocabulary ("gpt2") is built by PreTrainedTokenizerFast directly: the same
    conversion AutoTokenizer runs, without AutoTokenizer first parsing the whole file again to pick a config
    (10x slower). Other GGUF vocabularies go through AutoTokenizer, which picks their model-specific class.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    factory = PreTrainedTokenizerFast if gguf_tokenizer_model == "gpt2" else AutoTokenizer
    converted = converted_tokenizer_dir(Path(folder) / gguf_file, stamp) \
        if gguf_file is not None and factory is AutoTokenizer else None
    if converted is not None and (converted / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
        except Exception:  # noqa: BLE001 - a damaged cache entry: convert again below
            pass
    try:
        tokenizer = factory.from_pretrained(folder, **kwargs)
    except Exception as error:  # transformers raises OSError/ValueError/KeyError variants for missing files
        raise ModelNotFoundError(f"cannot load the tokenizer of {Path(folder) / (gguf_file or '')}: {error}") from None
    if converted is not None:
        _save_converted(tokenizer, converted)
    return tokenizer


def converted_tokenizer_dir(gguf_path: Path, stamp: int | None) -> Path | None:
    """Where the tokenizer converted from this GGUF file is kept: SentencePiece-style vocabularies take
    AutoTokenizer tens of seconds to convert (Gemma 3's 262,144 pieces: 24 s of a 35 s start to first token on the
    2-core VM), so the result is saved once in the model cache under the file's identity (path, size, mtime) and
    transformers' version, and loaded from there afterwards. None: no cache (the file cannot be read)."""
    import hashlib

    import transformers

    from metronome.server.models.fetch.cache import default_cache_root

    try:
        size = gguf_path.stat().st_size
    except OSError:
        return None
    identity = f"{gguf_path.resolve()}|{size}|{stamp}|{transformers.__version__}"
    return default_cache_root() / "tokenizers" / hashlib.sha256(identity.encode()).hexdigest()[:24]


def _save_converted(tokenizer: Any, target: Path) -> None:
    """Saved under a temporary name and renamed whole: a reader never sees half a tokenizer. A cache that cannot
    be written (read-only home, full disk) only costs the next start-up the conversion again."""
    import shutil
    import tempfile

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
        try:
            tokenizer.save_pretrained(str(partial))
            partial.replace(target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    except OSError:
        pass


class ByteTokenizer(Tokenizer):
    """Deterministic byte-level tokenizer for random-weight models: 0 <unk>, 1 <s>, 2 </s>, 3+b = byte b.

    Ids above 258 (random models emit them) decode to byte (id - 3) % 256, so every id sequence decodes.
    Chat messages are rendered in ChatML so chat endpoints work on random models too.
    """

    SPECIALS = ("<unk>", "<s>", "</s>")
    BYTE_OFFSET = 3

    def __init__(self, vocab_size: int, name: str, bos_token_id: int | None = 1, eos_token_ids: tuple[int, ...] = (2,)):
        if vocab_size < 256 + self.BYTE_OFFSET:
            raise ModelNotFoundError(f"a byte-level tokenizer needs a vocabulary of at least 259, got {vocab_size}")
        self.vocab_size = vocab_size
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self._special_ids = {0, 1, 2, *([bos_token_id] if bos_token_id is not None else []), *eos_token_ids}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [byte + self.BYTE_OFFSET for byte in text.encode("utf-8")]
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def max_chars_per_token(self) -> int:
        return 1  # one byte per token, and a character is at least one byte

    @property
    def special_ids(self) -> set[int]:
        return self._special_ids

    def special_text(self, token: int) -> str:
        return self.SPECIALS[token] if token < len(self.SPECIALS) else f"<special_{token}>"

    def incremental_decoder(self, skip_special_tokens: bool = True) -> ByteIncrementalDecoder:
        return ByteIncrementalDecoder(self, skip_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        pieces: list[str] = []
        pending = bytearray()
        for token in ids:
            token = int(token)
            if token in self._special_ids:
                if skip_special_tokens:
                    continue
                pieces.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                pieces.append(self.special_text(token))
                continue
            pending.append((token - self.BYTE_OFFSET) % 256)
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
