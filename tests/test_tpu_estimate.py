"""XLA:TPU's own estimate of a step, counted over its loops (measure/tpu_estimate.py): each op's
estimated cycles times the runs of its computation; `optimal_seconds` reads a loop's body once."""
import json
import os
import subprocess
import sys

import pytest

from measure import tpu_estimate
from tests.conftest import subprocess_env
from tests.test_target import needs_libtpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a module whose entry runs one fusion (10 cycles) and a loop of 3 trips whose body runs another
# (100 cycles) and an op the compiler gave no estimate (int64 max)
MODULE = """HloModule m

%b (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  %f = s32[] fusion(%p), calls=%x, backend_config={"estimated_cycles":"100"}
  ROOT %g = s32[] fusion(%f), calls=%x, backend_config={"estimated_cycles":"9223372036854775807"}
}

%c (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (a: s32[]) -> s32[] {
  %a = s32[] parameter(0)
  %e = s32[] fusion(%a), calls=%x, backend_config={"estimated_cycles":"10"}
  ROOT %w = s32[] while(%e), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_step_cycles_counts_each_op_by_its_loops():
  assert tpu_estimate.step_cycles(MODULE) == (10 + 3 * 100, 1)


SCAN = """
import json, sys
from runtime import target
target.configure("tpu-v5p")
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from measure import tpu_estimate
dev = target.devices("tpu-v5p", 4).devices[0]
on = SingleDeviceSharding(dev)
x = jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16, sharding=on)
ws = jax.ShapeDtypeStruct((4, 8192, 8192), jnp.bfloat16, sharding=on)
def layers(h, ws):
  return jax.lax.scan(lambda h, w: ((h @ w).astype(jnp.bfloat16), None), h, ws)[0]
scan = jax.jit(layers).lower(x, ws).compile()
spc = tpu_estimate.seconds_per_cycle(dev)
one = jax.jit(lambda a, b: a @ b).lower(x, jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16,
                                                                  sharding=on)).compile()
print(json.dumps({"scan_s": tpu_estimate.step_cycles(scan.as_text())[0] * spc,
                  "scan_optimal": tpu_estimate.optimal_seconds(scan),
                  "one_optimal": tpu_estimate.optimal_seconds(one)}))
"""


@needs_libtpu
def test_xla_tpus_estimate_counts_each_layer_of_a_scan():
  """A scan of 4 [2048, 8192] @ [8192, 8192] bf16 matmuls on one v5p chip: `optimal_seconds`
  is one matmul's (the body once); the estimate over the loop is at least 4 of them."""
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, "-c", SCAN], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert got["scan_optimal"] == pytest.approx(got["one_optimal"], rel=0.01)
  assert got["scan_s"] >= 4 * got["one_optimal"] * 0.999, got
