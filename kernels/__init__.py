"""Accelerator grouped-matmul kernels for modeling/gmm.py, kept out of the core.

Each module imports modeling.gmm and registers its kernels with register_kernel / register_wgrad
when imported; modeling.gmm never imports this package, so a kernel is used only where a caller
asked for it (run.py imports kernels.mgpu for --gmm=mgpu). Importing is cheap on any platform:
GPU-only code is loaded on a kernel's first use.
  mgpu   Pallas Mosaic-GPU ragged_dot_mgpu / transposed_ragged_dot_mgpu (Hopper), the per-shape
         tile table kernels/mgpu_tiles.json and its autotuner (bench/gmm.py --autotune).
"""
