"""Layer 2: what is computed. The config, the decoder-only MoE transformer, routing, token
permutation and the expert FFN, the grouped matmul, the optimizers. No mesh, no strategy.

Shape legend (used in every comment of the suite):
  B batch, S sequence, T tokens (= B*S, or the local share), D model dim,
  H query heads, KV key/value heads, G = H // KV, Dh head dim,
  E experts, e local experts, F expert hidden dim, Fs shared-expert hidden dim,
  K top-k, C capacity (rows per expert), V vocab, L layers.
einsum letters: b B, s S (queries), t T (keys, or tokens in the MoE), d D, k KV (attention) or
  K (MoE copies), g G, h Dh, e E, f F, v V, m M (microbatches), c C.
Sharding notation in comments: `[B, S, D] @ (data, None, None)` = PartitionSpec per dim.
"""
