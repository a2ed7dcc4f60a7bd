"""Layer 4: what the compiled program moves. Collective statistics read from XLA's HLO (hlo), the
analytic cost model (cost), the docstring contract parser (contract), wall-clock timing for the
benchmarks (timing). Imports parallel, modeling, layout.
"""
