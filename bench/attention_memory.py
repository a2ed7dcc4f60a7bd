"""Temp memory of the attention core alone, compiled and never run: XLA's temp bytes of
jit(value_and_grad) of modeling/attention.py's attend at DeepSeek-V3's MLA shape (1 sequence,
128 heads, KV = H, G = 1, q/k 128 + decoupled RoPE 64, v 128, bf16, chunk 512), for chunked and
xla at S = 1k, 4k, 16k, 64k (xla up to 16k: at 64k its scores alone are 2 TiB).

Run from the repo root:  python bench/attention_memory.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from modeling.attention import attend  # noqa: E402

H, NOPE, ROPE, V, CHUNK = 128, 128, 64, 128, 512


def temp_gib(impl: str, s: int) -> float:
  bf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  pos = jax.ShapeDtypeStruct((1, s), jnp.int32)
  loss = lambda q, k, v, q_r, k_r, p: attend(q, k, v, p, p, (NOPE + ROPE) ** -0.5, impl=impl,
                                             chunk=CHUNK, q_r=q_r, k_r=k_r).astype(jnp.float32).sum()
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  compiled = f.lower(bf(1, s, H, 1, NOPE), bf(1, s, H, NOPE), bf(1, s, H, V),
                     bf(1, s, H, 1, ROPE), bf(1, s, ROPE), pos).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**30


if __name__ == "__main__":
  print("| S | chunked | xla |\n|---|---|---|")
  for s in (1024, 4096, 16384, 65536):
    xla = f"{temp_gib('xla', s):.2f} GiB" if s <= 16384 else "-"
    print(f"| {s:,} | {temp_gib('chunked', s):.2f} GiB | {xla} |", flush=True)
