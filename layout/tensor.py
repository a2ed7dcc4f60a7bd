"""Megatron tensor-parallel pieces shared by tp and ep_x_tp: the column / row role table.

  attn wq [D, H@t, Dh]  wk/wv [D, KV@t, Dh]  (column)      attn wo [H@t, Dh, D]  (row)
  MLA wq_b [Rq, H@t, qk]  wkv_b [Rkv, H@t, nope + v]  (column; wq_a / wkv_a replicated)
  experts wi_0/wi_1 [E, D, F@t]  wo [E, F@t, D]            shared / dense [D, F@t], [F@t, D]
Embed, unembed, norms, router and bias are left out, i.e. replicated.
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P


def table(axis: str) -> dict:
  """role -> PartitionSpec: heads and every SwiGLU width over `axis`."""
  return {"attn_q": P(None, axis, None), "attn_kv": P(None, axis, None),     # [D, H_t|KV_t, Dh]
          "attn_q_b": P(None, axis, None), "attn_kv_b": P(None, axis, None),  # MLA [R, H_t, .]
          "attn_o": P(axis, None, None),                                      # [H_t, Dh, D] row
          "expert_in": P(None, None, axis),                                   # [E, D, F_t] column
          "expert_out": P(None, axis, None),                                  # [E, F_t, D] row
          "shared_in": P(None, axis), "shared_out": P(axis, None),
          "dense_in": P(None, axis), "dense_out": P(axis, None)}
