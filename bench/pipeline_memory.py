"""XLA temp memory of pp's train step under each schedule, compiled and never run: gpipe (autodiff
of the time loop, which keeps every tick's residuals) against 1f1b (each backward an explicit vjp
inside the loop, residuals for at most in_flight microbatches) as the microbatch count M grows
with one sequence per microbatch per device, so a microbatch's activations are fixed.

Beside the temps, Megatron's bound: gpipe's temp grows by a = (g(4P) - g(P)) / 3P per
microbatch, its activation share (M+P-1) a; 1f1b's share is its temp less its constant (its
M = 1 temp, one microbatch held, less a); the bound is min(M, P)/M x gpipe's share + 10%.

Shapes: Mixtral-8x7B (d 4096, 8 experts of F 14336 top-2, GQA 32/8, batch-wise aux loss: 1f1b
runs its counts pre-pass) and DeepSeek-V3-shaped (V3's d 7168 and MLA, a shared expert, the
sequence-wise aux loss, but 16 experts top-4 instead of 256 top-8: XLA:CPU lowers ragged_dot to a
masked dense product over [local experts, rows, D], f32[64, 131072, 7168] = 224 GiB per buffer at
V3's 64 experts per device here, which would measure the CPU's grouped matmul, not the
schedule), one MoE layer per stage, S = 4096, bf16, vocab cut to 32k, on 8 simulated devices:
stage:2,expert:4 and stage:4,expert:2, M = P and 4P.

Run from the repo root:  python bench/pipeline_memory.py [--quick]  (--quick: stage:2 only)

--interleaved: gpipe against interleaved (v = 2) instead, two MoE layers per stage (one per chunk),
M = P and 4P, beside the formula: interleaved keeps (v*M+P-1)/v ticks of a stage's residuals
where gpipe keeps M+P-1, the ratio of the activation shares (v*M+P-1) / (v*(M+P-1)); and 1f1b
plain and interleaved (v = 2) on the same shapes.
"""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from layout import mesh as mesh_lib  # noqa: E402
from modeling.config import get_config  # noqa: E402
from runtime import train  # noqa: E402
import strategies  # noqa: E402

PP = strategies.get("pp")
SHAPES = {"mixtral-8x7b": {}, "deepseek-v3": dict(first_k_dense_replace=0, n_experts=16, top_k=4,
                                                  n_group=1, topk_group=1)}


def temp_gib(model: str, mesh_spec: str, m: int, schedule: str, per_stage: int = 1,
             v: int = 1) -> float:
  shape = mesh_lib.parse_mesh_spec(mesh_spec)
  p, ep = shape["stage"], shape["expert"]
  cfg = get_config(model, n_layers=per_stage * p, seq_len=4096, batch=m * ep, microbatches=m,
                   dtype="bfloat16", vocab=32000, **SHAPES[model])
  mesh = mesh_lib.for_strategy(PP, mesh_spec)
  opts = PP.Options(schedule=schedule, virtual_stages=2 if schedule == "interleaved" else v)
  cfg = PP.stored_config(cfg, mesh, opts)
  job = train.build(PP, cfg, mesh, opts, compile_only=True)
  return job.compiled.memory_analysis().temp_size_in_bytes / 2**30


def interleaved(meshes):
  print("| model | mesh | M | gpipe temp GiB | interleaved v=2 temp GiB | ratio | formula "
        "(vM+P-1)/(v(M+P-1)) | 1f1b temp GiB | interleaved 1F1B v=2 temp GiB |")
  print("|---|---|---|---|---|---|---|---|---|")
  for model in SHAPES:
    for mesh_spec in meshes:
      p = int(mesh_spec.split(",")[0].split(":")[1])
      for m in (p, 4 * p):
        g, i = (temp_gib(model, mesh_spec, m, s, per_stage=2) for s in ("gpipe", "interleaved"))
        o, oi = (temp_gib(model, mesh_spec, m, "1f1b", per_stage=2, v=v) for v in (1, 2))
        print(f"| {model} | {mesh_spec} | {m} | {g:.2f} | {i:.2f} | {i / g:.2f} | "
              f"{(2 * m + p - 1) / (2 * (m + p - 1)):.2f} | {o:.2f} | {oi:.2f} |", flush=True)


def main(quick: bool):
  meshes = ["stage:2,expert:4"] if quick else ["stage:2,expert:4", "stage:4,expert:2"]
  if "--interleaved" in sys.argv:
    return interleaved(meshes)
  print("| model | mesh | M | gpipe temp GiB | 1f1b temp GiB | 1f1b in flight | ratio | "
        "gpipe share GiB | 1f1b share GiB | bound GiB |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for model in SHAPES:
    for mesh_spec in meshes:
      p = int(mesh_spec.split(",")[0].split(":")[1])
      g = {m: temp_gib(model, mesh_spec, m, "gpipe") for m in (p, 4 * p)}
      o = {m: temp_gib(model, mesh_spec, m, "1f1b") for m in (1, p, 4 * p)}
      a = (g[4 * p] - g[p]) / (3 * p)               # gpipe: one microbatch's activations
      for m in (p, 4 * p):
        r = PP.in_flight(PP.schedule("1f1b", p, m))
        share_g, share_o = (m + p - 1) * a, o[m] - (o[1] - a)
        print(f"| {model} | {mesh_spec} | {m} | {g[m]:.2f} | {o[m]:.2f} | {r} | "
              f"{o[m] / g[m]:.2f} | {share_g:.2f} | {share_o:.2f} | "
              f"{1.1 * min(m, p) / m * share_g:.2f} |", flush=True)


if __name__ == "__main__":
  main("--quick" in sys.argv)
