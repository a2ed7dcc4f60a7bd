"""reference — the oracle: one device, no mesh, no sharding, the plainest possible MoE.

Mesh axes: none. Every tensor lives whole on device 0.
MoE: every expert runs on every token (dense einsum over E) and the outputs are combined with
the top-k routing weights — no sort, no grouped matmul, no exchange — so a bug in the
permutation or gmm code that strategies share cannot hide in the oracle.
Collectives: none.
Pick it: to prove another strategy computes the same model (tests/parity.py), never to train.
Cost: E x the FLOPs of a dropless MoE; fine for the tiny test models only.

  python run.py --strategy=reference --model=deepseek-test --steps=5 --metrics_file=m.jsonl
"""
from layout.options import NoOptions
from modeling import model

NAME = "reference"
AXES: tuple[str, ...] = ()
MAIN_AXIS = None
COMPARE_MESH = None
LAYER_LAYOUT = True         # runs --layer_layout's padded MoE stack (model.moe_stack masks it)
Options = NoOptions
TEST_CASES, COST_CASES, BAD_INPUT = [], [], []   # the oracle itself: tests/test_reference.py


def check(cfg, mesh, opts):
  del cfg, mesh, opts


def param_specs(cfg, mesh, opts=None):
  del cfg, mesh
  return None


def batch_spec(cfg, mesh):
  del cfg, mesh
  return None


def layout(cfg, mesh, opts):
  del mesh, opts
  return model.reference_layout(cfg)
