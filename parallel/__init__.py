"""Layer 1 (bottom): JAX sharding primitives with no knowledge of the model: gather_weight (FSDP
gather / Megatron f) and reduce_scatter (g), varying / reduced typing inside shard_map, placing
pytrees on a mesh. Imports no other package of the suite.

Layers, bottom to top (each imports only the ones below it; tests/test_imports.py holds it):
  parallel  -> modeling -> layout -> measure -> strategies -> runtime -> the top: compare,
  report, command_line, run.py and planning/
  (kernels/ sits beside runtime: it imports modeling.gmm and registers with it; bench/ on top)
"""
