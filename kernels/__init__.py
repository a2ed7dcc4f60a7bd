"""Accelerator grouped-matmul kernels for common/gmm.py's "custom" backend, kept out of common/.

common.gmm imports this package on its first kernel lookup; each module below registers its
kernels with common.gmm.register_kernel / register_wgrad when imported. Importing is cheap on
any platform: GPU-only modules are imported on a kernel's first use, never here.
  mgpu   Pallas Mosaic-GPU ragged_dot_mgpu / transposed_ragged_dot_mgpu (Hopper), the per-shape
         tile table kernels/mgpu_tiles.json and its autotuner (bench/gmm.py --autotune).
"""
from kernels import mgpu  # noqa: F401  (registers kernel "mgpu" and wgrad "mgpu")
