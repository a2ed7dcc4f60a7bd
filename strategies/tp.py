"""tp — Megatron tensor parallelism: heads and expert hidden dim F over `tensor`, batch over `data`.

Mesh axes: (data, tensor)

| tensor                                   | sharding                                        |
|------------------------------------------|-------------------------------------------------|
| attn wq [D, H, Dh], wk/wv [D, KV, Dh]    | column-parallel: [D, H_t, Dh], [D, KV_t, Dh]    |
| attn wo [H, Dh, D]                       | row-parallel: [H_t, Dh, D]                      |
| MLA wq_b [Rq, H, qk], wkv_b [Rkv, H, .]  | column-parallel: [Rq, H_t, qk], [Rkv, H_t, .]   |
| MLA wq_a [D, Rq], wkv_a [D, Rkv + rope]  | replicated: token-local, every rank runs them   |
| experts wi_0/wi_1 [E, D, F], wo [E, F, D]| [E, D, F_t] column, [E, F_t, D] row             |
| shared wi_0/wi_1 [D, Fs], wo [Fs, D]     | [D, Fs_t] column, [Fs_t, D] row                 |
| attn bq [H, Dh], bk/bv [KV, Dh] (GQA)    | with their heads: [H_t, Dh], [KV_t, Dh]         |
| shared gate wg [D] (Qwen2-MoE)           | replicated: scales the shared hidden [.., Fs_t] |
| embed, unembed, norms, router, bias      | replicated                                      |
| tokens / positions [B, S]                | (B_data, S)                                     |
| residual x [B, S, D]                     | (B_data, S, D), replicated over tensor          |
| q [B, S, H, Dh], k/v [B, S, KV, Dh]      | heads over tensor (GQA groups stay on one rank) |
| MoE: routing, permutation                | every tensor rank routes the same local tokens  |
| MoE: expert hidden h [T*K, F]            | F over tensor (each rank its F_t slice)         |

Collectives per layer (t = tensor, d = data; x bytes = B_d*S*D*4, all on the critical path):
  forward : 1. attention out  o[B,S,H_t,Dh] @ wo[H_t,Dh,D] {U_t} -> all-reduce over t (x bytes)
            2. MoE (in the shard_map): route, permute, gmm with the F_t slices of wi_0/wi_1/wo ->
               ys[T*K, D] {U_t}; unpermute FIRST (it is linear), then ONE psum over t of
               y[T, D] (x bytes): summing after the weighted combine moves T*D, not T*K*D
            3. shared expert out h[B,S,Fs_t] @ wo[Fs_t, D] {U_t} -> all-reduce over t (x bytes)
            4. all-reduce over (d, t) of the router statistics (every t rank routes the same
               tokens; t rank 0's count, the others add zeros: exact for any t)
  backward: 5. ONE all-reduce over t per block input (2 x x bytes per layer): the normed h that
               attention (q, k, v) and the MLP (router, MoE, shared expert) read is typed
               *reduced* over t (Megatron's "f": gather_in = parallel.sharding.gather_weight), so
               every column-parallel dx stays an unreduced partial until that one sum, instead
               of one all-reduce for q/k/v, one for the MoE dx, one for d(combine weights)
               and two for the shared expert. MLA: what attention reads typed reduced is its
               latents after the replicated down-projections (normed c_Q, or h if q_lora_rank
               = 0, normed c_KV, rotated k_r: Rq + Rkv + rope per token, 2,112 at DeepSeek-V3
               against D = 7,168), so that all-reduce is of them; the down-projections'
               backward runs on the complete sum, and their weight grads need no sum over t
            6. all-reduce over d of every weight gradient (XLA combines them)
No all-gather, no all-to-all: no weight ever moves over tensor (but Muon's directions, below).

HLO contract (kind over mesh axes; size-1 axes drop out; tests/test_strategies.py enforces both
ways, and the cost model's (kind, axes) set must equal it; tests/test_tp.py adds the count and
bytes of the activation all-reduces):
  all-reduce over tensor: activations and their gradients (above)
  all-reduce over data: weight gradients, the CE sum
  all-reduce over (data, tensor): router grads, router statistics, grad norm
  all-gather over tensor [muon]: the tensor-split matrices' float32 directions, whole for
    Newton-Schulz, once per step (--optimizer=muon only)

Pick it for large d_ff / many heads within a fast interconnect (NVLink / one ICI ring): it cuts
weight and optimizer memory by t without gathering them, at the price of 2-3 activation
all-reduces per layer forward and 2 backward, on the critical path, that grow with B*S*D
rather than with the parameters.

  python run.py --strategy=tp --mesh=data:4,tensor:2 --devices=8 --steps=3 --hlo_stats
"""
import jax
from jax.sharding import PartitionSpec as P

from layout import mesh as mesh_lib, tensor
from layout.options import NoOptions
from layout.precision import moe_stored, stored_use
from measure import cost as cost_lib
from modeling import model, moe
from parallel import sharding
from strategies import BadInput, Case

NAME = "tp"
DATA, TENSOR = mesh_lib.DATA, mesh_lib.TENSOR
AXES = (DATA, TENSOR)
MAIN_AXIS = TENSOR
TOKENS = (DATA, TENSOR)          # router statistics and the router's grads: every rank routes
COMPARE_MESH = "data:4,tensor:2"   # the presets have 2 KV heads: TP = 2 for the comparison table
GROW_AXIS = TENSOR                    # at scale the model, not the preset, caps it
Options = NoOptions
_TINY8 = dict(n_heads=8, n_kv_heads=4)   # 8 / 4 heads: the same model on tensor:2 and tensor:4
TEST_CASES = [Case("tiny", "tensor:2,data:4", _TINY8), Case("tiny", "data:2,tensor:4", _TINY8),
              Case("deepseek-test", "tensor:2,data:4", dict(optimizer="muon"))]
COST_CASES = TEST_CASES
# bf16 mixed precision (tests/test_precision.py): the row holding its richest composition
BF16_CASE = Case("deepseek-test", "data:4,tensor:2")
INVARIANT_MESHES = ("tiny", ("tensor:2,data:4", "data:2,tensor:4"), _TINY8)
BAD_INPUT = [
    BadInput(dict(n_heads=6, n_kv_heads=2), "data:2,tensor:4", Options(),
             "n_heads=6 is not divisible by mesh axis tensor=4"),
    BadInput(dict(n_heads=8, n_kv_heads=2), "data:2,tensor:4", Options(),
             "n_kv_heads=2 is not divisible by mesh axis tensor=4"),
    BadInput(dict(n_heads=8, n_kv_heads=4, d_ff=66), "data:2,tensor:4", Options(),
             "d_ff=66 is not divisible by mesh axis tensor=4"),
    BadInput(dict(n_heads=8, n_kv_heads=4, batch=3), "data:2,tensor:4", Options(),
             "batch=3 is not divisible by mesh axis data=2")]


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("batch", cfg.batch, mesh, DATA)
  mesh_lib.require_head_split(cfg, mesh, TENSOR, expert_ff=True)


def param_specs(cfg, mesh, opts=None):
  # embed, norms, router, MLA's down-projections wq_a / wkv_a: replicated
  return model.param_specs(cfg, tensor.table(TENSOR))          # heads, F over tensor


def batch_spec(cfg, mesh):
  return P(DATA, None)                                     # [B, S] @ (data, None)


def layout(cfg, mesh, opts):
  x_spec = P(DATA, None, None)                             # [B, S, D] @ (data,), rep. over t
  # normed h as attention and the MLP read it: the same values, typed reduced over t (its
  # cotangent is an unreduced partial per t rank, summed once in gather_in's backward)
  h_spec = P(DATA, None, None, reduced=frozenset({TENSOR}))

  def moe_fn(p, x, positions):
    def body(p, x, pos):                                            # x [b, S, D] local, same on all t
      b, s, d = x.shape
      # x comes in *reduced* over t (gather_in): varying from here on, so its cotangent leaves
      # unreduced and the layer's ONE psum over t happens in gather_in's backward
      xv = jax.lax.pcast(x, TENSOR, to="varying")                      # [b, S, D]
      r, keep, stats = moe.route_tokens(p, xv, pos, cfg)          # the same on every t rank
      xv, r = moe.scaled_input(xv, r, keep, cfg)                    # Llama 4: scaled input
      xv = xv.reshape(b * s, d)                                     # [T, D]
      xs, gs, order = moe.permute(xv, r.experts, keep, cfg.n_experts)  # [T*K, D]
      ys = moe.swiglu_experts(xs, gs, tensor.bias_once(p, TENSOR), cfg.gmm_backend,
                              cfg)                                  # [T*K, D] {U_t}: F_t slice only
      y = moe.unpermute(ys, order, r.weights)                       # [T, D] {U_t}
      # one psum over t; the stats counted by t rank 0, summed over (d, t)
      y, stats = tensor.finish_moe(y, stats, TENSOR, TOKENS)       # [T, D]
      return y.reshape(b, s, d).astype(x.dtype), stats
    # experts [E, D, F@t] / [E, F@t, D] as stored (bf16: cast, typed reduced over data)
    p, specs = moe_stored(p, cfg, (DATA,))
    return jax.shard_map(body, in_specs=(specs, h_spec, P(DATA, None)),
                         out_specs=(x_spec, P()))(p, x, positions)  # y [B, S, D] @ (data,)
  # x_spec as out_sharding of the row-parallel matmuls (attention wo, shared wo) = the all-reduce
  gather_in = lambda h: sharding.gather_weight(h, x_spec, (TENSOR,))     # [B, S, D] -> h_spec; bwd psum over t
  return model.Parallelism(x=x_spec, use=stored_use(cfg, (DATA,)), moe=moe_fn,
                      gather_in=gather_in)


def activation_shardings(cfg, mesh, opts):
  return [("residual x [B, S, D]", f"[{cfg.batch}@data, {cfg.seq_len}, {cfg.d_model}]"),
          ("q [B, S, H, Dh]", f"[{cfg.batch}@data, {cfg.seq_len}, {cfg.n_heads}@tensor, {cfg.head_dim}]"),
          ("expert hidden [T*K, F]", f"F={cfg.d_ff}@tensor inside the MoE shard_map")]


def cost(cfg, mesh, opts):
  """Per-device collective bytes per step (measure/cost.py; the docstring's schedule): weights
  used as stored, their grads over data (the router's over (data, tensor): every tensor rank
  routes, rank 0 counts); the activation all-reduces over tensor; router statistics."""
  specs = param_specs(cfg, mesh)
  # gpt-oss's expert down bias: summed over tensor inside the MoE (tensor.bias_once), then data
  grads = {"router": TOKENS, "router_bias": TOKENS, "expert_out_bias": ((TENSOR,), (DATA,))}
  terms = (cost_lib.weight_terms(cfg, mesh, specs, (DATA,), grads=grads)
           + cost_lib.muon_terms(cfg, mesh, specs, (TENSOR,))
           + cost_lib.stats_terms(cfg, mesh, TOKENS))
  return terms + cost_lib.tensor_terms(cfg, mesh, TENSOR,
                                       cfg.batch // mesh_lib.axis_size(mesh, DATA))
