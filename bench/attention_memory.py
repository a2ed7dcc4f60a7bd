"""Temp memory of the attention core alone, compiled and never run: XLA's temp bytes of
jit(value_and_grad) of modeling/attention.py's attend at DeepSeek-V3's MLA shape (1 sequence,
128 heads, KV = H, G = 1, q/k 128 + decoupled RoPE 64, v 128, bf16, chunk 512), for chunked and
ordered (chunked with ordered=True: query blocks that visit only the key chunks at or before
them) and xla at S = 1k, 4k, 16k, 64k (xla up to 16k: at 64k its scores alone are 2 TiB).

With --backward: the chunked core's backward as written (a custom_vjp keeping q, k, v, the
output and the log-sum-exp) against autodiff through its key-chunk scan with each step under
jax.checkpoint (which keeps every step's running max, sum and output), at 1 sequence, 4 query
heads on 1 KV head, d 64, float32, chunk 256, S = 1k and 4k.

With --time=IMPL (chunked | ordered): compile, then run value_and_grad once at 1 sequence,
S = 8192, 8 query heads on 8 KV heads, d 64, float32, chunk 512, and print the run's seconds;
time whole processes of both (e.g. with /usr/bin/time -v) to compare.

With --ring_time=balanced|all: the same, through ring attention on 4 simulated devices
(context:4, the load-balanced order), S = 8192, 8 heads, d 64, float32, chunk 512, balanced
(each visit after the first computes the half-blocks the causal mask leaves) or not.

Run from the repo root:  python bench/attention_memory.py [--backward | --time=IMPL |
  --ring_time=KIND]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

if any(a.startswith("--ring_time=") for a in sys.argv):
  jax.config.update("jax_num_cpu_devices", 4)

from modeling import attention  # noqa: E402
from modeling.attention import attend  # noqa: E402

H, NOPE, ROPE, V, CHUNK = 128, 128, 64, 128, 512


def _impl(name: str) -> dict:
  """attend's keywords for a column: "ordered" is chunked with ordered=True."""
  return {"impl": "chunked", "ordered": True} if name == "ordered" else {"impl": name}


def temp_gib(impl: str, s: int) -> float:
  bf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  pos = jax.ShapeDtypeStruct((1, s), jnp.int32)
  scale = (NOPE + ROPE) ** -0.5
  loss = lambda q, k, v, q_r, k_r, p: attend(q, k, v, p, p, scale, chunk=CHUNK, q_r=q_r, k_r=k_r,
                                             **_impl(impl)).astype(jnp.float32).sum()
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  compiled = f.lower(bf(1, s, H, 1, NOPE), bf(1, s, H, NOPE), bf(1, s, H, V),
                     bf(1, s, H, 1, ROPE), bf(1, s, ROPE), pos).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**30


def _remat_attend(q, k, v, pos, scale, chunk):
  """The chunked forward differentiated by autodiff, each key-chunk step under jax.checkpoint."""
  def step(carry, xs):
    m, l, acc = carry
    k_c, v_c, pos_c, _ = xs
    s, _ = attention._chunk_scores(scale, q, None, pos, k_c, None, pos_c)   # [B, S, KV, G, C]
    m_new = jnp.maximum(m, s.max(-1))
    a, p = jnp.exp(m - m_new), jnp.exp(s - m_new[..., None])
    pv = jnp.einsum("bskgc,bckv->bskgv", p.astype(v.dtype), v_c, preferred_element_type=jnp.float32)
    return (m_new, a * l + p.sum(-1), a[..., None] * acc + pv), None
  carry = jax.lax.scan(jax.checkpoint(step), attention._init(q, v.shape[-1]),
                       attention._chunk_xs(k, v, pos, None, chunk))[0]
  return attention._finish(carry, v.dtype)[0]


def backward_mib(kind: str, s: int) -> float:
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  pos = jax.ShapeDtypeStruct((1, s), jnp.int32)
  core = ((lambda q, k, v, p: attend(q, k, v, p, p, 0.125, "chunked", 256)) if kind == "custom_vjp"
          else (lambda q, k, v, p: _remat_attend(q, k, v, p, 0.125, 256)))
  f = jax.jit(jax.value_and_grad(lambda q, k, v, p: core(q, k, v, p).sum(), argnums=(0, 1, 2)))
  compiled = f.lower(f32(1, s, 1, 4, 64), f32(1, s, 1, 64), f32(1, s, 1, 64), pos).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def _seconds(loss, q, k, v) -> float:
  """Wall seconds of one jit(value_and_grad(loss)) over q, k, v, after its compile and one
  warm-up."""
  import time
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  jax.block_until_ready(f(q, k, v))
  t0 = time.perf_counter()
  jax.block_until_ready(f(q, k, v))
  return time.perf_counter() - t0


def run_seconds(impl: str, s: int = 8192, heads: int = 8, d: int = 64) -> float:
  """Wall seconds of one value_and_grad of attention, after its compile and one warm-up."""
  import numpy as np
  rng = np.random.default_rng(0)
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k, v = x(1, s, heads, 1, d), x(1, s, heads, d), x(1, s, heads, d)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  loss = lambda q, k, v: attend(q, k, v, pos, pos, d ** -0.5, chunk=CHUNK, **_impl(impl)).sum()
  return _seconds(loss, q, k, v)


def ring_seconds(balanced: bool, s: int = 8192, heads: int = 8, d: int = 64, n: int = 4) -> float:
  """Wall seconds of one value_and_grad of ring attention over context:n (after its compile and
  one warm-up), q = k = v's tokens in the load-balanced order."""
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from layout import context, mesh as mesh_lib
  from modeling import model, ring_attention
  mesh = mesh_lib.make_mesh({"context": n})
  rng = np.random.default_rng(0)
  with jax.set_mesh(mesh):
    put = lambda x, spec: jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    x = lambda *shape: put(rng.standard_normal(shape).astype(np.float32),
                           P(None, "context", *([None] * (len(shape) - 2))))
    q, k, v = x(1, s, heads, 1, d), x(1, s, heads, d), x(1, s, heads, d)
    pos = put(context.load_balance_order(s, n)[None].astype(np.int32), P(None, "context"))
    loss = lambda q, k, v: ring_attention.ring_attend(
        q, (k, v), (), model._kv_as_is, pos, pos, d ** -0.5, CHUNK, ("context",),
        balanced=balanced).sum()
    return _seconds(loss, q, k, v)


if __name__ == "__main__" and any(a.startswith("--ring_time=") for a in sys.argv):
  kind = next(a for a in sys.argv if a.startswith("--ring_time="))[len("--ring_time="):]
  print(f"ring {kind}: {ring_seconds(kind == 'balanced'):.2f} s")
elif __name__ == "__main__" and any(a.startswith("--time=") for a in sys.argv):
  name = next(a for a in sys.argv if a.startswith("--time="))[len("--time="):]
  print(f"{name}: {run_seconds(name):.2f} s")
elif __name__ == "__main__" and "--backward" in sys.argv:
  print("| S | custom_vjp | remat per chunk |\n|---|---|---|")
  for s in (1024, 4096):
    vjp, remat = backward_mib("custom_vjp", s), backward_mib("remat", s)
    print(f"| {s:,} | {vjp:.1f} MiB | {remat:.1f} MiB |")
elif __name__ == "__main__":
  print("| S | chunked | ordered | xla |\n|---|---|---|---|")
  for s in (1024, 4096, 16384, 65536):
    xla = f"{temp_gib('xla', s):.2f} GiB" if s <= 16384 else "-"
    print(f"| {s:,} | {temp_gib('chunked', s):.2f} GiB | {temp_gib('ordered', s):.2f} GiB "
          f"| {xla} |", flush=True)
