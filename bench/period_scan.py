"""Where a scanned period's layer takes its params' row: inside its remat or outside it, and what
each compiler holds for the stack's gradient (modeling/model.py: _layer_body).

A toy stack of L layers (two float32 matrices each, cast to bf16 at use) runs as a scan over
L/n periods of n layers, each layer under jax.checkpoint; its train step (gradient, SGD update,
params donated) is compiled and XLA's temp bytes are printed over the params' bytes:
  one kind    the scan over L layers, one a step (n = 1)
  outside     the period's rows [n, ...] indexed in the scan step, the layer's row passed in
  inside      the period's rows passed to every layer's checkpoint, each indexing its own row

Run from the repo root:
  python bench/period_scan.py [--layers=48] [--period=4] [--target=tpu-v5p|h100]
--target compiles with that chip's compiler (runtime/target.py), no device needed.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

D, F, B = 256, 1024, 64


def losses(n: int):
  import jax
  import jax.numpy as jnp

  def body(x, w):                                          # w: {"a": [D, F], "b": [F, D]}
    h = jax.nn.relu(x @ w["a"].astype(jnp.bfloat16))      # [B, F]
    return (h @ w["b"].astype(jnp.bfloat16)).astype(x.dtype)

  def periods(p):                                          # [L, ...] -> [L/n, n, ...]
    return jax.tree.map(lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:]), p)

  def one_kind(p, x):
    x, _ = jax.lax.scan(lambda x, w: (jax.checkpoint(body)(x, w), None), x, p)
    return jnp.sum(x.astype(jnp.float32))

  def outside(p, x):
    def step(x, rows):
      for i in range(n):
        x = jax.checkpoint(body)(x, jax.tree.map(lambda a, i=i: a[i], rows))
      return x, None
    x, _ = jax.lax.scan(step, x, periods(p))
    return jnp.sum(x.astype(jnp.float32))

  def inside(p, x):
    def step(x, rows):
      for i in range(n):
        x = jax.checkpoint(lambda x, rows, i=i: body(x, jax.tree.map(lambda a: a[i], rows)))(
            x, rows)
      return x, None
    x, _ = jax.lax.scan(step, x, periods(p))
    return jnp.sum(x.astype(jnp.float32))
  return {"one kind": one_kind, "outside": outside, "inside": inside}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--layers", type=int, default=48)
  ap.add_argument("--period", type=int, default=4)
  ap.add_argument("--target", default=None)
  a = ap.parse_args()
  if a.layers % a.period:
    print(f"error: --layers={a.layers} is not a multiple of --period={a.period}", file=sys.stderr)
    return 2
  import jax
  import jax.numpy as jnp
  import numpy as np

  from runtime import target
  devices, compiler = None, "XLA:CPU"
  if not a.target and target.without_accelerator():
    jax.config.update("jax_platforms", "cpu")   # not the CUDA plugin or libtpu, where installed
  if a.target:
    target.check(a.target, 8)
    target.configure(a.target)
    t = target.devices(a.target, 8)
    devices, compiler = t.devices, t.compiler
  sharding = None
  if devices is not None:
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shape = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=sharding)
  p = {"a": shape((a.layers, D, F), jnp.float32), "b": shape((a.layers, F, D), jnp.float32)}
  x = shape((B, D), jnp.bfloat16)
  params = 2 * a.layers * D * F * 4
  print(f"{compiler}: {a.layers} layers in periods of {a.period}, params {params / 2**20:.0f} MiB")
  print("| the layer's row | XLA's temp | temp / params |\n|---|---|---|")
  for name, loss in losses(a.period).items():
    def step(p, x, loss=loss):
      g = jax.grad(loss)(p, x)
      return jax.tree.map(lambda w, dw: w - 0.1 * dw, p, g)
    temp = jax.jit(step, donate_argnums=0).lower(p, x).compile().memory_analysis() \
        .temp_size_in_bytes
    print(f"| {name} | {temp / 2**20:.1f} MiB | {temp / params:.2f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
