"""Accelerator grouped-matmul kernels for modeling/gmm.py, kept out of the core.

Each module imports modeling.gmm and registers its kernels with register_kernel / register_wgrad
when imported; modeling.gmm never imports this package, so a kernel is used only where a caller
asked for it (command_line.py imports kernels.mgpu for --gmm=mgpu). Importing is cheap on any
platform: GPU-only code is loaded on a kernel's first use.
  mgpu   Pallas Mosaic-GPU ragged_dot_mgpu / transposed_ragged_dot_mgpu (Hopper) and the tile
         autotuner, which writes the per-shape table kernels/mgpu_tiles.json (bench/gmm.py
         --autotune, on a Hopper GPU; until then the file is absent and every call takes
         MGPU_CONFIG).
"""
