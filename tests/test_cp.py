"""cp beyond the shared table (tests/test_strategies.py): the load-balanced placement and the
exact K/V all-gather bytes."""

import numpy as np
import pytest

from layout import context
from measure import hlo
from modeling.config import get_config
from tests import parity

NAME = "cp"
TINY = get_config("tiny")
# deepseek with the capacity rule: the path where CP must gather the sequence's expert ids
DEEPSEEK_CAP = get_config("deepseek-test", capacity_factor=1.0)
MESHES = ("context:4,data:2", "fsdp:2,context:2,data:2")


def test_load_balanced_placement():
  # S=8, cp=2: chunks [01][23][45][67] -> rank0 holds positions [0 1 6 7], rank1 [2 3 4 5]
  np.testing.assert_array_equal(context.lb_positions(8, 2), [[0, 1, 6, 7], [2, 3, 4, 5]])
  job = parity.job(NAME, TINY, MESHES[0])
  cp = job.mesh.shape["context"]
  want = context.lb_positions(TINY.seq_len, cp)
  pos = job.batch(0)["positions"]
  for shard in pos.addressable_shards:
    rank = shard.index[1].start // (TINY.seq_len // cp)
    np.testing.assert_array_equal(np.asarray(shard.data), np.broadcast_to(want[rank], shard.data.shape))
  # every rank holds the same causal work: sum of (position + 1) keys attended
  work = (want + 1).sum(axis=1)
  assert (work == work[0]).all()


@pytest.mark.parametrize("mesh", MESHES)
def test_kv_gather_bytes(mesh):
  job = parity.job(NAME, TINY, mesh)
  by = hlo.collective_stats_by_axes(job.hlo, job.mesh)
  b_local = TINY.batch // (job.mesh.shape["data"] * job.mesh.shape["fsdp"])
  kv = b_local * TINY.seq_len * TINY.n_kv_heads * TINY.head_dim * 4       # one of K, V per layer
  kv_pos = b_local * TINY.seq_len * 4
  assert by[("all-gather", frozenset({"context"}))]["bytes"] == 2 * TINY.n_layers * kv + kv_pos
  assert hlo.collective_stats(job.hlo)["all-to-all"]["count"] == 0


def test_ring_balanced_skips_the_empty_half_blocks():
  """ring_attend(balanced=True) on context:4 never reads the half-blocks the causal mask empties.
  NaN keys and values in the sequence's last chunk (positions 28..31, rank 0's second half):
  ranks 1..3 (the chunks before it) match the oracle, since each takes only rank 0's first half
  when its block visits. Without balanced every rank folds the whole block and gets NaN."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from layout import mesh as mesh_lib
  from modeling import attention, model, ring_attention
  n, s, h, d = 4, 32, 2, 8
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal(shape).astype(np.float32)
             for shape in ((1, s, h, 1, d), (1, s, h, d), (1, s, h, d)))
  pos = np.arange(s, dtype=np.int32)[None]
  want = np.asarray(attention.attend(*map(jnp.asarray, (q, k, v, pos, pos)), 0.25, "xla"))
  k[:, 28:], v[:, 28:] = np.nan, np.nan          # the oracle saw finite values: 0 * NaN = NaN
  order = context.load_balance_order(s, n)                  # ranks' tokens, in device order
  mesh = mesh_lib.make_mesh({"context": n})
  with jax.set_mesh(mesh):
    put = lambda x: jax.device_put(x[:, order], NamedSharding(
        mesh, P(None, "context", *([None] * (x.ndim - 2)))))
    run = lambda balanced: np.asarray(ring_attention.ring_attend(
        put(q), (put(k), put(v)), (), model._kv_as_is, put(pos), put(pos), 0.25, 4,
        ("context",), balanced=balanced))[:, np.argsort(order)]
    got, unbalanced = run(True), run(False)
  others = np.sort(context.lb_positions(s, n)[1:].ravel())  # the positions ranks 1..3 hold
  np.testing.assert_allclose(got[:, others], want[:, others], rtol=1e-5, atol=1e-6)
  assert np.isnan(unbalanced[:, others]).all()
