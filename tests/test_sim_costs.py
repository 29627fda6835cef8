"""Cost-model presets against values computed by hand from the published shapes."""

from __future__ import annotations

import pytest

from hicache.sim.geometry import ModelGeometry, model_preset
from hicache.sim.hardware import gpu_preset, link_preset


@pytest.mark.parametrize(
    ("name", "kv_bytes"),
    [
        ("llama-3-8b", 2 * 32 * 8 * 128 * 2),  # 131,072 B = 128 KiB per token
        ("qwen2.5-32b", 2 * 64 * 8 * 128 * 2),  # 262,144 B = 256 KiB
        ("deepseek-v3", 61 * (512 + 64) * 2),  # 70,272 B (MLA: latent + RoPE key)
    ],
)
def test_kv_bytes_per_token(name: str, kv_bytes: int) -> None:
    assert model_preset(name).kv_bytes_per_token == kv_bytes


def test_flops_per_token_with_and_without_context() -> None:
    m = model_preset("llama-3-8b")
    assert m.flops_per_token() == 2 * 8.03e9
    assert m.flops_per_token(context=1000) == 2 * 8.03e9 + 4 * 32 * 1000 * 32 * 128
    v3 = model_preset("deepseek-v3")
    assert v3.flops_per_token() == 2 * 37e9  # activated, not total, parameters
    assert v3.weight_bytes == 671e9 * 2


def test_mha_and_custom_geometry() -> None:
    mha = ModelGeometry(
        "custom", layers=2, q_heads=4, kv_heads=4, head_dim=8, active_params=1e6, total_params=1e6
    )
    assert mha.kv_bytes_per_token == 2 * 2 * 4 * 8 * 2
    with pytest.raises(ValueError, match="kv_heads must be in 1..q_heads"):
        ModelGeometry("bad", layers=2, q_heads=4, kv_heads=8, head_dim=8, active_params=1, total_params=1)


def test_hardware_presets_and_links() -> None:
    h200 = gpu_preset("h200")
    assert (h200.hbm_bytes, h200.hbm_bandwidth) == (141e9, 4.8e12)
    assert h200.effective_flops == 989e12 * 0.5
    assert link_preset("rdma400").seconds(50e9) == pytest.approx(1.0 + 5e-6)
    with pytest.raises(ValueError, match="unknown GPU 'b200'; expected one of: a100, h100, h200"):
        gpu_preset("b200")
    with pytest.raises(ValueError, match="unknown model"):
        model_preset("gpt-5")
