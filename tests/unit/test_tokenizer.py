"""Tokenizers: SmolLM2's (built from its GGUF), the byte-level one of random presets, chat templates, and
streaming detokenization (concatenated deltas == decode of all ids)."""
from __future__ import annotations

import random

import pytest

from metronome.contract.errors import InvalidRequestError, ModelNotFoundError
from metronome.server.models.tokenizer import REPLACEMENT_CHAR, ByteTokenizer, HFTokenizer, load_hf_tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Emoji 🍓🧑‍🚀 and accents: crêpe, naïve, Ørsted",
    "中文：今天天气很好，我们去公园吧。日本語も。",
    "def f(x):\n    return x ** 2  # squares\n",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    from metronome.server.models.default_model import default_model_path
    from metronome.server.models.gguf_loader import open_gguf_cached

    path = default_model_path()
    _, metadata = open_gguf_cached(path)
    return load_hf_tokenizer(path.parent, "smollm2", (2,), 1, gguf_file=path.name,
                             chat_template=metadata.get("tokenizer.chat_template"),
                             gguf_tokenizer_model=metadata.get("tokenizer.ggml.model"))


def test_gguf_fast_path_builds_what_autotokenizer_builds(smollm2):
    """load_hf_tokenizer skips AutoTokenizer for byte-level BPE GGUFs; it must not change a thing."""
    from transformers import AutoTokenizer

    from metronome.server.models.default_model import default_model_path

    path = default_model_path()
    auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    ours = smollm2.hf_tokenizer
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.all_special_ids == auto.all_special_ids and ours.chat_template == auto.chat_template
    for text in TEXTS:
        assert smollm2.encode(text) == auto.encode(text)


def stream(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    decoder = tokenizer.incremental_decoder()
    deltas = [decoder.push(token) for token in ids]
    return deltas, "".join(deltas) + decoder.finish()


def test_smollm2_encodes_like_transformers_and_round_trips(smollm2):
    # The ids transformers' own GGUF tokenizer gives (SmolLM2 adds no BOS by default).
    assert smollm2.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert smollm2.bos_token_id == 1 and smollm2.eos_token_ids == (2,) and smollm2.vocab_size == 49152
    for text in TEXTS:
        assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


def test_smollm2_special_tokens_are_skipped_on_request(smollm2):
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # the markers are single special tokens
    assert smollm2.decode(ids) == "user\nhi"
    assert smollm2.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_smollm2_chat_template_is_the_models_own(smollm2):
    messages = [{"role": "user", "content": "Hi there"}]
    ids = smollm2.apply_chat_template(messages)
    text = smollm2.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds its default system prompt
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = smollm2.decode(smollm2.apply_chat_template(messages, add_generation_prompt=False),
                               skip_special_tokens=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]
    with pytest.raises(InvalidRequestError):
        smollm2.apply_chat_template([])
    with pytest.raises(InvalidRequestError):
        smollm2.apply_chat_template([{"content": "no role"}])


def test_missing_chat_template_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, "<unk>")))
    tokenizer = HFTokenizer(bare, "bare")
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}])


def test_missing_tokenizer_files_raise_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="cannot load the tokenizer"):
        load_hf_tokenizer(tmp_path, "empty", (), None)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_streaming_matches_full_decode(smollm2, text):
    ids = smollm2.encode(text)
    deltas, streamed = stream(smollm2, ids)
    assert streamed == smollm2.decode(ids)
    # Nothing half-decoded is ever emitted for valid text.
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


def test_smollm2_streaming_holds_back_split_characters(smollm2):
    ids = smollm2.encode("🍓")
    assert len(ids) > 1  # byte-level BPE splits the emoji's 4 bytes over several tokens
    deltas, streamed = stream(smollm2, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🍓" and streamed == "🍓"


def test_streaming_random_ids_matches_full_decode(smollm2):
    """Random models emit arbitrary ids, partial UTF-8 included: streaming must still add up to decode()."""
    rng = random.Random(0)
    byte_tokenizer = ByteTokenizer(512, "random:tiny")
    for tokenizer, vocab in ((smollm2, 49152), (byte_tokenizer, 512)):
        for _ in range(20):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
            assert stream(tokenizer, ids)[1] == tokenizer.decode(ids)


def test_byte_tokenizer_round_trips_and_marks_specials():
    tokenizer = ByteTokenizer(512, "random:tiny", bos_token_id=1, eos_token_ids=(2,))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == 1 and all(3 <= i < 259 for i in ids[1:])
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("a", add_special_tokens=False) == [ord("a") + 3]
    assert tokenizer.decode([1, 100, 2], skip_special_tokens=False) == "<s>a</s>"
    assert tokenizer.decode([3 + ord("a") + 256]) == "a"  # ids past the bytes wrap around


def test_byte_tokenizer_renders_chatml():
    tokenizer = ByteTokenizer(512, "random:tiny")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_byte_tokenizer_needs_room_for_the_bytes():
    with pytest.raises(ModelNotFoundError, match="at least 259"):
        ByteTokenizer(100, "too-small")


def test_byte_tokenizer_streams_like_its_full_decode_with_and_without_specials():
    rng = random.Random(1)
    tokenizer = ByteTokenizer(512, "random:tiny")
    for _ in range(50):
        ids = [rng.randrange(512) for _ in range(rng.randrange(1, 200))]
        for skip in (True, False):
            decoder = tokenizer.incremental_decoder(skip_special_tokens=skip)
            streamed = "".join(decoder.push(t) for t in ids) + decoder.finish()
            assert streamed == tokenizer.decode(ids, skip_special_tokens=skip)
    deltas, streamed = stream(tokenizer, tokenizer.encode("🍓!", add_special_tokens=False))
    assert deltas == ["", "", "", "🍓", "!"] and streamed == "🍓!"


def test_long_streams_slide_the_window_and_decode_about_once_per_token(smollm2):
    """Past IncrementalDecoder.WINDOW tokens the window moves on; the text must still add up, with about one
    decode call per token (the second per token is what the cached prefix text saves)."""
    from metronome.server.models.tokenizer import IncrementalDecoder

    text = " ".join(TEXTS) * 4
    ids = smollm2.encode(text)
    calls = []

    def counting_decode(window: list[int]) -> str:
        calls.append(len(window))
        return smollm2.decode(window)

    decoder = IncrementalDecoder(counting_decode)
    streamed = "".join(decoder.push(t) for t in ids)
    pushes = len(calls)
    assert streamed + decoder.finish() == smollm2.decode(ids)
    assert len(ids) > 4 * IncrementalDecoder.WINDOW
    assert pushes <= 1.2 * len(ids) and max(calls[:pushes]) <= 2 * IncrementalDecoder.WINDOW
