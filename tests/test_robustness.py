"""Two ways an EP exchange can be silently wrong, for every strategy that exchanges tokens:

* Zero-token experts. The router bias of experts 0..3 (deepseek-test's whole first routing group)
  is -1e9, so no token can select them: under ep on expert:4 a whole EP shard receives no row,
  every gmm sees empty groups. Their gradient must be exactly zero, as in the reference, and with
  weight decay on their post-step parameters must still equal the reference's (a strategy that
  skipped them, "no gradient", would leave them undecayed).
* Uninitialised buffers. jax >= 0.11 leaves `jnp.empty` uninitialised on GPU/TPU; these runs fill
  every padded dispatch / combine / compaction buffer with NaN (common/buffers.py) and still hold
  full parity: no padding row is read into a result. test_dispatch.py does the same for the
  ragged exchange, and shows the NaN really is in the buffers.
"""
import numpy as np
import pytest

from common import model
from common.config import get_config
from tests import parity

DEAD = [0, 1, 2, 3]                      # deepseek-test: E 16 in 4 groups; top-4 of 2 groups


def dead_expert_init(cfg):
  p = model.init_params(cfg)
  for lp in p["layers"]:
    lp["moe"]["bias"][DEAD] = -1e9       # s + b < -1e8 for any token: never in the top-k
  return p


CASES = [("ep", dict(capacity_factor=1.0), "data:2,expert:4"),
         ("ep_as_cp", dict(context_sharding="expert"), "fsdp:2,expert:4"),
         ("shard_exp_on_fsdp", dict(expert_fsdp_mode="ep", capacity_factor=1.0), "fsdp:2,expert:4"),
         ("ep_tp", dict(capacity_factor=1.0), "data:4,expert:2")]


@pytest.mark.parametrize("name,over,mesh", CASES, ids=[c[0] for c in CASES])
def test_zero_token_experts_with_poisoned_buffers(name, over, mesh):
  cfg = get_config("deepseek-test", weight_decay=0.1, **over)
  got = parity.check(name, cfg, mesh, steps=2, init=dead_expert_init, poison=True)
  want = parity.reference(cfg, 2, init=dead_expert_init)
  init = dead_expert_init(cfg)
  for step, (g, w) in enumerate(zip(got, want)):
    for i, (lg, lw) in enumerate(zip(g["grads"]["layers"], w["grads"]["layers"])):
      for k in ("wi_0", "wi_1", "wo"):
        dead = lg["moe"][k][DEAD]
        assert np.all(dead == 0) and np.all(lw["moe"][k][DEAD] == 0), (step, i, k)
        assert np.any(lg["moe"][k] != 0), (step, i, k)             # the live experts learn
  for i, lp in enumerate(got[0]["params"]["layers"]):            # zero grad, still decayed
    for k in ("wi_0", "wi_1", "wo"):
      assert not np.allclose(lp["moe"][k][DEAD], init["layers"][i]["moe"][k][DEAD]), (i, k)
