"""Per-chip peak figures for the accelerators `zerojax plan` knows, as published by their vendors.

All numbers are *peak* per-chip figures as published: dense (no sparsity) bf16 FLOP/s, HBM capacity
as printed (GB = 1e9 bytes, GiB = 2**30 bytes), and the interconnect a data-parallel collective
runs over (NVLink inside one GPU node, ICI inside one TPU slice). Real collectives reach a fraction
of these; the planner's times are lower bounds, not predictions.

Interconnect: vendors quote bidirectional bandwidth (bytes in + out). A ring collective sends and
receives at once, so its time is bytes *sent* per device over the per-direction rate: half the
bidirectional figure. `link_bytes_per_s` is that half; the published number is kept beside it.

Host link: the bus between a chip and its host's memory (PCIe), which host offload (`zero.offload`,
`model.remat: offload`) copies over. GPU datasheets quote PCIe bidirectional; `host_bytes_per_s`
is one direction (a step's copies out and back in run in opposite directions, at once). TPU docs
publish no per-chip PCIe figure; "How to Scale Your Model" (chapter "All About TPUs") works its
problems with 1.5e10 bytes/s host to chip, taken here for every TPU generation as an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zerojax.errors import UserError

GB = 1e9
GIB = 2**30

# `zerojax plan`'s compute at a stated fraction of peak: published MFU of FSDP training on H100 and
# TPU is ~40-50% (MaxText's and Levanter's reported runs); `--mfu` overrides it.
DEFAULT_MFU = 0.45


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per chip
    hbm_bytes: float  # memory capacity per chip
    interconnect_bidirectional_bytes_per_s: float  # as published, per chip
    interconnect: str  # which fabric the figure describes
    host_bytes_per_s: float  # chip <-> host memory, one direction

    @property
    def link_bytes_per_s(self) -> float:
        """Per-direction rate: what a ring collective's bytes sent are divided by."""
        return self.interconnect_bidirectional_bytes_per_s / 2


_TPU_HOST = 15 * GB  # an estimate: see the module doc

HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): 312 TFLOPS bf16 dense, 80GB HBM2e,
    # third-generation NVLink 600 GB/s; PCIe Gen4 64 GB/s (bidirectional).
    "a100": Hardware("a100", 312e12, 80 * GB, 600 * GB, "NVLink 3 (intra-node)", 32 * GB),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): 1,979 TFLOPS bf16 *with sparsity*, so 989.5 dense;
    # 80GB HBM3; fourth-generation NVLink 900 GB/s; PCIe Gen5 128 GB/s (bidirectional).
    "h100": Hardware("h100", 989.5e12, 80 * GB, 900 * GB, "NVLink 4 (intra-node)", 64 * GB),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM, 141GB HBM3e,
    # NVLink 900 GB/s, PCIe Gen5 128 GB/s (bidirectional).
    "h200": Hardware("h200", 989.5e12, 141 * GB, 900 * GB, "NVLink 4 (intra-node)", 64 * GB),
    # Cloud TPU docs, "TPU v4" system architecture: 275 TFLOPs bf16, 32 GiB HBM2. That page gives no
    # per-chip ICI figure; 6 ICI links x 90 GB/s bidirectional (45 GB/s each way) per chip is taken
    # from "How to Scale Your Model" (JAX ML scaling book), chapter "All About TPUs".
    "tpu-v4": Hardware("tpu-v4", 275e12, 32 * GIB, 6 * 90 * GB, "ICI (3D torus)", _TPU_HOST),
    # Cloud TPU docs, "TPU v5e": 197 TFLOPs bf16, 16 GB HBM2, bidirectional ICI 400 GBps per chip.
    "tpu-v5e": Hardware("tpu-v5e", 197e12, 16 * GB, 400 * GB, "ICI (2D torus)", _TPU_HOST),
    # Cloud TPU docs, "TPU v5p": 459 TFLOPs bf16, 95 GB HBM2e (newer revisions print 95 GiB; the
    # smaller reading is kept), bidirectional ICI 1200 GBps per chip.
    "tpu-v5p": Hardware("tpu-v5p", 459e12, 95 * GB, 1200 * GB, "ICI (3D torus)", _TPU_HOST),
    # Cloud TPU docs, "TPU v6e" (Trillium): 918 TFLOPs bf16, 32 GB HBM, bidirectional ICI 800 GBps
    # per chip.
    "tpu-v6e": Hardware("tpu-v6e", 918e12, 32 * GB, 800 * GB, "ICI (2D torus)", _TPU_HOST),
}


# Chips sharing the fast links, and the per-direction bytes/s each chip has to other nodes: one
# 400 Gb/s (H100, H200) or 200 Gb/s (A100) NIC per GPU in DGX-style nodes. A TPU slice's ICI links
# every chip, so the whole slice is one node.
NODES: dict[str, tuple[int | None, float]] = {"h100": (8, 50 * GB), "h200": (8, 50 * GB), "a100": (8, 25 * GB)}


def node_links(hw: Hardware, devices: int) -> tuple[int, float]:
    """(chips per node, per-direction bytes/s between nodes) on `hw`."""
    size, between = NODES.get(hw.name, (None, hw.link_bytes_per_s))
    return (devices if size is None else size), between


def group_links(hw: Hardware, devices: int) -> Hardware:
    """`hw` as a collective over `devices` chips sees it: a group that spans nodes runs its ring
    through each chip's link to other nodes, so that rate bounds it; within one node, `hw` itself."""
    node, between = node_links(hw, devices)
    if devices <= node or between >= hw.link_bytes_per_s:
        return hw
    return replace(
        hw,
        interconnect_bidirectional_bytes_per_s=2 * between,
        interconnect=f"network between nodes of {node} ({between * 8 / 1e9:.0f} Gb/s per chip)",
    )


def get_hardware(name: str) -> Hardware:
    key = name.strip().lower()
    if key not in HARDWARE:
        raise UserError(f"hardware {name!r} is unknown; valid names are {', '.join(HARDWARE)}.")
    return HARDWARE[key]
