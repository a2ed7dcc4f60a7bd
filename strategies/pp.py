"""pp — pipeline parallelism over `stage`, expert parallelism inside each stage.

Mesh axes: (stage, data, expert), stage outermost. P = |stage| stages of L/P contiguous MoE
layers (L = n_layers - first_k_dense_replace);
M = cfg.microbatches (--microbatches) microbatches per step; EP = |expert|.
Uneven layouts (--layer_layout=c_0,..,c_{P-1}: c_s MoE layers on stage s, in depth order; e.g.
DeepSeek-V3's 58 on 16 stages as 4 x 10 + 3 x 6): the model stores its MoE stack padded to
P x max(c) rows (modeling/config.py layer_slots), group s in rows s*max(c).., its padding rows
zeros. A padding row is inert (model.moe_stack): its block runs and is discarded, its stats
are zeros, its weights get zero gradients. So every stage runs max(c) rows per tick (the
lockstep tick is the largest stage's anyway), and below "L/P" reads "max(c) rows": the cost
model counts the padding rows' exchanges, which the program issues. The reference runs the same
padded stack; tests/test_pp.py holds it to the unpadded model (every layer once, in order).
Without --layer_layout, a P that does not divide L gets balanced_layout(L, P) (`stored_config`:
the planner's rule, the larger stages first, 3 MoE layers on 2 stages as 2,1; `layout_note`
names it for the run to print); fewer MoE layers than stages admit no layout (check refuses).
Interleaved (--opt=schedule=interleaved, below): P x v groups, stage s holding groups s, s+P, ..
(the rows stored round-robin: layer_stages = P), each a chunk of max(c) rows.

| tensor                                   | sharding                                          |
|------------------------------------------|---------------------------------------------------|
| MoE layer params [L, ...]                | L over stage: stage s holds layers s*L/P..(s+1)*L/P-1 (uneven: its group's padded rows) |
| experts wi_0/wi_1 [L, E, D, F], wo       | (stage, expert, None, None): e = E/EP per device  |
| attn, router, shared experts [L, ..]     | (stage, D over data): wq [L@stage, D@data, H, Dh] |
| norms, router bias [L, ..]               | (stage, ...), replicated over (data, expert)      |
| dense prefix matrices [L_dense, ..]      | D over (stage, data): wq [L_dense, D@(stage,data), H, Dh] |
| embed [V, D], unembed [D, V]             | D over (stage, data): [V, D@(stage,data)]         |
| final_norm, the prefix's norms           | replicated                                        |
| optimizer state                          | like its parameter                                |
| tokens / targets / positions [B, S]      | ((data, expert), None), replicated over stage     |
| a microbatch between stages [b/M, S, D]  | per device: its b = B/(data*expert) rows, 1/M     |

The whole model is one full-manual shard_map (`loss`). gpipe and interleaved: every device
embeds its rows and runs the leading dense layers (DeepSeek's, as MaxText runs them: before the
pipeline, replicated over stage; stages > 0 discard theirs, so it costs P x their FLOPs and one
[b, S, D] per dense layer of activation memory), one microbatch at a time (`_prefix`: the
working set of b/M rows, not of b). 1f1b: stage 0 alone runs them, inside its phases, one
microbatch at a time (its forward reads the tokens, its backward sums the embedding's and
the prefix's gradients), and their residuals join the ring: min(M, P) microbatches of them, not
M. Stage 0 feeds microbatch t at time t; stage s runs its L/P layers (model.block, scanned) on
what stage s-1 sent at t-1; every stage ppermutes its output to s+1 after each time step; the
last stage keeps the M outputs and computes the head, one microbatch's logits at a time. Inside
a stage the MoE is ep.py's moe_body with its padded all-to-all over
expert (pp takes no --opt=dispatch: the ragged exchange is ep's alone until a GPU run holds it).

The stage's weights over data: ZeRO-3 at rest, ZeRO-1's traffic. Every non-expert matrix, its
float32 master and its optimizer state are stored split on D over data (1/data of them per
device, DeepSeek-V3's ZeRO-1 saving and more), all-gathered once per step before the time
loop in the compute dtype (`_use`), and their gradients reduce-scattered once, after it:
1x the weight gathered and 1/data reduce-scattered per step, the wire bytes of the all-reduce
they replace. FSDP's per-use gather would move the weight at every one of the M+P-1 ticks;
ZeRO-1's replicated bf16 copy would keep a whole stage's weights between steps. The gathered
copy lives for the step (its temp memory). The experts stay split over expert only. Embedding,
head and the dense prefix are split over every stage too, D over (stage, data): the first
stage alone reads the embedding and the prefix (1f1b) and the last alone the head, but a
stored share on each device (1/(P x data) of them and of their optimizer state) costs less
than whole copies on one stage (DeepSeek-V3's 3 dense layers: 1.75B values, 21 GB with Adam
whole, 0.65 GB a device at stage:16,data:2).

Schedules (--opt=schedule=gpipe|1f1b|interleaved), each a table (`schedule`: which microbatch's forward
F<m> and backward B<m> each stage runs at each tick; . = idle), P = 4.
gpipe, M = 4 (the default; all forwards, then all backwards: autodiff of the forward time
loop runs it reversed):
  tick     0  1  2  3  4  5  6  7  8  9  10 11 12 13
  stage 0  F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
  stage 1  .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
  stage 2  .  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .  .
  stage 3  .  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .
1f1b, M = 8 (Megatron's: stage s runs the forwards of microbatches 0..P-s-1 at ticks s.., then
alternates: F(i) at tick 2i+s, B(i) at 2P-1-s+2i; one phase per stage and tick):
  tick     0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21
  stage 0  F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
  stage 1  .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
  stage 2  .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
  stage 3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
gpipe takes M+P-1 forward and M+P-1 backward ticks: the bubble is (P-1)/(M+P-1) (3/7 above;
M >= P keeps it under 1/2; any M >= 1 is correct). The two differ in memory and time:
  gpipe keeps the time loop's residuals, M+P-1 ticks of one microbatch through L/P layers (the
    bubble ticks' too), (M+P-1)/M x the stage's activations for its b rows.
  1f1b runs each backward inside the loop as the explicit jax.vjp of the stage (`_run_table`, one
    full-manual shard_map driven by the table) and keeps residuals only for the microbatches in
    flight, a ring of min(M, P) (`in_flight`; stage s holds P-s), Megatron's bound: min(M, P)/M
    of gpipe's share. Residuals that are the stage's weights are kept by reference, never copied
    per microbatch. A stage may read an activation ticks after its neighbour sent it (stage 1
    reads F2 at tick 7, sent at tick 3): each direction has an inbox that keeps its last
    delivery.
  1f1b's time: neighbouring stages run different phases in one tick (one a forward, the other a
    backward), so each phase is a conditional (a stage runs only its own) and a tick lasts as
    long as the longest phase any stage runs in it. 2(M+P-1) ticks: P forward-only, then
    2M+P-2 that hold a backward: P*F + (2M+P-2)*B against gpipe's (M+P-1)*(F+B); with a
    backward twice a forward, 1.09x gpipe's at P = 4, M = 8 and 4/3 as M grows. Its permutes:
    both ways at each tick, 2(M+P-1) each way, twice gpipe's.
  1f1b's step returns the gradients from inside the loop: the train step's value_and_grad sees a
    custom_vjp whose forward rule runs the table and whose backward rule scales the gradients.
    Weight gradients are float32 sums over the ticks, psum'd once after the loop over the axes
    each weight is replicated on. The head (final norm, unembed, CE) runs in the last stage's
    forward phase only (a conditional), with its own backward at once: no residuals kept, the
    last stage's d(loss)/d(output) is stored per microbatch instead.
1f1b with --opt=virtual_stages=v > 1 (Megatron's interleaved 1F1B): the stack stored as
interleaved's below (v chunks per stage, round-robin), one chunk per phase. Each stage walks
Megatron's task order (microbatches in rounds of P, chunk by chunk; its (P-s-1)*2 + (v-1)*P
warm-up forwards, then one forward and one backward in turn) and runs its next task at the
first tick its input has arrived (`_one_f_one_b`). A send may wait ticks for its reader: each
direction has an inbox of slots, and the table names the slot each send is kept in and each
read comes from, and the ring slot of each chunk's residuals. P = 2, M = 4, v = 2 (F<m><chunk>):
  tick     0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17
  stage 0  F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a .   B2b .   B3b B2a B3a
  stage 1  .   F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a .
  The ring holds up to 2(P-1) + (v-1)P + 1 chunks' residuals (5 here), ((v+1)P-1)/v of a
  stage's microbatches against plain 1f1b's P; the bubble shrinks to about (P-1)/v plain ticks
  (P = 4, M = 16, v = 2: 70 ticks of 1/2 against 38) for v times the permutes, each the same
  [b/M, S, D].
interleaved (--opt=schedule=interleaved,virtual_stages=v): each stage holds v chunks of the MoE
stack, placed round-robin (Megatron's virtual pipeline): with the layout's P x v groups (the
balanced layout when --layer_layout is not given: `stored_config`), stage s holds
groups s, s+P, s+2P, .., stored in that order (the model field layer_stages = P: the stored
rows leave depth order, model.forward reads them back in depth order, a checkpoint records it).
A tick runs ONE chunk of one microbatch, so a tick costs 1/v of gpipe's, and the hop from stage
P-1 returns round the ring into stage 0's next chunk. Microbatches go in rounds of P: stage s
runs round g, chunk r, microbatch g*P + i at tick s + g*v*P + r*P + i (M a multiple of P).
P = 3, M = 3, v = 2 (F<m><chunk>; gpipe's order: all forwards, then autodiff's reverse):
  tick     0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15
  stage 0  F0a F1a F2a F0b F1b F2b .   .   .   .   B2b B1b B0b B2a B1a B0a
  stage 1  .   F0a F1a F2a F0b F1b F2b .   .   B2b B1b B0b B2a B1a B0a .
  stage 2  .   .   F0a F1a F2a F0b F1b F2b B2b B1b B0b B2a B1a B0a .   .
  v*M+P-1 ticks of 1/v each way: the bubble is (P-1)/(v*M+P-1) (2/8 above; gpipe's 2/5 at
  M = 3), the compute the same. The costs: v times the permutes (one per tick, each the same
  [b/M, S, D]), and memory like gpipe's: (v*M+P-1)/v ticks of a whole stage's residuals,
  (M+(P-1)/v)/M x the stage's activations. A chunk's weights are cut from the stage's stack by
  a dynamic slice whose vjp (`_chunk`) keeps the chunk's activations and re-cuts the weights in
  the backward: the stack is kept once, not once per tick.

Exact aux loss under microbatching: every microbatch's router statistics (counts, prob sums, z,
dropped; psum'd over (data, expert) in moe_body) are summed over the M microbatches per layer
before the load-balance and z losses are formed, and the losses of the L/P layers of each stage
summed over stage: the step's statistics, as the single-device reference computes them; the
aux-loss-free bias update uses the whole step's counts [L, E] (out over stage). Never an average
of per-microbatch losses.
The sequence-wise loss (aux_loss_kind "sequence", DeepSeek-V3's) and the z-loss are sums of
per-microbatch terms: under 1f1b each microbatch's term is final when its forward ends. The
batch-wise loss's f needs the step's counts before the first backward: 1f1b then runs a counts
pre-pass (the gpipe forward time loop with no residuals kept, `counts_pre_pass`), exact, and
priced by the cost model (one more forward's permutes and all-to-alls). Each microbatch's aux
term is then E * sum_e f_e * P_e(microbatch), linear in the microbatch, and the step's loss
the sum. The bias update's counts are summed after the step either way.

Collectives per step (x = expert; T_mb = b/M*S tokens per device per microbatch):
  forward : 1. collective-permute over stage of the activation [b/M, S, D], every time step
               (gpipe: M+P-1 of them, the sends of bubble steps carry zeros; 1f1b: at every
               tick of its table, 2(M+P-1) for v = 1, `permutes`; interleaved: v*M+P-1, round
               the ring, stage P-1 sending to stage 0 too, as interleaved 1F1B's)
            2. per stage pass (gpipe, interleaved: every tick; 1f1b: the stage's M*v chunk
               forwards) and local layer, moe_body: all-to-all over x of the counts [EP, e]
               and of the send buffer [EP, C, D] (C = ep.py's bound for b/M sequences), and of
               the expert outputs; all-reduce over (data, x) of the router statistics
  backward: 3. collective-permute over stage of the activation cotangents, M+P-1 steps (1f1b:
               its table's ticks; interleaved: v*M+P-1)
            4. the all-to-all transposes; weight grads once after the loop: the matrices
               reduce-scattered over data (embed, unembed, the dense prefix's: over (stage,
               data)), then the shard all-reduced over x; the experts all-reduced over data;
               norms over (data, x) (a layer's) or (stage, data, x) (final_norm, the prefix's)
  before  : the matrices all-gathered over data (embed, unembed, the dense prefix's: (stage,
            data)), once per step
  once    : the loss sums: CE over (stage, data, x), aux / z / dropped over stage; grad norm.
  1f1b with the batch-wise aux loss: the counts pre-pass, 1. and 2. once more (no recompute).
HLO contract (every collective of the compiled step; size-1 axes drop out; the cost model's
(kind, axes) set equals it, and tests/test_pp.py holds both to the program, both ways):
  all-gather over data: the non-expert matrices, once per step before the time loop
  all-gather over (stage, data): embed, unembed and the dense prefix's matrices, with them
  reduce-scatter over data: their gradients, once after it
  reduce-scatter over (stage, data): embed, unembed and dense-prefix matrix grads
  collective-permute over stage: activations forward, cotangents backward
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over (data, expert): router statistics per microbatch, layer norm-scale grads
  all-reduce over expert: layer matrix, prefix matrix, embed and unembed grad shards after the
    reduce-scatter
  all-reduce over data: expert grads
  all-reduce over stage: aux / z / dropped sums
  all-reduce over (stage, data, expert): final_norm and dense-prefix norm grads, CE sum, grad norm
  (Muon adds its float32 directions all-gathered over data, the prefix's over (stage, data),
  for Newton-Schulz, after the step.)
When to use: the model's layers do not fit on one EP group (pipeline across nodes over slow
links: only [b/M, S, D] activations cross a stage boundary), with M >= P microbatches to keep
the bubble small. Cost: the bubble, and P-1 idle stages during warm-up and drain; gpipe keeps
(M+P-1)/M x the activation memory, 1f1b min(M, P)/M for up to 4/3 the time (pick 1f1b when
gpipe's activations do not fit); interleaved
cuts the bubble to (P-1)/(v*M+P-1) for v x the permutes (pick it when the bubble dominates
and the stage boundary's link is fast); interleaved 1F1B (1f1b with virtual_stages) does both,
holding ((v+1)P-1)/v microbatches' activations.

  python run.py --strategy=pp --mesh=stage:2,expert:4 --microbatches=4 --steps=3
  python run.py --strategy=pp --mesh=stage:4,data:2 --layers=4 --microbatches=8 --steps=3
  python run.py --strategy=pp --mesh=stage:2,expert:4 --microbatches=8 --opt=schedule=1f1b
  python run.py --strategy=pp --mesh=stage:2,expert:4 --layers=4 --batch=16 --microbatches=4 \
      --opt=schedule=interleaved,virtual_stages=2
"""
import dataclasses
import functools

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from layout import dispatch, fsdp, mesh as mesh_lib, options
from measure import cost as cost_lib
from modeling import model, routing
from modeling.config import ConfigError, balanced_layout
from parallel import sharding
from strategies import BadInput, Case, ep

NAME = "pp"
STAGE, DATA, EXPERT = mesh_lib.STAGE, mesh_lib.DATA, mesh_lib.EXPERT
AXES = (STAGE, DATA, EXPERT)
MAIN_AXIS = STAGE
COMPARE_MESH = "data:1,stage:2,expert:4"        # tiny has 2 layers: 2 stages, EP inside; more
                                                # devices scale data
TOKENS = (DATA, EXPERT)                         # the batch axes (replicated over stage)
SPREAD = (STAGE, DATA)                          # embed, unembed and the dense prefix: D over every stage
LAYER_LAYOUT = True       # --layer_layout: stage s holds group s of the padded MoE stack


@dataclasses.dataclass(frozen=True)
class Options:
  schedule: str = options.choice("gpipe", ("gpipe", "1f1b", "interleaved"),
                                 "the pipeline schedule: all forwards then all backwards (gpipe, "
                                 "autodiff of the time loop), Megatron's 1F1B with at most P "
                                 "microbatches in flight (1f1b, explicit vjp per stage), or "
                                 "gpipe's order over "
                                 "virtual_stages chunks per stage placed round-robin "
                                 "(interleaved; 1f1b with virtual_stages > 1 is Megatron's "
                                 "interleaved 1F1B)")
  virtual_stages: int = options.integer(1, "interleaved, 1f1b: layer chunks per stage (v)", lo=1)


ONE_F = Options(schedule="1f1b")
INTERLEAVED = Options(schedule="interleaved", virtual_stages=2)
ONE_F_INTERLEAVED = Options(schedule="1f1b", virtual_stages=2)
TEST_CASES = [Case("tiny", "stage:2,expert:4", dict(batch=16, microbatches=4)),
              Case("tiny", "stage:4,data:2", dict(n_layers=4, batch=16, microbatches=8)),
              # two dense layers before the pipeline: 2 MoE layers, 1 per stage, not n_layers / 2
              Case("deepseek-test", "stage:2,data:2,expert:2",
                   dict(n_layers=4, first_k_dense_replace=2, microbatches=2)),
              # an uneven layout: 5 MoE layers on 4 stages (2, 1, 1, 1), padded to 8 rows, whose
              # zero padding matrices Muon's Newton-Schulz must leave zero
              Case("deepseek-test", "stage:4,expert:2",
                   dict(n_layers=6, layer_layout="2,1,1,1", microbatches=4,
                        capacity_factor=1.0, optimizer="muon")),
              # Muon's Newton-Schulz maps over each stage's own layers (modeling/optim.py)
              Case("tiny", "stage:2,expert:4", dict(optimizer="muon")),
              # 1f1b: the batch-wise aux loss through the counts pre-pass, 4 stages, M = 8 > 2P-1,
              # Muon on the gradients the table returns
              Case("tiny", "stage:4,data:2",
                   dict(n_layers=4, batch=16, microbatches=8, optimizer="muon"), ONE_F),
              # the sequence-wise loss, the dense prefix, drops, remat inside the stage's vjp,
              # an uneven layout (3 MoE layers: 2 + 1)
              Case("deepseek-test", "stage:2,data:2,expert:2",
                   dict(n_layers=5, first_k_dense_replace=2, layer_layout="2,1", batch=16,
                        microbatches=4, capacity_factor=1.0, remat="block"), ONE_F),
              # interleaved, v = 2: 4 MoE layers as 4 chunks, stage 0 holding layers 0 and 2
              Case("tiny", "stage:2,expert:4",
                   dict(n_layers=4, batch=16, microbatches=4, layer_layout="1,1,1,1",
                        layer_stages=2), INTERLEAVED),
              # the dense prefix, an uneven layout (chunks of 2, 1, 1, 1 MoE layers, padded),
              # drops, Muon on the round-robin stack
              Case("deepseek-test", "stage:2,data:2,expert:2",
                   dict(n_layers=6, layer_layout="2,1,1,1", layer_stages=2, batch=16,
                        microbatches=4, capacity_factor=1.0, optimizer="muon"), INTERLEAVED),
              # 4 stages, M = 8
              Case("tiny", "stage:4,data:2",
                   dict(n_layers=8, batch=16, microbatches=8, layer_layout="1,1,1,1,1,1,1,1",
                        layer_stages=4), INTERLEAVED),
              # interleaved 1F1B: the prefix in stage 0's first chunk, chunks of 2, 1, 1, 1
              # padded, drops, the batch-wise loss's counts pre-pass cut per chunk
              Case("deepseek-test", "stage:2,data:2,expert:2",
                   dict(n_layers=6, layer_layout="2,1,1,1", layer_stages=2, batch=16,
                        microbatches=4, capacity_factor=1.0, aux_loss_kind="batch"),
                   ONE_F_INTERLEAVED)]
COST_CASES = TEST_CASES[:3] + TEST_CASES[5:7] + TEST_CASES[8:]
BAD_INPUT = [
    BadInput(dict(n_layers=3), "stage:2,expert:4", Options(),
             "n_layers=3 is not divisible by mesh axis stage=2"),
    BadInput(dict(microbatches=4), "stage:2,expert:4", Options(),
             "batch=8 is not divisible by microbatches=4 x mesh axis dataxexpert=4"),
    BadInput(dict(n_experts=6, top_k=2), "stage:2,expert:4", Options(),
             "n_experts=6 is not divisible by mesh axis expert=4"),
    BadInput(dict(n_layers=4, d_model=36), "stage:4,data:2", Options(),   # embed's D
             "d_model=36 is not divisible by mesh axis stagexdata=8"),
    BadInput(dict(n_layers=3, layer_layout="1,1,1"), "stage:2,expert:4", Options(),
             "layer_layout=1,1,1 has 3 groups, mesh axis stage=2: one group per stage"),
    BadInput(dict(), "stage:2,expert:4", Options(virtual_stages=2),
             "--opt=virtual_stages=2 is the interleaved schedule's; schedule=gpipe runs one "
             "chunk per stage"),
    BadInput(dict(n_layers=4, layer_layout="1,1,1,1", layer_stages=2), "stage:2,expert:4",
             INTERLEAVED, "interleaved runs microbatches in rounds of stage=2: microbatches=1 "
             "is not a multiple of 2")]


def stored_config(cfg, mesh, opts):
  """The model as this schedule stores it: interleaved holds v chunks per stage, group j of a
  P x v group layout on stage j mod P (layer_stages = P; the layout balanced_layout's when
  --layer_layout is not given). Every other schedule: one group per stage, cfg as given, or
  where P does not divide the MoE layers and --layer_layout is not given, balanced_layout's
  (3 on 2 stages: 2,1); with fewer MoE layers than stages cfg as given, for check to refuse."""
  p = mesh.shape[STAGE]
  if not _round_robin(opts):
    n = cfg.n_moe_layers
    if cfg.layer_layout or n % p == 0 or n < p:
      return cfg
    return cfg.replace(layer_layout=balanced_layout(n, p)).validate()
  if cfg.layer_stages or p < 2:                                     # (check refuses p < 2)
    return cfg
  groups = p * opts.virtual_stages
  if not cfg.layer_layout and cfg.n_moe_layers < groups:
    raise ConfigError(f"--opt=virtual_stages={opts.virtual_stages} on stage={p} needs {groups} "
                      f"MoE layers, the model has {cfg.n_moe_layers}")
  layout = cfg.layer_layout or balanced_layout(cfg.n_moe_layers, groups)
  return cfg.replace(layer_layout=layout, layer_stages=p).validate()


def layout_note(cfg, mesh, opts) -> str | None:
  """The run's note when `stored_config` picks an uneven layout the model as given (cfg) does not
  name, e.g. "pp: 3 MoE layers on 2 stages: --layer_layout=2,1 (balanced)"; None otherwise."""
  stored = stored_config(cfg, mesh, opts)
  groups = stored.layer_groups
  if cfg.layer_layout or not stored.layer_layout or len(set(groups)) == 1:
    return None
  p = mesh.shape[STAGE]
  where = f"on {p} stages" if len(groups) == p else f"in {len(groups)} chunks on {p} stages"
  return (f"pp: {cfg.n_moe_layers} MoE layers {where}: --layer_layout={stored.layer_layout} "
          f"(balanced)")


def _round_robin(opts) -> bool:
  """The stack stored as v chunks per stage: interleaved, or 1f1b with virtual_stages > 1."""
  return opts.schedule == "interleaved" or (opts.schedule == "1f1b" and opts.virtual_stages > 1)


def check(cfg, mesh, opts):
  p, v = mesh.shape[STAGE], opts.virtual_stages
  if opts.schedule == "gpipe" and v != 1:
    raise ConfigError(f"--opt=virtual_stages={v} is the interleaved schedule's; "
                      f"schedule={opts.schedule} runs one chunk per stage")
  if _round_robin(opts):
    if p < 2:
      raise ConfigError(f"{opts.schedule} with virtual stages needs mesh axis stage >= 2 (one "
                        f"stage: gpipe's loop)")
    groups = len(cfg.layer_groups) if cfg.layer_layout else 0
    if cfg.layer_stages != p or groups != p * v:
      raise ConfigError(f"interleaved on stage={p} with virtual_stages={v} stores {p * v} layer "
                        f"groups round-robin over the stages (layer_stages={p}); the model has "
                        f"layer_layout={cfg.layer_layout or '(none)'}, layer_stages="
                        f"{cfg.layer_stages} (pp.stored_config makes them)")
    if cfg.microbatches % p:
      raise ConfigError(f"interleaved runs microbatches in rounds of stage={p}: microbatches="
                        f"{cfg.microbatches} is not a multiple of {p}")
  elif cfg.layer_stages:
    raise ConfigError(f"layer_stages={cfg.layer_stages} stores the layers for the interleaved "
                      f"schedule; schedule={opts.schedule} holds one group per stage")
  if cfg.layer_layout and not _round_robin(opts):          # one group of the stack per stage
    groups = len(cfg.layer_groups)
    if groups != mesh.shape[STAGE]:
      raise ConfigError(f"layer_layout={cfg.layer_layout} has {groups} groups, mesh axis "
                        f"stage={mesh.shape[STAGE]}: one group per stage")
  elif not cfg.layer_layout:                 # stored_config gives the uneven ones a layout
    name = "n_layers - first_k_dense_replace" if cfg.first_k_dense_replace else "n_layers"
    if cfg.n_moe_layers < p:
      raise ConfigError(f"{name}={cfg.n_moe_layers} < mesh axis stage={p}: fewer MoE layers "
                        f"than stages, no layer layout gives each stage one")
    mesh_lib.require_divisible(name, cfg.n_moe_layers, mesh, STAGE)
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, EXPERT)
  mesh_lib.require_divisible("batch", cfg.batch, mesh, TOKENS)
  fsdp.check(cfg, mesh, DATA)                 # the stage's matrices on their D dim over data
  if cfg.first_k_dense_replace:                 # the prefix's over (stage, data)
    fsdp.check(cfg, mesh, SPREAD)
  mesh_lib.require_divisible("d_model", cfg.d_model, mesh, SPREAD)   # embed, unembed
  mesh_lib.require_microbatches(cfg, mesh, batch_spec(cfg, mesh))  # B % (M x data x expert)


def param_specs(cfg, mesh, opts=None):
  # role -> spec of one layer: every non-expert matrix on its D dim over data (wq [D@data, H, Dh],
  # ...), embed and unembed over (stage, data), the routed experts' E over expert; norms and
  # the router bias replicated. The MoE layers' stacked L over stage; the dense prefix's
  # matrices on D over (stage, data) (wq [L_dense, D@(stage,data), H, Dh]), its L whole.
  return model.param_specs(cfg, {**fsdp.table(DATA), **fsdp.table(SPREAD, ("embed", "unembed")),
                                 "expert_in": P(EXPERT, None, None),     # [L@stage, E@x, D, F]
                                 "expert_out": P(EXPERT, None, None)}, layer_axis=STAGE,
                           dense_table=fsdp.table(SPREAD))


def batch_spec(cfg, mesh):
  return P(TOKENS, None)                                            # [B, S] @ ((data, x), None)


def chunks(cfg) -> int:
  """v: the layer chunks each stage holds (> 1: the stack stored for the interleaved schedule)."""
  return len(cfg.layer_groups) // cfg.layer_stages if cfg.layer_stages else 1


def bubble(cfg, mesh) -> float:
  p, v = mesh.shape[STAGE], chunks(cfg)
  return (p - 1) / (v * cfg.microbatches + p - 1)


def layout(cfg, mesh, opts):
  if opts.schedule in ("gpipe", "interleaved"):
    return model.Layout(loss=functools.partial(loss, cfg=cfg, mesh=mesh))
  return model.Layout(loss=functools.partial(_scheduled_loss, cfg=cfg, mesh=mesh,
                                             name=opts.schedule))


def loss(params, batch, *, cfg, mesh):
  """The whole model under the GPipe schedule (interleaved when the stack is stored for it:
  `chunks`) -> (loss, metrics as model.loss_fn's)."""
  specs = param_specs(cfg, mesh)
  bspec = batch_spec(cfg, mesh)
  keys = ("tokens", "targets", "positions")
  body = functools.partial(_pipeline, specs=specs, cfg=cfg, n_stage=mesh.shape[STAGE],
                           ep_size=mesh.shape[EXPERT])
  out_specs = (P(), {"loss": P(), "ce_loss": P(), "aux_loss": P(), "z_loss": P(), "dropped": P(),
                     "counts": P(STAGE, None)})
  return jax.shard_map(body, in_specs=(specs,) + (bspec,) * 3, out_specs=out_specs)(
      params, *(batch[k] for k in keys))


def logits(params, batch, *, cfg, mesh):
  """The model's logits [B, S, V] under the pipeline (no loss; for inference and the Hugging
  Face parity tests): the last stage's head, summed over stage (the other stages add zeros)."""
  specs = param_specs(cfg, mesh)
  def body(p, tokens, positions):
    p = _use(p, specs, cfg)
    outs, _ = _stages(p, tokens, positions, cfg=cfg, n_stage=mesh.shape[STAGE],
                      ep_size=mesh.shape[EXPERT])
    out = _head(outs, p, cfg)                                       # [M, b/M, S, V]
    last = jax.lax.axis_index(STAGE) == mesh.shape[STAGE] - 1
    out = jax.lax.psum(jnp.where(last, out, 0.0), STAGE)
    return einops.rearrange(out, "m mb s v -> (m mb) s v")          # [b, S, V]
  bspec = batch_spec(cfg, mesh)
  return jax.shard_map(body, in_specs=(specs, bspec, bspec),
                       out_specs=P(TOKENS, None, None))(params, batch["tokens"], batch["positions"])


def _pipeline(p, tokens, targets, positions, *, specs, cfg, n_stage, ep_size):
  """One device. tokens / targets / positions [b, S] local rows; p: this stage's layers."""
  m, all_axes = cfg.microbatches, (STAGE,) + TOKENS
  p = _use(p, specs, cfg)
  outs, stats = _stages(p, tokens, positions, cfg=cfg, n_stage=n_stage, ep_size=ep_size)
  last = jax.lax.axis_index(STAGE) == n_stage - 1
  tgt = einops.rearrange(targets, "(m mb) s -> m mb s", m=m)        # [M, b/M, S]
  ce = jnp.sum(jax.lax.map(lambda ot: _ce_sum(_head(ot[0][None], p, cfg), ot[1][None]),
                           (outs, tgt)))                        # one microbatch's logits at a time
  n_tokens = cfg.batch * cfg.seq_len
  ce = jax.lax.psum(jnp.where(last, ce, 0.0), all_axes) / n_tokens
  aux, z = routing.aux_losses(stats, n_tokens, cfg)       # [L/P] from the step's stats
  aux, z, dropped = (jax.lax.psum(jnp.sum(v), STAGE) for v in (aux, z, stats["dropped"]))
  total = ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
  return total, {"loss": total, "ce_loss": ce, "aux_loss": aux, "z_loss": z, "dropped": dropped,
                 "counts": stats["counts"]}


def _prefix(p, tokens, pos, cfg):
  """Every microbatch's stage-0 input: the embedding and the leading dense layers (DeepSeek's),
  tokens / pos [M, b/M, S] -> [M, b/M, S, D], one microbatch at a time (lax.map): the working
  set of one microbatch, not of the device's b rows at once (its residuals are M microbatches'
  either way)."""
  return jax.lax.map(lambda tp: model.dense_prefix(p["embed"][tp[0]], p, tp[1], cfg,
                                                   model.Layout()), (tokens, pos))


def _ce_sum(logits, tgt):
  """float32 logits [M, b/M, S, V], targets [M, b/M, S] -> the cross-entropy summed."""
  return jnp.sum(jax.nn.logsumexp(logits, axis=-1)
                 - jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0])


def _head(outs, p, cfg):
  """[M, b/M, S, D] -> float32 logits [M, b/M, S, V]."""
  h = model.rms_norm(outs, p["final_norm"], cfg.norm_eps)
  return jnp.einsum("mbsd,dv->mbsv", h, p["unembed"]).astype(jnp.float32)


def _use(p, specs, cfg):
  """This device's weights as the stage uses them, once per step, before the time loop: varying
  over every axis (each device sums its own gradient contributions over the ticks, and the
  reduction runs once, after the loop), cast to the compute dtype (router, bias, norms stay
  float32: model.KEEP_F32), and the sharded matrices all-gathered over data (embed and unembed
  over (stage, data)). Their gradient comes back reduce-scattered over those axes
  (`_gather`), then all-reduced over the axes the shard is replicated on (the pcast's
  transpose): scattering first makes that all-reduce 1/data of the weight. Mixed precision:
  the all-gather moves the compute dtype; the gradient is summed in grad_reduce_dtype (the cast
  after the pcast when that is float32)."""
  all_axes = (STAGE,) + TOKENS
  f32_sum = cfg.grad_reduce_dtype == "float32"

  def one(a, spec, role):
    dtype = a.dtype if role in model.KEEP_F32 else jnp.dtype(cfg.dtype)
    a = sharding.to_varying(a if f32_sum else a.astype(dtype), all_axes)
    dim, axes = _split_dim(spec)
    return a.astype(dtype) if dim is None else _gather(a, dim, axes, dtype)
  return jax.tree.map(one, p, specs, model.param_roles(cfg))


def _split_dim(spec) -> tuple:
  """(the dim a stored spec splits over data or (stage, data), its axes of size > 1), or
  (None, ()): the weight is used as stored (experts, norms; or nothing to gather)."""
  for dim, entry in enumerate(spec):
    axes = tuple(a for a in sharding.entry_axes(entry)
                 if a in SPREAD and DATA in sharding.entry_axes(entry)
                 and jax.lax.axis_size(a) > 1)
    if axes:
      return dim, axes
  return None, ()


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather(a, dim, axes, dtype):
  """[.., D/n, ..] -> [.., D, ..] in `dtype`, n = |axes|; backward: the cotangent in a's dtype
  (the sum's), reduce-scattered over `axes` (XLA:CPU emits a reduce-scatter only from an
  explicit psum_scatter)."""
  return jax.lax.all_gather(a.astype(dtype), axes, axis=dim, tiled=True)


def _gather_fwd(a, dim, axes, dtype):
  return _gather(a, dim, axes, dtype), jnp.zeros((), a.dtype)


def _gather_bwd(dim, axes, dtype, like, ct):
  return (jax.lax.psum_scatter(ct.astype(like.dtype), axes, scatter_dimension=dim, tiled=True),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def _stages(p, tokens, positions, *, cfg, n_stage, ep_size, unroll=False):
  """The GPipe time loop on one device, p as `_use` returns it -> (the last stage's outputs
  [M, b/M, S, D] (zeros on the other stages), this stage's router stats summed over the
  microbatches {name: [rows, ..]}). With v = chunks(cfg) > 1 (interleaved) a tick runs one of
  the stage's v chunks, and the sends go round the ring: stage P-1's output feeds stage 0's next
  chunk (`schedule`)."""
  m, all_axes, v = cfg.microbatches, (STAGE,) + TOKENS, chunks(cfg)
  b, s = tokens.shape
  mb = b // m
  # microbatch i = this device's rows i*b/M .. (i+1)*b/M - 1 (contiguous; train.microbatches
  # interleaves instead: the step's statistics are summed over all microbatches either way)
  split = lambda a: einops.rearrange(a, "(m mb) s -> m mb s", m=m)   # [M, b/M, S]
  pos = split(positions)
  stage = jax.lax.axis_index(STAGE)
  first, last = stage == 0, stage == n_stage - 1
  # the leading dense layers (DeepSeek) before the pipeline, on every device for its own rows
  # (stages > 0 compute it too and discard it: their gradient of it is zero)
  x0 = _prefix(p, split(tokens), pos, cfg)                          # [M, b/M, S, D]
  lay = model.Layout(moe=functools.partial(ep.moe_body, cfg=cfg, ep_axes=(EXPERT,), ep=ep_size,
                                           token_axes=TOKENS, transport=ep.a2a_exchange))

  mask = _stage_mask(cfg, n_stage)
  rows = cfg.n_layer_slots // n_stage                               # this stage's stored rows
  per = rows // v                                                   # a chunk's rows

  def run_chunk(x, pos_m, r):                                       # chunk r of this stage
    if v == 1:
      return model.moe_stack(x, p["layers"], pos_m, cfg, lay, mask)
    return _chunk(p["layers"], x, pos_m, r, per=per, mask=mask, cfg=cfg, lay=lay)

  # ring: with v chunks the last stage's output feeds the first stage's next chunk
  pairs = [(i, (i + 1) % n_stage) for i in range(n_stage)] if v > 1 else \
      [(i, i + 1) for i in range(n_stage - 1)]

  # the schedule's forward ticks: which microbatch (and chunk) this stage runs at tick t
  table = schedule("interleaved" if v > 1 else "gpipe", n_stage, m, v)
  ticks = len(table["F"]) // 2                                     # its forward half
  f_tab = jnp.asarray(table["F"][:ticks])
  c_tab = jnp.asarray(table["C"][:ticks] if v > 1 else np.zeros_like(table["F"][:ticks]))

  def step(carry, t):
    recv, outs, stats = carry
    valid = f_tab[t, stage] >= 0
    mc, r = jnp.maximum(f_tab[t, stage], 0), jnp.maximum(c_tab[t, stage], 0)
    x = jnp.where(first & (r == 0), x0[mc], recv)                   # [b/M, S, D]
    y, st = run_chunk(x, pos[mc], r)                                # st: {name: [rows/v, ...]}
    add = (lambda a, u: a + jnp.where(valid, u, 0)) if v == 1 else (   # into chunk r's rows
        lambda a, u: jax.lax.dynamic_update_slice_in_dim(
            a, jax.lax.dynamic_slice_in_dim(a, r * per, per) + jnp.where(valid, u, 0), r * per, 0))
    stats = jax.tree.map(add, stats, st)
    done = valid & last & (r == v - 1)                              # the last stage keeps them
    outs = outs.at[mc].set(jnp.where(done, y, outs[mc]))
    with jax.named_scope("stage_permute"):
      recv = jax.lax.ppermute(y, STAGE, pairs)
    return (recv, outs, stats), None

  zeros = lambda shape: sharding.to_varying(jnp.zeros(shape, cfg.dtype), all_axes)
  stat0 = jax.tree.map(
      lambda a: sharding.to_varying(jnp.zeros((rows,) + a.shape[1:], a.dtype), (STAGE,)),
      jax.eval_shape(run_chunk, zeros((mb, s, cfg.d_model)), pos[0], 0)[1])
  carry = (zeros((mb, s, cfg.d_model)), zeros((m, mb, s, cfg.d_model)), stat0)
  (_, outs, stats), _ = jax.lax.scan(step, carry, jnp.arange(ticks), unroll=unroll)
  return outs, stats


def _chunk(layers, x, pos_m, r, *, per, mask, cfg, lay):
  """Chunk r (rows r*per .. of this stage's stack `layers`) on x [b/M, S, D] -> (y, stats), with
  a vjp that keeps the chunk's activations but not its weights: the weight slices that its
  residuals hold are dropped and re-cut from the stack (loop-invariant, kept once) in the
  backward. Plain autodiff of a dynamic slice inside the time loop would save the chunk's
  weights at every tick ((v*M+P-1)/v x the stage's weights)."""
  cut = lambda a, r: jax.lax.dynamic_slice_in_dim(a, r * per, per)
  meta = {}                                   # the vjp's structure, from the forward's trace

  def run(lp, x, pos_m, mk):
    return model.moe_stack(x, lp, pos_m, cfg, lay, mk)

  @jax.custom_vjp
  def f(layers, x, pos_m, r, mk):
    return run(jax.tree.map(lambda a: cut(a, r), layers), x, pos_m, mk)

  def f_fwd(layers, x, pos_m, r, mk):
    lp = jax.tree.map(lambda a: cut(a, r), layers)
    out, vj = jax.vjp(lambda lp, x: run(lp, x, pos_m, mk), lp, x)
    kept, meta["tree"], meta["weight"] = _drop_weights(vj, lp)
    return out, (layers, r, kept)

  def f_bwd(res, ct):
    layers, r, kept = res
    lp = jax.tree.map(lambda a: cut(a, r), layers)              # the slices, cut again
    d_lp, dx = _with_weights(kept, meta["tree"], meta["weight"], lp)(ct)
    put = lambda a, d: jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(a), d.astype(a.dtype),
                                                           r * per, 0)
    return jax.tree.map(put, layers, d_lp), dx, None, None, None

  f.defvjp(f_fwd, f_bwd)
  return f(layers, x, pos_m, r, None if mask is None else cut(mask, r))


# ----------------------------------------------------------------------------- schedule tables
def schedule(name: str, n_stage: int, m: int, v: int = 1) -> dict:
  """The schedule as data: {"F": [ticks, P], "B": [ticks, P]} numpy int arrays, the microbatch
  whose forward / backward stage s runs at tick t (-1: none). A tick is one forward phase (then
  the activations' collective-permute to s+1) and one backward phase (then the cotangents' to
  s-1). gpipe: the M+P-1 forward ticks of the time loop, then its autodiff, the same loop
  reversed. 1f1b (Megatron's): stage s runs F(i) at tick s+i for i < P-s (its warm-up), F(i) at
  2i+s after, B(i) at 2P-1-s+2i: one phase per stage and tick, 2(M+P-1) ticks; with v > 1,
  Megatron's interleaved 1F1B; both with their chunk, ring and inbox slots (`_one_f_one_b`).
  interleaved (v chunks per stage; "C": [ticks, P], the chunk each entry runs): gpipe's order
  over v*M+P-1 ticks of one chunk each; stage s runs round g, chunk r, microbatch g*P + i at
  tick t = s + g*v*P + r*P + i, so chunk r of stage P-1 feeds chunk r+1 of stage 0 the next
  tick (M a multiple of P)."""
  p, ticks = n_stage, v * m + n_stage - 1
  t = np.arange(ticks)[:, None]
  s = np.arange(p)[None, :]
  none = np.full((ticks, p), -1)
  if name == "gpipe" or name == "interleaved":
    k = t - s
    ok = (k >= 0) & (k < v * m)
    fwd = np.where(ok, k // (v * p) * p + k % p, -1)
    chunk = np.where(ok, k % (v * p) // p, -1)
    out = {"F": np.concatenate([fwd, none]), "B": np.concatenate([none, fwd[::-1]])}
    return out if name == "gpipe" else {**out, "C": np.concatenate([chunk, chunk[::-1]])}
  if name == "1f1b":
    return _one_f_one_b(p, m, v)
  raise ValueError(f"unknown schedule {name!r}")


def _one_f_one_b(p: int, m: int, v: int) -> dict:
  """Megatron's 1F1B (v = 1) or interleaved 1F1B (v chunks per stage), in lockstep: each stage
  walks its task list (its warm-up forwards, then one forward and one backward in turn, then
  the remaining backwards; Megatron's order and warm-up counts) and runs its next task at the
  first tick whose input arrived before it. Chunk order, v > 1: microbatches in rounds of P,
  chunk by chunk within a round (backwards with the chunks reversed). -> the F / B table with
  "CF" / "CB" (the chunk an entry runs), "RF" / "RB" (the ring slot its residuals go to / come
  from), "XF" / "XB" (the inbox slot its input is read from; -1: stage 0's first chunk reads the
  tokens, the last stage's last chunk its head's d(loss)/dy), "AF" / "AB" (the inbox slot the
  neighbour's send of that tick is kept in; -1: nothing this stage reads)."""
  if v > 1:
    rounds = [(g * p + i, r) for g in range(m // p) for r in range(v) for i in range(p)]
    back = [(g * p + i, r) for g in range(m // p) for r in reversed(range(v)) for i in range(p)]
  else:
    rounds = back = [(i, 0) for i in range(m)]
  tasks = []
  for s in range(p):
    warm = min((p - s - 1) * 2 + (v - 1) * p if v > 1 else p - s - 1, m * v)
    seq = [("F",) + x for x in rounds[:warm]]
    for j in range(m * v - warm):
      seq += [("F",) + rounds[warm + j], ("B",) + back[j]]
    tasks.append(seq + [("B",) + x for x in back[m * v - warm:]])

  def needs(k, i, r, s):                       # the task whose output this one reads
    if k == "F":
      return ("F", i, r, s - 1) if s > 0 else ("F", i, r - 1, p - 1) if r > 0 else None
    return (("B", i, r, s + 1) if s < p - 1 else ("B", i, r + 1, 0) if r < v - 1
            else ("F", i, r, s))

  done, at, rows = {}, [0] * p, []
  while any(at[s] < len(tasks[s]) for s in range(p)):
    assert len(rows) < 4 * (m * v + p) * v, ("the lockstep walk stalled", p, m, v)
    t = len(rows)
    ready = lambda task, s: needs(*task, s) is None or done.get(needs(*task, s), t) < t
    row = [tasks[s][at[s]] if at[s] < len(tasks[s]) and ready(tasks[s][at[s]], s) else None
           for s in range(p)]
    for s, task in enumerate(row):
      if task:
        done[task + (s,)], at[s] = t, at[s] + 1
    rows.append(row)
  n = len(rows)
  out = {k: np.full((n, p), -1) for k in ("F", "B", "CF", "CB", "RF", "RB", "XF", "XB", "AF",
                                          "AB")}
  for t, row in enumerate(rows):
    for s, task in enumerate(row):
      if task:
        out[task[0]][t, s], out["C" + task[0]][t, s] = task[1], task[2]
  lowest = lambda used: min(set(range(len(used) + 1)) - set(used.values()))
  for s in range(p):
    ring = {}                                  # (microbatch, chunk) -> slot, forward to backward
    for t in range(n):
      if out["F"][t, s] >= 0:
        out["RF"][t, s] = ring[out["F"][t, s], out["CF"][t, s]] = lowest(ring)
      if out["B"][t, s] >= 0:
        out["RB"][t, s] = ring.pop((out["B"][t, s], out["CB"][t, s]))
    for k, step in (("F", -1), ("B", 1)):      # inboxes: a read frees, an arrival takes a slot
      box, src = {}, (s + step) % p
      for t in range(n):
        i, r = out[k][t, s], out["C" + k][t, s]
        dep = needs(k, i, r, s) if i >= 0 else None
        if dep is not None and dep[3] != s:    # read what the neighbour sent
          out["X" + k][t, s] = box.pop((i, r))
        i, r = out[k][t, src], out["C" + k][t, src]
        for reader in ((i, r), (i, r - step)) if i >= 0 and src != s else ():
          if 0 <= reader[1] < v and needs(k, *reader, s) == (k, i, r, src):
            out["A" + k][t, s] = box[reader] = lowest(box)
      assert not box, ("an arrival nobody reads", s, k, box)
  return out


def in_flight(table: dict) -> int:
  """The most microbatches any stage holds residuals for: forward run, backward not yet (the
  residual ring's length). Counted after a tick's forward phase, before its backward phase.
  A 1f1b table: its ring slots (of one chunk's residuals each, v > 1)."""
  if "RF" in table:
    return int(table["RF"].max()) + 1
  worst = 0
  for s in range(table["F"].shape[1]):
    live = set()
    for f, b in zip(table["F"][:, s], table["B"][:, s]):
      live |= {f} - {-1}
      worst = max(worst, len(live))
      live -= {b}
  return worst


def check_schedule(table: dict, m: int) -> None:
  """gpipe: every stage runs every microbatch's forward and backward once; a forward at stage
  s > 0 the tick after stage s-1's, a backward at s < P-1 the tick after s+1's; the last
  stage's backward follows its forward. 1f1b (slot tables): `_check_slots`.
  Interleaved (a "C" table): every (microbatch, chunk) once per stage, forward and backward;
  chunk r at stage s > 0 the tick after chunk r at s-1, chunk r > 0 at stage 0 the tick after
  chunk r-1 at stage P-1; the backward is the forward reversed, tick for tick."""
  fwd, bwd = table["F"], table["B"]
  p = fwd.shape[1]
  if "RF" in table:
    return _check_slots(table, m)
  if "C" in table:
    c = table["C"]
    half = len(fwd) // 2
    np.testing.assert_array_equal(bwd[half:], fwd[:half][::-1])
    v = int(c.max()) + 1
    at = {}
    for t in range(half):
      for s in range(p):
        if fwd[t, s] >= 0:
          assert (fwd[t, s], c[t, s], s) not in at, ("twice", t, s)
          at[fwd[t, s], c[t, s], s] = t
    assert len(at) == m * v * p, ("missing", len(at))
    for (i, r, s), t in at.items():
      if s > 0:
        assert at[i, r, s - 1] == t - 1, ("forward hop", i, r, s)
      elif r > 0:
        assert at[i, r - 1, p - 1] == t - 1, ("ring hop", i, r)
    return
  when = lambda a, s, i: int(np.flatnonzero(a[:, s] == i)[0])
  for s in range(p):
    for a in (fwd, bwd):
      assert sorted(a[:, s][a[:, s] >= 0].tolist()) == list(range(m)), (s, a[:, s])
  for s in range(p):
    for i in range(m):
      if s > 0:
        assert when(fwd, s, i) == when(fwd, s - 1, i) + 1, ("forward hop", s, i)
      if s < p - 1:
        assert when(bwd, s, i) == when(bwd, s + 1, i) + 1, ("backward hop", s, i)
      else:
        assert when(bwd, s, i) >= when(fwd, s, i), ("backward before forward", i)


def _check_slots(table: dict, m: int) -> None:
  """A 1f1b table run with its slots: every stage runs every (microbatch, chunk)'s forward and
  backward once, at most one phase a tick; replayed tick by tick, each read finds in its inbox
  slot what the neighbour sent for it at an earlier tick (kept, not overwritten), each
  backward finds its forward's residuals in its ring slot, the last stage's last chunk runs
  its backward after its forward, and nothing is left over."""
  p, n, v = table["F"].shape[1], len(table["F"]), int(table["CF"].max()) + 1
  get = lambda k, t, s: (int(table[k][t, s]), int(table["C" + k][t, s]))
  want = sorted((i, r) for i in range(m) for r in range(v))
  for s in range(p):
    for k in ("F", "B"):
      assert sorted(get(k, t, s) for t in range(n) if table[k][t, s] >= 0) == want, (k, s)
    assert not ((table["F"][:, s] >= 0) & (table["B"][:, s] >= 0)).any(), ("two phases", s)
  ring = [{} for _ in range(p)]
  box = {(k, s): {} for k in ("F", "B") for s in range(p)}
  ran = set()
  for t in range(n):
    for s in range(p):
      for k in ("F", "B"):
        i, r = get(k, t, s)
        if i < 0:
          continue
        first_in = k == "F" and s == 0 and r == 0
        from_head = k == "B" and s == p - 1 and r == v - 1
        if first_in or from_head:
          assert table["X" + k][t, s] < 0, ("reads an inbox", k, t, s)
          assert not from_head or ("F", i, r, s) in ran, ("backward before forward", i, t)
        else:
          got = box[k, s].pop(int(table["X" + k][t, s]), None)
          assert got == (i, r), ("read the wrong send", k, t, s, got, (i, r))
        if k == "F":
          assert int(table["RF"][t, s]) not in ring[s], ("ring slot reused while live", t, s)
          ring[s][int(table["RF"][t, s])] = (i, r)
        else:
          assert ring[s].pop(int(table["RB"][t, s]), None) == (i, r), ("ring slot lost", t, s)
        ran.add((k, i, r, s))
    for s in range(p):                         # the tick's sends arrive
      for k, src, hop in (("F", (s - 1) % p, s == 0), ("B", (s + 1) % p, s == p - 1)):
        slot, (i, r) = int(table["A" + k][t, s]), get(k, t, src)
        if slot >= 0:
          assert i >= 0 and slot not in box[k, s], ("an arrival overwrites", k, t, s)
          box[k, s][slot] = (i, r + (1 if k == "F" else -1) * hop)
  assert not any(ring) and not any(box.values()), "residuals or sends left over"


def diagram(table: dict) -> str:
  """The table as the docstring draws it: a row per stage, a column per tick, F<m> / B<m> /
  both / '.' (idle)."""
  fwd, bwd = table["F"], table["B"]
  none = np.full(fwd.shape, -1)                             # chunk r as a letter, v > 1
  cf, cb = (table.get(k, table.get("C", none)) for k in ("CF", "CB"))
  cf, cb = (c if c.max() > 0 else none for c in (cf, cb))
  tag = lambda r: "abcdefghijklmnopqrstuvwxyz"[r] if r >= 0 else ""
  cell = lambda f, b, rf, rb: ((f"F{f}{tag(rf)}" if f >= 0 else "")
                               + (f"B{b}{tag(rb)}" if b >= 0 else "") or ".")
  cells = [[cell(*e) for e in zip(fwd[t], bwd[t], cf[t], cb[t])] for t in range(len(fwd))]
  width = max(len(c) for row in cells for c in row)
  head = "  tick     " + " ".join(str(t).ljust(width) for t in range(len(fwd)))
  rows = [f"  stage {s}  " + " ".join(cells[t][s].ljust(width) for t in range(len(fwd)))
          for s in range(fwd.shape[1])]
  return "\n".join(line.rstrip() for line in [head, *rows])


# ----------------------------------------------------------------------------- scheduled (1f1b)
def _scheduled_loss(params, batch, *, cfg, mesh, name):
  """The model under a schedule table whose backward runs inside the time loop: a custom_vjp
  whose forward rule runs the whole table (forwards, and each backward as the explicit
  jax.vjp of a stage) and returns the gradients as its residual; the backward rule scales them
  by the loss's cotangent. The primal alone (no gradient asked) is the GPipe forward."""
  specs, bspec = param_specs(cfg, mesh), batch_spec(cfg, mesh)
  keys = ("tokens", "targets", "positions")
  table = schedule(name, mesh.shape[STAGE], cfg.microbatches, chunks(cfg))
  body = functools.partial(_run_table, specs=specs, cfg=cfg, n_stage=mesh.shape[STAGE],
                           ep_size=mesh.shape[EXPERT], table=table,
                           pre_pass=counts_pre_pass(cfg, Options(schedule=name)))
  out_specs = ((P(), {"loss": P(), "ce_loss": P(), "aux_loss": P(), "z_loss": P(),
                      "dropped": P(), "counts": P(STAGE, None)}), specs)
  run = jax.shard_map(body, in_specs=(specs,) + (bspec,) * 3, out_specs=out_specs)

  @jax.custom_vjp
  def f(p, *b):
    return loss(p, dict(zip(keys, b)), cfg=cfg, mesh=mesh)

  def f_fwd(p, *b):                           # -> ((loss, metrics), the gradients)
    return run(p, *b)

  def f_bwd(grads, cot):
    g = cot[0]
    return (jax.tree.map(lambda a: (a * g).astype(a.dtype), grads),) + (None,) * len(keys)

  f.defvjp(f_fwd, f_bwd)
  return f(params, *(batch[k] for k in keys))


def _run_table(p, tokens, targets, positions, *, specs, cfg, n_stage, ep_size, table,
               pre_pass):
  """One device: ((loss, metrics), grads) of its shards, running a 1f1b `table` (see `schedule`;
  one chunk of the stage's v per phase).

  State across ticks: inboxes of the activations received from s-1 and the cotangents from
  s+1 (each kept in the slot the table gives it until its reader runs: check_schedule), a ring
  of R = in_flight(table) chunk runs' vjp residuals (the chunk's weights, which every residual
  set shares, are not copied into it), the last stage's d(loss)/d(output) per ring slot, and
  float32 gradient sums. Weight gradients are reduced once, after the loop: reduce-scattered over data where the
  weight is stored split over it, then psum'd over the axes the weight (its shard) is
  replicated on."""
  m, all_axes = cfg.microbatches, (STAGE,) + TOKENS
  n_tokens = cfg.batch * cfg.seq_len
  stage = jax.lax.axis_index(STAGE)
  first, last = stage == 0, stage == n_stage - 1
  split = lambda a: einops.rearrange(a, "(m mb) s -> m mb s", m=m)   # [M, b/M, S]
  pos, tgt = split(positions), split(targets)
  f32_sum = cfg.grad_reduce_dtype == "float32"
  home = jax.tree.map(sharding.varying_axes, p)                 # the axes each weight varies over
  pc = _use(p, specs, cfg)            # gathered over data; its gradients are summed explicitly
  layers = pc["layers"]
  lay = model.Layout(moe=functools.partial(ep.moe_body, cfg=cfg, ep_axes=(EXPERT,), ep=ep_size,
                                           token_axes=TOKENS, transport=ep.a2a_exchange))
  v = chunks(cfg)                             # chunks per stage (interleaved 1F1B: v > 1)

  # the batch-wise load-balance loss's f needs the step's counts before the first backward: a
  # forward pass over every microbatch first (exact; the sequence-wise loss needs none)
  # v = 1 unrolled: a second while loop beside the table's, reloaded from the persistent
  # compilation cache, crashes XLA:CPU (stage:4,data:2); v > 1 a loop: unrolled, XLA keeps a
  # share of every chunk tick live at once (48 MiB more temp per microbatch on a d 512 Mixtral
  # shape, where the loop's is flat: README, "Interleaved 1F1B")
  counts = None
  if pre_pass:
    counts = jax.lax.stop_gradient(
        _stages(pc, tokens, positions, cfg=cfg, n_stage=n_stage, ep_size=ep_size,
                unroll=v == 1)[1]["counts"])

  mask = _stage_mask(cfg, n_stage)
  per = cfg.n_layer_slots // n_stage // v     # a chunk's rows of the stage's stack
  # chunk r's rows of a stage-stacked array (the layers, their mask, counts, stats); v = 1: all
  cut = lambda a, r: a if v == 1 else jax.lax.dynamic_slice_in_dim(a, r * per, per)
  into = lambda a, r, u: (a + u.astype(a.dtype) if v == 1 else    # add u into chunk r's rows
                          jax.lax.dynamic_update_slice_in_dim(
                              a, cut(a, r) + u.astype(a.dtype), r * per, 0))

  def stage_fn(lp, pe, x, tok_m, pos_m, r):   # [b/M, S, D] -> ([b/M, S, D], aux + z terms)
    # stage 0's first chunk reads its microbatch's tokens through the embedding and the dense
    # prefix, every other chunk what the stage before sent (a conditional: only stage 0 runs
    # the prefix)
    x = jax.lax.cond(first & (r == 0),
                     lambda pe, x: model.dense_prefix(pe["embed"][tok_m], pe, pos_m, cfg,
                                                      model.Layout()),
                     lambda pe, x: x, pe, x)
    mk = None if mask is None else cut(mask, r)
    y, st = model.moe_stack(x, lp, pos_m, cfg, lay, mk)            # st: {name: [rows/v, ...]}
    cnt = None if counts is None else cut(counts, r)
    aux, z = routing.aux_losses(st if cnt is None else {**st, "counts": cnt}, n_tokens, cfg)
    part = cfg.aux_loss_coef * jnp.sum(aux) + cfg.z_loss_coef * jnp.sum(z)
    return (y, part), (st, aux, z)

  def head(ph, y, t):                         # the last stage: [b/M, S, D] -> its CE sum / T
    return _ce_sum(_head(y[None], ph, cfg), t[None]) / n_tokens

  # embedding and the dense prefix (stage 0's, inside its phases), final norm and head (the
  # last stage's)
  pe = {k: pc[k] for k in ("embed", "dense_layers") if k in pc}
  ph = {k: pc[k] for k in ("final_norm", "unembed")}
  tok = split(tokens)                                               # [M, b/M, S]
  tab = {k: jnp.asarray(a) for k, a in table.items()}
  at = lambda k, t: tab[k][t, stage]                                # this stage's entry

  # the residuals' structure, from one traced (and unused: compiled away) vjp of a stage on
  # inputs typed as the loop's: which leaves are the chunk's weights (shared by every
  # microbatch, never copied) and which go into the ring
  vary = lambda a, like: sharding.to_varying(a, sharding.varying_axes(like))
  act0 = sharding.to_varying(jnp.zeros(tok.shape[1:] + (cfg.d_model,), cfg.dtype), all_axes)

  def run_forward(x, mc, r):
    lp = jax.tree.map(lambda a: cut(a, r), layers)
    out, vj, aux = jax.vjp(lambda lp, pe, x: stage_fn(lp, pe, x, tok[mc], pos[mc], r),
                           lp, pe, x, has_aux=True)
    return (out,) + _drop_weights(vj, (lp, pe)) + (aux,)

  (y0, part0), ring0, tree, weight, aux0 = run_forward(
      act0, jnp.clip(at("F", 0), 0, m - 1), jnp.maximum(at("CF", 0), 0))

  def zeros_like(a, lead=(), also=(), dtype=None):   # zeros typed as `a` (varying also over
    return sharding.to_varying(jnp.zeros(lead + a.shape, dtype or a.dtype),   # `also`)
                               sharding.varying_axes(a) | set(also))

  def run_backward(ring, dy, r):
    lp = jax.tree.map(lambda a: cut(a, r), layers)                  # the chunk, cut again
    vj = _with_weights(ring, tree, weight, (lp, pe))
    one = vary(jnp.ones((), jnp.float32), part0)
    return vj((vary(dy.astype(y0.dtype), y0), one))               # d chunk, d prefix, dx

  # with v chunks the sends go round the ring: stage P-1's output feeds stage 0's next chunk
  ring_pairs = v > 1
  fwd_pairs = [(i, (i + 1) % n_stage) for i in range(n_stage - 1 + ring_pairs)]
  bwd_pairs = [((i + 1) % n_stage, i) for i in range(n_stage - 1 + ring_pairs)]
  ticks = len(table["F"])
  upd = lambda buf, i, u: jax.lax.dynamic_update_index_in_dim(buf, u, i, 0)
  get = lambda buf, i: jax.lax.dynamic_index_in_dim(buf, jnp.maximum(i, 0), keepdims=False)
  add = lambda acc, u: jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, u)

  def forward(c, x, mc, r, slot):             # chunk r of the stage on microbatch mc
    (y, part), res, tree_f, weight_f, (st, aux, z) = run_forward(x, mc, r)
    assert weight_f == weight and tree_f.num_leaves == tree.num_leaves, \
        "a stage's residuals changed structure between traces"
    c["ring"] = [upd(buf, slot, u) for buf, u in zip(c["ring"], res)]

    # the last stage's last chunk ends the forward: the head's loss, its gradients, d(loss)/dy
    def head_step(dys, g):
      ce, (d_ph, dy) = jax.value_and_grad(head, argnums=(0, 1))(ph, y, tgt[mc])
      return upd(dys, slot, dy.astype(dys.dtype)), add(g, d_ph), ce
    c["dy"], c["g_head"], ce = jax.lax.cond(last & (r == v - 1), head_step,
                                            lambda dys, g: (dys, g, ce0), c["dy"], c["g_head"])
    c["stats"] = {"ce": c["stats"]["ce"] + ce,
                  **{k: into(c["stats"][k], r, u) for k, u in
                     (("aux", aux), ("z", z), ("dropped", st["dropped"]),
                      ("counts", st["counts"]))}}
    return c, y

  def backward(c, dy, r, slot):               # chunk r's vjp from its ring slot
    ring = [get(buf, slot) for buf in c["ring"]]
    d_lp, d_pe, dx = run_backward(ring, dy, r)
    c["g_layers"] = jax.tree.map(lambda g, d: into(g, r, d), c["g_layers"], d_lp)
    c["g_pre"] = add(c["g_pre"], d_pe)
    return c, dx

  # a phase runs only where the table has an entry for this stage (a conditional: a tick costs
  # the longer of the stages' phases, not both). hlo.py counts a collective inside a
  # conditional at every run of it, unless the scope says how often its branch is taken
  # (measure/hlo.py TAKEN): each stage takes its forward (backward) branch M*v times in `ticks`.
  taken = jax.named_scope(f"pp_phase.taken_{m * v}_of_{ticks}")

  def tick(c, t):
    i, r = at("F", t), jnp.maximum(at("CF", t), 0)
    keys = ("ring", "dy", "g_head", "stats")
    with taken:
      sub, y = jax.lax.cond(i >= 0, forward, lambda c, *_: (c, act), {k: c[k] for k in keys},
                            get(c["recv"], at("XF", t)), jnp.clip(i, 0, m - 1), r,
                            jnp.maximum(at("RF", t), 0))
    c.update(sub)
    i, r, slot = at("B", t), jnp.maximum(at("CB", t), 0), jnp.maximum(at("RB", t), 0)
    dy = jnp.where(at("XB", t) < 0, get(c["dy"], slot), get(c["recv_ct"], at("XB", t)))
    keys = ("ring", "g_layers", "g_pre")
    with taken:
      sub, dx = jax.lax.cond(i >= 0, backward, lambda c, *_: (c, act), {k: c[k] for k in keys},
                             dy, r, slot)
    c.update(sub)
    # the sends; each arrival is kept in the inbox slot the table gives it until its reader runs
    for k, buf, u, pairs in (("AF", "recv", y, fwd_pairs), ("AB", "recv_ct", dx, bwd_pairs)):
      with jax.named_scope("stage_permute"):
        got = jax.lax.ppermute(u, STAGE, pairs)
      c[buf] = jnp.where(at(k, t) >= 0, upd(c[buf], jnp.maximum(at(k, t), 0), got), c[buf])
    return c, None

  act, ce0 = zeros_like(y0), vary(jnp.zeros((), jnp.float32), y0)
  rows = cfg.n_layer_slots // n_stage
  stat = lambda a: zeros_like(a[0], (rows,), also=(STAGE,))       # [rows, ..] of [rows/v, ..]
  carry = {
      "recv": zeros_like(y0, (int(table["AF"].max()) + 1,)),
      "recv_ct": zeros_like(y0, (int(table["AB"].max()) + 1,)),
      "ring": [zeros_like(a, (in_flight(table),), also=(STAGE,)) for a in ring0],
      "dy": zeros_like(y0, (in_flight(table),)),
      "g_layers": jax.tree.map(lambda a: zeros_like(a, dtype=jnp.float32), layers),
      "g_head": jax.tree.map(lambda a: zeros_like(a, dtype=jnp.float32), ph),
      "g_pre": jax.tree.map(lambda a: zeros_like(a, dtype=jnp.float32), pe),
      "stats": {"ce": ce0,
                **{k: stat(a) for k, a in zip(("aux", "z"), aux0[1:])},
                **{k: stat(aux0[0][k]) for k in ("dropped", "counts")}}}
  carry, _ = jax.lax.scan(tick, carry, jnp.arange(ticks))

  grads = {**carry["g_pre"], **carry["g_head"], "layers": carry["g_layers"]}
  def reduce(g, a, axes, spec):               # scattered where split, summed where replicated
    g = g if f32_sum else g.astype(cfg.dtype)
    dim, split = _split_dim(spec)
    g = g if dim is None else jax.lax.psum_scatter(g, split, scatter_dimension=dim, tiled=True)
    over = tuple(ax for ax in all_axes if ax not in axes)
    return (jax.lax.psum(g, over) if over else g).astype(a.dtype)
  grads = jax.tree.map(reduce, grads, p, home, specs)

  st = carry["stats"]
  ce = jax.lax.psum(st["ce"], all_axes)
  aux, z, dropped = (jax.lax.psum(jnp.sum(st[k]), STAGE) for k in ("aux", "z", "dropped"))
  total = ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
  return (total, {"loss": total, "ce_loss": ce, "aux_loss": aux, "z_loss": z,
                  "dropped": dropped, "counts": st["counts"]}), grads


def _stage_mask(cfg, n_stage):
  """[slots per stage] bool, this device's rows of the padded MoE stack that hold a layer
  (--layer_layout), or None when the stack has no padding."""
  mask = model.slot_mask(cfg)
  if mask is None:
    return None
  return jnp.asarray(mask.reshape(n_stage, -1))[jax.lax.axis_index(STAGE)]


def _drop_weights(vj, layers) -> tuple:
  """A vjp (jax.vjp's function, a pytree of residuals) -> (its residual leaves that are not the
  weights `layers`, its treedef, {residual leaf index: weight leaf index} for those that ARE):
  the weights are kept once by the caller, never copied per microbatch or per tick."""
  leaves, tree = jax.tree.flatten(vj)
  w = jax.tree.leaves(layers)
  index = {i: j for i, leaf in enumerate(leaves) for j, v in enumerate(w) if leaf is v}
  return [l for i, l in enumerate(leaves) if i not in index], tree, index


def _with_weights(kept, tree, index, layers):
  """_drop_weights' inverse: the vjp from its kept residuals and the weights `layers`."""
  w, it = jax.tree.leaves(layers), iter(kept)
  return jax.tree.unflatten(tree, [w[index[i]] if i in index else next(it)
                                   for i in range(tree.num_leaves)])


def permutes(name: str, table: dict) -> tuple[int, int]:
  """(forward, backward) collective-permutes over stage per step, each of one microbatch's
  [b/M, S, D]: gpipe's (interleaved's) autodiff sends at every one of its forward ticks, and
  at every tick of its reverse; `_run_table` sends both ways at every tick of the table."""
  ticks = len(table["F"])
  return (ticks // 2,) * 2 if name in ("gpipe", "interleaved") else (ticks,) * 2


def activation_shardings(cfg, mesh, opts):
  b = cfg.batch // mesh_lib.axis_size(mesh, *TOKENS)
  return [("microbatch between stages", f"[{b // cfg.microbatches}, {cfg.seq_len}, "
           f"{cfg.d_model}] per device, {cfg.microbatches} microbatches"),
          ("bubble fraction", f"{bubble(cfg, mesh):.2f}")]


def counts_pre_pass(cfg, opts) -> bool:
  """A schedule whose backwards run inside the loop (1f1b) with the batch-wise load-balance loss
  runs a forward pass over every microbatch first, for the step's counts (the loss's f);
  gpipe's and interleaved's autodiff see the whole step's forward."""
  return (opts.schedule not in ("gpipe", "interleaved") and cfg.aux_loss_kind == "batch"
          and bool(cfg.aux_loss_coef))


def stage_passes(cfg, n_stage: int, opts) -> tuple[int, int]:
  """(the stage passes a device runs per step, those of the counts pre-pass): gpipe and
  interleaved run one at every tick, v*M + P - 1 (a bubble tick's on zeros), 1f1b its M*v
  table entries (the other ticks skip the phase); the pre-pass, where `counts_pre_pass`, one
  at every tick of the GPipe forward loop. A pass runs one of the stage's v chunks."""
  v = chunks(cfg)
  ticks = v * cfg.microbatches + n_stage - 1
  steps = cfg.microbatches * v if opts.schedule == "1f1b" else ticks
  return steps, ticks * counts_pre_pass(cfg, opts)


def cost(cfg, mesh, opts):
  """Per-device collective bytes per step (measure/cost.py; the docstring's schedule)."""
  p, ep_size, v = mesh.shape[STAGE], mesh.shape[EXPERT], chunks(cfg)
  # the stage passes a device runs per step (`stage_passes`), and the MoE rows a pass runs
  ticks, local_layers = v * cfg.microbatches + p - 1, cfg.n_layer_slots // p // v
  steps, pre_steps = stage_passes(cfg, p, opts)
  sends = permutes(opts.schedule, schedule(opts.schedule, p, cfg.microbatches, v))
  mb = cfg.batch // mesh_lib.axis_size(mesh, *TOKENS) // cfg.microbatches
  act = mb * cfg.seq_len * cfg.d_model * cost_lib.act_bytes(cfg)  # one [b/M, S, D]
  c = dispatch.send_rows(cfg, mb, cfg.seq_len, ep_size)
  buf = ep_size * c * cfg.d_model * cost_lib.act_bytes(cfg)       # [EP, C, D]
  runs = steps * local_layers                                       # moe_body calls per pass
  term = functools.partial(cost_lib.term, mesh)
  # each run's statistics and dropped count; dropless, the count is the constant 0, and under
  # autodiff's time loop (gpipe, interleaved) XLA hoists its all-reduce out: one per step
  hoist = cfg.capacity_factor == 0 and opts.schedule != "1f1b"
  stats = (cost_lib.stats_values(cfg) + (not hoist)) * cost_lib.F32
  # the non-expert matrices gathered whole once per step (outside any remat'd layer): a stacked
  # leaf keeps its L dim as stored (the MoE stack's over stage: gathered over data; the dense
  # prefix's whole: over (stage, data)), embed and unembed over (stage, data)
  kept_l = lambda spec: (P(*spec[:1]), AXES)
  gathered = {**{role: kept_l for role in model.D_DIM if role not in ("expert_in", "expert_out")},
              "embed": (P(), AXES), "unembed": (P(), AXES)}
  out = (cost_lib.weight_terms(cfg, mesh, param_specs(cfg, mesh), AXES, gathered, once=True)
         + cost_lib.muon_terms(cfg, mesh, param_specs(cfg, mesh), SPREAD)
         + term("collective-permute", "fwd", "activations to the next stage", sends[0] * act,
                STAGE)
         + term("collective-permute", "bwd", "cotangents to the previous stage", sends[1] * act,
                STAGE)
         + term("all-to-all", "fwd", "dispatch + combine buffers, counts [EP, e]",
                runs * (2 * buf + cfg.n_experts * 4), EXPERT, cost_lib.RECOMPUTED)
         + term("all-to-all", "bwd", "their transposes", runs * 2 * buf, EXPERT)
         + term("all-reduce", "fwd", "router stats per microbatch", runs * stats, TOKENS)
         + term("all-reduce", "fwd", cost_lib.HOISTED, hoist * cost_lib.F32, TOKENS)
         + term("all-reduce", "fwd", "aux / z / dropped sums", 3 * cost_lib.F32, STAGE)
         + term("all-reduce", "fwd", "CE sum", cost_lib.F32, AXES))
  if cfg.bias_update_rate and opts.schedule != "gpipe" and not counts_pre_pass(cfg, opts):
    # the bias update reads the step's counts: summed over the token axes once (the pre-pass
    # sums them where it runs; under gpipe XLA reuses each pass's sums), measured
    out += term("all-reduce", "fwd", "the step's counts [L/P, E] for the bias update",
                cfg.n_layer_slots // p * cfg.n_experts * cost_lib.F32, TOKENS)
  if counts_pre_pass(cfg, opts):               # the GPipe forward time loop, once more
    out += (term("collective-permute", "fwd", "counts pre-pass: activations (v = 1, unrolled: "
                 "its last tick's send, read by no stage, compiled away)",
                 (ticks - (v == 1)) * act, STAGE)
            + term("all-to-all", "fwd", "counts pre-pass: buffers and counts",
                   pre_steps * local_layers * (2 * buf + cfg.n_experts * 4), EXPERT)
            + term("all-reduce", "fwd", "counts pre-pass: the step's counts [L/P, E]",
                   cfg.n_layer_slots // p * cfg.n_experts * cost_lib.F32, TOKENS))
    if v > 1:                                  # run in chunks, each tick's counts stay
      out += term("all-reduce", "fwd", "counts pre-pass: each tick's counts [E] per row "
                  "(measured: with one chunk per stage XLA folds them away)",
                  ticks * local_layers * cfg.n_experts * cost_lib.F32, TOKENS)
  return out
