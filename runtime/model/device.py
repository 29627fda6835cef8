"""Which device a node computes on (`--device`, `--base-gpu-id`), resolved once at start-up.

A node's weights, forward, L1 and sampling live on that device; L2 stays in host memory (pinned
when the device is a GPU, so load-backs and backups are DMA that overlaps compute). With tensor
parallelism, rank r of a node uses GPU `base_gpu_id + r`, as SGLang's `--base-gpu-id` does.
"""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")


class DeviceError(ValueError):
    """The device asked for cannot be used here; the message names the flag."""


def resolve_device(kind: str = "cpu", base_gpu_id: int = 0, rank: int = 0) -> torch.device:
    """The torch device of `--device kind` for TP rank `rank`; a `DeviceError` names the flag
    when torch cannot use it (no CUDA build, no GPU, too few GPUs)."""
    if kind not in DEVICES:
        raise DeviceError(f"--device {kind}: expected one of {', '.join(DEVICES)}")
    if isinstance(base_gpu_id, bool) or not isinstance(base_gpu_id, int) or base_gpu_id < 0:
        raise DeviceError(f"--base-gpu-id {base_gpu_id!r}: expected an integer >= 0")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "this torch is a CPU build" if torch.version.cuda is None else "torch sees no CUDA device"
        raise DeviceError(f"--device cuda: {build}; use --device cpu")
    index = base_gpu_id + rank
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"--base-gpu-id {base_gpu_id}: rank {rank} needs GPU {index}, but torch sees {count} GPU(s)"
        )
    return torch.device("cuda", index)


def describe(device: torch.device) -> str:
    """One line naming the device, for a node's ready line and logs."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / 2**30:.0f} GiB)"
