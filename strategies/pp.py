"""pp — pipeline parallelism over `stage`, expert parallelism inside each stage.

Mesh axes: (stage, data, expert), stage outermost. P = |stage| stages of L/P contiguous MoE
layers (L = n_layers - first_k_dense_replace);
M = cfg.microbatches (--microbatches) microbatches per step; EP = |expert|.

| tensor                                   | sharding                                          |
|------------------------------------------|---------------------------------------------------|
| MoE layer params [L, ...]                | L over stage: stage s holds layers s*L/P..(s+1)*L/P-1 |
| dense prefix params [L_dense, ...]       | replicated                                        |
| experts wi_0/wi_1 [L, E, D, F], wo       | (stage, expert, None, None): e = E/EP per device  |
| attn, norms, router, bias, shared [L, ..]| (stage, ...), replicated over (data, expert)      |
| embed, final_norm, unembed               | replicated                                        |
| tokens / targets / positions [B, S]      | ((data, expert), None), replicated over stage     |
| a microbatch between stages [b/M, S, D]  | per device: its b = B/(data*expert) rows, 1/M     |

The whole model is one full-manual shard_map (`loss`). Every device embeds its rows and runs the
leading dense layers (DeepSeek's, as MaxText runs them: before the pipeline, replicated over
stage; stages > 0 discard theirs, so it costs P x their FLOPs and one [b, S, D] per dense layer
of activation memory). Stage 0 feeds microbatch t at time t;
stage s runs its L/P layers (model.block, scanned) on what stage s-1 sent at t-1; every stage
ppermutes its output to s+1 after each time step; the last stage keeps the M outputs and
computes the head. Inside a stage the MoE is ep.py's moe_body with its padded all-to-all over
expert (pp takes no --opt=dispatch: the ragged exchange is ep's alone until a GPU run holds it).

GPipe schedule (all forwards, then all backwards: autodiff of the time loop runs it reversed),
P = 4, M = 4, F_m / B_m = forward / backward of microbatch m, . = bubble:
  time     0  1  2  3  4  5  6    7  8  9 10 11 12 13
  stage 0  F0 F1 F2 F3 .  .  .    .  .  .  B3 B2 B1 B0
  stage 1  .  F0 F1 F2 F3 .  .    .  .  B3 B2 B1 B0 .
  stage 2  .  .  F0 F1 F2 F3 .    .  B3 B2 B1 B0 .  .
  stage 3  .  .  .  F0 F1 F2 F3   B3 B2 B1 B0 .  .  .
Bubble fraction (P-1)/(M+P-1) (3/7 here; M >= P keeps it under 1/2; any M >= 1 is correct).
Activation memory per stage: the time loop's residuals, M+P-1 steps of one microbatch through
L/P layers, i.e. (M+P-1)/M x the stage's activations for its whole b rows (GPipe keeps every
microbatch's activations until its backward).

Exact aux loss under microbatching: every microbatch's router statistics (counts, prob sums, z,
dropped; psum'd over (data, expert) in moe_body) are summed over the M microbatches per layer
before the load-balance and z losses are formed, and the losses of the L/P layers of each stage
summed over stage: the step's statistics, as the single-device reference computes them; the
aux-loss-free bias update uses the whole step's counts [L, E] (out over stage). Never an average
of per-microbatch losses.
The sequence-wise loss (aux_loss_kind "sequence", DeepSeek-V3's) needs no such sum: each
microbatch's sequences are whole, so its loss term is final when its forward ends. A schedule
that starts a microbatch's backward before the last microbatch's forward (1F1B, interleaved)
can run it exactly; the batch-wise loss's f would need every microbatch's counts first (a
forward pass over all of them, as runtime.train's gradient accumulation does), or change to a
per-microbatch statistic. The bias update's counts are summed after the step either way.

Collectives per step (x = expert; T_mb = b/M*S tokens per device per microbatch):
  forward : 1. collective-permute over stage of the activation [b/M, S, D], every time step
               (M+P-1 of them; the sends of bubble steps carry zeros)
            2. per time step and local layer, moe_body: all-to-all over x of the counts [EP, e]
               and of the send buffer [EP, C, D] (C = ep.py's bound for b/M sequences), and of
               the expert outputs; all-reduce over (data, x) of the router statistics
  backward: 3. collective-permute over stage of the activation cotangents, M+P-1 steps
            4. the all-to-all transposes; weight grads: layer params all-reduced over (data, x)
               (the experts over data), embed / final_norm / unembed and the dense prefix's
               params over (stage, data, x)
  once    : the loss sums: CE over (stage, data, x), aux / z / dropped over stage; grad norm.
HLO contract (every collective of the compiled step; size-1 axes drop out; the cost model's
(kind, axes) set equals it, and tests/test_pp.py holds both to the program, both ways):
  collective-permute over stage: activations forward, cotangents backward
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over (data, expert): router statistics per microbatch, layer-param grads
  all-reduce over data: expert grads
  all-reduce over stage: aux / z / dropped sums
  all-reduce over (stage, data, expert): embed / final_norm / unembed / dense-prefix grads, CE
    sum, grad norm
When to use: the model's layers do not fit on one EP group (pipeline across nodes over slow
links: only [b/M, S, D] activations cross a stage boundary), with M >= P microbatches to keep
the bubble small. Cost: the bubble, (M+P-1)/M x the activation memory, and P-1 idle stages
during warm-up and drain.

  python run.py --strategy=pp --mesh=stage:2,expert:4 --microbatches=4 --steps=3
  python run.py --strategy=pp --mesh=stage:4,data:2 --layers=4 --microbatches=8 --steps=3
"""
import functools

import einops
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from layout import dispatch, mesh as mesh_lib
from layout.options import NoOptions
from measure import cost as cost_lib
from modeling import model, routing
from parallel import sharding
from strategies import BadInput, Case, ep

NAME = "pp"
STAGE, DATA, EXPERT = mesh_lib.STAGE, mesh_lib.DATA, mesh_lib.EXPERT
AXES = (STAGE, DATA, EXPERT)
MAIN_AXIS = STAGE
COMPARE_MESH = "data:1,stage:2,expert:4"        # tiny has 2 layers: 2 stages, EP inside; more
                                                # devices scale data
TOKENS = (DATA, EXPERT)                         # the batch axes (replicated over stage)
Options = NoOptions
TEST_CASES = [Case("tiny", "stage:2,expert:4", dict(batch=16, microbatches=4)),
              Case("tiny", "stage:4,data:2", dict(n_layers=4, batch=16, microbatches=8)),
              # two dense layers before the pipeline: 2 MoE layers, 1 per stage, not n_layers / 2
              Case("deepseek-test", "stage:2,data:2,expert:2",
                   dict(n_layers=4, first_k_dense_replace=2, microbatches=2)),
              Case("deepseek-test", "stage:4,expert:2",
                   dict(n_layers=5, microbatches=4, capacity_factor=1.0)),
              # Muon's Newton-Schulz maps over each stage's own layers (modeling/optim.py)
              Case("tiny", "stage:2,expert:4", dict(optimizer="muon"))]
COST_CASES = TEST_CASES[:3]
BAD_INPUT = [
    BadInput(dict(n_layers=3), "stage:2,expert:4", Options(),
             "n_layers=3 is not divisible by mesh axis stage=2"),
    BadInput(dict(microbatches=4), "stage:2,expert:4", Options(),
             "batch=8 is not divisible by microbatches=4 x mesh axis dataxexpert=4"),
    BadInput(dict(n_experts=6, top_k=2), "stage:2,expert:4", Options(),
             "n_experts=6 is not divisible by mesh axis expert=4")]


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("n_layers - first_k_dense_replace" if cfg.first_k_dense_replace
                             else "n_layers", cfg.n_moe_layers, mesh, STAGE)
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, EXPERT)
  mesh_lib.require_divisible("batch", cfg.batch, mesh, TOKENS)
  mesh_lib.require_microbatches(cfg, mesh, batch_spec(cfg, mesh))  # B % (M x data x expert)


def param_specs(cfg, mesh):
  return model.param_specs(cfg, {"expert_in": P(EXPERT, None, None),     # [L@stage, E@x, D, F]
                                 "expert_out": P(EXPERT, None, None)}, layer_axis=STAGE)


def batch_spec(cfg, mesh):
  return P(TOKENS, None)                                            # [B, S] @ ((data, x), None)


def bubble(cfg, mesh) -> float:
  p = mesh.shape[STAGE]
  return (p - 1) / (cfg.microbatches + p - 1)


def layout(cfg, mesh, opts):
  return model.Layout(loss=functools.partial(loss, cfg=cfg, mesh=mesh))


def loss(params, batch, *, cfg, mesh):
  """The whole model under the GPipe schedule -> (loss, metrics as model.loss_fn's)."""
  specs = param_specs(cfg, mesh)
  bspec = batch_spec(cfg, mesh)
  keys = ("tokens", "targets", "positions")
  body = functools.partial(_pipeline, cfg=cfg, n_stage=mesh.shape[STAGE],
                           ep_size=mesh.shape[EXPERT])
  out_specs = (P(), {"loss": P(), "ce_loss": P(), "aux_loss": P(), "z_loss": P(), "dropped": P(),
                     "counts": P(STAGE, None)})
  return jax.shard_map(body, in_specs=(specs,) + (bspec,) * 3, out_specs=out_specs)(
      params, *(batch[k] for k in keys))


def logits(params, batch, *, cfg, mesh):
  """The model's logits [B, S, V] under the pipeline (no loss; for inference and the Hugging
  Face parity tests): the last stage's head, summed over stage (the other stages add zeros)."""
  def body(p, tokens, positions):
    outs, _, p = _stages(p, tokens, positions, cfg=cfg, n_stage=mesh.shape[STAGE],
                      ep_size=mesh.shape[EXPERT])
    out = _head(outs, p, cfg)                                       # [M, b/M, S, V]
    last = jax.lax.axis_index(STAGE) == mesh.shape[STAGE] - 1
    out = jax.lax.psum(jnp.where(last, out, 0.0), STAGE)
    return einops.rearrange(out, "m mb s v -> (m mb) s v")          # [b, S, V]
  bspec = batch_spec(cfg, mesh)
  return jax.shard_map(body, in_specs=(param_specs(cfg, mesh), bspec, bspec),
                       out_specs=P(TOKENS, None, None))(params, batch["tokens"], batch["positions"])


def _pipeline(p, tokens, targets, positions, *, cfg, n_stage, ep_size):
  """One device. tokens / targets / positions [b, S] local rows; p: this stage's layers."""
  m, all_axes = cfg.microbatches, (STAGE,) + TOKENS
  outs, stats, p = _stages(p, tokens, positions, cfg=cfg, n_stage=n_stage, ep_size=ep_size)
  last = jax.lax.axis_index(STAGE) == n_stage - 1
  tgt = einops.rearrange(targets, "(m mb) s -> m mb s", m=m)        # [M, b/M, S]
  logits = _head(outs, p, cfg)                                      # [M, b/M, S, V]
  ce = jnp.sum(jax.nn.logsumexp(logits, axis=-1)
               - jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0])
  n_tokens = cfg.batch * cfg.seq_len
  ce = jax.lax.psum(jnp.where(last, ce, 0.0), all_axes) / n_tokens
  aux, z = routing.aux_losses(stats, n_tokens, cfg)       # [L/P] from the step's stats
  aux, z, dropped = (jax.lax.psum(jnp.sum(v), STAGE) for v in (aux, z, stats["dropped"]))
  total = ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
  return total, {"loss": total, "ce_loss": ce, "aux_loss": aux, "z_loss": z, "dropped": dropped,
                 "counts": stats["counts"]}


def _head(outs, p, cfg):
  """[M, b/M, S, D] -> float32 logits [M, b/M, S, V]."""
  h = model.rms_norm(outs, p["final_norm"], cfg.norm_eps)
  return jnp.einsum("mbsd,dv->mbsv", h, p["unembed"]).astype(jnp.float32)


def _stages(p, tokens, positions, *, cfg, n_stage, ep_size):
  """The GPipe time loop on one device -> (the last stage's outputs [M, b/M, S, D] (zeros on
  the other stages), this stage's router stats summed over the microbatches {name: [L/P, ..]},
  p cast and varying: the head reads its final_norm and unembed)."""
  m, all_axes = cfg.microbatches, (STAGE,) + TOKENS
  b, s = tokens.shape
  mb = b // m
  # microbatch i = this device's rows i*b/M .. (i+1)*b/M - 1 (contiguous; train.microbatches
  # interleaves instead: the step's statistics are summed over all microbatches either way)
  split = lambda a: einops.rearrange(a, "(m mb) s -> m mb s", m=m)   # [M, b/M, S]
  pos = split(positions)
  stage = jax.lax.axis_index(STAGE)
  first, last = stage == 0, stage == n_stage - 1
  # varying over every axis before the time loop: each device accumulates its weight grads over
  # the M+P-1 steps, and the psum (pcast's transpose) runs ONCE, after the loop, not per step
  # mixed precision: the cast comes after the pcast, so the one psum sums float32 gradients
  # (before it with --grad_reduce_dtype=bfloat16); router, bias, norms stay float32 (KEEP_F32)
  cast = lambda t: jax.tree.map(lambda a, role: a if role in model.KEEP_F32 else
                                a.astype(cfg.dtype), t, model.param_roles(cfg))
  f32_sum = cfg.grad_reduce_dtype == "float32"
  p = jax.tree.map(lambda a: sharding.to_varying(a, all_axes), p if f32_sum else cast(p))
  p = cast(p) if f32_sum else p
  # the leading dense layers (DeepSeek) before the pipeline, on every device for its own rows
  # (stages > 0 compute it too and discard it: their gradient of it is zero)
  x0 = model.dense_prefix(p["embed"][tokens], p, positions, cfg, model.Layout())   # [b, S, D]
  x0 = einops.rearrange(x0, "(m mb) s d -> m mb s d", m=m)          # [M, b/M, S, D]
  lay = model.Layout(moe=functools.partial(ep.moe_body, cfg=cfg, ep_axes=(EXPERT,), ep=ep_size,
                                           token_axes=TOKENS, transport=ep.a2a_exchange))

  def run_stage(x, pos_m):                                          # L/P layers of this stage
    body = model.remat(lambda h, lp: model.block(h, lp, pos_m, cfg, lay), cfg)
    return jax.lax.scan(body, x, p["layers"])

  def step(carry, t):
    recv, outs, stats = carry
    mi = t - stage                                                  # this stage's microbatch
    valid = (mi >= 0) & (mi < m)
    mc = jnp.clip(mi, 0, m - 1)
    x = jnp.where(first, x0[jnp.minimum(t, m - 1)], recv)          # [b/M, S, D]
    y, st = run_stage(x, pos[mc])                                   # st: {name: [L/P, ...]}
    stats = jax.tree.map(lambda a, v: a + jnp.where(valid, v, 0), stats, st)
    outs = outs.at[mc].set(jnp.where(valid & last, y, outs[mc]))    # the last stage keeps them
    with jax.named_scope("stage_permute"):
      recv = jax.lax.ppermute(y, STAGE, [(i, i + 1) for i in range(n_stage - 1)])
    return (recv, outs, stats), None

  zeros = lambda shape: sharding.to_varying(jnp.zeros(shape, cfg.dtype), all_axes)
  stat0 = jax.tree.map(lambda a: sharding.to_varying(jnp.zeros(a.shape, a.dtype), (STAGE,)),
                       jax.eval_shape(run_stage, zeros((mb, s, cfg.d_model)), pos[0])[1])
  carry = (zeros((mb, s, cfg.d_model)), zeros((m, mb, s, cfg.d_model)), stat0)
  (_, outs, stats), _ = jax.lax.scan(step, carry, jnp.arange(m + n_stage - 1))
  return outs, stats, p


def activation_shardings(cfg, mesh, opts):
  b = cfg.batch // mesh_lib.axis_size(mesh, *TOKENS)
  return [("microbatch between stages", f"[{b // cfg.microbatches}, {cfg.seq_len}, "
           f"{cfg.d_model}] per device, {cfg.microbatches} microbatches"),
          ("bubble fraction", f"{bubble(cfg, mesh):.2f}")]


def cost(cfg, mesh, opts):
  """Per-device collective bytes per step (measure/cost.py; the docstring's schedule)."""
  p, ep_size = mesh.shape[STAGE], mesh.shape[EXPERT]
  steps, local_layers = cfg.microbatches + p - 1, cfg.n_moe_layers // p    # MoE layers a stage holds
  mb = cfg.batch // mesh_lib.axis_size(mesh, *TOKENS) // cfg.microbatches
  act = mb * cfg.seq_len * cfg.d_model * cost_lib.act_bytes(cfg)  # one [b/M, S, D]
  c = dispatch.send_rows(cfg, mb, cfg.seq_len, ep_size)
  buf = ep_size * c * cfg.d_model * cost_lib.act_bytes(cfg)       # [EP, C, D]
  runs = steps * local_layers                                       # moe_body calls per step
  term = functools.partial(cost_lib.term, mesh)
  stats = cost_lib.stats_values(cfg) * cost_lib.F32
  return (cost_lib.weight_terms(cfg, mesh, param_specs(cfg, mesh), AXES)
          + term("collective-permute", "fwd", "activations to the next stage", steps * act, STAGE)
          + term("collective-permute", "bwd", "cotangents to the previous stage", steps * act,
                 STAGE)
          + term("all-to-all", "fwd", "dispatch + combine buffers, counts [EP, e]",
                 runs * (2 * buf + cfg.n_experts * 4), EXPERT, cost_lib.RECOMPUTED)
          + term("all-to-all", "bwd", "their transposes", runs * 2 * buf, EXPERT)
          + term("all-reduce", "fwd", "router stats per microbatch", runs * stats, TOKENS)
          + term("all-reduce", "fwd", "aux / z / dropped sums", 3 * cost_lib.F32, STAGE)
          + term("all-reduce", "fwd", "CE sum", cost_lib.F32, AXES))
