"""Layer 6: running it. Build a job from a strategy module and run the training loop (train),
the synthetic data (data), orbax checkpoints (checkpoint), multi-process start-up
(distributed). Strategies are passed in as arguments, never imported here.
"""
