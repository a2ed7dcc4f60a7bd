"""Two ways an EP exchange can be silently wrong, for every strategy that exchanges tokens:

* Zero-token experts. The router bias of experts 0..3 (deepseek-test's whole first routing group)
  is -1e9, so no token can select them: under ep on expert:4 a whole EP shard receives no row,
  every gmm sees empty groups. Their gradient must be exactly zero, as in the reference, and with
  weight decay on their post-step parameters must still equal the reference's (a strategy that
  skipped them, "no gradient", would leave them undecayed).
* Uninitialised buffers. jax >= 0.11 leaves `jnp.empty` uninitialised on GPU/TPU; these runs fill
  every padded dispatch / combine / compaction buffer with NaN (layout/buffers.py) and still hold
  full parity: no padding row is read into a result. test_dispatch.py does the same for the
  ragged exchange, and shows the NaN really is in the buffers.
"""
import numpy as np
import pytest

from modeling import model
from modeling.config import get_config
import strategies
from tests import parity

DEAD = [0, 1, 2, 3]                      # deepseek-test: E 16 in 4 groups; top-4 of 2 groups


def dead_expert_init(cfg):
  p = model.init_params(cfg)
  p["layers"]["moe"]["bias"][:, DEAD] = -1e9    # [L, E]: s + b < -1e8, never in any top-k
  return p


MODE_EP = strategies.get("shard_exp_on_fsdp").Options(mode="ep")
CASES = [("ep", dict(capacity_factor=1.0), "data:2,expert:4", None),
         ("ep_as_cp", dict(capacity_factor=1.0), "fsdp:2,expert:4", None),
         ("shard_exp_on_fsdp", dict(capacity_factor=1.0), "fsdp:2,expert:4", MODE_EP),
         ("ep_tp", dict(capacity_factor=1.0), "data:4,expert:2", None),
         ("pp", dict(capacity_factor=1.0), "stage:2,expert:4", None)]


@pytest.mark.parametrize("name,over,mesh,opts", CASES, ids=[c[0] for c in CASES])
def test_zero_token_experts_with_poisoned_buffers(name, over, mesh, opts):
  cfg = get_config("deepseek-test", weight_decay=0.1, **over)
  got = parity.check(name, cfg, mesh, steps=2, opts=opts, init=dead_expert_init, poison=True)
  want = parity.reference(cfg, 2, init=dead_expert_init)
  init = dead_expert_init(cfg)
  for step, (g, w) in enumerate(zip(got, want)):
    for k in ("wi_0", "wi_1", "wo"):                             # [L, E, ...]
      lg, lw = g["grads"]["layers"]["moe"][k], w["grads"]["layers"]["moe"][k]
      assert np.all(lg[:, DEAD] == 0) and np.all(lw[:, DEAD] == 0), (step, k)
      assert all(np.any(lg[i] != 0) for i in range(cfg.n_moe_layers)), (step, k)   # live ones learn
  for k in ("wi_0", "wi_1", "wo"):                               # zero grad, still decayed
    p, p0 = got[0]["params"]["layers"]["moe"][k], init["layers"]["moe"][k]
    assert not np.any(np.isclose(p[:, DEAD], p0[:, DEAD], rtol=0, atol=0)), k
