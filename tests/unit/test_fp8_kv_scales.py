"""FP8 KV-cache scales: read from a checkpoint (per tensor or per kv head, both names) or calibrated at start-up
from one prefill of the model's own K and V."""
from __future__ import annotations

import pytest
import torch
from test_model_exact import PagedCache

from metronome.kernels.torch_ref import from_cache, to_cache
from metronome.server.models import load_model
from metronome.server.models.quant import fp8
from metronome.server.models.quant.kv_scales import HEADROOM, _RecordingBackend, calibrate, from_checkpoint


def test_checkpoint_scales_per_tensor_and_per_head():
    tensors = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.1, 0.2]),
               "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([[0.3], [0.4]])}
    scales = from_checkpoint(tensors, num_layers=2, num_kv_heads=2)
    assert scales.source == "checkpoint"
    assert torch.equal(scales.k[0], torch.tensor([0.5, 0.5])) and torch.equal(scales.v[0], torch.tensor([0.25, 0.25]))
    assert torch.equal(scales.k[1], torch.tensor([0.1, 0.2])) and torch.equal(scales.v[1], torch.tensor([0.3, 0.4]))
    assert from_checkpoint({}, 2, 2) is None


@pytest.mark.parametrize("tensors, message", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor([1.0, 2.0, 3.0])}, "one per kv head"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}, "positive"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(1.0)}, "some layers only"),
    ({"model.layers.7.self_attn.k_scale": torch.tensor(1.0)}, "has 2 layers"),
    ({"model.layers.0.self_attn.q_scale": torch.tensor(1.0)}, "not a KV-cache scale"),
])
def test_checkpoint_scales_that_do_not_fit_are_refused(tensors, message):
    with pytest.raises(ValueError, match=message):
        from_checkpoint(tensors, num_layers=2, num_kv_heads=2)


def test_calibration_covers_the_models_own_k_and_v():
    loaded = load_model("random:tiny", dtype="float32", attention_backend="torch", seed=1)
    config = loaded.config
    scales = calibrate(loaded.model, config, loaded.tokenizer, loaded.device, loaded.dtype)
    assert scales.source == "calibrated" and len(scales.k) == len(scales.v) == config.num_hidden_layers
    assert all(s.shape == (config.num_key_value_heads,) and bool((s > 0).all()) for s in scales.k + scales.v)
    assert loaded.model.attention_backend.name == "torch" and not isinstance(loaded.model.attention_backend,
                                                                             _RecordingBackend)
    # the layer-0 K of a fresh prompt, in FP8 with the calibrated scale: within e4m3's rounding, never saturated
    keys = []

    class KeepKeys(_RecordingBackend):
        def write_kv(self, key, value, k_cache, v_cache, slot_mapping):
            keys.append(key.clone())
            super().write_kv(key, value, k_cache, v_cache, slot_mapping)

    loaded.model.set_attention_backend(KeepKeys(loaded.model.attention_backend))
    loaded.model.fused = False
    ids = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    cache = PagedCache(config, 1, 40)
    with torch.inference_mode():
        loaded.model(ids, torch.arange(40), cache.kv, cache.metadata([0], [40]))
    k = keys[0]
    back = from_cache(to_cache(k, torch.float8_e4m3fn, scales.k[0]), scales.k[0])
    assert k.abs().amax() < fp8.FP8_MAX * scales.k[0].max()  # inside the range (HEADROOM x the calibration amax)
    smallest_normal = 2 ** -6 * scales.k[0][None, :, None]
    bound = torch.maximum(k.abs() * 2 ** -4, smallest_normal * 2 ** -3)
    assert bool(((back - k).abs() <= bound * 1.0001).all())
    assert HEADROOM >= 1
