"""Cluster profiles as data: one accelerator's peak and memory, and the two link classes a
collective's group can span (inside one node vs across nodes). Every number carries its public
source; per-direction bandwidths are what one GPU sends while it also receives as much.

What the planner assumes beyond these figures (its own assumptions, not sourced):
  - a group whose devices all sit in one node runs at the NVLink per-direction bandwidth;
    a group that crosses a node boundary runs at the InfiniBand bandwidth per GPU (one 400 Gb/s
    NIC per GPU; no hierarchical algorithm, no NVLink share of a cross-node all-to-all);
  - no overlap of communication with compute and no per-collective latency.
No TPU profile: the planner's link model is "node of G devices, one fast and one slow link
class", and a TPU slice's ICI is a 2D / 3D torus whose per-axis bandwidth depends on the slice's
shape; a profile would need that topology, which this module does not model.
"""
from __future__ import annotations

import dataclasses

GB = 1e9
TFLOPS = 1e12


@dataclasses.dataclass(frozen=True)
class Cluster:
  name: str
  peak_flops: float     # dense bf16 FLOP/s per device (no 2:4 sparsity)
  hbm_bytes: float      # memory per device (B)
  node_size: int        # devices per node, joined by the fast links
  intra_bw: float       # B/s one device sends per direction inside a node
  inter_bw: float       # B/s one device sends per direction across nodes
  doc: str              # the sources, one line


PROFILES = {
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100, H100 SXM column):
    # BF16 Tensor Core 1,979 TFLOPS "with sparsity", i.e. 989.4 dense; 80 GB HBM3; NVLink
    # 900 GB/s (bidirectional: 450 GB/s per direction). DGX H100 user guide: 8 GPUs per node,
    # 8 ConnectX-7 NICs of 400 Gb/s InfiniBand NDR, one per GPU: 50 GB/s per direction.
    "h100": Cluster("h100", 989.4 * TFLOPS, 80 * GB, 8, 450 * GB, 50 * GB,
                    "H100 SXM datasheet: 989 TFLOP/s bf16 dense, 80 GB, NVLink 900 GB/s bidir; "
                    "DGX H100: 8 GPUs/node, 400 Gb/s IB per GPU"),
    # H800 SXM: the H100 SXM die with NVLink cut to 400 GB/s bidirectional (NVIDIA H800 product
    # brief: 200 GB/s per direction); the same 989.4 TFLOP/s bf16 dense and 80 GB HBM3.
    # DeepSeek-V3 technical report (arXiv 2412.19437, section 3.2.2): 8 GPUs per node on NVLink /
    # NVSwitch, InfiniBand across nodes at 50 GB/s (400 Gb/s) per GPU; it quotes 160 GB/s as the
    # NVLink bandwidth it achieves, which is below the 200 GB/s used here.
    "h800": Cluster("h800", 989.4 * TFLOPS, 80 * GB, 8, 200 * GB, 50 * GB,
                    "H800 SXM: 989 TFLOP/s bf16 dense, 80 GB, NVLink 400 GB/s bidir; "
                    "DeepSeek-V3 report: 8 GPUs/node, IB 50 GB/s per GPU"),
}


def get(name: str) -> Cluster:
  from modeling.config import ConfigError
  if name not in PROFILES:
    raise ConfigError(f"unknown cluster {name!r}; choose from {', '.join(PROFILES)}")
  return PROFILES[name]
