"""Hardware presets: GPUs and links, each number with its source.

GPU figures are the vendor's datasheet values (dense bf16 Tensor Core throughput, without
sparsity); an efficiency factor (MFU) scales the FLOP/s a real kernel reaches.
"""

from __future__ import annotations

import attrs


@attrs.frozen(slots=True)
class GPU:
    name: str
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    efficiency: float = 0.5  # fraction of peak a serving kernel reaches (MFU)
    # Fraction of peak HBM bandwidth that streaming reads of weights and KV reach; decode
    # kernels (FlashInfer/FlashAttention decode, cuBLAS GEMV) reach 70-90% on Hopper.
    hbm_efficiency: float = 0.8

    def __attrs_post_init__(self) -> None:
        for field in ("efficiency", "hbm_efficiency"):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise ValueError(f"GPU {self.name!r}: {field} must be in (0, 1], got {value}")

    @property
    def effective_flops(self) -> float:
        return self.bf16_flops * self.efficiency


@attrs.frozen(slots=True)
class Link:
    """A transfer path: time = latency + bytes / bandwidth."""

    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds per transfer

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


GPUS: dict[str, GPU] = {
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense (1,979 with sparsity).
    "h100": GPU("h100", 80e9, 3.35e12, 989e12),
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, same Hopper compute as H100.
    "h200": GPU("h200", 141e9, 4.8e12, 989e12),
    # NVIDIA A100 80GB SXM datasheet: 80 GB HBM2e, 2,039 GB/s, 312 TFLOPS bf16 dense.
    "a100": GPU("a100", 80e9, 2.039e12, 312e12),
    # NVIDIA A800 80GB SXM: the A100 80GB with NVLink cut to 400 GB/s (not modelled here): 80 GB
    # HBM2e, 2,039 GB/s, 312 TFLOPS bf16 dense. Mooncake (FAST'25) Table 1 uses 8 x 312 TFLOPS.
    "a800": GPU("a800", 80e9, 2.039e12, 312e12),
    # NVIDIA H800 SXM5: the H100 SXM5 with NVLink cut to 400 GB/s: 80 GB HBM3, 3.35 TB/s,
    # 989 TFLOPS bf16 dense.
    "h800": GPU("h800", 80e9, 3.35e12, 989e12),
    # NVIDIA H20 (Hopper, export variant) as published by NVIDIA partners: 96 GB HBM3, 4.0 TB/s,
    # 148 TFLOPS bf16 dense Tensor Core.
    "h20": GPU("h20", 96e9, 4.0e12, 148e12),
}

LINKS: dict[str, Link] = {
    # PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b encoding = 63 GB/s per direction raw; ~10 us
    # per DMA including setup.
    "pcie5": Link("pcie5", 63e9, 10e-6),
    # PCIe 4.0 x16 (A100/A800 hosts): 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction raw.
    "pcie4": Link("pcie4", 31.5e9, 10e-6),
    # NVLink-C2C (Grace Hopper): 900 GB/s total, 450 GB/s per direction.
    "c2c": Link("c2c", 450e9, 2e-6),
    # 400 Gb/s RDMA NIC (ConnectX-7 class): 50 GB/s per direction, a few microseconds per post.
    "rdma400": Link("rdma400", 50e9, 5e-6),
}


def gpu_preset(name: str) -> GPU:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; expected one of: {', '.join(sorted(GPUS))}") from None


def link_preset(name: str) -> Link:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; expected one of: {', '.join(sorted(LINKS))}") from None
