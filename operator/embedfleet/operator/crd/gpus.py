"""GPU types a spec may name, and the node labels that identify them.

NVIDIA's GPU feature discovery labels nodes with ``nvidia.com/gpu.product``; one spec type covers the
board variants a scheduler should treat as equivalent. An unknown type is rejected by validation
rather than rendered into an affinity no node can ever satisfy.
"""

from __future__ import annotations

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

KNOWN_GPU_TYPES: dict[str, tuple[str, ...]] = {
    "nvidia-t4": ("Tesla-T4",),
    "nvidia-a10g": ("NVIDIA-A10G",),
    "nvidia-l4": ("NVIDIA-L4",),
    "nvidia-l40s": ("NVIDIA-L40S",),
    "nvidia-a100-40gb": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"),
    "nvidia-a100-80gb": ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
    "nvidia-h100": ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL"),
    "nvidia-h200": ("NVIDIA-H200", "NVIDIA-H200-NVL"),
    "nvidia-b200": ("NVIDIA-B200",),
}
