"""One whole train step on ONE device: measured step time against the planner's compute term.

Run from the repo root (a GPU host; on CPU it runs, and says nothing about a GPU):
  python bench/step_mfu.py --model=mixtral-8x7b --layers=2 --seq=4096 --batch=2 --dtype=bfloat16

The step is the reference's train step (no mesh: the strategies need 2 or more devices) with the
strategies' MoE in place of its dense oracle (modeling.moe.moe_local: the tokens sorted by
expert through the grouped matmul, --gmm), AdamW, the model's default attention
(chunked, ordered). It is compiled once, run --warmup times, then timed over --steps steps
(wall clock around each step, metrics fetched to the host: the step is synchronous). Printed:
  step_s      the median step time
  mfu         planning.plan.flops_per_step(cfg) / (step_s x peak), peak the cluster profile's
              dense bf16 FLOP/s (planning/clusters.py; --cluster=h100)
  predicted   the planner's compute time for that step on one device at --plan_efficiency
              (planning/plan.py timing: flops / (efficiency x peak); no collectives on one
              device), and measured / predicted
The planner's --plan_efficiency is the fraction of peak it assumes every step reaches; mfu here
is that fraction measured for this suite's program on this device.
"""
import argparse
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def one_device():
  """The reference strategy with the strategies' MoE (modeling.moe.moe_local: tokens sorted by
  expert through the grouped matmul) in place of its dense oracle: one device's train step."""
  from modeling import model, moe
  import strategies
  ref = strategies.get("reference")
  one = types.SimpleNamespace(**{k: getattr(ref, k) for k in dir(ref) if not k.startswith("__")})
  one.__name__, one.NAME = "one_device", "one_device"
  one.layout = lambda cfg, mesh, opts: model.Parallelism(
      moe=lambda p, x, pos: moe.moe_local(p, x, pos, cfg))
  return one


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="tiny")
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--seq", type=int, default=None)
  ap.add_argument("--batch", type=int, default=None)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--remat", default="none")
  ap.add_argument("--attention", default=None)
  ap.add_argument("--gmm", default="ragged_dot")
  ap.add_argument("--cluster", default="h100")
  ap.add_argument("--plan_efficiency", type=float, default=0.5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--steps", type=int, default=5)
  a = ap.parse_args()

  import jax
  from modeling.config import get_config
  from planning import clusters, plan
  from runtime import train

  if a.gmm == "mgpu":
    import kernels.mgpu  # noqa: F401  (registers the Hopper kernel with modeling.gmm)
  over = {k: v for k, v in dict(n_layers=a.layers, seq_len=a.seq, batch=a.batch,
                                attention_impl=a.attention).items() if v is not None}
  cfg = get_config(a.model, dtype=a.dtype, remat=a.remat, gmm_backend=a.gmm, **over)
  if cfg.first_k_dense_replace >= cfg.n_layers:
    cfg = cfg.replace(first_k_dense_replace=cfg.n_layers - 1)
  t0 = time.perf_counter()
  job = train.build(one_device(), cfg, None)
  compile_s = time.perf_counter() - t0
  times = [dt for *_, dt in train.steps(job, a.warmup + a.steps)][a.warmup:]
  step_s = statistics.median(times)
  cluster = clusters.get(a.cluster)
  flops = plan.flops_per_step(cfg)
  predicted = flops / (a.plan_efficiency * cluster.peak_flops)
  dev = jax.devices()[0]
  print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
  print(f"{a.model} layers={cfg.n_layers} seq={cfg.seq_len} batch={cfg.batch} {cfg.dtype} "
        f"remat={cfg.remat} attention={cfg.attention_impl} gmm={cfg.gmm_backend}: build+compile {compile_s:.1f} s")
  print(f"  step_s {step_s:.5g} (median of {a.steps}; min {min(times):.4f} max {max(times):.4f})"
        f"  tokens/s {cfg.batch * cfg.seq_len / step_s:,.0f}")
  print(f"  model flops/step {flops:.3e}  mfu {flops / (step_s * cluster.peak_flops):.3g} of "
        f"{cluster.name} {cluster.peak_flops / 1e12:.1f} TFLOP/s")
  print(f"  planner compute at efficiency {a.plan_efficiency}: {predicted:.4f} s; measured / "
        f"predicted {step_s / predicted:.2f}")
  stats = dev.memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    print(f"  peak device memory {stats['peak_bytes_in_use'] / 2**30:.1f} GiB")


if __name__ == "__main__":
  main()
