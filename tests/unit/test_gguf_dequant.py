"""GGUF dequantisation against the gguf package's numpy reference, bit for bit: every block format on random
blocks (quantised by gguf where it can quantise the type, else random bytes with finite scales), odd shapes and
chunk boundaries, the refusals, and every tensor of a real Q4_K_M file (Gemma 3 270M)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize

from metronome.server.models import gguf_dequant
from metronome.server.models.gguf_dequant import FORMATS, UnsupportedGGMLType, dequantize, tensor_nbytes

# Byte offsets of each format's float16 factors: random bytes there could be NaN or inf, so they get finite
# values (including zero, negatives, subnormals and the largest half) instead.
HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
QUANTISABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16")
SPECIAL_HALVES = np.array([0.0, -0.0, 6e-8, -3e-5, 65504.0, -1.0], dtype=np.float16)


def random_blocks(name: str, n_blocks: int, seed: int) -> np.ndarray:
    """n_blocks random blocks of the format, as the flat uint8 bytes of a tensor."""
    form = FORMATS[getattr(gguf_dequant, name)]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_blocks, form.block_bytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[name]:
        halves = (rng.standard_normal(n_blocks) * 0.02).astype(np.float16)
        halves[:len(SPECIAL_HALVES)] = SPECIAL_HALVES[:n_blocks]
        raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def gguf_reference(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    rows = raw.reshape(shape[0], -1) if len(shape) > 1 else raw
    array = reference_dequantize(np.array(rows), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.asarray(array, dtype=np.float32).reshape(shape))


def assert_same_bits(ours: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert ours.dtype == torch.float32 and ours.shape == expected.shape, what
    assert torch.equal(ours.contiguous().view(torch.int32), expected.contiguous().view(torch.int32)), what


def test_the_format_table_matches_gguf():
    for qtype, form in FORMATS.items():
        assert GGMLQuantizationType(qtype).name == form.name
        assert GGML_QUANT_SIZES[GGMLQuantizationType(qtype)] == (form.block, form.block_bytes)


@pytest.mark.parametrize("name", sorted(HALF_OFFSETS))
@pytest.mark.parametrize("blocks_per_row, rows", [(1, 1), (3, 5), (2, 1), (7, 2)])
def test_random_blocks_match_gguf_bit_for_bit(name, blocks_per_row, rows):
    qtype = getattr(gguf_dequant, name)
    block = FORMATS[qtype].block
    shape = (rows, blocks_per_row * block) if rows > 1 else (blocks_per_row * block,)
    raw = random_blocks(name, rows * blocks_per_row, seed=rows * 10 + blocks_per_row)
    assert raw.size == tensor_nbytes(qtype, rows * blocks_per_row * block)
    assert_same_bits(dequantize(raw, qtype, shape), gguf_reference(raw, qtype, shape))


@pytest.mark.parametrize("name", sorted(HALF_OFFSETS))
def test_chunked_tensors_match_gguf_bit_for_bit(monkeypatch, name):
    """Large tensors are dequantised a slice of blocks at a time; an uneven last slice changes nothing."""
    qtype = getattr(gguf_dequant, name)
    block = FORMATS[qtype].block
    monkeypatch.setattr(gguf_dequant, "CHUNK_ELEMENTS", 3 * block)
    shape = (4, 3, 5 * block)  # 60 blocks: 20 slices of 3
    raw = random_blocks(name, 60, seed=5)
    assert_same_bits(dequantize(raw, qtype, shape), gguf_reference(raw, qtype, shape))
    monkeypatch.setattr(gguf_dequant, "CHUNK_ELEMENTS", 7 * block)  # 8 slices of 7 and one of 4
    assert_same_bits(dequantize(raw, qtype, shape), gguf_reference(raw, qtype, shape))


@pytest.mark.parametrize("name", QUANTISABLE)
def test_weights_quantised_by_gguf_come_back_bit_for_bit(name):
    qtype = GGMLQuantizationType[name]
    weights = np.random.default_rng(3).standard_normal((6, 96)).astype(np.float32) * 3
    weights[0, :32] = 0.0  # a block of zeros: scale 0
    raw = np.ascontiguousarray(quantize(weights, qtype)).view(np.uint8).reshape(-1)
    assert raw.size == tensor_nbytes(int(qtype), weights.size)
    assert_same_bits(dequantize(raw, int(qtype), (6, 96)), gguf_reference(raw, int(qtype), (6, 96)))


def test_a_type_only_gguf_reads_goes_through_its_reference():
    """Ternary TQ2_0 has no torch path here: gguf's numpy reference reads it, shaped like the tensor."""
    weights = np.random.default_rng(4).standard_normal((3, 512)).astype(np.float32)
    raw = np.ascontiguousarray(quantize(weights, GGMLQuantizationType.TQ2_0)).view(np.uint8).reshape(-1)
    qtype = int(GGMLQuantizationType.TQ2_0)
    assert_same_bits(dequantize(raw, qtype, (3, 512)), gguf_reference(raw, qtype, (3, 512)))


def test_types_that_cannot_be_read_are_refused_by_name():
    with pytest.raises(UnsupportedGGMLType, match="Q8_K is llama.cpp's activation format"):
        dequantize(np.zeros(292, dtype=np.uint8), gguf_dequant.Q8_K, (256,))
    with pytest.raises(UnsupportedGGMLType, match="type 99"):
        tensor_nbytes(99, 256)
    with pytest.raises(UnsupportedGGMLType, match="type 99"):
        dequantize(np.zeros(64, dtype=np.uint8), 99, (64,))
    with pytest.raises(UnsupportedGGMLType, match="I32 cannot be dequantised"):
        dequantize(np.zeros(64, dtype=np.uint8), int(GGMLQuantizationType.I32), (16,))
    with pytest.raises(UnsupportedGGMLType, match="rows of 320 values are not whole Q4_K blocks of 256"):
        dequantize(np.zeros(288, dtype=np.uint8), gguf_dequant.Q4_K, (1, 320))


def test_the_loader_names_the_tensor_and_type_it_cannot_read(tmp_path):
    import gguf

    from metronome.server.models import UnsupportedModelError
    from metronome.server.models.gguf_loader import gguf_weights, open_gguf
    from metronome.server.models.presets import preset_config

    path = tmp_path / "activation-format.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 292), dtype=np.uint8), raw_shape=(2, 292),
                      raw_dtype=GGMLQuantizationType.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.weight .*Q8_K"):
        list(gguf_weights(open_gguf(path), preset_config("tiny")))


@pytest.fixture
def one_thread():
    """As the loader runs (gguf_loader.gguf_weights): torch's threads spin against each other on a busy
    machine, where one thread dequantises many times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_tensor_of_a_real_q4_k_m_file_matches_gguf(request, one_thread):
    """Gemma 3 270M Q4_K_M as llama.cpp wrote it: Q4_K, Q6_K, the Q5_0 fallback (rows of 640), Q8_0 and F32.
    The reference's digests are cached by the file's and gguf's versions (computing them takes seconds)."""
    from math import prod

    from metronome.server.models.gguf_file import GGUFFile
    from metronome.server.models.packaged_gguf import GEMMA3_270M_Q4_K_M, packaged_gguf_path

    reader = GGUFFile(packaged_gguf_path(GEMMA3_270M_Q4_K_M))
    kinds = {FORMATS[t.ggml_type].name for t in reader.tensors if t.ggml_type in FORMATS}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= kinds
    key = f"metronome/gguf-reference/{GEMMA3_270M_Q4_K_M.sha256[:16]}-gguf-{_gguf_version()}"
    cached = request.config.cache.get(key, None)
    digests = {}
    for tensor in reader.tensors:
        shape = tuple(reversed(tensor.shape))
        raw = reader.raw(tensor, tensor_nbytes(tensor.ggml_type, prod(tensor.shape)))
        ours = dequantize(raw, tensor.ggml_type, shape)
        if cached is None:
            expected = gguf_reference(raw, tensor.ggml_type, shape)
            assert_same_bits(ours, expected, tensor.name)
            digests[tensor.name] = _digest(expected)
        else:
            assert _digest(ours) == cached[tensor.name], tensor.name
    if cached is None:
        request.config.cache.set(key, digests)


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(tensor.contiguous().numpy()).cast("B")).hexdigest()


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def test_parts_are_joined_only_into_a_file_with_the_published_hash(tmp_path):
    from metronome.contract.errors import ModelNotFoundError
    from metronome.server.models.packaged_gguf import PartedGGUF, join_parts, packaged_gguf_path

    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(b"GGUF" + bytes(range(200)))
    parts[1].write_bytes(b"tail")
    good = hashlib.sha256(parts[0].read_bytes() + parts[1].read_bytes()).hexdigest()
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(ModelNotFoundError, match="reinstall the part packages"):
        join_parts(parts, "0" * 64, target)
    assert list(target.parent.iterdir()) == []  # nothing half-written is left behind
    assert join_parts(parts, good, target).read_bytes() == parts[0].read_bytes() + b"tail"

    missing = PartedGGUF("x.gguf", good, (("no_such_part_package_1", "x.part00"),), "pip install x-part1")
    with pytest.raises(ModelNotFoundError, match="no_such_part_package_1 is not installed.*pip install x-part1"):
        packaged_gguf_path(missing, tmp_path)
