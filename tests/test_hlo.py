"""Tests for measure.hlo on real compiled programs (8 simulated CPU devices)."""

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P
import pytest

from measure import hlo

ROWS = P(("data", "expert"), None)  # [32, 8] global -> [4, 8] = 128 B per device


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)


def _shard_map_hlo(mesh, body, shape=(32, 8)):
  """Compiled per-device HLO of a full-manual shard_map over rows."""
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones(shape, jnp.float32), ROWS)
    f = jax.jit(jax.shard_map(body, in_specs=ROWS, out_specs=ROWS))
    return f.lower(x).compile().as_text()


def _nontrivial(text):
  return [op for op in hlo.collective_ops(text) if not hlo.is_trivial(op)]


# wire: what a device sends (ring algorithms, hlo.wire_factor), worked by hand: expert is 4
# devices, data 2, both 8. all-gather 512 x 3/4; all-reduce 128 x 2(n-1)/n; reduce-scatter
# 32 x (n-1); all-to-all 128 x 3/4 (its own block stays); permute sends its buffer once.
@pytest.mark.parametrize("body, kind, nbytes, axes, wire", [
  (lambda v: jax.lax.all_gather(v, "expert", tiled=True), "all-gather", 512, {"expert"}, 384),
  (lambda v: jax.lax.psum(v, "data"), "all-reduce", 128, {"data"}, 128),
  (lambda v: jax.lax.psum(v, ("data", "expert")), "all-reduce", 128, {"data", "expert"}, 224),
  (lambda v: jax.lax.psum_scatter(v, "expert", tiled=True), "reduce-scatter", 32, {"expert"}, 96),
  (lambda v: jax.lax.all_to_all(v, "expert", 0, 0, tiled=True), "all-to-all", 128, {"expert"},
   96),
  (lambda v: jax.lax.ppermute(v, "data", [(0, 1), (1, 0)]), "collective-permute", 128, {"data"},
   128),
], ids=["all_gather", "psum", "psum_2axes", "psum_scatter", "all_to_all", "ppermute"])
def test_shard_map_collective(mesh, body, kind, nbytes, axes, wire):
  text = _shard_map_hlo(mesh, body)
  (op,) = _nontrivial(text)
  assert (op.kind, op.bytes, op.count) == (kind, nbytes, 1)
  assert hlo.op_axes(op, mesh) == frozenset(axes)
  stats = hlo.collective_stats(text)
  assert set(stats) == set(hlo.COLLECTIVE_KINDS)
  assert stats[kind] == {"count": 1, "bytes": nbytes, "wire_bytes": wire}
  assert sum(s["count"] for s in stats.values()) == 1
  assert hlo.collective_stats_by_axes(text, mesh) == {
    (kind, frozenset(axes)): {"count": 1, "bytes": nbytes, "wire_bytes": wire}}


def _gather_first(v):
  return jax.lax.all_gather(v, "expert", tiled=True)[: v.shape[0]] * 0.5


@pytest.mark.parametrize("body, count", [
  (lambda v: jax.lax.fori_loop(0, 3, lambda i, c: _gather_first(c), v), 3),
  (lambda v: jax.lax.scan(lambda c, _: (_gather_first(c), None), v, None, length=3)[0], 3),
  (lambda v: jax.lax.fori_loop(
    0, 3, lambda i, c: jax.lax.fori_loop(0, 2, lambda j, d: _gather_first(d), c), v), 6),
], ids=["fori_loop", "scan", "nested"])
def test_loop_trip_counts(mesh, body, count):
  text = _shard_map_hlo(mesh, body)
  (op,) = _nontrivial(text)
  assert (op.kind, op.bytes, op.count) == ("all-gather", 512, count)
  assert hlo.collective_stats(text)["all-gather"] == {"count": count, "bytes": 512 * count,
                                                      "wire_bytes": 384 * count}


def test_partitioner_collectives_and_compiled_stats(mesh):
  # Explicit-sharding reshard [16@data, 16@expert] -> replicated: XLA emits two
  # all-gathers with mesh-form replica groups, one per mesh axis.
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((16, 16), jnp.float32), P("data", "expert"))
    w = jax.device_put(jnp.ones((16, 8), jnp.float32), P())
    compiled = jax.jit(lambda a, b: jax.reshard(a, P()) @ b).lower(x, w).compile()
  text = compiled.as_text()
  assert "replica_groups=mesh[" in text
  assert {(op.kind, hlo.op_axes(op, mesh), op.bytes) for op in _nontrivial(text)} == {
    ("all-gather", frozenset({"expert"}), 8 * 16 * 4),
    ("all-gather", frozenset({"data"}), 16 * 16 * 4)}
  stats = hlo.compiled_stats(compiled, mesh)
  assert stats["flops"] >= 2 * 16 * 16 * 8
  assert stats["memory"]["argument_bytes"] == (8 * 4 + 16 * 8) * 4
  assert set(stats["memory"]) == {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes"}
  assert stats["collectives"]["all-gather"] == {                 # expert: 3/4 sent, data: 1/2
    "count": 2, "bytes": (128 + 256) * 4, "wire_bytes": 128 * 4 * 3 / 4 + 256 * 4 / 2}
  assert stats["collectives_by_axes"][("all-gather", frozenset({"data"}))]["count"] == 1


@pytest.mark.parametrize("scope,ticks,count", [(None, 4, 4), ("phase.taken_1_of_3", 3, 1)])
def test_a_conditional_branch_counts_at_every_run_or_its_taken_share(mesh, scope, ticks, count):
  """A psum inside a conditional inside a loop: counted at every run of the conditional (an
  upper bound: the branch runs once here), or at the share its TAKEN scope declares. (The two
  programs differ in more than metadata: the persistent compilation cache keys them without
  it.)"""
  def body(x):
    def tick(c, t):
      run = lambda c: jax.lax.pcast(jax.lax.psum(c, "expert"), ("expert",), to="varying")
      with jax.named_scope(scope) if scope else contextlib.nullcontext():
        return jax.lax.cond(t == 1, run, lambda c: c, c), None
    return jax.lax.scan(tick, x, jnp.arange(ticks))[0]
  assert hlo.collective_stats(_shard_map_hlo(mesh, body))["all-reduce"]["count"] == count


@pytest.mark.parametrize("scopes,ticks,count", [
    (("phase.taken_1_of_2", "attention_full.taken_1_of_3"), 6, 1),     # nested: 1/2 x 1/3
    (("attention_full.taken_1_of_3", "attention_full.taken_1_of_3"), 3, 1)])  # named twice
def test_nested_taken_scopes_multiply_and_one_named_twice_counts_once(mesh, scopes, ticks,
                                                                       count):
  """pp's 1f1b phase around a layer's attention kind (model.switched_rows): their shares
  multiply. remat's recompute repeats a forward's scopes inside the backward's, so a scope
  named twice in an op's path is one share."""
  def body(x):
    def tick(c, t):
      run = lambda c: jax.lax.pcast(jax.lax.psum(c, "expert"), ("expert",), to="varying")
      with jax.named_scope(scopes[0]), jax.named_scope(scopes[1]):
        return jax.lax.cond(t == 1, run, lambda c: c, c), None
    return jax.lax.scan(tick, x, jnp.arange(ticks))[0]
  assert hlo.collective_stats(_shard_map_hlo(mesh, body))["all-reduce"]["count"] == count


# ---------------------------------------------------------------------------
# Hand-written lines: replica-group formats as printed by XLA (jax 0.10.2).

_SNIPPETS = [
  ("%ag = f32[4,8]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, "
  "dimensions={0}, use_global_device_ids=true",
  ((0, 1, 2, 3), (4, 5, 6, 7)), {"expert"}),
  ("%ag = f32[4,16]{0,1} all-gather(%c), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), "
  "dimensions={1}, use_global_device_ids=true",
  ((0, 4), (1, 5), (2, 6), (3, 7)), {"data"}),
  ("%ag = f32[16,8]{1,0} all-gather(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}",
  ((0, 1, 2, 3), (4, 5, 6, 7)), {"expert"}),
  ("%ag = f32[8,16]{0,1} all-gather(%c), channel_id=1, "
  "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}",
  ((0, 1, 2, 3), (4, 5, 6, 7)), {"expert"}),
  ("ROOT %ar = f32[8]{0} all-reduce(%r), channel_id=1, replica_groups=mesh['axis_0'=4,"
  "'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, use_global_device_ids=true, to_apply=%add",
  ((0, 1, 2, 3), (4, 5, 6, 7)), {"expert"}),
  ("%ag = f32[16,16]{1,0} all-gather(%p), channel_id=1, "
  "replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}",
  ((0, 1, 2, 3, 4, 5, 6, 7),), {"data", "expert"}),
  ("%ar = f32[8]{0} all-reduce(%r), replica_groups=mesh['axis_0'=8] {'axis_0':(1)4}, to_apply=%add",
  ((0, 2, 4, 6), (1, 3, 5, 7)), {"?"}),
  ("%cp = f32[1,8]{1,0} collective-permute(%p), channel_id=1, "
  "source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}",
  ((0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4)), {"expert"}),
]


@pytest.mark.parametrize("line, groups, axes", _SNIPPETS)
def test_replica_group_formats(mesh, line, groups, axes):
  (op,) = hlo.collective_ops(line)
  assert op.groups == groups
  assert hlo.op_axes(op, mesh) == frozenset(axes)


def test_mesh_form_three_axes():
  # (2,2,2) mesh, P('a','c') gathered over 'a': XLA's mesh is permuted (a, c, b).
  mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Explicit,) * 3)
  line = ("%ag = f32[16,16]{1,0} all-gather(%w), channel_id=2, replica_groups="
      "mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}, "
      "dimensions={0}")
  (op,) = hlo.collective_ops(line)
  assert op.groups == ((0, 4), (2, 6), (1, 5), (3, 7))
  assert hlo.op_axes(op, mesh) == {"a"}
  iota = "%ag = f32[16,8]{1,0} all-gather(%p), replica_groups=[4,2]<=[2,2,2]T(2,1,0), dimensions={0}"
  assert hlo.op_axes(hlo.collective_ops(iota)[0], mesh) == {"a"}


def test_tuple_bytes_trivial_and_async():
  text = "\n".join([
    "HloModule m, num_partitions=8",
    "",
    "ENTRY %main (p: f32[8]) -> f32[8] {",
    "  %a2a = (f32[1,8]{1,0}, f32[1,8]{1,0}, /*index=2*/bf16[1,8]{1,0}) all-to-all(%a, %b, %c), "
    "channel_id=1, replica_groups={}",
    "  %triv = f32[4]{0} all-reduce(%p), replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, "
    "to_apply=%add",
    "  %ags = (f32[2]{0}, f32[16]{0}) all-gather-start(%p), replica_groups={{0,1,2,3,4,5,6,7}}, "
    "dimensions={0}",
    "  ROOT %agd = f32[16]{0} all-gather-done(%ags)",
    "}",
  ])
  a2a, triv, ag = hlo.collective_ops(text)
  assert (a2a.kind, a2a.bytes, a2a.groups) == ("all-to-all", 32 + 32 + 16, (tuple(range(8)),))
  assert hlo.is_trivial(triv) and not hlo.is_trivial(a2a)
  assert (ag.kind, ag.bytes, ag.count, len(ag.groups[0])) == ("all-gather", 64, 1, 8)
  stats = hlo.collective_stats(text)
  assert stats["all-reduce"] == {"count": 0, "bytes": 0, "wire_bytes": 0}  # trivial: skipped
  assert stats["all-gather"] == {"count": 1, "bytes": 64, "wire_bytes": 64 * 7 / 8}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_reads_the_buffer_assignment(dtype, tmp_path):
  """measure/peak.py on a compile-only step's dump (f32: a dump of its own; bf16: beside the
  wire pass's): its peak is within XLA's temp and holds most of it, and its largest buffer is
  the float32 logits [T, V] (tiny with a vocabulary of 32,768, T = 256 tokens per device on
  expert:8)."""
  from layout import mesh as mesh_lib
  from measure import peak
  from modeling.config import get_config
  from runtime import train
  import strategies
  cfg = get_config("tiny", dtype=dtype, seq_len=256, vocab=32768, batch=8)
  strat = strategies.get("ep")
  job = train.build(strat, cfg, mesh_lib.for_strategy(strat, "expert:8"), compile_only=True,
                    dump_dir=str(tmp_path))
  got = peak.peak(str(tmp_path))
  assert got.temp_bytes == job.compiled.memory_analysis().temp_size_in_bytes
  assert 0.5 * got.temp_bytes <= got.bytes <= got.temp_bytes, (got.bytes, got.temp_bytes)
  size, shape, _ = got.buffers[0]
  assert size == 256 * 32768 * 4 and shape.startswith("f32[") and "32768" in shape, \
      got.buffers[:3]


# measure/compilers.py: the normal form the target compilers' programs are held in, on
# hand-made byte tables over a data:2 x expert:4 mesh.
class _Mesh:
  shape = {"data": 2, "expert": 4}


_D, _E, _DE = frozenset({"data"}), frozenset({"expert"}), frozenset({"data", "expert"})


@pytest.mark.parametrize("predicted, measured, off, merges", [
  # a reduce-scatter over expert issued as an all-reduce of the whole operand (4 x)
  ({("reduce-scatter", _E): 100.0}, {("all-reduce", _E): 400}, {}, []),
  # the model's sums over data and then expert, one all-reduce over both
  ({("all-reduce", _D): 50.0, ("all-reduce", _E): 50.0, ("all-reduce", _DE): 1000.0},
   {("all-reduce", _DE): 1050}, {}, [(("data",), ("expert",), 50.0)]),
  # short on one axis, over on the union by another amount: not a merge, both reported
  ({("all-reduce", _D): 50.0, ("all-reduce", _E): 50.0, ("all-reduce", _DE): 1000.0},
   {("all-reduce", _DE): 1080, ("all-reduce", _E): 50},
   {("all-reduce", _D): (50.0, 0), ("all-reduce", _DE): (1000.0, 1080)}, []),
  # a reduce-scatter that vanished without its all-reduce
  ({("reduce-scatter", _E): 100.0}, {}, {("all-reduce", _E): (400.0, 0.0)}, []),
], ids=["rs_as_all_reduce", "merged", "not_a_merge", "missing"])
def test_compilers_normal_form(predicted, measured, off, merges):
  from measure import compilers
  got_off, got_merges, gathers = compilers.agreement(predicted, measured, _Mesh)
  assert got_off == off and got_merges == merges and gathers == []


def test_compilers_all_gather_as_all_reduce():
  from measure import compilers
  got = compilers.agreement({("all-gather", _E): 512.0, ("all-reduce", _E): 10000.0},
                            {("all-reduce", _E): 10512}, _Mesh)
  assert got == ({}, [], [(("expert",), 512.0)])
  got = compilers.agreement({("all-gather", _E): 512.0, ("all-reduce", _E): 10000.0},
                            {("all-reduce", _E): 10000}, _Mesh)
  assert got[0] == {("all-gather", _E): (512.0, 0.0)} and got[2] == []
