"""Each routing formula against an independent numpy computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from modeling import routing
from modeling.config import get_config


def _np_softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def _np_topk(scores, k):
  # stable: ties go to the lower expert id
  return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((24, 16)).astype(np.float32)
  w = rng.standard_normal((16, 16)).astype(np.float32)
  b = (rng.standard_normal(16) * 0.5).astype(np.float32)
  return x, w, b


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk(inputs, norm):
  x, w, b = inputs
  cfg = get_config("tiny", n_experts=16, top_k=3, norm_topk_prob=norm)
  r = routing.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), cfg)
  p = _np_softmax(x @ w)
  idx = _np_topk(p, 3)
  wt = np.take_along_axis(p, idx, -1)
  if norm:
    wt = wt / wt.sum(-1, keepdims=True)
  np.testing.assert_array_equal(np.asarray(r.experts), idx)
  np.testing.assert_allclose(np.asarray(r.weights), wt, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(r.probs), p, rtol=1e-5, atol=1e-6)


def test_sigmoid_grouped(inputs):
  x, w, b = inputs
  cfg = get_config("deepseek-test")          # 16 experts, 4 groups, top-2 groups, top-4, scale 2.5
  r = routing.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), cfg)
  s = 1 / (1 + np.exp(-(x @ w)))
  sb = s + b
  want_idx, want_w = [], []
  for t in range(x.shape[0]):
    groups = sb[t].reshape(4, 4)
    gscore = np.sort(groups, axis=1)[:, -2:].sum(1)                 # sum of top-2 per group
    keep = np.argsort(-gscore, kind="stable")[:2]
    masked = np.full(16, -np.inf)
    for g in keep:
      masked[g * 4:(g + 1) * 4] = sb[t, g * 4:(g + 1) * 4]
    idx = np.argsort(-masked, kind="stable")[:4]
    ws = s[t, idx]                                                  # unbiased scores
    want_idx.append(idx)
    want_w.append(ws / ws.sum() * 2.5)
  np.testing.assert_array_equal(np.asarray(r.experts), np.array(want_idx))
  np.testing.assert_allclose(np.asarray(r.weights), np.array(want_w), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(r.probs), s / s.sum(-1, keepdims=True), rtol=1e-5)


def test_bias_changes_selection_not_weights(inputs):
  x, w, _ = inputs
  cfg = get_config("deepseek-test")
  big = np.zeros(16, np.float32)
  big[5] = 100.0                                                    # force expert 5 in
  r = routing.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(big), cfg)
  assert (np.asarray(r.experts) == 5).any(axis=1).all()
  s = 1 / (1 + np.exp(-(x @ w)))
  ws = np.take_along_axis(s, np.asarray(r.experts), -1)
  np.testing.assert_allclose(np.asarray(r.weights), ws / ws.sum(-1, keepdims=True) * 2.5, rtol=1e-5)


def test_aux_and_z_loss(inputs):
  x, w, b = inputs
  cfg = get_config("tiny", n_experts=16, top_k=2)
  r = routing.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), cfg)
  keep = jnp.ones(r.experts.shape, bool)
  aux, z = routing.aux_losses(routing.router_stats(r, keep, 16), x.shape[0], cfg)
  logits = x @ w
  p = _np_softmax(logits)
  idx = _np_topk(p, 2)
  f = np.bincount(idx.ravel(), minlength=16) / x.shape[0]
  np.testing.assert_allclose(float(aux), 16 * np.sum(f * p.mean(0)), rtol=1e-5)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  np.testing.assert_allclose(float(z), np.mean(lse ** 2), rtol=1e-5)


def test_aux_loss_is_global_not_mean_of_shards(inputs):
  # aux over the global batch != mean of per-shard aux losses: stats must be summed first.
  x, w, b = inputs
  cfg = get_config("tiny", n_experts=16, top_k=2)
  keep = jnp.ones((12, 2), bool)
  halves = [routing.router_stats(routing.route(jnp.asarray(h), jnp.asarray(w), jnp.asarray(b), cfg),
                                 keep, 16) for h in (x[:12], x[12:])]
  total = jax.tree.map(lambda a, c: a + c, *halves)
  r = routing.route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), cfg)
  full = routing.router_stats(r, jnp.ones((24, 2), bool), 16)
  np.testing.assert_allclose(float(routing.aux_losses(total, 24, cfg)[0]),
                             float(routing.aux_losses(full, 24, cfg)[0]), rtol=1e-6)


def test_bias_update():
  b = routing.update_bias(jnp.zeros(4), jnp.array([1.0, 3.0, 2.0, 2.0]), 0.1)
  np.testing.assert_allclose(np.asarray(b), [0.1, -0.1, 0.0, 0.0])


def test_capacity_rule_hand_case():
  # one sequence, S=3, K=2, E=2, C=2: assignments in (pos, k) order
  # pos0: [0, 1], pos1: [0, 1], pos2: [0, 1] -> expert 0 gets ranks 0,1,2 -> third dropped.
  experts = jnp.array([[[0, 1], [0, 1], [0, 1]]])
  positions = jnp.array([[0, 1, 2]])
  keep = routing.capacity_keep(experts, positions, 2, 2)
  np.testing.assert_array_equal(np.asarray(keep), [[[True, True], [True, True], [False, False]]])
  # the same tokens stored in another order (CP layout) keep the same assignments
  order = np.array([2, 0, 1])
  keep2 = routing.capacity_keep(experts[:, order], positions[:, order], 2, 2)
  np.testing.assert_array_equal(np.asarray(keep2), np.asarray(keep)[:, order])


def test_capacity_value():
  cfg = get_config("tiny", capacity_factor=1.25)                    # S=32, K=2, E=8
  assert routing.expert_slots(cfg, 32) == 10                           # ceil(1.25*32*2/8)
  assert routing.expert_slots(get_config("tiny"), 32) == 0


def test_sequence_aux_loss_matches_formula():
  """DeepSeek-V3's sequence-wise loss, from the routing of B sequences: mean over sequences of
  sum_e (E / (K S) count_se) (sum_t p_te / S), against numpy; and it is not the batch-wise one."""
  cfg = get_config("deepseek-test", batch=4, seq_len=8)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((cfg.batch * cfg.seq_len, cfg.d_model)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((cfg.d_model, cfg.n_experts)), jnp.float32)
  r = routing.route(x, w, jnp.zeros(cfg.n_experts), cfg)
  got = routing.sequence_aux_sum(r, cfg.batch, cfg) / cfg.batch
  e, k, s = cfg.n_experts, cfg.top_k, cfg.seq_len
  ids, probs = np.asarray(r.experts).reshape(cfg.batch, s, k), np.asarray(r.probs).reshape(cfg.batch, s, e)
  want = np.mean([np.sum(e / (k * s) * np.bincount(ids[b].ravel(), minlength=e)
                         * probs[b].sum(0) / s) for b in range(cfg.batch)])
  np.testing.assert_allclose(float(got), want, rtol=1e-6)
  stats = routing.router_stats(r, jnp.ones(r.experts.shape, bool), e)
  batch = routing.aux_losses(stats, cfg.batch * s, cfg.replace(aux_loss_kind="batch"))[0]
  seq = routing.aux_losses({**stats, "seq_aux_sum": got * cfg.batch}, cfg.batch * s, cfg)[0]
  np.testing.assert_allclose(float(seq), want, rtol=1e-6)
  assert abs(float(batch) * k - float(seq)) > 1e-3 * float(seq)    # per sequence is not global
