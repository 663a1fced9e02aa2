"""Model loading: Hugging Face folders (Llama, Qwen2, tied embeddings, Llama 3 rope) against transformers,
GGUF metadata and Q/K un-permutation, random presets, and bad model specs."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import decoder_writer, finish, llama_cpp_permute
from test_model_exact import PagedCache

from metronome.contract.errors import InvalidRequestError, ModelNotFoundError
from metronome.server.models import ModelConfig, UnsupportedModelError, load_model
from metronome.server.models.families import build_model
from metronome.server.models.gguf_loader import unpermute_rows
from metronome.server.models.hf_config import config_from_hf_dict
from metronome.server.models.llama import LlamaForCausalLM
from metronome.server.models.loader import parse_model_spec
from metronome.server.models.presets import PRESETS, preset_config, preset_names
from metronome.server.models.rope import compute_inv_freq

VOCAB = 320
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer without merges (one token per byte) plus specials, saved in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *sorted(alphabet)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    tokenizer.save_pretrained(folder)


def save_hf_model(folder: Path, config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases start at 1/0: randomise them so a mix-up would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


def our_prefill_logits(loaded, ids: list[int]) -> torch.Tensor:
    cache = PagedCache(loaded.config, 1, len(ids))
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache.kv, cache.metadata([0], [len(ids)]))
        return loaded.model.compute_logits(hidden)


def assert_matches_transformers(folder: Path, hf_model, prompt_len: int = 24) -> None:
    loaded = load_model(f"hf-dir:{folder}", dtype="float32", device="cpu", attention_backend="torch")
    ids = torch.randint(3, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(our_prefill_logits(loaded, ids), expected, rtol=0, atol=1e-4)


def test_hf_llama_folder_matches_transformers(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(**SMALL, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    hf_model = save_hf_model(tmp_path, config)
    assert_matches_transformers(tmp_path, hf_model)
    loaded = load_model(str(tmp_path), attention_backend="torch")  # a bare folder path works too
    assert loaded.name == tmp_path.name and loaded.config.architecture == "llama"
    assert loaded.model.lm_head is not None and loaded.tokenizer.eos_token_ids == (2,)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo wörld")) == "héllo wörld"


def test_hf_qwen2_folder_with_qkv_bias_matches_transformers(tmp_path):
    from transformers import Qwen2Config

    config = Qwen2Config(**SMALL, rope_theta=1000000.0, tie_word_embeddings=False)
    hf_model = save_hf_model(tmp_path, config)
    assert hf_model.model.layers[0].self_attn.q_proj.bias is not None
    assert_matches_transformers(tmp_path, hf_model)
    loaded = load_model(f"hf-dir:{tmp_path}", attention_backend="torch")
    assert loaded.config.attention_bias and not loaded.config.attention_output_bias


def test_tied_embeddings_share_one_matrix(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(**SMALL, tie_word_embeddings=True)
    hf_model = save_hf_model(tmp_path, config)
    assert_matches_transformers(tmp_path, hf_model)
    loaded = load_model(f"hf-dir:{tmp_path}", attention_backend="torch")
    assert loaded.config.tie_word_embeddings and loaded.model.lm_head is None


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
    ours = config_from_hf_dict(config.to_dict())
    assert ours.rope_scaling["rope_type"] == "llama3"
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    assert torch.equal(compute_inv_freq(ours), expected)
    # All three bands are exercised: frequencies kept, divided by the factor, and blended in between.
    plain_raw = {**config.to_dict(), "rope_parameters": {"rope_theta": 500000.0}}
    plain = compute_inv_freq(config_from_hf_dict(plain_raw))
    kept, slowed = plain == expected, torch.isclose(plain / 8.0, expected, rtol=1e-6, atol=0)
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()
    hf_model = save_hf_model(tmp_path, config)
    assert_matches_transformers(tmp_path, hf_model, prompt_len=100)  # well past original_max_position_embeddings


def test_classic_config_keys_are_read():
    """config.json files written by transformers 4 (rope_theta + rope_scaling with "type") read the same."""
    raw = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": 131072, "bos_token_id": 128000,
           "eos_token_id": [128001, 128008, 128009],
           "rope_scaling": {**LLAMA3_ROPE, "rope_type": None, "type": "llama3",
                            "original_max_position_embeddings": 8192}}
    config = config_from_hf_dict(raw, generation={"eos_token_id": [128009, 128001]})
    assert config.eos_token_ids == (128009, 128001, 128008)  # generation_config first, then config.json
    assert config == replace(preset_config("llama-3.1-8b"), eos_token_ids=config.eos_token_ids)


def test_sliding_windows_are_per_layer_and_never_cap_the_context():
    raw = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 32768, "sliding_window": 4096}
    config = config_from_hf_dict(raw)
    assert config.max_position_embeddings == 32768 and config.layer_windows == (4096,) * 32
    assert config_from_hf_dict({**raw, "sliding_window": None}).layer_windows == (None,) * 32
    qwen = {**raw, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 30}
    assert config_from_hf_dict(qwen).layer_windows == (None,) * 30 + (4096,) * 2
    assert config_from_hf_dict({**qwen, "use_sliding_window": False}).layer_windows == (None,) * 32
    gemma = {**raw, "model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 512,
             "hidden_activation": "gelu_pytorch_tanh"}
    assert config_from_hf_dict(gemma).layer_windows == ((512,) * 5 + (None,)) * 2


def test_unsupported_configs_say_why():
    base = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        config_from_hf_dict({**base, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="rope scaling 'yarn'"):
        config_from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        config_from_hf_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="multiple of"):
        config_from_hf_dict({**base, "num_key_value_heads": 3})
    with pytest.raises(ModelNotFoundError, match="intermediate_size"):
        config_from_hf_dict({k: v for k, v in base.items() if k != "intermediate_size"})


def test_gguf_unpermute_inverts_llama_cpp_permutation():
    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        permuted = llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight)
        assert np.array_equal(unpermute_rows(permuted, heads), weight)


def write_gguf(path: Path, hf_model, arch: str) -> None:
    """Write a transformers model as llama.cpp's converter would (float32 tensors, Q/K permuted for llama)."""
    config = hf_model.config
    writer, _ = decoder_writer(path, config, arch)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in hf_model.state_dict().items():
        array = tensor.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{suffix}"
            if arch == "llama" and module == "self_attn.q_proj":
                array = llama_cpp_permute(array, config.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                array = llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(gguf_name, array)
    finish(writer)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_weights_and_config_match_transformers(tmp_path, arch):
    """A GGUF written like llama.cpp's converter (permuted Q/K for llama; qkv biases for qwen2) computes what
    the original transformers model computes."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from metronome.kernels import get_backend
    from metronome.server.models.gguf_loader import gguf_config, gguf_metadata, gguf_weights, open_gguf
    from metronome.server.models.loader import build_empty_model

    config_class = LlamaConfig if arch == "llama" else Qwen2Config
    torch.manual_seed(1)
    hf_model = AutoModelForCausalLM.from_config(config_class(**SMALL, rope_theta=20000.0,
                                                             tie_word_embeddings=arch == "qwen2")).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, hf_model, arch)

    reader = open_gguf(path)
    config = gguf_config(reader, gguf_metadata(reader))
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == (arch, arch == "qwen2",
                                                                                      arch == "qwen2")
    assert (config.rope_theta, config.num_key_value_heads, config.max_position_embeddings) == (20000.0, 2, 512)
    model = build_empty_model(config, get_backend("torch"), torch.device("cpu"), torch.float32)
    model.load_weights(gguf_weights(reader, config))
    loaded = type("Loaded", (), {"model": model, "config": config})()
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(our_prefill_logits(loaded, ids), expected, rtol=0, atol=1e-4)


def test_gguf_rope_freqs_tensor_divides_the_frequencies():
    """Llama 3.1 GGUFs carry their rope scaling as llama.cpp's `rope_freqs` factors instead of metadata."""
    config = preset_config("tiny")
    model = LlamaForCausalLM(config, attention=None)
    plain = model.model.rotary.inv_freq.clone()
    factors = torch.linspace(1.0, 8.0, plain.numel())
    model.model.rotary.set_freq_factors(factors)
    assert torch.equal(model.model.rotary.inv_freq, plain / factors)
    with pytest.raises(ValueError, match="rope_freqs has 3 entries"):
        model.model.rotary.set_freq_factors(torch.ones(3))


def test_default_gguf_config_is_smollm2_135m():
    from metronome.server.models.default_model import default_model_path
    from metronome.server.models.gguf_loader import gguf_config, gguf_metadata, open_gguf

    reader = open_gguf(default_model_path())
    config = gguf_config(reader, gguf_metadata(reader))
    preset = preset_config("smollm2-135m")
    assert config.rms_norm_eps == pytest.approx(preset.rms_norm_eps)
    assert config == ModelConfig(**{**PRESETS["smollm2-135m"], "rms_norm_eps": config.rms_norm_eps})


@pytest.mark.parametrize("name", preset_names())
def test_presets_build_with_their_shapes_on_meta(name):
    config = preset_config(name)
    with torch.device("meta"):
        model = build_model(config, attention=None)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (config.q_size + 2 * config.kv_size,
                                                                      config.hidden_size)


def test_preset_sizes_are_real():
    assert preset_config("llama-3-8b").num_parameters() == pytest.approx(8.03e9, rel=0.01)
    assert preset_config("llama-3-70b").num_parameters() == pytest.approx(70.6e9, rel=0.01)
    assert preset_config("mistral-7b").num_parameters() == pytest.approx(7.24e9, rel=0.01)
    assert preset_config("qwen2-7b").num_parameters() == pytest.approx(7.62e9, rel=0.01)
    assert preset_config("smollm2-135m").num_parameters() == pytest.approx(134.5e6, rel=0.01)


def test_random_models_are_deterministic_per_seed_and_sane():
    first = load_model("random:tiny", seed=5, attention_backend="torch")
    again = load_model("random:tiny", seed=5, attention_backend="torch")
    other = load_model("random:tiny", seed=6, attention_backend="torch")
    for (name, a), b, c in zip(first.model.state_dict().items(), again.model.state_dict().values(),
                               other.model.state_dict().values()):
        assert torch.equal(a, b), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(a, c), name
    assert first.dtype == torch.float32 and first.name == "random:tiny"
    logits = our_prefill_logits(first, first.tokenizer.encode("hello there"))
    assert torch.isfinite(logits).all() and 0.01 < logits.std().item() < 10


def test_random_bf16_model_runs():
    loaded = load_model("random:tiny", dtype="bf16", attention_backend="torch")
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    cache = PagedCache(loaded.config, 1, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor([1, 50, 60]), torch.arange(3), cache.kv, cache.metadata([0], [3]))
        logits = loaded.model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_bad_specs_raise_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="valid presets: .*llama-3-8b.*tiny"):
        load_model("random:llama-9")
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(f"gguf:{tmp_path / 'missing.gguf'}")
    with pytest.raises(ModelNotFoundError, match="empty"):
        load_model("  ")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ModelNotFoundError, match="cannot read GGUF"):
        load_model(str(garbage))
    with pytest.raises(ModelNotFoundError, match="config.json is missing"):
        load_model(f"hf-dir:{tmp_path}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelNotFoundError, match="cannot read"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **SMALL}))
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(tmp_path))
    other = tmp_path / "notes.txt"
    other.write_text("hi")
    with pytest.raises(ModelNotFoundError, match="neither a .gguf file nor a model folder"):
        parse_model_spec(str(other))


def test_weights_that_do_not_fit_the_config_are_rejected(tmp_path):
    from transformers import LlamaConfig

    save_hf_model(tmp_path, LlamaConfig(**SMALL))
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "intermediate_size": 128}))
    with pytest.raises(ModelNotFoundError, match="do not fit"):
        load_model(str(tmp_path), attention_backend="torch")
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    with pytest.raises(ModelNotFoundError, match="lacks"):
        load_model(str(tmp_path), attention_backend="torch")


def test_bad_dtype_device_and_backend_are_invalid_requests():
    with pytest.raises(InvalidRequestError, match="dtype"):
        load_model("random:tiny", dtype="int8")
    with pytest.raises(InvalidRequestError, match="device"):
        load_model("random:tiny", device="tpu")
    with pytest.raises(InvalidRequestError, match="attention backend"):
        load_model("random:tiny", attention_backend="magic")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16"])
def test_torch_dequantisation_is_bit_identical_to_gguf(kind):
    """The cold-start dequantiser (torch) computes exactly what gguf's numpy reference computes."""
    from gguf.quants import GGMLQuantizationType, dequantize, quantize

    from metronome.server.models import gguf_dequant

    qtype = GGMLQuantizationType[kind]
    weights = np.random.default_rng(3).standard_normal((6, 64)).astype(np.float32) * 3
    raw = np.ascontiguousarray(quantize(weights, qtype)).view(np.uint8).reshape(-1)
    expected = dequantize(raw.reshape(6, -1), qtype).astype(np.float32)
    assert raw.size == gguf_dequant.tensor_nbytes(int(qtype), weights.size)
    ours = gguf_dequant.dequantize(raw, int(qtype), (6, 64))
    assert ours.dtype == torch.float32 and torch.equal(ours, torch.from_numpy(expected))


def test_the_lazy_gguf_reader_matches_ggufs_own(tmp_path):
    """Metadata (string arrays decoded on demand), tensor table and tensor bytes as gguf.GGUFReader reads them."""
    import gguf

    from metronome.server.models.gguf_file import GGUFFile, StringArray

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["<s>", "</s>", "héllo", "wörld"])
    writer.add_token_types([3, 3, 1, 1])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_chat_template("{{ messages }}")
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones((2, 32), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    tokens = ours.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == 4 and list(tokens) == ["<s>", "</s>", "héllo", "wörld"]
    assert ours.metadata["tokenizer.ggml.token_type"] == [3, 3, 1, 1]
    assert ours.metadata["test.nested"] == [[1, 2], [3]]
    assert ours.metadata["llama.block_count"] == 2 and ours.metadata["tokenizer.chat_template"] == "{{ messages }}"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(int(d) for d in reference.shape)
        assert mine.ggml_type == int(reference.tensor_type)
        assert bytes(ours.raw(mine, reference.n_bytes)) == bytes(np.asarray(reference.data).view(np.uint8).reshape(-1))


def test_a_truncated_gguf_is_a_model_error(tmp_path):
    from metronome.server.models.default_model import default_model_path
    from metronome.server.models.gguf_loader import open_gguf

    path = tmp_path / "cut.gguf"
    path.write_bytes(default_model_path().read_bytes()[:4096])
    with pytest.raises(ModelNotFoundError, match="cannot read GGUF file"):
        open_gguf(path)
    (tmp_path / "not.gguf").write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ModelNotFoundError, match="GGUF magic"):
        open_gguf(tmp_path / "not.gguf")
