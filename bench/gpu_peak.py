"""One train step's memory on a GPU: measured on the device against what XLA:GPU predicts for
the same program compiled without it (`--target`'s deviceless compile) and with it.

Run from the repo root on a GPU host, one process per mode (JAX starts one backend a process):
  python bench/gpu_peak.py --mode=deviceless   # XLA:GPU for an H100 description, JAX_PLATFORMS=cpu
  python bench/gpu_peak.py --mode=device       # the lent GPU: compile, then run the steps
  python bench/gpu_peak.py --mode=cpu          # XLA:CPU (gmm scan, as --compile_only compiles)

The program is runtime.train.build's compile-only step (params and optimizer state donated, so
XLA's temp is the scratch beside one copy of the state) on one device: the reference's step with
the strategies' MoE (bench/step_mfu.one_device: tokens sorted by expert, the grouped matmul). Each mode prints one JSON line: memory_analysis()'s argument, output,
alias and temp bytes and `predicted_peak` = argument + output - alias + temp (what the step holds
at its fullest if every buffer lived the whole step). The device mode then places real params
and optimizer state, runs --steps donated steps and adds `peak_bytes_in_use` (the allocator's
high-water mark over the process: compile-time autotuning and the steps), `in_use_before`
(the state alone, before the first step), the median step time and tokens/s.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mode", choices=("deviceless", "device", "cpu"), required=True)
  ap.add_argument("--target", default="h100", help="deviceless: the GPU profile (runtime/target.py)")
  ap.add_argument("--model", default="mixtral-8x7b")
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--remat", default="block")
  ap.add_argument("--steps", type=int, default=4)
  a = ap.parse_args()

  from runtime import target
  if a.mode == "deviceless":
    target.configure(a.target)
  elif a.mode == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
  import contextlib
  import jax
  from bench.step_mfu import one_device
  from modeling import model
  from modeling.config import get_config
  from runtime import train

  gmm = "scan" if a.mode == "cpu" else "ragged_dot"
  cfg = get_config(a.model, n_layers=a.layers, seq_len=a.seq, batch=a.batch, dtype=a.dtype,
                   remat=a.remat, gmm_backend=gmm)
  if a.mode == "deviceless":
    from jax.experimental import topologies
    devices = topologies.get_topology_desc(**target.PROFILES[a.target].topology(1)).devices
  else:
    devices = jax.devices()
  t0 = time.perf_counter()
  with jax.default_device(devices[0]) if a.mode == "deviceless" else contextlib.nullcontext():
    job = train.build(one_device(), cfg, None, compile_only=True)     # a topology device: no run
  ma = job.compiled.memory_analysis()
  row = dict(mode=a.mode, device=str(devices[0].device_kind), jax=jax.__version__,
             model=a.model, layers=a.layers, seq=a.seq, batch=a.batch,
             dtype=a.dtype, remat=a.remat, gmm=gmm, compile_s=round(time.perf_counter() - t0, 1),
             argument=ma.argument_size_in_bytes, output=ma.output_size_in_bytes,
             alias=ma.alias_size_in_bytes, temp=ma.temp_size_in_bytes)
  row["predicted_peak"] = row["argument"] + row["output"] - row["alias"] + row["temp"]
  if a.mode == "device":
    params = jax.device_put(model.init_params(cfg))
    opt_state = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype),
                             job.opt_state)                   # AdamW's init: zero moments, count 0
    jax.block_until_ready((params, opt_state))
    dev = devices[0]
    stats = dev.memory_stats() or {}                          # None where the backend keeps none
    row["in_use_before"] = stats.get("bytes_in_use")
    row["peak_after_compile"] = stats.get("peak_bytes_in_use")
    times = []
    for i in range(a.steps):
      batch = job.batch(i)
      t = time.perf_counter()
      params, opt_state, metrics = job.step(params, opt_state, batch)
      float(metrics["loss"])                                  # waits for the step
      times.append(time.perf_counter() - t)
    stats = dev.memory_stats() or {}
    row.update(peak_bytes_in_use=stats.get("peak_bytes_in_use"),
               step_s=round(statistics.median(times[1:]), 4),
               tokens_per_s=round(cfg.batch * cfg.seq_len / statistics.median(times[1:])),
               loss=float(metrics["loss"]))
    if row["peak_bytes_in_use"]:
      row["measured_over_predicted"] = round(row["peak_bytes_in_use"] / row["predicted_peak"], 3)
  print(json.dumps(row))


if __name__ == "__main__":
  main()
