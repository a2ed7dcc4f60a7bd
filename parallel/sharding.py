"""Sharding helpers shared by strategies: FSDP weight gather with a reduce-scatter backward (also
the sequence all-gather of an activation; gather_weight_manual inside a full-manual shard_map),
an explicit reduce-scatter of an unreduced array, placing pytrees on a mesh (multi-process too),
and reading layouts back for --dump_sharding."""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np


def entry_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def dim_axes(spec, dim: int) -> tuple[str, ...]:
  """Mesh axes that split dimension `dim` under PartitionSpec `spec` (() past its end)."""
  entries = tuple(spec)
  return entry_axes(entries[dim]) if dim < len(entries) else ()


def full_spec(x) -> P:
  """x's PartitionSpec with one entry per dim (None past the stated ones), reduced kept."""
  s = jax.typeof(x).sharding.spec
  return P(*(tuple(s.partitions) + (None,) * (x.ndim - len(s.partitions))), reduced=s.reduced)


def spec_axes(spec) -> tuple[str, ...]:
  """Every mesh axis a PartitionSpec names, dims in order."""
  return tuple(a for e in (spec or ()) for a in entry_axes(e))


def without_axis(spec, axis: str) -> P:
  """`spec` with mesh axis `axis` removed from every dim (the layout a gather over it leaves)."""
  return P(*(tuple(a for a in entry_axes(e) if a != axis) or None for e in (spec or ())))


def axis_size(mesh, *names) -> int:
  """The devices over mesh axes `names` together: the product of their sizes (an axis the mesh
  does not have counts 1)."""
  return math.prod(mesh.shape[n] for n in names if n in mesh.shape)


def spec_shards(spec, mesh) -> int:
  """How many ways a PartitionSpec splits an array on this mesh."""
  return axis_size(mesh, *spec_axes(spec))


def varying_axes(a) -> frozenset:
  """Manual mesh axes `a` varies over inside a shard_map (manual_axis_type.varying where the
  type has it, else .vma)."""
  t = jax.typeof(a)
  mat = getattr(t, "manual_axis_type", None)
  return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def to_varying(a, axes) -> jax.Array:
  """Inside a shard_map: `a` typed varying over every axis of `axes` (pcast of the ones it is not
  varying over yet; the transpose psums its cotangent over them)."""
  missing = tuple(sorted(set(axes) - varying_axes(a)))
  return jax.lax.pcast(a, missing, to="varying") if missing else a


def gather_weight(w: jax.Array, out_spec: P, grad_axes: Sequence[str], dtype=None,
                  reduce_dtype=None) -> jax.Array:
  """All-gather a sharded weight to `out_spec` for use; the gradient comes back reduce-scattered.

  Forward : w [.., D@fsdp, ..] -> all-gather -> [.., D, ..], typed *reduced* over grad_axes
            (the axes the tokens are split over), so autodiff hands us an *unreduced* cotangent.
  Backward: inside a full-manual shard_map, psum_scatter over the axes the forward gathered
            (a real reduce-scatter; XLA:CPU would otherwise emit a full all-reduce + slice),
            then psum of the scattered shard over the remaining grad axes (pure data
            parallelism) — scattering first makes that all-reduce 1/fsdp of the weight.
  grad_axes must be exactly the mesh axes the computation using the weight is split over.

  Activations too (Megatron-SP, ep_tp): h [B@data, S@expert, D] -> out_spec (data, None, None),
  grad_axes=("expert",): when everything downstream is split over expert (heads, hidden, local
  experts), the cotangent is partial over expert, and the backward is one reduce-scatter over
  expert on the sequence dim (data is a batch axis there, not a grad axis: leave it out).

  Mixed precision (dtype, e.g. bfloat16): the stored float32 shard is cast BEFORE the gather,
  so the all-gather moves `dtype`; the backward sums the gradient in `reduce_dtype` (default:
  the master's float32, the cotangent upcast first, as FSDP2's reduce_dtype=float32) and hands
  the master its own dtype. out_spec == the stored spec gathers nothing: the weight is only cast
  and typed reduced, so its gradient's all-reduce is this psum in reduce_dtype, not XLA's in bf16.
  """
  master = w.dtype
  dtype = master if dtype is None else jnp.dtype(dtype)
  reduce_dtype = master if reduce_dtype is None else jnp.dtype(reduce_dtype)
  in_spec = jax.typeof(w).sharding.spec
  in_spec = tuple(in_spec) + (None,) * (w.ndim - len(in_spec))
  out_entries = tuple(out_spec) + (None,) * (w.ndim - len(tuple(out_spec)))
  grad_axes = tuple(grad_axes)
  if not grad_axes:
    return jax.reshard(w.astype(dtype), P(*out_entries))

  @jax.custom_vjp
  def _gather(a):
    return jax.reshard(a.astype(dtype), P(*out_entries, reduced=frozenset(grad_axes)))

  def _fwd(a):
    return _gather(a), None

  def _bwd(_, ct):
    scatter = [(d, tuple(a for a in entry_axes(in_spec[d]) if a not in entry_axes(out_entries[d])))
               for d in range(w.ndim)]
    scattered = {a for _, axs in scatter for a in axs}
    rest = tuple(a for a in grad_axes if a not in scattered)

    def body(g):
      g = g.astype(reduce_dtype)
      for d, axs in scatter:
        if axs:
          g = jax.lax.psum_scatter(g, axs, scatter_dimension=d, tiled=True)
      if rest:
        g = jax.lax.psum(g, rest)
      return g.astype(master)

    # the cotangent is unreduced over the grad axes; the body sees each device's partial sum
    out = jax.shard_map(body, in_specs=P(*out_entries, unreduced=frozenset(grad_axes)),
                        out_specs=P(*in_spec))(ct)
    return (out,)

  _gather.defvjp(_fwd, _bwd)
  return _gather(w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_weight_manual(a: jax.Array, dim: int, axes: tuple, dtype) -> jax.Array:
  """gather_weight inside a full-manual shard_map (pp's pipeline), where no reshard applies:
  a [.., D/n, ..] -> [.., D, ..] in `dtype` (cast before the all-gather, which then moves
  `dtype`), n = |axes|. Backward: the cotangent cast to a's dtype (the sum's),
  reduce-scattered over `axes` (XLA:CPU emits a reduce-scatter only from an explicit
  psum_scatter); the caller's pcast sums the shard over the axes it is replicated on."""
  return jax.lax.all_gather(a.astype(dtype), axes, axis=dim, tiled=True)


def _gather_manual_fwd(a, dim, axes, dtype):
  return gather_weight_manual(a, dim, axes, dtype), jnp.zeros((), a.dtype)


def _gather_manual_bwd(dim, axes, dtype, like, ct):
  return (jax.lax.psum_scatter(ct.astype(like.dtype), axes, scatter_dimension=dim, tiled=True),)


gather_weight_manual.defvjp(_gather_manual_fwd, _gather_manual_bwd)


def reduce_scatter(y: jax.Array, out_spec: P) -> jax.Array:
  """Sum y, typed *unreduced* over some mesh axes, and scatter it to out_spec: a real
  reduce-scatter (psum_scatter in a full-manual shard_map), where XLA:CPU turns an
  unreduced -> sharded reshard into an all-reduce + slice. Each unreduced axis that out_spec adds
  to a dim is scattered over that dim; the other unreduced axes are psum'd. Backward: all-gather.
  """
  spec = jax.typeof(y).sharding.spec
  in_entries = spec.partitions + (None,) * (y.ndim - len(spec))
  out_entries = tuple(out_spec) + (None,) * (y.ndim - len(tuple(out_spec)))
  scatter = [(d, tuple(a for a in entry_axes(out_entries[d]) if a not in entry_axes(in_entries[d])))
             for d in range(y.ndim)]
  rest = tuple(a for a in spec.unreduced if all(a not in axs for _, axs in scatter))

  def body(a):
    for d, axs in scatter:
      if axs:
        a = jax.lax.psum_scatter(a, axs, scatter_dimension=d, tiled=True)
    return jax.lax.psum(a, rest) if rest else a

  return jax.shard_map(body, in_specs=spec, out_specs=P(*out_entries))(y)


def partial_einsum(subscripts: str, a: jax.Array, b: jax.Array, axes: Sequence[str]) -> jax.Array:
  """einsum(subscripts, a, b), typed *reduced* over `axes`, for an operand gathered over them:
  MLA's latent all-gathered over the sequence axes (CP), up-projected to K and V [B, T, H, .].
  The queries of each device read all of K / V, so the cotangent comes back a partial sum over
  `axes` (typed unreduced), and dot_general takes no unreduced operand: the backward contracts it
  in a full-manual shard_map, each device with its own partial, and hands back each operand's
  cotangent unreduced over that operand's reduced axes (the latent's: `axes`, from its gather; a
  weight's: the token axes of its use), which the gathers' own backwards sum once. Checked when
  traced: every axis an operand is reduced over must be one its local cotangent is a partial sum
  over (`axes`, or an axis splitting a dim its backward contracts), else the sum would be wrong."""
  ins, out = subscripts.split("->")
  sa, sb = ins.split(",")
  axes = frozenset(axes)
  a_spec, b_spec = full_spec(a), full_spec(b)

  @jax.custom_vjp
  def f(a, b):
    y = jnp.einsum(subscripts, a, b)
    return jax.reshard(y, P(*jax.typeof(y).sharding.spec.partitions, reduced=axes))

  def fwd(a, b):
    return f(a, b), (a, b)

  def bwd(res, ct):
    a, b = res
    ct_spec = jax.typeof(ct).sharding.spec
    for name, sub, s, other in (("a", sa, a_spec, (sb, b_spec)), ("b", sb, b_spec, (sa, a_spec))):
      partial = axes | {x for subs, sp in ((out, ct_spec), other)
                        for ch, e in zip(subs, sp.partitions) if ch not in sub for x in entry_axes(e)}
      if not s.reduced <= partial:
        raise ValueError(f"partial_einsum {subscripts}: {name} is reduced over "
                         f"{sorted(s.reduced - partial)}, which its cotangent is not summed over")

    def body(ct, a, b):                                   # each device's partial products
      return (jnp.einsum(f"{out},{sb}->{sa}", ct, b).astype(a.dtype),
              jnp.einsum(f"{sa},{out}->{sb}", a, ct).astype(b.dtype))

    plain = lambda s: P(*s.partitions)
    unreduced = lambda s: P(*s.partitions, unreduced=s.reduced)
    a, b = jax.reshard(a, plain(a_spec)), jax.reshard(b, plain(b_spec))   # values, not types
    # check_vma=False: the cotangent comes in unreduced, a type a dot_general does not take
    return jax.shard_map(body, in_specs=(ct_spec, plain(a_spec), plain(b_spec)),
                         out_specs=(unreduced(a_spec), unreduced(b_spec)), check_vma=False)(ct, a, b)

  f.defvjp(fwd, bwd)
  return f(a, b)


def put(tree, specs, mesh):
  """Place a numpy pytree (the same global values on every process) with a matching pytree of
  PartitionSpecs (None = replicated). Each process fills only its addressable shards, so this
  works multi-process (jax.distributed) as well as on one host."""
  if mesh is None:
    return jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]), tree)

  def one(a, s):
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, s if s is not None else P()),
                                        lambda idx: a[idx])
  return jax.tree.map(one, tree, specs, is_leaf=lambda x: isinstance(x, np.ndarray))


def describe(tree) -> list[tuple[str, str]]:
  """[(path, 'float32[64@fsdp,128]'), ...] for --dump_sharding."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(p), str(jax.typeof(v))) for p, v in leaves]
