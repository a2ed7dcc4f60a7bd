"""ep_as_cp — the expert axis plays context parallelism everywhere except inside the core MoE
(MaxText #3656's ep-as-cp rule): tokens are split over `expert` along the *sequence*.

Mesh axes: (data, fsdp, expert)   cfg.context_sharding names the axis playing CP: it must be
"expert" (--context_sharding=expert); the flag's default "context" names no axis of this mesh and
is read as "this strategy's CP axis", i.e. expert too, so one config can drive cp and ep_as_cp
(`--compare`). Any other value is a one-line error.

| tensor                                  | sharding                                            |
|-----------------------------------------|-----------------------------------------------------|
| tokens / targets / positions [B, S]     | (B_(data,fsdp), S_expert), load-balanced order      |
| residual x [B, S, D], q [B, S, H, Dh]   | (B_(data,fsdp), S_expert, ..)                       |
| k / v [B, T, KV, Dh], kv_pos [B, T]     | (B_(data,fsdp), T, ..): all-gathered over expert    |
| weights, experts                        | as ep.py: matrices D over fsdp; experts [E_expert,   |
|                                         |   D_fsdp, F], gathered over fsdp before the MoE     |
| dispatch / combine buffer               | [N_src, EP, C, D] @ P((data,fsdp), expert)          |
Non-expert weights are FSDP over fsdp only (MaxText's rule also shards them over expert), so the
weight layout equals cp.py's and FSDP=2+CP=2 vs FSDP=2+EP-as-CP=2 compares like for like.

Only between the two exchanges are tokens "sharded over expert as the experts' inputs": the
MoE is ep.py's moe_ep (one shard_map, its all_to_all exchange) on the local b x S/EP tokens.
Load balancing as cp.py (common/layouts.py): S cut into 2*EP chunks, rank i holds chunks i and
2EP-1-i. The capacity rule needs whole sequences: the expert ids and positions (ints) are
all-gathered over expert (moe_ep's gather_sequence).
Because S is split over expert, the global batch only needs to divide by data*fsdp: batch 2 on
fsdp:2,expert:4 gives each device a quarter of one sequence (a fractional per-device batch).

Collectives per layer (d/f/x = the data/fsdp/expert axes; kv = B_loc*S*KV*Dh*4; C as in ep.py, b_loc the
sequences a device holds parts of)
  forward : 1. all-gather over f of the weight matrices and experts (as ep.py)
            2. all-gather over x of K and V (2 x kv)                          [critical path]
            3. "dispatch_a2a" / "combine_a2a": all-to-all over x of the counts and of
               [EP, C, D] twice                                               [critical path]
            4. router statistics all-reduced over (d, f, x); with capacity_factor > 0 the
               expert ids [b, S, K] and positions [b, S] all-gathered over x
  backward: 5. all-to-all over x x2 (transposes of 3); dK/dV reduce-scattered over x (2 x kv/EP,
               model._gather_kv); weight grads as ep.py
  once per step: kv_pos all-gathered over x; embed / unembed like one layer's matrices.
Pick it for long sequences, or a global batch smaller than the device count (strong scaling);
cost vs ep.py: the K/V all-gathers, and attention work that no longer shrinks with EP.

HLO contract (every collective of the compiled step; size-1 axes drop out; the cost model's
(kind, axes) set equals it, and tests/test_ep_as_cp.py holds both to the program, both ways):
  all-gather over fsdp: weight matrices and experts (fwd)
  reduce-scatter over fsdp: their gradients
  all-gather over expert: K, V, kv_pos (fwd); expert ids + positions (capacity_factor > 0)
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  reduce-scatter over expert: dK/dV
  all-reduce over expert: norm-scale grads, summed over the sequence axis first (XLA's split)
  all-reduce over (data, fsdp): then over the batch axes
  all-reduce over (data, expert): non-expert grad shards after the fsdp reduce-scatter
  all-reduce over data: expert grad shards
  all-reduce over (data, fsdp, expert): router stats, loss sums, grad norm

  python run.py --strategy=ep_as_cp --mesh=fsdp:2,expert:2,data:2 --context_sharding=expert --steps=3
  python run.py --strategy=ep_as_cp --mesh=fsdp:2,expert:4 --batch=2 --context_sharding=expert
"""
from jax.sharding import PartitionSpec as P

from common import dispatch, layouts
from common import mesh as mesh_lib
from common import model
from common.config import ConfigError
from strategies import ep

NAME = "ep_as_cp"
DATA, FSDP, EXPERT = mesh_lib.DATA, mesh_lib.FSDP, mesh_lib.EXPERT
AXES = (DATA, FSDP, EXPERT)
MAIN_AXIS = EXPERT
BATCH = (DATA, FSDP)
CP = EXPERT
TOKENS = (DATA, FSDP, EXPERT)                 # axes tokens are split over (= grad axes)


def cp_axis(cfg, mesh) -> str:
  """The physical axis playing CP: "expert" ("context", the flag's default, means the same)."""
  name = EXPERT if cfg.context_sharding == mesh_lib.CONTEXT else cfg.context_sharding
  if name != CP or name not in mesh.axis_names:
    raise ConfigError(f"context_sharding={cfg.context_sharding!r} must be 'expert' for ep_as_cp "
                      f"(mesh axes {', '.join(mesh.axis_names)}; expert plays context parallelism)")
  return name


def check(cfg, mesh):
  cp_axis(cfg, mesh)
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, EXPERT)
  mesh_lib.require_divisible("batch", cfg.batch, mesh, BATCH)
  layouts.check_cp(cfg, mesh, CP)
  layouts.check_fsdp(cfg, mesh, FSDP)
  dispatch.check_method(cfg.dispatch)


def param_specs(cfg, mesh):
  return ep.param_specs(cfg, mesh)


def batch_spec(cfg, mesh):
  return P(BATCH, CP)                                               # [B, S] @ ((d, f), expert)


def prepare_batch(b, cfg, mesh):
  return layouts.cp_prepare_batch(b, cfg, mesh, CP)


def layout(cfg, mesh):
  x_spec = P(BATCH, CP, None)                                       # [B, S, D] @ ((d, f), e, None)
  kv, kv_pos = layouts.cp_kv_specs(BATCH)                           # [B, T, KV, Dh] @ ((d, f),)
  gather_seq = layouts.sequence_gatherer(CP) if cfg.capacity_factor > 0 else None

  def moe_fn(p, x, positions):                                      # ep.py's exchange, S split
    return ep.moe_ep(ep.moe_weights(p, TOKENS, cfg), x, positions, cfg, ep_axes=(EXPERT,),
                     gather_sequence=gather_seq)
  return model.Layout(x=x_spec, kv=kv, kv_pos=kv_pos, use=layouts.fsdp_use(TOKENS, cfg), moe=moe_fn)


def dispatch_buffer_type(cfg, mesh):
  return ep.buffer_type(cfg, mesh, P(BATCH, CP, None), (EXPERT,))


def activation_shardings(cfg, mesh):
  t = dispatch_buffer_type(cfg, mesh)
  cp = mesh_lib.axis_size(mesh, CP)
  return [("residual x [B, S, D]", f"[{cfg.batch}@(data,fsdp), {cfg.seq_len}@expert, {cfg.d_model}]"),
          ("k/v [B, T, KV, Dh]", f"[{cfg.batch}@(data,fsdp), {cfg.seq_len}, {cfg.n_kv_heads}, "
                                 f"{cfg.head_dim}]"),
          ("dispatch buffer [N_src, EP, C, D]", f"{t.shape} @ {t.sharding.spec}"),
          ("load-balanced positions per expert rank",
           str(layouts.lb_positions(cfg.seq_len, cp).tolist()))]


def cost(cfg, mesh):
  return (ep.cost(cfg, mesh, token_axes=TOKENS, batch_axes=BATCH,
                  grads=layouts.cp_norm_grads(CP, BATCH))
          + layouts.cp_terms(cfg, mesh, CP, BATCH))
