"""Where a node computes (`--device`, `--base-gpu-id`; `runtime/model/device.py`): the flags, the
refusals naming them, and a model whose weights, K/V and forward all stay on the device it was
given. On this CPU-only machine the device checks run on torch's `meta` device (shapes and
devices, no data), which fails on any tensor left on the host or any value read back mid-forward,
as a GPU would stall on; the same checks on a real GPU are marked `gpu`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hicache.cli import build_parser
from hicache.runtime.kv.l1_sizing import device_memory, host_memory
from hicache.runtime.model.device import DeviceError, describe, resolve_device
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.model.llama_weights import tiny_weights

CONFIG = TinyConfig(layers=2, head_dim=8, ffn=48, vocab=97)


def test_the_cpu_is_the_default_and_ignores_the_gpu_index() -> None:
    assert resolve_device() == torch.device("cpu")
    assert resolve_device("cpu", 3, rank=2) == torch.device("cpu")
    assert describe(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize(
    ("kind", "base", "flag"),
    [("tpu", 0, "--device tpu"), ("cpu", -1, "--base-gpu-id -1"), ("cuda", True, "--base-gpu-id True")],
)
def test_bad_values_name_the_flag(kind: str, base: int, flag: str) -> None:
    with pytest.raises(DeviceError, match="^" + flag):
        resolve_device(kind, base)


def test_rank_r_takes_gpu_base_plus_r_and_too_few_gpus_name_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("cuda", 1, rank=2) == torch.device("cuda", 3)
    with pytest.raises(DeviceError, match=r"--base-gpu-id 2: rank 2 needs GPU 4, but torch sees 4 GPU"):
        resolve_device("cuda", 2, rank=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_refused_saying_why() -> None:
    with pytest.raises(DeviceError, match="^--device cuda: .*; use --device cpu$"):
        resolve_device("cuda")


@pytest.mark.parametrize(
    "command",
    [["node", "decode", "--prefill", "127.0.0.1:9"], ["node", "prefill"], ["serve"]],
    ids=["decode", "prefill", "serve"],
)
def test_the_commands_take_the_device_flags(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(command)
    assert (args.device, args.base_gpu_id) == ("cpu", 0)
    args = parser.parse_args([*command, "--device", "cuda", "--base-gpu-id", "2"])
    assert (args.device, args.base_gpu_id) == ("cuda", 2)
    for bad in (["--device", "tpu"], ["--base-gpu-id", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([*command, *bad])
        assert exit_info.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"argument {bad[0]}" in lines[-1], lines


@pytest.mark.process
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("node", ["decode", "prefill"])
def test_a_node_asked_for_cuda_without_one_exits_2_in_one_line(node: str) -> None:
    argv = ["node", node, "--device", "cuda", "--port", "0"]
    if node == "decode":
        argv += ["--prefill", "127.0.0.1:9"]
    done = subprocess.run(
        [sys.executable, "-m", "hicache", *argv], capture_output=True, text=True, timeout=120
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"hicache node {node}: --device cuda: "), lines


def test_l1_is_sized_from_the_hosts_memory_on_the_cpu() -> None:
    assert device_memory(torch.device("cpu")).total == host_memory().total


# -- a model on a device ---------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_moving_the_weights_keeps_a_tied_head_a_view_of_the_embedding(tied: bool) -> None:
    weights = tiny_weights(TinyConfig(layers=2, head_dim=8, ffn=48, vocab=97, tied_embeddings=tied))
    assert (weights.head.data_ptr() == weights.embed.data_ptr()) == tied
    assert weights.to(torch.device("cpu")) is weights
    moved = weights.to(torch.device("meta"))
    assert moved.embed.device.type == "meta" and moved.layers[1].w_down.device.type == "meta"
    assert moved.head.device.type == "meta" and moved.head.shape == weights.head.shape
    assert (moved.head._base is moved.embed) == tied  # a view of the moved embedding, not a copy


def test_the_forward_runs_on_the_models_device_without_reading_back() -> None:
    model = TinyModel(CONFIG, device="meta")
    cfg = model.config
    pool = torch.zeros((6, cfg.layers, 2, 4, cfg.kv_heads, cfg.head_dim), dtype=model.kv_dtype, device="meta")
    logits = model.forward_paged(pool, [[0, 1], [2, 3]], [0, 0], [[1, 2, 3], [4, 5]])
    assert (logits.shape, logits.device.type) == ((2, cfg.vocab), "meta")
    logits = model.decode_batch(pool, [[0, 1], [2, 3]], [3, 2], [1, 2])
    assert logits.device.type == "meta"
    kv, last = model.forward(torch.tensor([1, 2, 3]))
    assert (kv.device.type, last.device.type) == ("meta", "meta")
    rows = model.forward(torch.tensor([1, 2, 3]), kv, rows_from=1)[1]
    assert rows.shape == (2, cfg.vocab)


def test_a_pool_or_past_on_another_device_is_refused() -> None:
    model = TinyModel(CONFIG, device="meta")
    cfg = model.config
    pool = torch.zeros((6, cfg.layers, 2, 4, cfg.kv_heads, cfg.head_dim), dtype=model.kv_dtype)
    with pytest.raises(ValueError, match="pool: expected a pool on the model's device meta, got one on cpu"):
        model.decode_batch(pool, [[0]], [0], [1])
    with pytest.raises(ValueError, match="past_kv: .* on meta, got .* on cpu"):
        model.forward(torch.tensor([1]), torch.zeros(cfg.kv_shape(2), dtype=model.kv_dtype))


@pytest.mark.gpu
def test_a_cuda_model_computes_what_the_cpu_model_computes() -> None:
    cpu, gpu = TinyModel(CONFIG), TinyModel(CONFIG, device="cuda")
    cfg = cpu.config
    shape = (6, cfg.layers, 2, 4, cfg.kv_heads, cfg.head_dim)
    pools = torch.zeros(shape, dtype=cpu.kv_dtype), torch.zeros(shape, dtype=gpu.kv_dtype, device="cuda")
    args = ([[0, 1], [2, 3]], [0, 0], [[1, 2, 3], [4, 5]])
    want = cpu.forward_paged(pools[0], *args)
    got = gpu.forward_paged(pools[1], *args)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-9)
    torch.testing.assert_close(pools[1].cpu(), pools[0], rtol=0, atol=1e-9)
