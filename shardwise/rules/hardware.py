"""GPU presets: vendor datasheet peaks of each accelerator and the fabric it sits in.

Bandwidths are per GPU and per direction, because a ring collective's time is the bytes one rank sends divided by
the rate it can send at. Memory sizes are the advertised decimal GB (the real binary-sized HBM is a few percent
larger; that slack is part of the planner's headroom). The planner multiplies peaks by achievable fractions
(`planner.estimate.Assumptions`); a training run divides its model FLOP/s by the peak for MFU (`training.observe`).
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    peak_bf16_flops: float
    """Dense (no 2:4 sparsity) BF16 tensor-core FLOP/s."""
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """Scale-up link (NVLink / Infinity Fabric), per GPU per direction."""
    nvlink_domain: int
    """GPUs that reach each other over the scale-up link."""
    domain_spans_nodes: bool
    """True when the scale-up domain is larger than a node (NVL72 racks)."""
    internode_bytes_per_s: float
    """Scale-out NIC bandwidth per GPU per direction."""
    gpus_per_node: int
    peak_fp8_flops: float | None = None
    """Dense FP8 (e4m3/e5m2) tensor-core FLOP/s; None: no FP8 tensor cores (`--fp8` is refused)."""


GPU_PRESETS: dict[str, GPU] = {
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s BF16 dense (no FP8 tensor cores), 2,039 GB/s HBM2e, NVLink3 600 GB/s
    # (bidirectional, so 300 GB/s each way); DGX A100: 8 GPUs, 8x 200 Gb/s HDR InfiniBand (25 GB/s/GPU).
    "a100-80gb": GPU("a100-80gb", 80 * GB, 312e12, 2.039e12, 300e9, 8, False, 25e9, 8),
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16 dense (1,979 with sparsity), 1,979 FP8 dense, 3.35 TB/s HBM3,
    # NVLink4 900 GB/s bidirectional (450 each way); DGX H100: 8x 400 Gb/s NDR ConnectX-7 (50 GB/s/GPU).
    "h100-80gb": GPU("h100-80gb", 80 * GB, 989e12, 3.35e12, 450e9, 8, False, 50e9, 8, 1979e12),
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s; same Hopper die, BF16 and NVLink as H100;
    # HGX H200 systems ship 400 Gb/s per GPU; 1,979 TFLOP/s FP8 dense.
    "h200": GPU("h200", 141 * GB, 989e12, 4.8e12, 450e9, 8, False, 50e9, 8, 1979e12),
    # NVIDIA HGX/DGX B200 datasheet: 180 GB HBM3e per GPU (1,440 GB per 8), 7.7 TB/s, 2.25 PFLOP/s
    # BF16 dense (4.5 sparse), 4.5 PFLOP/s FP8 dense, NVLink5 1.8 TB/s bidirectional; DGX B200: 8x 400 Gb/s ConnectX-7.
    "b200": GPU("b200", 180 * GB, 2.25e15, 7.7e12, 900e9, 8, False, 50e9, 8, 4.5e15),
    # AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, 1,307.4 TFLOP/s BF16 dense, 2,614.9 FP8 dense; Infinity
    # Fabric 7 links x 64 GB/s each way to the 7 peers of an 8-GPU OAM platform (896 GB/s aggregate
    # bidirectional); typical platforms pair each GPU with a 400 Gb/s NIC.
    "mi300x": GPU("mi300x", 192 * GB, 1307.4e12, 5.3e12, 448e9, 8, False, 50e9, 8, 2614.9e12),
    # NVIDIA GB200 NVL72 spec sheet: 72 GPUs in one NVLink domain (130 TB/s = 1.8 TB/s bidirectional
    # per GPU), 13.4 TB HBM3e (186 GB/GPU), 576 TB/s (8 TB/s/GPU), 180 PFLOP/s FP16/BF16 dense per
    # rack (2.5 PFLOP/s/GPU), 360 PFLOP/s FP8 dense (5 PFLOP/s/GPU); compute trays hold 4 GPUs; scale-out
    # 400 Gb/s ConnectX-7 per GPU.
    "gb200-nvl72": GPU("gb200-nvl72", 186 * GB, 2.5e15, 8e12, 900e9, 72, True, 50e9, 4, 5e15),
}


DEVICE_NAMES = (("GB200", "gb200-nvl72"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100-80gb"),
                ("A100", "a100-80gb"), ("MI300X", "mi300x"))
"""A device name's substring (torch.cuda.get_device_name) -> its preset; longest names first (GB200 before B200)."""


def preset_of_device(device_name: str) -> GPU | None:
    """The preset of a device by its reported name, or None for one the table does not know."""
    return next((GPU_PRESETS[p] for key, p in DEVICE_NAMES if key in device_name), None)
