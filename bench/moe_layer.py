"""Benchmark of one whole MoE layer on ONE device, for every grouped-matmul backend.

Run from the repo root:  python bench/moe_layer.py [--proxies=mixtral,deepseek] [--scale=1]

The layer is the one the strategies run (modeling/moe.py), on T tokens of width D:
  route      modeling.moe.route_tokens -> modeling.routing.route   (dropless: capacity_factor=0)
  permute    modeling.moe.permute                                [T*k, D] sorted by expert
  gmm x 3    modeling.moe.swiglu_experts                         silu(xs@wi_0) * (xs@wi_1) @ wo
  unpermute  modeling.moe.unpermute                              weighted combine -> [T, D]
Modes: "fwd" = y = layer(x); "fwd+bwd" = jax.value_and_grad of sum(y^2) (in f32) w.r.t. x and
the router, wi_0, wi_1 and wo weights. Both are jitted and AOT-compiled before timing; the
time is the best of --iters calls after one warmup call (robust on a shared machine).
TFLOP/s counts model FLOPs only: 2*T*k*D*F*3 forward, 3x that for fwd+bwd (not the E x dense
work that some backends really do, nor routing/permute).

Proxies (routed experts only, no shared experts, no attention):
  mixtral   T=16384 D=4096 F=14336 E=8  k=2  softmax router, top-k weights renormalised
  deepseek  T=16384 D=2048 F=1408  E=64 k=6  softmax router with norm_topk_prob=False
            (DeepSeek-V2-Lite's routed-expert shape and router; not the V3 sigmoid router)
Params are built directly: router [D, E], wi_0 / wi_1 [E, D, F], wo [E, F, D], normal / sqrt(fan_in).
--scale divides T, D and F (a CPU mode; CPU timings say nothing about GPU kernels).

Backends (--backends; default: all of modeling.gmm.available_backends(), plus custom:mgpu and
custom:mgpu:mgpu where modeling.gmm reports the Mosaic-GPU kernels that kernels/ registers):
  ragged_dot                 jax.lax.ragged_dot, autodiff by JAX
  padded                     capacity-padded einsum; capacity = largest group of THIS batch's
                             routing rounded up to 8 (dropless for this batch; a real run needs
                             a static bound, the worst case being C = T*k)
  custom[:kernel[:wgrad]]    custom_vjp backend with that kernel (default ragged_dot, so plain
                             "custom" never silently turns into mgpu) and wgrad (default auto)
  torch                      the same layer in PyTorch eager with torch._grouped_mm (in the
                             default list where torch has it; CUDA if torch sees it, else CPU),
                             on the same weights and tokens; its forward is checked against the
                             JAX layer (ragged_dot) before timing, and a mismatch fails the row.
                             Peak memory: torch.cuda.max_memory_allocated (CUDA only).
The other gmm options reach modeling.gmm.gmm through swiglu_experts' gmm_kwargs.

Peak memory is jax.devices()[0].memory_stats()["peak_bytes_in_use"] (GPU; "n/a" where the
backend exposes no stats, e.g. CPU). That counter only grows, so on GPU (--isolate=auto) every
(proxy, backend) row runs in its own child process and the peak is that row's: params, data,
fwd and fwd+bwd together. "XLA temp" is the fwd+bwd executable's temp buffer size from
compiled.memory_analysis(), a per-executable figure available on every backend.
A row that fails (OOM, lowering error, crash of its child) prints "error: <one line>".
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json
import math
import subprocess
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kernels import mgpu  # noqa: F401  (registers the "mgpu" kernel and wgrad)
from measure import timing
from modeling import gmm as gmm_lib, moe
from modeling.config import Config

PROXIES = {  # name: (T, D, F, E, k, norm_topk_prob)
    "mixtral": (16384, 4096, 14336, 8, 2, True),
    "deepseek": (16384, 2048, 1408, 64, 6, False),
}

# Figures the team measured on an H100 (bf16, full-size proxies). NOT measured by this run.
REFERENCE_H100 = (  # (proxy, implementation, layer fwd+bwd)
    ("mixtral", "PyTorch eager torch._grouped_mm", "60.5 ms"),
    ("deepseek", "PyTorch eager torch._grouped_mm", "17.1 ms"),
    ("mixtral", "JAX lax.ragged_dot", "402 ms"),
    ("deepseek", "JAX lax.ragged_dot", "OOM (57 GiB)"),
)

CPU_SCALE = 64      # default --scale on CPU: the default run stays well under 60 s on 2 cores
CPU_ITERS, GPU_ITERS = 3, 10
_ROW_TAG = "@@moe_layer_row "

_PROXIES = flags.DEFINE_list("proxies", list(PROXIES), f"Subset of {', '.join(PROXIES)}.")
_BACKENDS = flags.DEFINE_list(
    "backends", None,
    "gmm backends: ragged_dot, padded, custom[:kernel[:wgrad]] (default: all available).")
_ITERS = flags.DEFINE_integer("iters", None, f"Timed calls per mode (default {GPU_ITERS} GPU, "
                              f"{CPU_ITERS} CPU); the best one is reported.")
_SCALE = flags.DEFINE_integer("scale", None, f"Divides T, D, F (default 1 GPU, {CPU_SCALE} CPU).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["bf16", "f32"], "Default: bf16 on GPU, f32 on CPU.")
_ISOLATE = flags.DEFINE_enum(
    "isolate", "auto", ["auto", "yes", "no"],
    "Run each (proxy, backend) in a child process (auto: where the device has memory stats).")
_CHILD_TIMEOUT = flags.DEFINE_integer("child_timeout", 900, "Seconds per child process.")
_CHILD = flags.DEFINE_bool("child", False, "Internal: run one row and print it as JSON.")


# ---------------------------------------------------------------- setup


def default_backends():
  names = list(gmm_lib.available_backends())
  if "mgpu" in gmm_lib.available_kernels():
    names.append("custom:mgpu")
    if "mgpu" in gmm_lib.available_wgrads():
      names.append("custom:mgpu:mgpu")
  if timing.grouped_mm_torch() is not None:
    names.append("torch")
  return names


def parse_backend(spec):
  """'padded' | 'custom:mgpu:segment' | 'torch' -> (base, gmm kwargs other than capacity)."""
  if spec == "torch":
    if timing.grouped_mm_torch() is None:
      raise app.UsageError("backend 'torch': torch with torch._grouped_mm is not importable")
    return "torch", {}
  base, *rest = spec.split(":")
  try:
    concrete = gmm_lib.resolve_backend(base)
    if len(rest) > 1:
      gmm_lib.resolve_wgrad(rest[1])
  except ValueError as err:
    raise app.UsageError(f"backend {spec!r}: {err}") from None
  if concrete != base:
    raise app.UsageError(f"backend {spec!r}: name a concrete backend, not {base!r}")
  if rest and base != "custom":
    raise app.UsageError(f"backend {spec!r}: only custom takes :kernel[:wgrad]")
  if len(rest) > 2:
    raise app.UsageError(f"backend {spec!r}: expected custom[:kernel[:wgrad]]")
  if base != "custom":
    return base, {}
  try:
    kernel = gmm_lib.resolve_kernel(rest[0]) if rest else "ragged_dot"
  except ValueError as err:
    raise app.UsageError(f"backend {spec!r}: {err}") from None
  wgrad = rest[1] if len(rest) > 1 else "auto"
  return base, {"kernel": kernel, "wgrad": wgrad}


def scaled(name, scale):
  """Shapes divided by scale; D and F rounded down to multiples of 8 (16-byte rows for the
  grouped GEMMs of torch and the Hopper kernels)."""
  t, d, f, e, k, norm = PROXIES[name]
  r8 = lambda v: max(8, v // scale // 8 * 8)
  return max(e, t // scale), r8(d), r8(f), e, k, norm


def fwd_flops(t, d, f, k):
  return 2.0 * t * k * d * f * 3


def make_config(d, f, e, k, norm, base):
  return Config(d_model=d, d_ff=f, n_experts=e, top_k=k, router="softmax",
                norm_topk_prob=norm, capacity_factor=0.0, gmm_backend=base).validate()


def make_params(t, d, f, e, dtype, seed=0):
  """(weights {router, wi_0, wi_1, wo}, bias [E] zeros, x [T, D]), normal / sqrt(fan_in)."""
  keys = jax.random.split(jax.random.key(seed), 5)

  @jax.jit
  def make():
    def normal(key, shape, fan_in):
      # drawn in the bench dtype: no f32 copy of the weights inflates the peak-memory counter
      return jax.random.normal(key, shape, dtype) * jnp.asarray(1 / math.sqrt(fan_in), dtype)
    w = {"router": normal(keys[0], (d, e), d),
         "wi_0": normal(keys[1], (e, d, f), d),
         "wi_1": normal(keys[2], (e, d, f), d),
         "wo": normal(keys[3], (e, f, d), f)}
    x = jax.random.normal(keys[4], (t, d), dtype)
    return w, jnp.zeros((e,), jnp.float32), x

  return make()


# ---------------------------------------------------------------- the layer


def layer(w, bias, x, cfg, gmm_kwargs=None):
  """x [T, D] -> y [T, D]: route, permute, swiglu_experts (3 gmms), unpermute."""
  t, d = x.shape
  p = dict(w, bias=bias)
  positions = jnp.arange(t, dtype=jnp.int32)[None]                     # unused when dropless
  r, keep, _ = moe.route_tokens(p, x[None], positions, cfg)          # over T tokens
  xs, group_sizes, order = moe.permute(x, r.experts, keep, cfg.n_experts)   # [T*k, D]
  ys = moe.swiglu_experts(xs, group_sizes, p, cfg.gmm_backend, **(gmm_kwargs or {}))  # [T*k, D]
  return moe.unpermute(ys, order, r.weights).astype(x.dtype)        # [T, D]


def loss_and_grads(w, bias, x, cfg, gmm_kwargs=None):
  def loss(w, x):
    y = layer(w, bias, x, cfg, gmm_kwargs)
    return jnp.sum(jnp.square(y.astype(jnp.float32)))
  return jax.value_and_grad(loss, argnums=(0, 1))(w, x)


def padded_capacity(w, bias, x, cfg):
  """Largest group of this batch's routing, rounded up to 8 (at most T*k)."""
  @jax.jit
  def largest(w, bias, x):
    p = dict(w, bias=bias)
    r, keep, _ = moe.route_tokens(p, x[None], jnp.zeros((1, x.shape[0]), jnp.int32), cfg)
    return jnp.max(moe.permute(x, r.experts, keep, cfg.n_experts)[1])
  big = int(largest(w, bias, x))
  return min(-(-big // 8) * 8, x.shape[0] * cfg.top_k)


# ---------------------------------------------------------------- the layer in PyTorch


def torch_layer(w, x, cfg, dtype):
  """The same layer in PyTorch eager (torch._grouped_mm), on copies of the JAX weights and tokens.

  Returns (torch, fwd, fwd_bwd, reset_peak, peak): fwd() -> y [T, D]; fwd_bwd() -> grads of
  sum(y^2) w.r.t. x and the four weights, as in loss_and_grads.
  """
  torch = timing.grouped_mm_torch()
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  tdtype = {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.float32): torch.float32}[
      jnp.dtype(dtype)]
  to_t = lambda a: torch.from_numpy(np.array(a, np.float32)).to(dev, tdtype).requires_grad_()
  k, e = cfg.top_k, cfg.n_experts
  router = to_t(w["router"])                                         # [D, E]
  # expert weights as [E, out, in] (nn.Linear's layout); the gmm reads their transposed views
  wi_0, wi_1, wo = (to_t(np.swapaxes(np.asarray(w[n], np.float32), 1, 2))
                    for n in ("wi_0", "wi_1", "wo"))
  xt = to_t(x)                                                       # [T, D]

  def gmm(a, wt, offs):                                              # a [M, in] -> [M, out]
    return torch._grouped_mm(a, wt.transpose(-2, -1), offs=offs)  # pylint: disable=protected-access

  def layer():
    t, d = xt.shape
    probs = torch.softmax(xt.float() @ router.float(), dim=-1)      # [T, E] f32
    top_w, top_e = torch.topk(probs, k, dim=-1)                     # [T, k]
    if cfg.norm_topk_prob:
      top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    flat = top_e.reshape(-1)                                         # [T*k]
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)  # group ends
    xs = xt[order // k]                                              # [T*k, D] sorted by expert
    h = torch.nn.functional.silu(gmm(xs, wi_0, offs)) * gmm(xs, wi_1, offs)    # [T*k, F]
    ys = gmm(h, wo, offs)                                            # [T*k, D]
    y = torch.empty_like(ys).index_copy(0, order, ys).view(t, k, d)  # back to token order
    return (y * top_w.to(y.dtype).unsqueeze(-1)).sum(dim=1)          # [T, D]

  def fwd():
    with torch.no_grad():
      return layer()

  def fwd_bwd():
    loss = layer().float().square().sum()
    return torch.autograd.grad(loss, (router, wi_0, wi_1, wo, xt))

  cuda = dev == "cuda"
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  reset = torch.cuda.reset_peak_memory_stats if cuda else (lambda: None)
  peak = (lambda: int(torch.cuda.max_memory_allocated())) if cuda else (lambda: None)
  return sync, fwd, fwd_bwd, reset, peak


def torch_row(row, w, bias, x, cfg, dtype, iters):
  """Fill a 'torch' row: forward checked against the JAX layer, then fwd and fwd+bwd times."""
  want = np.asarray(jax.jit(lambda w, b, x: layer(w, b, x, cfg))(w, bias, x), np.float32)
  sync, fwd, fwd_bwd, reset, peak = torch_layer(w, x, cfg, dtype)
  reset()
  got = fwd().float().cpu().numpy()
  err = float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-30))
  tol = 5e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 1e-4
  if not err <= tol:
    raise AssertionError(f"torch layer differs from the JAX layer: rel err {err:.2e} > {tol}")
  row["note"] = f"forward rel err vs the JAX layer {err:.1e}"
  for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
    row[mode] = timing.best_wall_ms(fn, iters, lambda _: sync())
  row["peak"] = peak()
  return row


def one_line(err):
  lines = [s.strip() for s in str(err).splitlines() if s.strip()]
  msg = f"{type(err).__name__}: {lines[0] if lines else ''}"
  return msg[:200]


def fmt_bytes(n):
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def peak_memory():
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return int(stats["peak_bytes_in_use"])


def temp_bytes(compiled):
  try:
    return int(compiled.memory_analysis().temp_size_in_bytes)
  except Exception:  # pylint: disable=broad-except
    return None


def mgpu_note(kw, d, f, dtype):
  """Why the mgpu kernel would fall back to ragged_dot here ('' if it runs natively)."""
  if kw.get("kernel") != "mgpu" and kw.get("wgrad") != "mgpu":
    return ""
  if "mgpu" not in gmm_lib.available_kernels():
    return "mgpu unavailable here: runs as ragged_dot"
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return "mgpu needs bf16/f16: runs as ragged_dot"
  if d % 128 or f % 128:
    return "mgpu tiles do not divide D/F: some gmms run as ragged_dot"
  return ""


def bench_row(proxy, spec, scale, dtype, iters):
  """One (proxy, backend) row as a dict: fwd/fwd+bwd ms or errors, peak/temp bytes, note."""
  t, d, f, e, k, norm = scaled(proxy, scale)
  base, kw = parse_backend(spec)
  cfg = make_config(d, f, e, k, norm, "ragged_dot" if base == "torch" else base)
  row = {"proxy": proxy, "backend": spec, "note": mgpu_note(kw, d, f, dtype)}
  try:
    w, bias, x = make_params(t, d, f, e, dtype)
    if base == "padded":
      kw = dict(kw, capacity=padded_capacity(w, bias, x, cfg))
      row["note"] = f"capacity={kw['capacity']}"
  except Exception as err:  # pylint: disable=broad-except
    row["error"] = "setup: " + one_line(err)
    return row
  if base == "torch":
    try:
      return torch_row(row, w, bias, x, cfg, dtype, iters)
    except Exception as err:  # pylint: disable=broad-except
      row["error"] = one_line(err)
      return row
  modes = (("fwd", lambda w, b, x: layer(w, b, x, cfg, kw)),
           ("fwd+bwd", lambda w, b, x: loss_and_grads(w, b, x, cfg, kw)))
  errors = {}  # one-line message -> modes it broke
  for mode, fn in modes:
    try:
      compiled = jax.jit(fn).lower(w, bias, x).compile()
      if mode == "fwd+bwd":
        row["temp"] = temp_bytes(compiled)
      row[mode] = timing.best_ms(compiled, (w, bias, x), iters)
    except Exception as err:  # pylint: disable=broad-except
      errors.setdefault(one_line(err), []).append(mode)
  if errors:
    row["error"] = "; ".join(f"{' and '.join(m)}: {msg}" for msg, m in errors.items())
  row["peak"] = peak_memory()
  return row


def run_child(proxy, spec, scale, dtype_name, iters, env):
  """bench_row in a fresh process (its own peak-memory counter; crashes stay contained)."""
  cmd = [sys.executable, os.path.abspath(__file__), f"--proxies={proxy}", f"--backends={spec}",
         f"--scale={scale}", f"--dtype={dtype_name}", f"--iters={iters}", "--child"]
  if spec == "torch":   # JAX only builds the data and checks the output: leave the GPU to torch
    env = dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_ALLOCATOR="platform")
  try:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                         timeout=_CHILD_TIMEOUT.value, check=False)
  except subprocess.TimeoutExpired:
    return {"proxy": proxy, "backend": spec, "error": f"child timed out after "
                                                     f"{_CHILD_TIMEOUT.value} s"}
  for line in out.stdout.splitlines():
    if line.startswith(_ROW_TAG):
      return json.loads(line[len(_ROW_TAG):])
  tail = [s for s in (out.stderr + out.stdout).splitlines() if s.strip()]
  return {"proxy": proxy, "backend": spec,
          "error": f"child exit {out.returncode}: {tail[-1].strip()[:200] if tail else ''}"}


# ---------------------------------------------------------------- output


def fmt_row(row, scale, isolated):
  t, d, f, _, k, _ = scaled(row["proxy"], scale)
  flops = fwd_flops(t, d, f, k)
  cells = [row["proxy"], row["backend"]]
  for mode, mult in (("fwd", 1), ("fwd+bwd", 3)):
    ms = row.get(mode)
    cells += ([f"{ms:.2f}", f"{mult * flops / ms / 1e9:.3g}"] if ms is not None else ["-", "-"])
  peak = row.get("peak")
  cells.append("n/a" if peak is None else fmt_bytes(peak) + ("" if isolated else " †"))
  temp = row.get("temp")
  cells.append("n/a" if temp is None else fmt_bytes(temp))
  notes = [n for n in (row.get("note", ""),) if n]
  if "error" in row:
    notes.append("error: " + row["error"])
  cells.append("; ".join(notes).replace("|", "/"))
  return "| " + " | ".join(cells) + " |"


def print_reference(scale, dtype_name):
  print("\nFor reference, NOT measured by this run: figures the team measured on an H100 "
        "(bf16, full-size proxies, one MoE layer fwd+bwd):")
  for proxy, impl, fig in REFERENCE_H100:
    t, d, f, _, k, _ = PROXIES[proxy]
    ms = float(fig.split()[0]) if fig.endswith(" ms") else None
    rate = (f" (= {3 * fwd_flops(t, d, f, k) / ms / 1e9:.0f} TFLOP/s by the FLOP count above, if "
            f"their proxy has these shapes)") if ms else ""
    print(f"  - {proxy} proxy, {impl}: {fig}{rate}  [not measured by this run]")
  if scale != 1 or dtype_name != "bf16" or jax.default_backend() != "gpu":
    print("  (this run: "
          f"{jax.default_backend()}, scale={scale}, dtype={dtype_name}: not comparable)")


def main(argv):
  del argv
  if _CHILD.value:   # one row, printed as JSON for the parent
    row = bench_row(_PROXIES.value[0], _BACKENDS.value[0], _SCALE.value,
                    {"bf16": jnp.bfloat16, "f32": jnp.float32}[_DTYPE.value], _ITERS.value)
    print(_ROW_TAG + json.dumps(row), flush=True)
    return

  child_env = dict(os.environ)
  if _ISOLATE.value != "no":
    # The parent only plans and prints; keep it from reserving most of the GPU for nothing.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  cpu = jax.default_backend() == "cpu"
  dtype_name = _DTYPE.value or ("f32" if cpu else "bf16")
  dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype_name]
  iters = _ITERS.value or (CPU_ITERS if cpu else GPU_ITERS)
  scale = _SCALE.value or (CPU_SCALE if cpu else 1)
  if scale < 1 or iters < 1:
    raise app.UsageError("--scale and --iters must be >= 1")
  for name in _PROXIES.value:
    if name not in PROXIES:
      raise app.UsageError(f"unknown proxy {name!r}; choose from {', '.join(PROXIES)}")
  backends = _BACKENDS.value or default_backends()
  for spec in backends:
    parse_backend(spec)
  isolated = (_ISOLATE.value == "yes" or
              (_ISOLATE.value == "auto" and peak_memory() is not None))

  dev = jax.devices()[0]
  print(f"device={dev.device_kind} ({jax.default_backend()}) jax={jax.__version__} "
        f"dtype={dtype_name} scale={scale} iters={iters} (best of) "
        f"kernels={gmm_lib.available_kernels()} wgrads={gmm_lib.available_wgrads()} "
        f"isolated={isolated}")
  for name in _PROXIES.value:
    t, d, f, e, k, norm = scaled(name, scale)
    print(f"{name} proxy: T={t} D={d} F={f} E={e} k={k} router=softmax "
          f"norm_topk_prob={norm}, dropless; model GFLOP fwd={fwd_flops(t, d, f, k) / 1e9:.3f} "
          f"fwd+bwd={3 * fwd_flops(t, d, f, k) / 1e9:.3f}")
  print()
  print("| proxy | backend | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | peak mem "
        "| XLA temp fwd+bwd | note |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---|")
  t0 = time.perf_counter()
  for name in _PROXIES.value:
    for spec in backends:
      if isolated:
        row = run_child(name, spec, scale, dtype_name, iters, child_env)
      else:
        row = bench_row(name, spec, scale, dtype, iters)
      print(fmt_row(row, scale, isolated), flush=True)
  print(f"\ntotal {time.perf_counter() - t0:.1f} s. ms = best of {iters} after a warmup; "
        "TFLOP/s = model FLOPs (2*T*k*D*F*3 fwd, 3x fwd+bwd) / time.")
  if not isolated and peak_memory() is not None:
    print("† process-wide running peak (rows not isolated): an upper bound for later rows.")
  print_reference(scale, dtype_name)


if __name__ == "__main__":
  app.run(main)
