"""Cluster profiles as data: one accelerator's peak and memory, and the two link classes a
collective's group can span (inside one node vs across nodes). Every number carries its public
source; per-direction bandwidths are what one GPU sends while it also receives as much.

What the planner assumes beyond these figures (its own assumptions, not sourced):
  - a group whose devices all sit in one node runs at the NVLink per-direction bandwidth;
    a group that crosses a node boundary runs at the InfiniBand bandwidth per GPU (one 400 Gb/s
    NIC per GPU; no hierarchical algorithm, no NVLink share of a cross-node all-to-all);
  - a collective's fixed time (alpha) from the link classes' per-step latencies below and its
    algorithm's steps (planning.plan.latency_s); what runs under compute is --plan_overlap's
    (planning/plan.py).
TPU (tpu-v5p): the two link classes are a slice's ICI and the data-center network between
slices; the "node" is the largest single slice. A slice's ICI is a 3D torus: a chip has six
links, and a collective runs at what the links of the torus dimensions its group spans carry.
The profile states one dimension's (two of the six links). The planner gives every group inside
the slice that (`--plan_ici=dimension`) or, at `--plan_ici=torus` (the default), k times it for
a group that spans k dimensions (planning.plan.ici_dims). Which mesh axis maps to which dimension
is not modelled, nor a group that is not a whole ring of its dimension.
"""
from __future__ import annotations

import dataclasses

GB = 1e9
TFLOPS = 1e12
US = 1e-6

# The collectives each compiler merges, those a layer run issues over one group into one
# (planning.plan.link_loads): XLA:GPU merges the weights' all-gathers and reduce-scatters too,
# XLA:TPU only the all-reduces, XLA:CPU none (each strategy's first test row compiled for 8
# devices: docs/planner.md)
MERGES = {"XLA:GPU": ("all-reduce", "all-gather", "reduce-scatter"), "XLA:TPU": ("all-reduce",),
          "XLA:CPU": ()}


@dataclasses.dataclass(frozen=True)
class Protocol:
  """How a collective library moves a call: its fixed times and the bandwidth it moves at."""
  name: str
  call: float            # s a call
  near: float            # s a step inside a node (a TPU slice)
  far: float             # s a step across nodes (slices)
  share: float = 1.0     # the share of the links' bandwidth its data moves at
  tree: bool = False     # all-reduce only: a tree, 2 (steps inside a node + log2(nodes) across)


# GPUs: NCCL's own tuning model (NVIDIA/nccl src/graph/tuning.cc), which picks for each call the
# algorithm and protocol of least time: the ring with the Simple protocol (baseLat 8.4 us, hwLat
# 3.4 us a step over NVLink, 14 us over the network; the whole bandwidth), the ring with LL
# (6.6 us; 0.6 and 2.7 us; a quarter of the bandwidth) and, for an all-reduce, the tree with LL
# (6.8 us; 0.6 and 5.0 us; 1/3.8 of it).
NCCL = (Protocol("ring/Simple", 8.4 * US, 3.4 * US, 14 * US),
        Protocol("ring/LL", 6.6 * US, 0.6 * US, 2.7 * US, 1 / 4),
        Protocol("tree/LL", 6.8 * US, 0.6 * US, 5.0 * US, 1 / 3.8, tree=True))
# TPU slices: no launch of its own (the collective is an op of the compiled program), 1 us per
# ICI hop (ASTRA-sim's TPU validation: "link latency is 1 us, as per the TPU research team");
# between slices no TPU figure is published: NCCL's network step stands in.
ICI = (Protocol("ICI", 0.0, 1 * US, 14 * US),)


@dataclasses.dataclass(frozen=True)
class Cluster:
  name: str
  peak_flops: float     # dense bf16 FLOP/s per device (no 2:4 sparsity)
  hbm_bytes: float      # memory per device (B)
  node_size: int        # devices per node, joined by the fast links
  intra_bw: float       # B/s one device sends per direction inside a node
  inter_bw: float       # B/s one device sends per direction across nodes
  doc: str              # the sources, one line
  # whose compiler's temp the planner predicts (planning.plan.TEMP_COEFS): a TPU's is fitted to
  # XLA:TPU's programs; a GPU's is XLA:CPU's, as no GPU fit exists (XLA:GPU compiles ragged_dot
  # densely over the experts, where a GPU user runs a grouped-matmul kernel)
  temp_model: str = "XLA:CPU"
  # dense FP8 FLOP/s per device (no 2:4 sparsity), 0 where the chip has no FP8 matmul; only
  # published FP8 runs are priced at it (planning/published.py: the suite trains in bf16)
  fp8_flops: float = 0.0
  # a TPU slice's ICI: the torus' dimensions (0: not a torus) and the devices JAX sees per chip
  torus_dims: int = 0
  chip_devices: int = 1
  # the collective library's protocols (Protocol), their fixed times (planning.plan.latency_s)
  protocols: tuple = NCCL
  # the collectives its compiler merges (MERGES)
  merges: tuple = MERGES["XLA:GPU"]

  @property
  def platform(self) -> str:
    """The devices' platform, as jax names it ('tpu', 'gpu'): the planner's abstract meshes
    stand for it, so that a strategy's check() admits what the cluster's compiler compiles
    (ep's exchange=ragged, which XLA:CPU cannot)."""
    return "tpu" if self.name.startswith("tpu") else "gpu"


PROFILES = {
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100, H100 SXM column):
    # BF16 Tensor Core 1,979 TFLOPS "with sparsity", i.e. 989.4 dense (FP8 3,958 with sparsity,
    # 1,978.9 dense, as on the H800 and H200); 80 GB HBM3; NVLink
    # 900 GB/s (bidirectional: 450 GB/s per direction). DGX H100 user guide: 8 GPUs per node,
    # 8 ConnectX-7 NICs of 400 Gb/s InfiniBand NDR, one per GPU: 50 GB/s per direction.
    "h100": Cluster("h100", 989.4 * TFLOPS, 80 * GB, 8, 450 * GB, 50 * GB,
                    "H100 SXM datasheet: 989 TFLOP/s bf16 dense, 80 GB, NVLink 900 GB/s bidir; "
                    "DGX H100: 8 GPUs/node, 400 Gb/s IB per GPU", fp8_flops=1978.9 * TFLOPS),
    # H800 SXM: the H100 SXM die with NVLink cut to 400 GB/s bidirectional (NVIDIA H800 product
    # brief: 200 GB/s per direction); the same 989.4 TFLOP/s bf16 dense and 80 GB HBM3.
    # DeepSeek-V3 technical report (arXiv 2412.19437, section 3.2.2): 8 GPUs per node on NVLink /
    # NVSwitch, InfiniBand across nodes at 50 GB/s (400 Gb/s) per GPU; it quotes 160 GB/s as the
    # NVLink bandwidth it achieves, which is below the 200 GB/s used here.
    "h800": Cluster("h800", 989.4 * TFLOPS, 80 * GB, 8, 200 * GB, 50 * GB,
                    "H800 SXM: 989 TFLOP/s bf16 dense, 80 GB, NVLink 400 GB/s bidir; "
                    "DeepSeek-V3 report: 8 GPUs/node, IB 50 GB/s per GPU",
                    fp8_flops=1978.9 * TFLOPS),
    # Cloud TPU v5p (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16 per chip; 95 GiB HBM2e
    # ("95 GB" in an earlier revision of the page: 95e9 B here, the smaller); bidirectional ICI
    # 1,200 GB/s per chip over a 3D torus (six links: 100 GB/s per link and direction), one
    # dimension's two links 200 GB/s per direction; DCN 50 Gb/s per chip (6.25 GB/s) between
    # slices; the largest single slice 6,144 chips (16x16x24), a pod 8,960.
    "tpu-v5p": Cluster("tpu-v5p", 459 * TFLOPS, 95 * GB, 6144, 200 * GB, 6.25 * GB,
                       "Cloud TPU v5p: 459 TFLOP/s bf16, 95 GB HBM, ICI 1,200 GB/s bidir per chip "
                       "(3D torus; one dimension's 2 links, 200 GB/s per direction, assumed); "
                       "DCN 50 Gb/s per chip; slices up to 6,144 chips", temp_model="XLA:TPU",
                       torus_dims=3, protocols=ICI,
                       merges=MERGES["XLA:TPU"]),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): the H100's 989.4 TFLOP/s bf16 dense
    # (1,979 with sparsity), 141 GB HBM3e, NVLink 900 GB/s bidirectional; HGX H200: 8 GPUs per
    # node, 400 Gb/s InfiniBand NIC per GPU.
    "h200": Cluster("h200", 989.4 * TFLOPS, 141 * GB, 8, 450 * GB, 50 * GB,
                    "H200 SXM datasheet: 989 TFLOP/s bf16 dense, 141 GB, NVLink 900 GB/s bidir; "
                    "HGX H200: 8 GPUs/node, 400 Gb/s IB per GPU", fp8_flops=1978.9 * TFLOPS),
    # NVIDIA HGX B200 (1,000 W per GPU): bf16 2,250 TFLOP/s dense (4,500 with sparsity),
    # FP8 4,500 dense (9,000 with sparsity); 180 GB HBM3e per GPU (1.44 TB for 8),
    # fifth-generation NVLink 1.8 TB/s bidirectional per GPU (900 GB/s per direction); DGX
    # B200: 8 GPUs per node, 400 Gb/s ConnectX-7 per GPU.
    "b200": Cluster("b200", 2250 * TFLOPS, 180 * GB, 8, 900 * GB, 50 * GB,
                    "HGX B200: 2,250 TFLOP/s bf16 dense, 180 GB, NVLink 1.8 TB/s bidir; "
                    "DGX B200: 8 GPUs/node, 400 Gb/s IB per GPU", fp8_flops=4500 * TFLOPS),
    # Cloud TPU v6e, Trillium (cloud.google.com/tpu/docs/v6e): 918 TFLOP/s bf16 per chip, 32 GB
    # HBM, ICI 800 GB/s bidirectional per chip over a 2D torus (four ports: 100 GB/s per port
    # and direction, one dimension's two 200 GB/s per direction), DCN 100 Gb/s per chip
    # (12.5 GB/s, the TPU7x page's comparison table); a pod, the largest slice, is 256 chips.
    "tpu-v6e": Cluster("tpu-v6e", 918 * TFLOPS, 32 * GB, 256, 200 * GB, 12.5 * GB,
                       "Cloud TPU v6e: 918 TFLOP/s bf16, 32 GB HBM, ICI 800 GB/s bidir per chip "
                       "(2D torus; one dimension's 2 links, 200 GB/s per direction, assumed); "
                       "DCN 100 Gb/s per chip; slices up to 256 chips", temp_model="XLA:TPU",
                       torus_dims=2, protocols=ICI,
                       merges=MERGES["XLA:TPU"]),
    # Cloud TPU7x, Ironwood (cloud.google.com/tpu/docs/tpu7x): per chip 2,307 TFLOP/s bf16
    # (4,614 FP8), 192 GiB HBM, ICI 1,200 GB/s bidirectional over a 3D torus, DCN 100 Gb/s,
    # two TensorCores that JAX sees as two devices; 9,216 chips per pod. A device here is half
    # a chip: 1,153.5 TFLOP/s, 96 GiB, and half a chip's links (one dimension's two links of
    # 100 GB/s per direction each, shared by its two devices: 100 GB/s per device).
    "tpu-v7": Cluster("tpu-v7", 1153.5 * TFLOPS, 96 * 2**30, 18432, 100 * GB, 6.25 * GB,
                      "Cloud TPU7x: 2,307 TFLOP/s bf16 and 192 GiB per chip, 2 devices per "
                      "chip; ICI 1,200 GB/s bidir per chip (3D torus; one dimension's 2 links "
                      "shared by the chip's 2 devices, 100 GB/s per device and direction, "
                      "assumed); DCN 100 Gb/s per chip; pods of 9,216 chips",
                      temp_model="XLA:TPU", fp8_flops=2307 * TFLOPS, torus_dims=3,
                      chip_devices=2, protocols=ICI,
                      merges=MERGES["XLA:TPU"]),
}


def get(name: str) -> Cluster:
  from modeling.config import ConfigError
  if name not in PROFILES:
    raise ConfigError(f"unknown cluster {name!r}; choose from {', '.join(PROFILES)}")
  return PROFILES[name]
