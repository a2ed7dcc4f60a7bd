"""AdamW and Muon over the model's parameter pytree, built from optax.

Leaf roles (modeling.model.ROLES, declared once with each parameter; see `muon_dims`):

* "bias" (aux-loss-free routing bias) is frozen: its optimizer update is
  exactly zero and it gets no weight decay. The train step updates it itself.
* Weight decay (decoupled, AdamW style: ``p -= lr * wd * p``) applies to every
  role but the norm scales and the bias (NO_DECAY): embed, unembed, router,
  attention, expert and shared matrices.
* "adamw": optax.adamw on every trainable leaf.
* "muon": momentum orthogonalised by Newton-Schulz for the hidden matrices
  (attention, shared expert, per-expert matrices); AdamW with the same
  hyperparameters for embed, unembed, norms and router.

Muon is the optax.chain

  optax.trace(mu, nesterov)        momentum m = mu*m + g; Nesterov feeds g + mu*m
  orthogonalize(roles, ns_steps)   Newton-Schulz of each leaf's direction
  scale_by_fan_ratio(roles)        * sqrt(max(1, fan_out / fan_in))
  optax.add_decayed_weights(wd)    + wd * p
  optax.scale(-lr)

* Momentum is optax.trace's heavy-ball sum (Nesterov on by default), kept in
  the param's layout; scale_by_muon's own momentum (a bias-corrected EMA) is
  switched off (beta=0), see `orthogonalize` for why.
* Newton-Schulz is optax.contrib.scale_by_muon's: 5 quintic steps with
  (a, b, c) = (3.4445, -4.7750, 2.0315), in float32, after dividing by the
  Frobenius norm (+ 1e-7), on the wide orientation (transposed when
  fan_in > fan_out). It maps the singular values into roughly [0.7, 1.2],
  not exactly 1.
* Matrix views (optax.contrib.MuonDimensionNumbers, `muon_dims`): the
  reduction (fan-in) axes become the rows, the output axes the columns, every
  other axis is a batch axis orthogonalised independently (vmap). attn
  wq/wk/wv [D, H, Dh] -> [D, H*Dh]; attn wo [H, Dh, D] -> [H*Dh, D]; shared
  wi_0/wi_1 [D, Fs], wo [Fs, D] as they are; experts [E, D, F] / [E, F, D]:
  E independent matrices. The stacked layer dim [L] of every layer role is one
  more batch axis.
* Scale: sqrt(max(1, fan_out / fan_in)) on the [fan_in, fan_out] view: Keller
  Jordan's rule (written as sqrt(max(1, rows / cols)) for PyTorch's [out, in]
  weights) and the width scaling of optax.contrib.muon, whose scale_by_muon
  applies none, hence `scale_by_fan_ratio`.

Sharding (explicit mode): elementwise code (momentum, decay, Adam) keeps the
param's sharding. Newton-Schulz needs each matrix whole, and optax's does not
reshard: on a matrix sharded along a row or column axis its dot products fail
to type-check (jax.sharding ShardingTypeError). So `orthogonalize` reshards
each direction to its Newton-Schulz layout -- batch axes keep their sharding,
the matrix axes are gathered (P(None, ...) for attention / shared matrices,
P(None, spec[1], None, None) for [L, E, D, F] experts) -- and the result back to the param's
spec. Experts sharded only on the expert dim need no collective at all; a
D-sharded expert or matrix is all-gathered once (its direction only). Without
a mesh (or when already laid out like that) nothing is resharded.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import optax
from optax.contrib import MuonDimensionNumbers

from modeling import model
from parallel.sharding import entry_axes

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7



class Optimizer(NamedTuple):
  """``init(params) -> state``; ``update(grads, state, params) -> (params, state)``."""
  init: Callable[[Any], Any]
  update: Callable[[Any, Any, Any], tuple[Any, Any]]


# ----------------------------------------------------------------------------
# What each role gets (roles: modeling.model.ROLES, one per leaf).

# Muon's matrix view of one layer's array: (reduction = fan-in axes, output axes); the
# others (E of the experts, and the stacked layer dim) are batch axes.
_MUON_VIEW = {
  "attn_q": ((0,), (1, 2)), "attn_kv": ((0,), (1, 2)),   # [D, H|KV, Dh] -> [D, H*Dh]
  "attn_o": ((0, 1), (2,)),                               # [H, Dh, D] -> [H*Dh, D]
  "attn_q_a": ((0,), (1,)), "attn_kv_a": ((0,), (1,)),    # MLA [D, Rq], [D, Rkv + rope]
  "attn_q_b": ((0,), (1, 2)), "attn_kv_b": ((0,), (1, 2)),  # MLA [R, H, k] -> [R, H*k]
  "shared_in": ((0,), (1,)), "shared_out": ((0,), (1,)),  # [D, Fs], [Fs, D]
  "dense_in": ((0,), (1,)), "dense_out": ((0,), (1,)),    # [D, Fd], [Fd, D]
  "expert_in": ((1,), (2,)), "expert_out": ((1,), (2,)),  # [E, D, F], [E, F, D]: E matrices
}
MUON_ROLES = tuple(_MUON_VIEW)
NO_DECAY = model.NORMS + model.BIASES + ("bias", "attn_sinks")   # norm scales, q/k/v biases; the frozen bias


def muon_dims(role: str) -> MuonDimensionNumbers | None:
  """Muon's dimension numbers for one layer's array of `role` (the stacked [L] dim of a layer
  role is mapped over, see `_per_layer`)."""
  if role not in _MUON_VIEW:
    return None
  red, out = _MUON_VIEW[role]
  return MuonDimensionNumbers(reduction_axis=red, output_axis=out)


def _per_layer(role, fn):
  """fn on one layer's array, mapped (lax.map, a loop) over the stacked [L] dim of a layer
  role: optax would otherwise merge L with E into one batch dim, a reshape that explicit
  sharding rejects when E is sharded (a vmap rounds differently between sharded and
  unsharded programs, which Newton-Schulz amplifies past the parity tolerance)."""
  if role not in model.LAYER_ROLES:
    return fn

  def mapped(a):
    layer_axes = entry_axes(_spec(a)[0])
    if not layer_axes:
      return jax.lax.map(fn, a)
    # [L] split over pipeline stages (pp): each stage maps over its own layers, in a
    # shard_map manual over those axes only (lax.map needs its mapped dim unsharded)
    entry = layer_axes[0] if len(layer_axes) == 1 else layer_axes
    return jax.shard_map(lambda x: jax.lax.map(fn, x), in_specs=P(entry), out_specs=P(entry),
              axis_names=set(layer_axes))(a)
  return mapped


def _by_path(roles, fn) -> dict:
  """{keystr(path): fn(role)} over a roles pytree: how a transform that sees a masked params
  tree (optax.multi_transform) finds its leaves' roles."""
  return {jax.tree_util.keystr(p): fn(r) for p, r in jax.tree_util.tree_flatten_with_path(roles)[0]}


# ----------------------------------------------------------------------------
# Muon pieces optax does not provide: the reshard around Newton-Schulz and the
# suite's shape factor.

def _spec(x) -> tuple:
  """The explicit PartitionSpec of x padded to x.ndim (all None if none)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return spec + (None,) * (x.ndim - len(spec))


def _reshard(x, spec: tuple):
  """jax.reshard to `spec` on x's mesh; no-op without a mesh or if equal."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or _spec(x) == spec:
    return x
  return jax.reshard(x, NamedSharding(mesh, P(*spec)))


def orthogonalize(roles, ns_steps: int = 5) -> optax.GradientTransformation:
  """Newton-Schulz direction of each Muon leaf, in float32, returned in the param's layout.

  The orthogonalisation is optax.contrib.scale_by_muon's, run with beta=0
  (no momentum of its own: optax.trace before it keeps the momentum in the
  param's layout). scale_by_muon does momentum and Newton-Schulz in one
  update, so resharding around the whole of it would gather the gradient
  *and* the momentum -- twice the bytes; here only the direction moves.
  """
  role_of = _by_path(roles, lambda r: r)

  def one(path, d):
    role = role_of[jax.tree_util.keystr(path)]
    dims = muon_dims(role)
    ns = optax.contrib.scale_by_muon(NS_COEFFS, ns_steps, beta=0.0, eps=NS_EPS,
                    nesterov=False, weight_dimension_numbers=dims)
    spec = _spec(d)
    # gather the matrix axes, keep the batch (expert, layer) axes as they are
    shift = 1 if role in model.LAYER_ROLES else 0
    matrix_axes = {a + shift for a in dims.reduction_axis + dims.output_axis}
    local = _reshard(d.astype(jnp.float32), tuple(
      None if ax in matrix_axes else s for ax, s in enumerate(spec)))
    o = _per_layer(role, lambda m: ns.update(m, ns.init(m))[0])(local)
    # materialise o: XLA may otherwise recompute NS's last elementwise steps inside
    # the consumer's fusion, rounding differently per program; NS amplifies that
    o = jax.lax.optimization_barrier(o)
    return _reshard(o.astype(d.dtype), spec)

  def update(updates, state, params=None):
    del params
    return jax.tree_util.tree_map_with_path(one, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def scale_by_fan_ratio(roles) -> optax.GradientTransformation:
  """Multiply each Muon leaf by sqrt(max(1, fan_out / fan_in)) (see the module docstring)."""
  role_of = _by_path(roles, lambda r: r)

  def one(path, o):
    role = role_of[jax.tree_util.keystr(path)]
    dims, shape = muon_dims(role), o.shape[1:] if role in model.LAYER_ROLES else o.shape
    fan_in = math.prod(shape[a] for a in dims.reduction_axis)
    fan_out = math.prod(shape[a] for a in dims.output_axis)
    return o * math.sqrt(max(1.0, fan_out / fan_in))

  def update(updates, state, params=None):
    del params
    return jax.tree_util.tree_map_with_path(one, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


# ----------------------------------------------------------------------------
# Public factory.

def make_optimizer(name: str, roles, lr: float, weight_decay: float = 0.0, b1=0.9, b2=0.95,
         eps=1e-8, muon_momentum=0.95, ns_steps=5, nesterov=True) -> Optimizer:
  """Build "adamw" or "muon" as a pure (init, update) pair for params shaped like `roles`
  (modeling.model.param_roles: a role string per leaf).

  ``update`` returns the new params (not the deltas) and the new state; it
  is jittable and deterministic. See the module docstring for the roles.
  """
  if name not in ("adamw", "muon"):
    raise ValueError(f"unknown optimizer {name!r}; expected 'adamw' or 'muon'")
  decay = jax.tree.map(lambda r: r not in NO_DECAY, roles)
  adamw = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay)
  transforms = {"adam": adamw, "frozen": optax.set_to_zero()}
  if name == "muon":
    transforms["muon"] = optax.chain(
      optax.trace(decay=muon_momentum, nesterov=nesterov),
      orthogonalize(roles, ns_steps),
      scale_by_fan_ratio(roles),
      optax.add_decayed_weights(weight_decay),
      optax.scale(-lr))

  def label(role):
    if role == "bias":
      return "frozen"
    return "muon" if name == "muon" and role in MUON_ROLES else "adam"

  tx = optax.multi_transform(transforms, jax.tree.map(label, roles))

  def update(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return Optimizer(tx.init, update)
