"""Cost-model presets against values computed by hand from the published shapes."""

from __future__ import annotations

import attrs
import pytest
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.sim.channel import Channel
from hicache.sim.costs import NodeCosts, steps_time, steps_within
from hicache.sim.geometry import ModelGeometry, model_preset
from hicache.sim.hardware import gpu_preset, link_preset
from hicache.sim.store import SharedStore


@pytest.mark.parametrize(
    ("name", "kv_bytes"),
    [
        ("llama-3-8b", 2 * 32 * 8 * 128 * 2),  # 131,072 B = 128 KiB per token
        ("qwen2.5-32b", 2 * 64 * 8 * 128 * 2),  # 262,144 B = 256 KiB
        ("deepseek-v3", 61 * (512 + 64) * 2),  # 70,272 B (MLA: latent + RoPE key)
        ("qwen3-32b", 2 * 64 * 8 * 128 * 2),  # 262,144 B, as Qwen2.5-32B
        ("llama-3-70b", 2 * 80 * 8 * 128 * 2),  # 327,680 B = 320 KiB (Mooncake's figure)
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
    with pytest.raises(ValueError, match="unknown GPU 'b200'; expected one of: a100, a800, h100, h20, h200"):
        gpu_preset("b200")
    with pytest.raises(ValueError, match="unknown model"):
        model_preset("gpt-5")


def test_presets_for_published_comparisons() -> None:
    a800, h800, h20 = gpu_preset("a800"), gpu_preset("h800"), gpu_preset("h20")
    assert (a800.hbm_bytes, a800.hbm_bandwidth, a800.bf16_flops) == (80e9, 2.039e12, 312e12)
    assert (h800.hbm_bytes, h800.hbm_bandwidth, h800.bf16_flops) == (80e9, 3.35e12, 989e12)
    assert (h20.hbm_bytes, h20.hbm_bandwidth, h20.bf16_flops) == (96e9, 4.0e12, 148e12)
    assert link_preset("pcie4").seconds(31.5e9) == pytest.approx(1.0 + 10e-6)
    # Qwen3-32B has 64 query heads where Qwen2.5-32B has 40: more attention FLOPs, same KV.
    q3 = model_preset("qwen3-32b")
    assert q3.flops_per_token(context=8192) == 2 * 32.8e9 + 4 * 64 * 8192 * 64 * 128


def test_llama_3_70b_prefill_on_8_a800_by_hand() -> None:
    # An 8K prompt from scratch at full peak (MFU 1): 2 x 70.6e9 per token plus causal attention
    # over contexts 0..8191, over 8 x 312 TFLOPS.
    c = NodeCosts(model_preset("llama-3-70b"), attrs.evolve(gpu_preset("a800"), efficiency=1.0), 8)
    flops = 2 * 70.6e9 * 8192 + 4 * 80 * 64 * 128 * (8192 * 8191 / 2)
    assert c.prefill_seconds(8192) == pytest.approx(flops / (8 * 312e12), rel=1e-12)
    assert c.prefill_seconds(8192) == pytest.approx(0.4987, abs=1e-4)
    # 8 x 80 GB at 0.9 minus 141.2 GB of weights, in 320 KiB tokens
    assert c.kv_capacity_tokens(0.9) == int((8 * 80e9 * 0.9 - 70.6e9 * 2) // 327680)


# --------------------------------------------------------------------------- node costs


def _costs(gpus: int = 8) -> NodeCosts:
    return NodeCosts(model_preset("llama-3-8b"), gpu_preset("h100"), gpus, step_overhead=0.004)


def test_prefill_seconds_by_hand() -> None:
    c = _costs()
    flops = 8 * 989e12 * 0.5
    # 1,000 tokens after 3,000 cached: 2 x params each, plus attention over contexts 3000..3999.
    attended = sum(range(3000, 4000))
    want = (2 * 8.03e9 * 1000 + 4 * 32 * 32 * 128 * attended) / flops
    assert c.prefill_seconds(1000, 3000) == pytest.approx(want, rel=1e-12)
    assert c.prefill_seconds(0, 5000) == 0.0


def test_decode_step_by_hand() -> None:
    c = _costs()
    bw = 8 * 3.35e12 * 0.8
    weights = 8.03e9 * 2 / bw
    # memory-bound at batch 16: weights + 16 contexts of 2,000 tokens of 128 KiB each
    want = 0.004 + weights + 16 * 2000 * 131072 / bw
    assert c.step_seconds(16, 16 * 2000) == pytest.approx(want, rel=1e-12)
    # compute-bound at a huge batch: 2 x params x batch FLOPs beat the weight read
    big = 100_000
    assert c.step_constant(big) == pytest.approx(0.004 + 2 * 8.03e9 * big / (8 * 989e12 * 0.5))


def test_kv_capacity_from_hbm() -> None:
    c = _costs()
    want = int((80e9 * 8 * 0.9 - 8.03e9 * 2) // 131072)
    assert c.kv_capacity_tokens(0.9) == want
    with pytest.raises(ValueError, match="does not fit"):
        NodeCosts(model_preset("deepseek-v3"), gpu_preset("h100"), 1).kv_capacity_tokens(0.9)


@settings(max_examples=examples(300), deadline=None)
@given(
    a=st.floats(1e-4, 0.1),
    b=st.floats(1e-9, 1e-5),
    batch=st.integers(1, 512),
    context=st.integers(0, 10_000_000),
    elapsed=st.floats(0, 1000),
)
def test_steps_within_inverts_steps_time(
    a: float, b: float, batch: int, context: int, elapsed: float
) -> None:
    k = steps_within(a, b, batch, context, elapsed)
    assert steps_time(a, b, batch, context, k) <= elapsed
    assert steps_time(a, b, batch, context, k + 1) > elapsed
    # the closed form equals the step-by-step sum
    total = sum(a + b * (context + batch * j) for j in range(min(k, 50)))
    assert steps_time(a, b, batch, context, min(k, 50)) == pytest.approx(total, rel=1e-9, abs=1e-12)


# --------------------------------------------------------------------------- channels and storage


def test_channel_is_fifo_with_pipelined_latency() -> None:
    ch = Channel("link", bandwidth=1e9, latency=0.01)
    t1 = ch.reserve(0.0, 1e9)  # 1 s of data
    t2 = ch.reserve(0.5, 0.5e9)  # queued behind the first
    assert (t1.start, t1.busy_until, t1.done) == (0.0, 1.0, pytest.approx(1.01))
    assert (t2.start, t2.busy_until, t2.done) == (1.0, 1.5, pytest.approx(1.51))
    assert t1.fraction_at(0.25) == 0.25
    ch.cut(t2, 1.25)  # stopped half way, nothing behind it: the channel frees at once
    assert ch.free_at == 1.25
    assert ch.reserve(2.0, 0).start == 2.0


def test_store_lru_capacity() -> None:
    store = SharedStore(Channel("L3", 1e9, 0.0), capacity_pages=3)
    store.add([1, 2, 3])
    store.touch([1])
    store.add([4])  # evicts 2, the least recently used
    assert [k in store for k in (1, 2, 3, 4)] == [True, False, True, True]
    assert store.prefix_hits([1, 3, 2, 4]) == 2
    unbounded = SharedStore(Channel("L3", 1e9, 0.0))
    unbounded.add(range(1000))
    assert len(unbounded) == 1000 and unbounded.evicted == 0
