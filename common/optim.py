"""AdamW and Muon over the model's parameter pytree, built from optax.

Leaf roles (by path; see `muon_kind` and `muon_dims`):

* ``moe/bias`` (aux-loss-free routing bias) is frozen: its optimizer update is
  exactly zero and it gets no weight decay. The train step updates it itself.
* Weight decay (decoupled, AdamW style: ``p -= lr * wd * p``) applies to every
  leaf with ndim >= 2: embed, unembed, router, attention, expert and shared
  matrices. Norm scales (1-D) and the bias are not decayed.
* "adamw": optax.adamw on every trainable leaf.
* "muon": momentum orthogonalised by Newton-Schulz for the hidden matrices
  (attention, shared expert, per-expert matrices); AdamW with the same
  hyperparameters for embed, unembed, norms and router.

Muon is the optax.chain

  optax.trace(mu, nesterov)        momentum m = mu*m + g; Nesterov feeds g + mu*m
  orthogonalize(ns_steps)          Newton-Schulz of each leaf's direction
  scale_by_fan_ratio()             * sqrt(max(1, fan_out / fan_in))
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
  E independent matrices.
* Scale: sqrt(max(1, fan_out / fan_in)) on the [fan_in, fan_out] view: Keller
  Jordan's rule (written as sqrt(max(1, rows / cols)) for PyTorch's [out, in]
  weights) and the width scaling of optax.contrib.muon, whose scale_by_muon
  applies none, hence `scale_by_fan_ratio`. The hand-written Muon before this
  used the transposed factor sqrt(max(1, fan_in / fan_out)).

Sharding (explicit mode): elementwise code (momentum, decay, Adam) keeps the
param's sharding. Newton-Schulz needs each matrix whole, and optax's does not
reshard: on a matrix sharded along a row or column axis its dot products fail
to type-check (jax.sharding ShardingTypeError). So `orthogonalize` reshards
each direction to its Newton-Schulz layout -- batch axes keep their sharding,
the matrix axes are gathered (P() for attention / shared matrices,
P(spec[0], None, None) for experts) -- and the result back to the param's
spec. Experts sharded only on the expert dim need no collective at all; a
D-sharded expert or matrix is all-gathered once (its direction only). Without
a mesh (or when already laid out like that) nothing is resharded.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7

_ATTN_IN = ("wq", "wk", "wv")
_FFN = ("wi_0", "wi_1", "wo")


class Optimizer(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (params, state)``."""
    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


# ----------------------------------------------------------------------------
# Leaf roles.

def _names(path) -> tuple:
    """Plain key names (str / int) of a tree path."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                k = getattr(k, attr)
                break
        out.append(k)
    return tuple(out)


def muon_kind(path) -> str | None:
    """"matrix" / "experts" for leaves Muon orthogonalises, else None.

    ``path`` is a tuple of keys as given by ``jax.tree_util.tree_flatten_with_path``
    (plain strings and ints work too).
    """
    names = _names(path)
    if not names:
        return None
    leaf, parents = names[-1], names[:-1]
    if "attn" in parents and leaf in _ATTN_IN + ("wo",):
        return "matrix"
    if "shared" in parents and leaf in _FFN:
        return "matrix"
    if "moe" in parents and leaf in _FFN:
        return "experts"
    return None


def muon_dims(path) -> MuonDimensionNumbers | None:
    """Reduction (fan-in) and output axes of a Muon leaf; the other axes are batch axes."""
    kind = muon_kind(path)
    if kind == "experts":  # [E, D, F] / [E, F, D]: E independent matrices
        return MuonDimensionNumbers(reduction_axis=(1,), output_axis=(2,))
    if kind == "matrix" and "attn" in _names(path):
        if _names(path)[-1] == "wo":  # [H, Dh, D] -> [H*Dh, D]
            return MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=(2,))
        return MuonDimensionNumbers(reduction_axis=(0,), output_axis=(1, 2))  # [D, H*Dh]
    if kind == "matrix":  # shared [D, Fs] / [Fs, D]
        return MuonDimensionNumbers(reduction_axis=(0,), output_axis=(1,))
    return None


def _is_frozen(path) -> bool:
    names = _names(path)
    return len(names) >= 2 and names[-2:] == ("moe", "bias")


def _decay_mask(params):
    """True for leaves that get weight decay: trainable and ndim >= 2."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.ndim(x) >= 2 and not _is_frozen(p), params)


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


def orthogonalize(ns_steps: int = 5) -> optax.GradientTransformation:
    """Newton-Schulz direction of each Muon leaf, in float32, returned in the param's layout.

    The orthogonalisation is optax.contrib.scale_by_muon's, run with beta=0
    (no momentum of its own: optax.trace before it keeps the momentum in the
    param's layout). scale_by_muon does momentum and Newton-Schulz in one
    update, so resharding around the whole of it would gather the gradient
    *and* the momentum -- twice the bytes; here only the direction moves.
    """
    def one(path, d):
        dims = muon_dims(path)
        ns = optax.contrib.scale_by_muon(NS_COEFFS, ns_steps, beta=0.0, eps=NS_EPS,
                                         nesterov=False, weight_dimension_numbers=dims)
        spec = _spec(d)
        # gather the matrix axes, keep the batch (expert) axes as they are
        matrix_axes = set(dims.reduction_axis) | set(dims.output_axis)
        local = _reshard(d.astype(jnp.float32), tuple(
            None if ax in matrix_axes else s for ax, s in enumerate(spec)))
        o, _ = ns.update(local, ns.init(local))
        # materialise o: XLA may otherwise recompute NS's last elementwise steps inside
        # the consumer's fusion, rounding differently per program; NS amplifies that
        o = jax.lax.optimization_barrier(o)
        return _reshard(o.astype(d.dtype), spec)

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(one, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def scale_by_fan_ratio() -> optax.GradientTransformation:
    """Multiply each Muon leaf by sqrt(max(1, fan_out / fan_in)) (see the module docstring)."""
    def one(path, o):
        dims = muon_dims(path)
        fan_in = math.prod(o.shape[a] for a in dims.reduction_axis)
        fan_out = math.prod(o.shape[a] for a in dims.output_axis)
        return o * math.sqrt(max(1.0, fan_out / fan_in))

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(one, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


# ----------------------------------------------------------------------------
# Public factory.

def make_optimizer(name: str, lr: float, weight_decay: float = 0.0, b1=0.9, b2=0.95,
                   eps=1e-8, muon_momentum=0.95, ns_steps=5, nesterov=True) -> Optimizer:
    """Build "adamw" or "muon" as a pure (init, update) pair.

    ``update`` returns the new params (not the deltas) and the new state; it
    is jittable and deterministic. See the module docstring for the roles.
    """
    if name not in ("adamw", "muon"):
        raise ValueError(f"unknown optimizer {name!r}; expected 'adamw' or 'muon'")
    adamw = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                        mask=_decay_mask)
    transforms = {"adam": adamw, "frozen": optax.set_to_zero()}
    if name == "muon":
        transforms["muon"] = optax.chain(
            optax.trace(decay=muon_momentum, nesterov=nesterov),
            orthogonalize(ns_steps),
            scale_by_fan_ratio(),
            optax.add_decayed_weights(weight_decay),
            optax.scale(-lr))

    def label(path, _):
        if _is_frozen(path):
            return "frozen"
        return "muon" if name == "muon" and muon_kind(path) else "adam"

    tx = optax.multi_transform(
        transforms, lambda params: jax.tree_util.tree_map_with_path(label, params))

    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return Optimizer(tx.init, update)
