"""The FlashAttention-4 backend and `--attention-backend auto` on the CPU: how our metadata maps onto FA4's call
(checked through a stand-in module that computes FA4's documented semantics from FA4's own arguments, against
the torch reference), how FA4 is detected (not fooled by a namespace `flash_attn`), the batch classes, the
measured table and the per-class routing. FA4's kernels themselves run on the GPU only
(tests/gpu/test_flash_attn4_gpu.py)."""
from __future__ import annotations

import importlib
import json
import math
import sys

import pytest
import torch

from metronome.kernels import backend as backend_module
from metronome.kernels import flash_attn_backend as fa
from metronome.kernels.attention_choice import (
    BATCH_CLASSES,
    CLASS_NAMES,
    PerClassBackend,
    choose,
    classify,
    load_table,
    parse_table,
)
from metronome.kernels.metadata import AttentionMetadata
from metronome.kernels.torch_ref import TorchBackend


class FakeFA4:
    """FA4's flash_attn_varlen_func as documented, from its own arguments only: paged K/V through page_table,
    seqused_k context lengths, causal bottom-right, window (left, right), softcap, learnable sinks in
    natural-log units. Records each call's keyword arguments."""

    def __init__(self):
        self.calls: list[dict] = []

    def flash_attn_varlen_func(self, q, k, v, *, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table,
                               softmax_scale, causal, window_size, learnable_sink, softcap):
        self.calls.append(dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window_size=window_size,
                               softcap=softcap, causal=causal, sinks=learnable_sink,
                               dtypes=(cu_seqlens_q.dtype, seqused_k.dtype, page_table.dtype)))
        assert type(max_seqlen_q) is int and type(max_seqlen_k) is int  # host ints: tensors would recompile
        assert causal and page_table.stride(-1) == 1
        page = k.shape[1]
        n_heads, group = q.shape[1], q.shape[1] // k.shape[2]
        out = torch.zeros_like(q)
        cu, used = cu_seqlens_q.tolist(), seqused_k.tolist()
        left, right = window_size
        for b in range(len(used)):
            rows, length = slice(cu[b], cu[b + 1]), used[b]
            pages = page_table[b, :math.ceil(length / page)].long()
            keys = k[pages].reshape(-1, *k.shape[2:])[:length].float()
            values = v[pages].reshape(-1, *v.shape[2:])[:length].float()
            qb = q[rows].float()
            positions = torch.arange(length - qb.shape[0], length)[:, None]
            j = torch.arange(length)[None, :]
            visible = j <= positions + (0 if right is None else right)
            if left is not None:
                visible &= j >= positions - left
            for h in range(n_heads):
                scores = qb[:, h] @ keys[:, h // group].T * softmax_scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                scores = scores.masked_fill(~visible, float("-inf"))
                if learnable_sink is not None:
                    scores = torch.cat([scores, learnable_sink[h].float().expand(scores.shape[0], 1)], 1)
                probs = torch.softmax(scores, -1)[:, :length]
                out[rows, h] = (probs @ values[:, h // group]).to(q.dtype)
        return out, None


def _paged_batch(q_lens, contexts, n_heads=8, n_kv=2, d=16, page=4, seed=0, dtype=torch.float32):
    """A mixed batch (decodes and chunks) over a paged cache with shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(contexts, q_lens)]
    pages_each = [math.ceil(n / page) for n in lens]
    num_pages = sum(pages_each) + 3
    k = torch.randn(num_pages, page, n_kv, d, generator=g).to(dtype)
    v = torch.randn(num_pages, page, n_kv, d, generator=g).to(dtype)
    order = torch.randperm(num_pages, generator=g).tolist()
    width = max(pages_each)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_each):
        table[b, :n] = torch.tensor(order[used:used + n])
        used += n
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table,
                             slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64), max_seqlen_q=max(q_lens),
                             max_seqlen_k=max(lens), q_lens_host=list(q_lens), seq_lens_host=lens)
    q = torch.randn(cu[-1], n_heads, d, generator=g).to(dtype)
    return q, k, v, meta


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (5, None, False), (None, 30.0, False),
                                                  (7, 20.0, True), (None, None, True)])
def test_the_call_maps_our_metadata_onto_fa4s_arguments(window, softcap, sinks):
    fake = FakeFA4()
    backend = fa.FlashAttnBackend(module=fake)
    q, k, v, meta = _paged_batch([1, 1, 9, 1, 14], [10, 3, 0, 22, 6])
    sink = torch.randn(q.shape[1]) if sinks else None
    q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    got = backend.attention(q, k, v, meta, 0.25, window=window, softcap=softcap, sinks=sink)
    expected = TorchBackend().attention(q, k, v, meta, 0.25, window=window, softcap=softcap, sinks=sink)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    call = fake.calls[-1]
    assert call["window_size"] == ((None, None) if window is None else (window - 1, 0))
    assert call["softcap"] == (softcap or 0.0) and (call["sinks"] is sink)
    assert call["dtypes"] == (torch.int32, torch.int32, torch.int32)
    out = torch.full_like(q, float("nan"))
    assert backend.attention(q, k, v, meta, 0.25, out=out, window=window, softcap=softcap, sinks=sink) is out
    torch.testing.assert_close(out, got)


def test_fa4_refuses_what_it_has_no_kernels_for():
    backend = fa.FlashAttnBackend(module=FakeFA4())
    q, k, v, meta = _paged_batch([1, 3], [4, 0])
    with pytest.raises(ValueError, match="bf16 or fp16"):
        backend.attention(q, k, v, meta, 1.0)  # float32
    q, k, v, meta = _paged_batch([1, 3], [4, 0], d=12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        backend.attention(q, k, v, meta, 1.0)
    assert fa.flash_attn_fits(128) and fa.flash_attn_fits(256) and not fa.flash_attn_fits(264)


def test_warm_up_launches_each_variant_batch_for_every_window(monkeypatch):
    import metronome.kernels.triton_kv_write as kv_write

    monkeypatch.setattr(kv_write, "write_kv_triton", lambda *args: None)
    fake = FakeFA4()
    k = torch.zeros(8, 4, 2, 16, dtype=torch.bfloat16)
    launches = fa.FlashAttnBackend(module=fake).warm_up((1, 8, 16), k, k.clone(), 64, windows=(None, 5, None),
                                                        softcap=30.0, sinks=True)
    batches = fa.warm_up_batches(4)
    assert launches == 1 + 2 * len(batches)
    assert {c["window_size"] for c in fake.calls} == {(None, None), (4, 0)}
    assert all(c["softcap"] == 30.0 and c["sinks"] is not None for c in fake.calls)
    sizes = {(len(b), max(b)) for b in batches}
    # one query tile (decodes) and more (a chunk: its packed GQA rows pass 128), below and above 256 sequences
    assert any(n <= fa.FA4_LARGE_BATCH and m == 1 for n, m in sizes)
    assert any(n > fa.FA4_LARGE_BATCH and m == 1 for n, m in sizes)
    assert any(n <= fa.FA4_LARGE_BATCH and m * 4 > 128 for n, m in sizes)
    assert any(n > fa.FA4_LARGE_BATCH and m * 4 > 128 for n, m in sizes)


def test_detection_is_not_fooled_by_a_namespace_flash_attn(tmp_path, monkeypatch):
    def fresh(files: dict[str, str]) -> bool:
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        for mod in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            monkeypatch.delitem(sys.modules, mod)
        sys.path.insert(0, str(root))
        importlib.invalidate_caches()
        fa.fa4_importable.cache_clear()
        try:
            return fa.fa4_importable()
        finally:
            sys.path.remove(str(root))
            fa.fa4_importable.cache_clear()
            for mod in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
                del sys.modules[mod]

    monkeypatch.delenv(fa.CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv(fa.CACHE_ENABLED_ENV, raising=False)
    assert not fresh({"flash_attn/other.py": ""})  # a namespace package: `import flash_attn` works, no FA4
    assert not fresh({"flash_attn/__init__.py": "def flash_attn_varlen_func(): pass\n"})  # FA2's module layout
    assert not fresh({"flash_attn/cute/__init__.py": "raise ImportError('libcuda')\n"})  # installed, fails to load
    assert fresh({"flash_attn/cute/__init__.py": "def flash_attn_varlen_func(): pass\n"})
    # The JIT cache was switched on, in a writable folder, before the import.
    assert fa.os.environ[fa.CACHE_ENABLED_ENV] == "1" and fa.os.environ[fa.CACHE_DIR_ENV]


def test_the_jit_cache_goes_where_it_is_told_unless_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.delenv(fa.CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv(fa.CACHE_ENABLED_ENV, raising=False)
    assert fa.configure_jit_cache(tmp_path / "jit") == tmp_path / "jit"
    assert fa.os.environ[fa.CACHE_ENABLED_ENV] == "1"
    assert fa.configure_jit_cache(tmp_path / "other") == tmp_path / "jit"  # the first setting stays
    monkeypatch.delenv(fa.CACHE_DIR_ENV)
    assert fa.configure_jit_cache().name == "metronome-flash-attn-cute"


def test_batch_classes():
    assert classify(1, 1, True) == "decode_small" and classify(64, 64, True) == "decode_medium"
    assert classify(300, 300, True) == "decode_large"
    assert classify(1, 128, False) == "chunk_small" and classify(3, 512, False) == "chunk_medium"
    assert classify(2, 2048, False) == "chunk_large"
    assert classify(65, 576, True) == "mixed"
    for c in BATCH_CLASSES:  # each representative batch lands in its own class
        decodes, chunk, _ = c.representative
        seqs, tokens = decodes + (1 if chunk else 0), decodes + chunk
        assert classify(seqs, tokens, decodes > 0) == c.name


def test_the_table_on_record_is_valid_and_its_checks():
    table = load_table()
    assert set(table.choice) == set(CLASS_NAMES)
    if table.uses_flash_attn:
        assert {"date", "machine", "command"} <= set(table.measured)
    with pytest.raises(ValueError, match="unknown batch class"):
        parse_table({"choice": {"decode_tiny": "triton"}})
    with pytest.raises(ValueError, match="unknown backend"):
        parse_table({"choice": {"mixed": "fa4"}})
    with pytest.raises(ValueError, match="measured"):
        parse_table({"choice": {"mixed": "flash_attn"}})
    assert parse_table({"choice": {"mixed": "flash_attn"}, "measured": {"date": "d"}}).backend_for("decode_small") \
        == "triton"


def test_choose_takes_the_faster_and_falls_back_to_triton():
    picked = choose({"decode_small": {"triton": 1.0, "flash_attn": 2.0}, "mixed": {"triton": 3.0, "flash_attn": 2.5},
                     "chunk_large": {"triton": 1.0, "flash_attn": None}})
    assert picked["decode_small"] == "triton" and picked["mixed"] == "flash_attn"
    assert picked["chunk_large"] == "triton" and picked["decode_large"] == "triton"  # failed / not measured


class _Recorder:
    def __init__(self, name):
        self.name, self.calls = name, 0

    def attention(self, q, *args, **kwargs):
        self.calls += 1
        return self.name


def test_per_class_routing():
    table = parse_table({"choice": {"mixed": "flash_attn", "chunk_large": "flash_attn"}, "measured": {"date": "x"}})
    triton, flash = _Recorder("triton"), _Recorder("flash_attn")
    auto = PerClassBackend(table, triton, flash)

    def route(q_lens, contexts, dtype=torch.bfloat16):
        q, k, v, meta = _paged_batch(q_lens, contexts, dtype=dtype)
        return auto.attention(q, k, v, meta, 1.0)

    assert route([1, 1, 40], [5, 6, 0]) == "flash_attn"  # mixed
    assert route([1, 1, 1], [5, 6, 7]) == "triton"  # decode
    assert route([1, 1, 40], [5, 6, 0], dtype=torch.float32) == "triton"  # FA4 has no fp32
    assert route([1100, 1000], [0, 0]) == "flash_attn"  # chunk_large
    assert route([300], [0]) == "triton"  # chunk_medium
    assert "mixed=flash_attn" in auto.describe()


@pytest.fixture
def fa4_here(monkeypatch):
    """Pretend FA4 is installed and the device can run it (the CPU has neither)."""
    monkeypatch.setattr(fa, "fa4_importable", lambda: True)
    monkeypatch.setattr(fa, "fa4_runs_on", lambda device: torch.device(device).type == "cuda")
    backend_module._importable.cache_clear()
    yield
    backend_module._importable.cache_clear()


def test_auto_resolves_per_class_only_where_fa4_runs_and_the_table_uses_it(fa4_here):
    sends = parse_table({"choice": {"mixed": "flash_attn"}, "measured": {"date": "x"}})
    stays = parse_table({"choice": {"mixed": "triton"}})
    select = backend_module.select_backend
    assert select("cuda", 16, 128, "auto", table=sends) == "auto"
    assert select("cuda", 16, 128, "auto", table=stays) == "triton"
    assert select("cuda", 16, 12, "auto", table=sends) == "triton"  # a head size FA4 has no kernels for
    assert select("cpu", 16, 128, "auto", table=sends) == "torch"
    assert select("cuda", 16, 128, "flash_attn") == "flash_attn"  # any block size (FA2 wanted multiples of 256)
    with pytest.raises(ValueError, match="compute capability"):
        select("cpu", 16, 128, "flash_attn")


def test_flash_attn_without_fa4_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(fa, "fa4_importable", lambda: False)
    backend_module._importable.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"metronome\[flash\]"):
            backend_module.select_backend("cuda", 16, 128, "flash_attn")
        assert "flash_attn" not in backend_module.available_backends()
        assert backend_module.select_backend("cuda", 16, 128, "auto", table=parse_table(
            {"choice": {"mixed": "flash_attn"}, "measured": {"date": "x"}})) in ("triton", "torch")
    finally:
        backend_module._importable.cache_clear()


def test_table_json_round_trips(tmp_path):
    table = parse_table({"choice": {"mixed": "flash_attn"}, "measured": {"date": "2026-12-02", "machine": "H200",
                                                                        "command": "x"}, "results": {"mixed": {}}})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.to_json()))
    assert load_table(path) == table
