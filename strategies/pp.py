"""pp — pipeline parallelism over `stage`, expert, context and tensor parallelism inside each
stage (Megatron's TP x PP x EP x CP layouts: experts over `expert`, the sequence over `context`,
heads and widths over `tensor`).

Mesh axes: (stage, data, expert, context, tensor), stage outermost. P = |stage| stages of L/P
contiguous MoE layers (L = n_layers - first_k_dense_replace); M = --microbatches per step;
EP = |expert|,
c = |context| (Megatron's CP), t = |tensor| (Megatron's TP, with ETP = TP: each expert's F split
over tensor, as ep_x_tp's).
--layer_layout=c_0,..,c_{P-1} puts c_s MoE layers on stage s, the stack stored padded to
P x max(c) rows (modeling/config.py layer_slots; a padding row is inert), so "L/P" below reads
"max(c)"; without it, a P that does not divide L gets balanced_layout(L, P) (`stored_config`).
The interleaved schedules store P x v groups round-robin (stage s holds groups s, s+P, ..).
Layers of different attention kinds (attention_pattern: gpt-oss, Llama 4) run on any layout:
where a chunk starts inside a period (gpt-oss-120b's 9 layers a stage on 4 stages), each row's
kind is data and its block a lax.switch over the kinds (slot_kinds, model.switched_rows; not
with the ring, check), and under 1f1b on every layout (its explicit vjp then keeps a stack
scanned as stored, the weights once). Dense layers inside the stack (mlp_only_layers:
Maverick) are stage rows as the MoE layers are, their stack's L over stage, where the model is
one repeated period with no prefix and each chunk holds whole periods of its dense/MoE pattern
(`_check_dense_inside`: Maverick's dense, MoE pairs, 3 a stage on 8 stages; under the
interleaved schedules whole periods a chunk, both stacks stored round-robin, config.dense_slots),
the attention kinds data where a stage starts inside their period (model.switched_periods).

| tensor                                   | sharding                                          |
|------------------------------------------|---------------------------------------------------|
| MoE layer params [L, ...]                | L over stage: stage s holds layers s*L/P..(s+1)*L/P-1 (uneven: its group's padded rows) |
| experts wi_0/wi_1 [L, E, D, F], wo       | (stage, expert, None, tensor): [L@stage, E@x, D, F@t] |
| attn, router, shared experts [L, ..]     | (stage, D over data): wq [L@stage, D@data, H@t, Dh] |
|                                          | heads and SwiGLU widths over tensor (layout/tensor.py) |
| norms, router bias [L, ..]               | (stage, ...), replicated over (data, expert)      |
| dense prefix matrices [L_dense, ..]      | D over (stage, data): wq [L_dense, D@(stage,data), H@t, Dh] |
| embed [V, D], unembed [D, V]             | D over (stage, data): [V, D@(stage,data)]         |
| final_norm, the prefix's norms           | replicated                                        |
| optimizer state                          | like its parameter                                |
| tokens / targets / positions [B, S]      | ((data, expert), context), cp's load-balanced order; replicated over stage, tensor |
| a microbatch between stages [b/M, S/c, D] | per device: its b = B/(data*expert) rows, 1/M; each tensor rank the same |
| K, V (MLA: latent) [b/M, T, ..], kv_pos  | whole along T: all-gathered over context per layer (kv_pos once per step) |

The whole model is one full-manual shard_map. Stage 0 feeds microbatch t at time t; stage s runs
its L/P layers (model.block, scanned) on what stage s-1 sent at t-1 and ppermutes its output to
s+1; the last stage computes the head, one microbatch's logits at a time. Inside a stage the MoE
is ep.py's moe_body with its padded all-to-all over expert. With t > 1 every tensor rank of a
stage holds the same residual and routes the same tokens; attention runs H/t heads, the SwiGLUs
and the experts their F/t slice, and each block's row-parallel output is all-reduced over
tensor (`_stage_layout`); tensor rank 0 alone counts the CE and the aux and z losses, the other
ranks' gradients arriving through those all-reduces. With c > 1 each device holds S/c
positions of every sequence in cp's load-balanced order (layout/context.py: context rank i holds
chunks i and 2c-1-i), and every attention all-gathers K and V (MLA: its latent and RoPE key)
over context, as cp's allgather exchange, written by hand (model.Parallelism.kv_axes), or with
--opt=kv_exchange=ring passes them around the context ring (ring_attend(manual=True); gpipe and
interleaved: a 1f1b phase is a conditional one stage takes, and a collective-permute is one op
over every device); the router statistics are summed over context, so every context rank forms
the same aux loss. The leading dense layers (DeepSeek's) run before the pipeline on every
device, under 1f1b in stage 0's phases. The non-expert matrices
are stored split on D over data (embedding, head, dense prefix: (stage, data)), all-gathered
once per step before the time loop (`_use`), their gradients reduce-scattered once after it.

Schedules (--opt=schedule=..; each one's table, drawn, in layout/schedule.py): gpipe, autodiff
of the forward time loop; 1f1b, Megatron's 1F1B run from its table with an explicit jax.vjp per
phase (`_run_table`), residuals for min(M, P) microbatches; interleaved, v = virtual_stages
chunks per stage in gpipe's order (1f1b with v > 1: Megatron's interleaved 1F1B). The router
statistics are summed over the M microbatches before the aux and z losses are formed (the
step's, as the reference's; never a mean of microbatch losses); under 1f1b the batch-wise loss
first runs a counts pre-pass (gpipe's forward loop, no residuals kept: `counts_pre_pass`).

Collectives per step (x = expert):
  forward : 1. collective-permute over stage of the activation [b/M, S/c, D] at every tick
               (`permutes`: gpipe M+P-1, a bubble tick's send carrying zeros; 1f1b 2(M+P-1);
               interleaved v*M+P-1, round the ring: stage P-1 sends to stage 0 too)
            2. per stage pass (`stage_passes`) and local layer, moe_body: all-to-all over x of
               the counts [EP, e], the send buffer [EP, C, D] (C = ep.py's bound for b/M
               sequences) and the expert outputs; all-reduce over (data, x) of router statistics
            2t. t > 1, per pass and layer: all-reduce over tensor of attention's output and of
               the MLP block's (MoE + shared, or a dense FFN's), [b/M, S/c, D] each (the
               prefix's per microbatch; sequence_parallel: an all-gather and a reduce-scatter
               each, below)
            2c. c > 1, per pass and layer (and the prefix's): all-gather over context of K and V
               [b/M, S, KV, Dh] (MLA: latent + RoPE key [b/M, S, Rkv + rope]); with the
               capacity rule the layer's expert ids [b/M, S, K] (and the pass's positions);
               with the sequence-wise loss each sequence's counts and probs [b/M, E] summed
  backward: 3. collective-permute over stage of the activation cotangents, as many;
               c > 1: reduce-scatter over context of each layer's dK, dV (d latent)
            4. the all-to-all transposes; t > 1: all-reduce over tensor of the cotangent of each
               block's output (2t's transpose: every rank's residual holds a copy of the sum);
               weight grads once after the loop: the matrices
               reduce-scattered over data (embed, unembed, the prefix's: over (stage, data)),
               then the shard all-reduced over x (and tensor where replicated over it); the
               experts all-reduced over data; norms over (data, x, t) (a layer's) or (stage,
               data, x, t) (final_norm, the prefix's)
  before  : the matrices all-gathered over data (embed, unembed, the prefix's: (stage, data))
  once    : kv_pos [b, S] all-gathered over context (c > 1), before the time loop;
            the loss sums: CE over (stage, data, x, c, t), aux / z / dropped over (stage, t); grad
            norm; t > 1: the step's counts [rows, E] over tensor (tensor rank 0's);
            1f1b with the batch-wise aux loss: the counts pre-pass, 1. and 2. once more.
HLO contract (every collective of the compiled step; size-1 axes drop out; the cost model's
(kind, axes) set equals it, and tests/test_strategies.py holds both to the program, both ways):
  all-gather over data: the non-expert matrices, once per step before the time loop
  all-gather over (stage, data): embed, unembed and the dense prefix's matrices, with them
  reduce-scatter over data: their gradients, once after it
  reduce-scatter over (stage, data): embed, unembed and dense-prefix matrix grads
  collective-permute over stage: activations forward, cotangents backward
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over (data, expert, context): router statistics per microbatch
  all-reduce over (data, expert, context, tensor): layer norm-scale and router grads; t > 1,
    1f1b: the step's counts (with the counts pre-pass, or for the bias update)
  all-reduce over (expert, context): tensor-split layer and prefix matrix grad shards after the
    reduce-scatter
  all-reduce over (expert, context, tensor): replicated matrices' (embed, unembed, MLA
    down-projections) grad shards after the reduce-scatter
  all-reduce over (data, context): expert grads
  all-reduce over (stage, tensor): aux / z / dropped sums
  all-reduce over tensor: t > 1, the row-parallel outputs and their cotangents; the step's counts
  all-reduce over (stage, data, expert, context, tensor): final_norm and dense-prefix norm
    grads, CE sum, grad norm
  all-gather over context: K and V (MLA: latent + RoPE key) per layer (kv_exchange=allgather),
    kv_pos once; the capacity rule's expert ids per layer and positions per pass
  reduce-scatter over context [allgather]: dK, dV (MLA: d(latent)) per layer
  collective-permute over context [ring]: kv_exchange=ring, the K/V (MLA: latent) blocks, c - 1
    sends per layer forward, backward again with their float32 d(K/V) sums and one more home
  all-reduce over context: the sequence-wise loss's per-sequence partials and their cotangents
  all-gather over tensor [muon]: the tensor-split matrices' float32 directions, whole for
    Newton-Schulz, once per step
  (Muon adds its float32 directions all-gathered over data, the prefix's over (stage, data), and
  the tensor-split ones over tensor, for Newton-Schulz, after the step.)

--opt=sequence_parallel=true (Megatron's SP, experts=split): the residual between the blocks and
the stages is [b/M, S/(c t), D], tensor rank r holding slice r of the device's S/c positions
(the embedding, the head and the CE its own; each rank counts its CE). Each block all-gathers
its normed input over tensor (attention's h, MLA's latents after the token-local
down-projections; the MLP block's h, which the MoE routes whole on every rank) and
reduce-scatters its partial output (`_stage_layout`): an all-reduce's bytes, split in two, and
the stage sends 1/t of the activation.
HLO contract, sequence_parallel:
  all-gather over data: the non-expert matrices, once per step before the time loop
  all-gather over (stage, data): embed, unembed and the dense prefix's matrices, with them
  reduce-scatter over data: their gradients, once after it
  reduce-scatter over (stage, data): embed, unembed and dense-prefix matrix grads
  collective-permute over stage: activations [b/M, S/(c t), D] forward, cotangents backward
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over (data, expert, context): router statistics per microbatch
  all-reduce over (data, expert, context, tensor): layer norm-scale and router grads; 1f1b: the
    step's counts with the counts pre-pass
  all-reduce over (expert, context): tensor-split layer and prefix matrix grad shards after the
    reduce-scatter
  all-reduce over (expert, context, tensor): replicated matrices' grad shards after the
    reduce-scatter
  all-reduce over (data, context): expert grads
  all-reduce over (stage, tensor): aux / z / dropped sums
  all-gather over tensor: each block's normed input (MLA: its latents) per layer, forward; the
    reduce-scatters' cotangents, backward
  reduce-scatter over tensor: attention's and the MLP block's outputs per layer, forward; the
    gathered inputs' cotangents, backward
  all-reduce over tensor [counts]: the step's counts [rows, E] for the bias update, tensor rank 0's
  all-reduce over (stage, data, expert, context, tensor): final_norm and dense-prefix norm
    grads, CE sum, grad norm
  all-gather over context: K and V (MLA: latent + RoPE key) per layer (kv_exchange=allgather),
    kv_pos once; the capacity rule's expert ids per layer and positions per pass
  reduce-scatter over context [allgather]: dK, dV (MLA: d(latent)) per layer
  collective-permute over context [ring]: kv_exchange=ring, the K/V (MLA: latent) blocks and
    their float32 d(K/V) sums
  all-reduce over context: the sequence-wise loss's per-sequence partials and their cotangents

--opt=experts=fold (Megatron's parallel folding: ETP 1, EP = |expert| x |tensor|): the experts
are stored whole, [L@stage, E@(expert,tensor), D, F], e = E/(EP t) per device. Tensor rank r
routes its own S/(c t) positions of the microbatch ([b/M, S/(c t), D]) through the all-to-all
over (expert, tensor) and writes the outputs into its slice of a zero [b/M, S/c, D]; the MLP
block's all-reduce over tensor assembles the slices with the shared expert's partial sums, so a
layer keeps its two all-reduces. The router statistics are summed over tensor where they are
formed. With c > 1 this is Megatron's long-context folding: attention TP x CP x DP and the
MoE's EP = |expert| x |tensor| over the same devices of a stage.
HLO contract, experts=fold (under the capacity rule; dropless drops the all-gather over
(context, tensor)):
  all-gather over data: the non-expert matrices, once per step before the time loop
  all-gather over (stage, data): embed, unembed and the dense prefix's matrices, with them
  reduce-scatter over data: their gradients, once after it
  reduce-scatter over (stage, data): embed, unembed and dense-prefix matrix grads
  collective-permute over stage: activations forward, cotangents backward
  all-to-all over (expert, tensor): counts, dispatch and combine buffers of each rank's S/(c t)
    positions, fwd and bwd
  all-gather over (context, tensor): the capacity rule's expert ids [b/M, S, K] per run and
    positions [b/M, S] per pass (it orders whole sequences)
  all-reduce over (data, expert, context, tensor): router statistics per microbatch, layer
    norm-scale and router grads; 1f1b: the step's counts
  all-reduce over (expert, context): tensor-split layer and prefix matrix grad shards after the
    reduce-scatter
  all-reduce over (expert, context, tensor): replicated matrices' grad shards after the
    reduce-scatter
  all-reduce over (data, context): expert grads
  all-reduce over stage: aux / z / dropped sums
  all-reduce over tensor: the row-parallel outputs and their cotangents; 1f1b: each phase's aux
    term's cotangent
  all-reduce over (context, tensor): the sequence-wise loss's per-sequence partials and their
    cotangents
  all-reduce over (stage, data, expert, context, tensor): final_norm and dense-prefix norm grads,
    CE sum, grad norm
  all-gather over context: K and V (MLA: latent + RoPE key) per layer (kv_exchange=allgather),
    kv_pos once
  reduce-scatter over context [allgather]: dK, dV (MLA: d(latent)) per layer
  collective-permute over context [ring]: kv_exchange=ring, the K/V (MLA: latent) blocks and
    their float32 d(K/V) sums
  all-gather over tensor [muon]: the tensor-split matrices' float32 directions, once per step
When to use: the model's layers do not fit on one EP group (pipeline across nodes over slow
links: only [b/M, S, D] activations cross a stage boundary), with M >= P microbatches to keep
the bubble small. Cost: the bubble (P-1 stages idle in warm-up and drain); gpipe keeps (M+P-1)/M
x the activations, 1f1b min(M, P)/M for up to 4/3 the time (pick it when gpipe's do not fit);
interleaved cuts the bubble to (P-1)/(v*M+P-1) for v x the permutes (pick it when the bubble
dominates and the stage link is fast); interleaved 1F1B does both, holding ((v+1)P-1)/v
microbatches' activations.

  python run.py --strategy=pp --mesh=stage:2,expert:4 --microbatches=4 --steps=3
  python run.py --strategy=pp --mesh=stage:4,data:2 --layers=4 --microbatches=8 --steps=3
  python run.py --strategy=pp --mesh=stage:2,expert:4 --microbatches=8 --opt=schedule=1f1b
  python run.py --strategy=pp --mesh=stage:2,expert:4 --layers=4 --batch=16 --microbatches=4 \
      --opt=schedule=interleaved,virtual_stages=2
  python run.py --strategy=pp --mesh=stage:2,data:2,tensor:2 --model=mixtral-test --layers=4 \
      --microbatches=2 --opt=schedule=1f1b,experts=fold --steps=3
  python run.py --strategy=pp --mesh=stage:2,context:2,tensor:2 --model=mixtral-test --layers=4 \
      --microbatches=2 --opt=sequence_parallel=true --steps=3
"""
import dataclasses
import functools

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from layout import context, dispatch, fsdp, mesh as mesh_lib, options, tensor
from layout.schedule import (bubble, check_layout, chunks, counts_pre_pass, in_flight, permutes,
                             round_robin, schedule, stage_passes)
from layout.schedule import layout_note, stored_config  # noqa: F401 (hooks: the stored layers)
from measure import cost as cost_lib
from modeling import model, routing
from modeling.config import ConfigError
from parallel import sharding
from strategies import BadInput, Case, ep

NAME = "pp"
STAGE, DATA, EXPERT, CONTEXT, TENSOR = (mesh_lib.STAGE, mesh_lib.DATA, mesh_lib.EXPERT,
                                         mesh_lib.CONTEXT, mesh_lib.TENSOR)
AXES = (STAGE, DATA, EXPERT, CONTEXT, TENSOR)
MAIN_AXIS = STAGE
COMPARE_MESH = "data:1,stage:2,expert:4"        # tiny's 2 layers on 2 stages; more devices: data
BATCH = (DATA, EXPERT)                          # the axes splitting B (replicated over stage)
TOKENS = BATCH + (CONTEXT,)                     # every axis splitting the tokens (S: context)
SPREAD = (STAGE, DATA)                          # embed, unembed and the dense prefix: D over every stage
ALL = (STAGE,) + TOKENS + (TENSOR,)             # every axis (a gradient's sums run over them)
LAYER_LAYOUT = True       # --layer_layout: stage s holds group s of the padded MoE stack
KEYS = ("tokens", "targets", "positions")
METRICS = {"loss": P(), "ce_loss": P(), "aux_loss": P(), "z_loss": P(), "dropped": P(),
           "counts": P(STAGE, None)}                                # out_specs of the metrics


@dataclasses.dataclass(frozen=True)
class Options:
  schedule: str = options.choice("gpipe", ("gpipe", "1f1b", "interleaved"),
                                 "the pipeline schedule: all forwards then all backwards (gpipe, "
                                 "autodiff of the time loop), Megatron's 1F1B with at most P "
                                 "microbatches in flight (1f1b, explicit vjp per stage), or "
                                 "gpipe's order over virtual_stages chunks per stage placed "
                                 "round-robin (interleaved; 1f1b with virtual_stages > 1 is "
                                 "Megatron's interleaved 1F1B)")
  virtual_stages: int = options.integer(1, "interleaved, 1f1b: layer chunks per stage (v)", lo=1)
  experts: str = options.choice("split", ("split", "fold"),
                                "with a tensor axis: each expert's F split over tensor (split: "
                                "Megatron's ETP = TP), or the experts whole, E over (expert, "
                                "tensor), each tensor rank routing its S/t positions through "
                                "the all-to-all over both (fold: Megatron's parallel folding, "
                                "ETP 1, EP = |expert| x |tensor|)")
  sequence_parallel: bool = dataclasses.field(default=False, metadata={
      "doc": "with a tensor axis: Megatron's sequence parallelism inside the stages, the "
             "residual's S over tensor ([b/M, S/(c t), D] between the blocks and the stages), "
             "all-gather and reduce-scatter over tensor around the tensor-parallel blocks in "
             "place of their all-reduces (experts=split)"})
  kv_exchange: str = options.choice(
      "allgather", ("allgather", "ring"),
      "with a context axis: how each device's queries reach every key, as cp's: K/V (MLA: the "
      "latent) all-gathered over context per layer, or passed around its ring of "
      "collective-permutes (modeling/ring_attention.py)")


ONE_F = Options(schedule="1f1b")
INTERLEAVED = Options(schedule="interleaved", virtual_stages=2)
ONE_F_INTERLEAVED = Options(schedule="1f1b", virtual_stages=2)
FOLD, FOLD_1F = Options(experts="fold"), Options(schedule="1f1b", experts="fold")
MAVERICK_PAIRS = dict(n_layers=8, attention_pattern="local,local,local,nope",
                      mlp_only_layers="0,2,4,6", batch=16, microbatches=4)
MAVERICK_CHUNKS = dict(MAVERICK_PAIRS, layer_layout="1,1,1,1", layer_stages=2)
TEST_CASES = [Case("tiny", "stage:2,expert:4", dict(batch=16, microbatches=4)),
              Case("tiny", "stage:4,data:2", dict(n_layers=4, batch=16, microbatches=8)),
              # two dense layers before the pipeline: 2 MoE layers, 1 per stage, not n_layers / 2
              Case("deepseek-test", "stage:2,data:2,expert:2",
                   dict(n_layers=4, first_k_dense_replace=2, microbatches=2)),
              # 5 MoE layers on 4 stages (2, 1, 1, 1), padded to 8 rows: Muon leaves padding zero
              Case("deepseek-test", "stage:4,expert:2",
                   dict(n_layers=6, layer_layout="2,1,1,1", microbatches=4,
                        capacity_factor=1.0, optimizer="muon")),
              # Muon's Newton-Schulz maps over each stage's own layers (modeling/optim.py)
              Case("tiny", "stage:2,expert:4", dict(optimizer="muon")),
              # 1f1b: the batch-wise loss's counts pre-pass, M = 8 > 2P-1, Muon on its gradients
              Case("tiny", "stage:4,data:2",
                   dict(n_layers=4, batch=16, microbatches=8, optimizer="muon"), ONE_F),
              # the sequence-wise loss, the prefix, drops, remat in the stage's vjp, layout 2 + 1.
              # Seed 3: at seed 0 the reference's own routing flips one token at step 1 or 2
              # when its init moves by 3e-6 relative (a near-tie, the noise of another layout);
              # at seed 3 three such perturbations drop the same tokens at every step
              Case("deepseek-test", "stage:2,data:2,expert:2",
                   dict(n_layers=5, first_k_dense_replace=2, layer_layout="2,1", batch=16,
                        microbatches=4, capacity_factor=1.0, remat="block", seed=3), ONE_F),
              # interleaved, v = 2: 4 MoE layers as 4 chunks, stage 0 holding layers 0 and 2
              Case("tiny", "stage:2,expert:4",
                   dict(n_layers=4, batch=16, microbatches=4, layer_layout="1,1,1,1",
                        layer_stages=2), INTERLEAVED),
              # the prefix, chunks of 2, 1, 1, 1 MoE layers (padded), drops, Muon on the stack
              Case("deepseek-test", "stage:2,data:2,expert:2",
                   dict(n_layers=6, layer_layout="2,1,1,1", layer_stages=2, batch=16,
                        microbatches=4, capacity_factor=1.0, optimizer="muon"), INTERLEAVED),
              # 4 stages, M = 8
              Case("tiny", "stage:4,data:2",
                   dict(n_layers=8, batch=16, microbatches=8, layer_layout="1,1,1,1,1,1,1,1",
                        layer_stages=4), INTERLEAVED),
              # interleaved 1F1B: the prefix in stage 0's first chunk, drops, the pre-pass per chunk
              Case("deepseek-test", "stage:2,data:2,expert:2",
                   dict(n_layers=6, layer_layout="2,1,1,1", layer_stages=2, batch=16,
                        microbatches=4, capacity_factor=1.0, aux_loss_kind="batch"),
                   ONE_F_INTERLEAVED),
              # tensor parallelism inside the stages (Megatron's TP x PP x EP): Mixtral-style
              # GQA under 1f1b with the counts pre-pass; DeepSeek's MLA, dense prefix, shared
              # expert and bias update, interleaved, and under 1f1b with Muon
              Case("mixtral-test", "stage:2,data:2,tensor:2",
                   dict(n_layers=4, batch=8, microbatches=2), ONE_F),
              Case("deepseek-test", "stage:2,expert:2,tensor:2",
                   dict(n_layers=5, microbatches=2, layer_layout="1,1,1,1", layer_stages=2),
                   INTERLEAVED),
              Case("deepseek-test", "stage:2,expert:2,tensor:2",
                   dict(n_layers=5, microbatches=2, optimizer="muon"), ONE_F),
              # experts=fold (Megatron's parallel folding): the experts whole over (expert,
              # tensor), each tensor rank routing its S/t positions, under the capacity rule
              # (whole sequences' ids gathered over tensor); 1f1b with the counts pre-pass, and
              # gpipe with MLA, the dense prefix and the sequence-wise loss
              Case("mixtral-test", "stage:2,data:2,tensor:2",
                   dict(n_layers=4, batch=8, microbatches=2, capacity_factor=1.0), FOLD_1F),
              Case("deepseek-test", "stage:2,expert:2,tensor:2",
                   dict(n_layers=5, microbatches=2, capacity_factor=1.0), FOLD),
              # context parallelism inside the stages: S over context in cp's load-balanced
              # order, MLA's latent all-gathered per layer; 1f1b with the capacity rule (the
              # sequence's expert ids gathered) and interleaved; GQA's K/V with TP
              Case("deepseek-test", "stage:2,context:2,expert:2",
                   dict(n_layers=5, microbatches=2, capacity_factor=1.0), ONE_F),
              Case("deepseek-test", "stage:2,context:2,expert:2",
                   dict(n_layers=5, microbatches=2, layer_layout="1,1,1,1", layer_stages=2),
                   INTERLEAVED),
              Case("mixtral-test", "stage:2,context:2,tensor:2",
                   dict(n_layers=4, batch=8, microbatches=2)),
              # fold with context (Megatron's long-context layouts): each tensor rank routes
              # S/(c t) positions; the sequence-wise loss and the capacity rule over both
              Case("deepseek-test", "stage:2,context:2,tensor:2",
                   dict(n_layers=5, microbatches=2, capacity_factor=1.0), FOLD_1F),
              # kv_exchange=ring: cp's ring of K/V (MLA: latent) blocks inside the stages,
              # interleaved with MLA and gpipe with GQA split over tensor
              Case("deepseek-test", "stage:2,context:2,expert:2",
                   dict(n_layers=5, microbatches=2, layer_layout="1,1,1,1", layer_stages=2),
                   Options(schedule="interleaved", virtual_stages=2, kv_exchange="ring")),
              Case("mixtral-test", "stage:2,context:2,tensor:2",
                   dict(n_layers=4, batch=8, microbatches=2), Options(kv_exchange="ring")),
              # sequence parallelism inside the stages (Megatron's SP): the residual's S over
              # tensor, AG / RS around the blocks; MLA's latents, the prefix, the shared expert
              # and the bias update under 1f1b, and GQA with a context axis under gpipe
              Case("deepseek-test", "stage:2,expert:2,tensor:2",
                   dict(n_layers=5, microbatches=2),
                   Options(schedule="1f1b", sequence_parallel=True)),
              Case("mixtral-test", "stage:2,context:2,tensor:2",
                   dict(n_layers=4, batch=8, microbatches=2), Options(sequence_parallel=True)),
              # one stage (the planner enumerates it): 1f1b's table with nothing to receive
              Case("tiny", "stage:1,data:2,expert:4", dict(batch=16, microbatches=2), ONE_F),
              # Maverick's layers (dense and MoE in turn, a NoPE layer every fourth): one
              # (dense, MoE) pair a stage, stages 1 and 3 ending on NoPE (switched_periods);
              # under 1f1b with TP inside the stages, the switch's branches all-reducing
              Case("llama4-maverick-test", "stage:4,data:2", MAVERICK_PAIRS),
              Case("llama4-maverick-test", "stage:4,tensor:2", MAVERICK_PAIRS, ONE_F),
              # ... and both stacks stored round-robin, 4 chunks of one pair (stage 0 runs
              # layers 0, 1, 4, 5, all local; stage 1 layers 2, 3, 6, 7, its MoE layers NoPE):
              # interleaved with data and expert, interleaved 1F1B with TP
              Case("llama4-maverick-test", "stage:2,data:2,expert:2", MAVERICK_CHUNKS,
                   INTERLEAVED),
              Case("llama4-maverick-test", "stage:2,expert:2,tensor:2", MAVERICK_CHUNKS,
                   ONE_F_INTERLEAVED)]
# interleaved, dropless, over (data, expert): the router bias's zero gradient never all-reduced
# (_bias_held), the dropped count's all-reduce hoisted out of the time loop
COST_CASES = TEST_CASES[:3] + TEST_CASES[5:7] + TEST_CASES[8:] + [
    Case("tiny", "stage:2,data:2,expert:2",
         dict(n_layers=4, batch=16, microbatches=4, layer_layout="1,1,1,1", layer_stages=2,
              capacity_factor=0.0), INTERLEAVED)]
BF16_CASE = Case("deepseek-test", "stage:2,data:2,expert:2", opts=ONE_F)    # its explicit vjp
PIPELINE = True     # runs its microbatches in its own pipeline (the planner: no accumulation)
PLAN_GRID = {"schedule": ("gpipe", "1f1b")}            # experts=fold: the planner's --opt
PLAN_EXTRA = tuple(dict(schedule=s, virtual_stages=2) for s in ("interleaved", "1f1b"))
PLAN_INSIDE_NODE = (TENSOR,)      # the planner keeps tensor inside a node, as Megatron's TP
# the planner splits the sequence over context only from this length (Megatron Core's guide: CP
# for long sequences, 8K+ tokens); --plan_find and --mesh name any context size
PLAN_MIN_SEQ = {CONTEXT: 8192}
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
             "is not a multiple of 2"),
    # a dense layer inside the stack that is no period of it: MoE, dense, MoE, MoE
    BadInput(dict(n_layers=4, mlp_only_layers="1", dense_d_ff=64), "stage:2,expert:4", Options(),
             "pp: mlp_only_layers=1 (dense layers inside the stack) go on the stages in whole "
             "periods of the layers; not with 3 runs of layers, not one repeated period"),
    BadInput(dict(MAVERICK_PAIRS, attention_pattern="sliding,sliding,sliding,full",
                  sliding_window=8, dense_d_ff=64), "stage:2,context:2,tensor:2",
             Options(kv_exchange="ring"),
             "pp: attention_pattern=sliding,sliding,sliding,full over mlp_only_layers=0,2,4,6 "
             "runs a stack's layers of different kinds as switched rows: kv_exchange=ring runs "
             "where each stack's layers are of one kind"),
    # 4 (dense, MoE) pairs in 8 chunks: a chunk would hold half a pair
    BadInput(dict(MAVERICK_PAIRS, dense_d_ff=64, local_chunk=8), "stage:2,expert:4",
             Options(schedule="interleaved", virtual_stages=4),
             "pp: mlp_only_layers=0,2,4,6 (dense layers inside the stack) go on the stages in "
             "whole periods of the layers; not with 8 layers on 8 chunks (stage=2 x "
             "virtual_stages=4) split a period of 2 dense and MoE layers"),
    # dense and MoE in turn, 3 pairs on 2 stages: a stage would start inside a pair
    BadInput(dict(n_layers=6, mlp_only_layers="0,2,4", dense_d_ff=64), "stage:2,expert:4",
             Options(), "pp: mlp_only_layers=0,2,4 (dense layers inside the stack) go on the "
             "stages in whole periods of the layers; not with 6 layers on stage=2 split a period "
             "of 2 dense and MoE layers"),
    BadInput(dict(n_heads=8, n_kv_heads=2), "stage:2,tensor:4", Options(),
             "n_kv_heads=2 is not divisible by mesh axis tensor=4"),
    BadInput(dict(), "stage:2,expert:4", FOLD, "pp option experts=fold needs a tensor axis of "
             "size > 1 (without one it is experts=split's program)"),
    BadInput(dict(n_experts=4, top_k=2), "expert:4,tensor:2", FOLD,
             "n_experts=4 is not divisible by mesh axis expertxtensor=8"),
    BadInput(dict(seq_len=36), "stage:2,context:4", Options(),   # the load-balanced order
             "seq_len=36 is not divisible by 2*context=8"),
    BadInput(dict(seq_len=36, n_kv_heads=4), "context:2,tensor:4", FOLD,  # a rank's S/(c t)
             "seq_len=36 is not divisible by mesh axis contextxtensor=8"),
    BadInput(dict(), "stage:2,expert:4", Options(kv_exchange="ring"),
             "pp option kv_exchange=ring needs a context axis of size > 1 (without one nothing "
             "travels)"),
    BadInput(dict(), "stage:2,context:2,expert:2", Options(schedule="1f1b", kv_exchange="ring"),
             "pp option kv_exchange=ring runs under gpipe and interleaved: 1f1b's phases are "
             "conditionals that one stage takes, and the ring's collective-permute is one op over "
             "every device"),
    # gpt-oss's (sliding, full) on stages of 3 layers: stage 1's rows start on a full layer;
    # on 4,3 (the second stage's rows end in a padding row)
    BadInput(dict(n_layers=6, attention_pattern="sliding,full", sliding_window=8),
             "stage:2,context:2,expert:2", Options(kv_exchange="ring"),
             "pp: attention_pattern=sliding,full on chunks of 3 layers that start inside a "
             "period or hold padding: kv_exchange=ring runs where every chunk holds whole "
             "periods"),
    BadInput(dict(n_layers=7, layer_layout="4,3", attention_pattern="sliding,full",
                  sliding_window=8), "stage:2,context:2,expert:2", Options(kv_exchange="ring"),
             "pp: attention_pattern=sliding,full on chunks of 4 layers that start inside a "
             "period or hold padding: kv_exchange=ring runs where every chunk holds whole "
             "periods"),
    BadInput(dict(), "stage:2,expert:4", Options(sequence_parallel=True),
             "pp option sequence_parallel=true needs a tensor axis of size > 1 (without one "
             "nothing is split)"),
    BadInput(dict(), "stage:2,expert:2,tensor:2", Options(experts="fold", sequence_parallel=True),
             "pp option sequence_parallel=true runs with experts=split; with experts=fold each "
             "tensor rank already routes its own S/(c t) positions")]


def contract_variant(opts):
  """Which HLO contract block of the docstring this layout compiles to."""
  return ("experts=fold" if opts.experts == "fold" else
          "sequence_parallel" if opts.sequence_parallel else None)


def contract_tags(opts, cfg=None):
  """The tagged lines of the blocks: the K/V exchange's, [allgather] or [ring]; [counts] where the
  step's counts are all-reduced over tensor alone (the bias update's, without the counts
  pre-pass, which sums them over every token axis)."""
  counts = (cfg is not None and cfg.bias_update_rate and opts.experts == "split"
            and not counts_pre_pass(cfg, opts))
  return (opts.kv_exchange,) + (("counts",) if counts else ())


def check(cfg, mesh, opts):
  if cfg.dense_inside:
    _check_dense_inside(cfg, mesh, opts)
  # layers of different attention kinds switched per row (model.switched_rows: chunks that
  # start inside a period, or padding rows among them; model.switched_periods: a stack of dense
  # layers inside whose layers take more than one kind): the stages run different branches,
  # and the ring's collective-permute is one op over every device (a window shortens it, too)
  ring = opts.kv_exchange == "ring" and mesh_lib.axis_size(mesh, CONTEXT) > 1
  if ring and cfg.dense_inside and model.switches(cfg):
    raise ConfigError(f"pp: attention_pattern={cfg.attention_pattern} over mlp_only_layers="
                      f"{cfg.mlp_only_layers} runs a stack's layers of different kinds as "
                      "switched rows: kv_exchange=ring runs where each stack's layers are of "
                      "one kind")
  if (ring and not cfg.dense_inside
          and _switched_moe(cfg, mesh_lib.axis_size(mesh, STAGE), chunks(cfg))):
    raise ConfigError(f"pp: attention_pattern={cfg.attention_pattern} on chunks of "
                      f"{cfg.n_layer_slots // mesh_lib.axis_size(mesh, STAGE) // chunks(cfg)} "
                      "layers that start inside a period or hold padding: kv_exchange=ring runs "
                      "where every chunk holds whole periods")
  check_layout(cfg, mesh, opts)               # the schedule's options and the layer layout
  fold = opts.experts == "fold"
  if fold and mesh_lib.axis_size(mesh, TENSOR) == 1:
    raise ConfigError("pp option experts=fold needs a tensor axis of size > 1 (without one it "
                      "is experts=split's program)")
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, (EXPERT, TENSOR) if fold else EXPERT)
  mesh_lib.require_head_split(cfg, mesh, TENSOR, expert_ff=not fold)   # heads, widths over t
  if fold:                                      # each tensor rank routes its S/(c t) positions
    mesh_lib.require_divisible("seq_len", cfg.seq_len, mesh, (CONTEXT, TENSOR))
  if mesh_lib.axis_size(mesh, CONTEXT) > 1:     # S over context, in the load-balanced order
    context.check(cfg, mesh, CONTEXT)
    context.check_options(cfg, opts)
  elif opts.kv_exchange == "ring":
    raise ConfigError("pp option kv_exchange=ring needs a context axis of size > 1 (without one "
                      "nothing travels)")
  if opts.sequence_parallel:                    # the residual's S/c over tensor
    if mesh_lib.axis_size(mesh, TENSOR) == 1:
      raise ConfigError("pp option sequence_parallel=true needs a tensor axis of size > 1 "
                        "(without one nothing is split)")
    if fold:
      raise ConfigError("pp option sequence_parallel=true runs with experts=split; with "
                        "experts=fold each tensor rank already routes its own S/(c t) positions")
    mesh_lib.require_divisible("seq_len", cfg.seq_len, mesh, (CONTEXT, TENSOR))
  if opts.kv_exchange == "ring" and opts.schedule == "1f1b":
    raise ConfigError("pp option kv_exchange=ring runs under gpipe and interleaved: 1f1b's "
                      "phases are conditionals that one stage takes, and the ring's "
                      "collective-permute is one op over every device")
  mesh_lib.require_divisible("batch", cfg.batch, mesh, BATCH)
  fsdp.check(cfg, mesh, DATA)                 # the stage's matrices on their D dim over data
  if cfg.first_k_dense_replace:                 # the prefix's over (stage, data)
    fsdp.check(cfg, mesh, SPREAD)
  mesh_lib.require_divisible("d_model", cfg.d_model, mesh, SPREAD)   # embed, unembed
  mesh_lib.require_microbatches(cfg, mesh, batch_spec(cfg, mesh))  # B % (M x data x expert)


def _check_dense_inside(cfg, mesh, opts) -> None:
  """Dense layers inside the stack (mlp_only_layers) go on the stages with the MoE layers: the
  model one repeated period of layers (config.layer_segments) with no dense prefix, each of the
  P x v chunks holding whole periods of its dense/MoE pattern (config.mlp_period: Maverick's
  dense, MoE; the attention kinds data where a chunk starts inside their period, slot_kinds;
  the interleaved schedules store both stacks' chunks round-robin, config.dense_slots); one
  line otherwise."""
  p = mesh_lib.axis_size(mesh, STAGE)
  v = opts.virtual_stages if round_robin(opts) else 1
  runs = cfg.layer_segments
  unit = cfg.mlp_period
  where = f"stage={p}" if v == 1 else f"{p * v} chunks (stage={p} x virtual_stages={v})"
  why = ("a dense prefix before them" if cfg.first_k_dense_replace else
         f"{len(runs)} runs of layers, not one repeated period" if len(runs) > 1 else
         f"{cfg.n_layers} layers on {where} split a period of {unit} dense and MoE layers"
         if cfg.n_layers % (p * v * unit) else None)
  if why:
    raise ConfigError(f"pp: mlp_only_layers={cfg.mlp_only_layers} (dense layers inside the "
                      f"stack) go on the stages in whole periods of the layers; not with {why}")


def param_specs(cfg, mesh, opts=None):
  # role -> spec of one layer: heads and every SwiGLU width over tensor (layout/tensor.py's
  # column / row table: wq [D, H@t, Dh], wo [H@t, Dh, D], experts [E@x, D, F@t]), and every
  # non-expert matrix also on its D dim over data (wq [D@data, H@t, Dh], ...), embed and unembed
  # on D over (stage, data); norms, the router's bias and the embedding's V replicated. The MoE
  # stack's L over stage; the dense prefix's matrices on D over (stage, data) (wq [L_dense,
  # D@(stage,data), H@t, Dh]); dense layers inside the stack: their L over stage, as the MoE
  # stack's (wi_0 [L_dense@stage, D@data, F@t]).
  inside = bool(cfg.dense_inside)
  if opts is not None and opts.experts == "fold":                     # [L@stage, E@(x,t), D, F]
    experts = {"expert_in": P((EXPERT, TENSOR), None, None),
               "expert_out": P((EXPERT, TENSOR), None, None)}
  else:
    experts = {"expert_in": P(EXPERT, None, TENSOR),                    # [L@stage, E@x, D, F@t]
               "expert_out": P(EXPERT, TENSOR, None)}                   # [L@stage, E@x, F@t, D]
  cols = {**tensor.table(TENSOR), **experts}
  d_split = [r for r in model.D_DIM if r not in ("expert_in", "expert_out", "embed", "unembed")]
  table = {**fsdp.over(cols, DATA, d_split), **fsdp.table(SPREAD, ("embed", "unembed"))}
  spread = fsdp.over(fsdp.over(cols, STAGE, d_split), DATA, d_split)   # D over (stage, data)
  return model.param_specs(cfg, table, layer_axis=STAGE, dense_table=None if inside else spread,
                           dense_layer_axis=STAGE if inside else None)


def batch_spec(cfg, mesh):
  return P(BATCH, CONTEXT)                                      # [B, S] @ ((data, x), context)


def prepare_batch(b, cfg, mesh):
  """With a context axis, cp's load-balanced order (layout/context.py): context rank i holds
  chunks i and 2c-1-i of the sequence; the model masks with the true positions."""
  if mesh_lib.axis_size(mesh, CONTEXT) == 1:
    return b
  return context.prepare_batch(b, cfg, mesh, CONTEXT)


def layout(cfg, mesh, opts):
  # the whole model is pp's loss; kv_axes says what its stages do with a context axis
  run = loss if opts.schedule in ("gpipe", "interleaved") else _scheduled_loss
  cp = (CONTEXT,) if mesh_lib.axis_size(mesh, CONTEXT) > 1 else ()
  return model.Parallelism(loss=functools.partial(run, cfg=cfg, mesh=mesh, opts=opts), kv_axes=cp)


def loss(params, batch, *, cfg, mesh, opts):
  """The whole model under the GPipe schedule (interleaved when the stack is stored for it:
  `chunks`) -> (loss, metrics as model.loss_fn's)."""
  specs, bspec = param_specs(cfg, mesh, opts), batch_spec(cfg, mesh)
  body = functools.partial(_pipeline, specs=specs, cfg=cfg, n_stage=mesh_lib.axis_size(mesh, STAGE),
                           ep_size=mesh_lib.axis_size(mesh, EXPERT), opts=opts)
  return jax.shard_map(body, in_specs=(specs,) + (bspec,) * 3, out_specs=(P(), METRICS))(
      params, *(batch[k] for k in KEYS))


def _pipeline(p, tokens, targets, positions, *, specs, cfg, n_stage, ep_size, opts):
  """One device. tokens / targets / positions [b, S] local rows; p: this stage's layers."""
  p = _use(p, specs, cfg)
  sp = opts.sequence_parallel
  outs, stats = _stages(p, tokens, _positions(positions, cfg.microbatches, sp), cfg=cfg,
                        n_stage=n_stage, ep_size=ep_size, opts=opts)
  last = jax.lax.axis_index(STAGE) == n_stage - 1
  tgt = _split(_own(targets, sp), cfg.microbatches)               # [M, b/M, S/c (/t)]
  ce = jnp.sum(jax.lax.map(lambda ot: _ce_sum(ot[0], ot[1], p, cfg),
                           (outs, tgt)))                        # one microbatch's logits at a time
  n_tokens = cfg.batch * cfg.seq_len
  ce = jax.lax.psum(jnp.where(last, ce, 0.0) * _ce_share(sp), ALL) / n_tokens
  aux, z = routing.aux_losses(stats, n_tokens, cfg)       # [L/P] from the step's stats
  aux, z, dropped = (_once(jnp.sum(v), STAGE) for v in (aux, z, stats["dropped"]))
  total, metrics = model.loss_total(ce, aux, z, cfg)
  return total, {**metrics, "dropped": dropped, "counts": _once(stats["counts"])}


def _split(a, m):
  """This device's rows [b, S] as M microbatches [M, b/M, S]: microbatch i = rows i*b/M ..
  (i+1)*b/M - 1 (the step's statistics are summed over the microbatches, whichever rows)."""
  return einops.rearrange(a, "(m mb) s -> m mb s", m=m)


def _own(a, sp, axis=1):
  """With sequence parallelism, tensor rank r's slice r of a's sequence dim (S/c -> S/(c t):
  the residual's positions); else a."""
  if not sp:
    return a
  s = a.shape[axis] // jax.lax.axis_size(TENSOR)
  return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(TENSOR) * s, s, axis=axis)


def _ce_share(sp):
  """Which tensor ranks count the CE: with sequence parallelism each its own positions (1.0),
  else tensor rank 0 alone (every rank holds the same logits)."""
  return 1.0 if sp else _first_tensor_rank()


def _positions(positions, m, sp=False):
  """This device's positions [b, S/c] -> model.Positions of the M microbatches: the queries'
  [M, b/M, S/c], the residual's (sequence parallelism: this tensor rank's S/(c t) of them), the
  keys' [M, b/M, S] (with a context axis, all-gathered over it once per step, before the time
  loop)."""
  q = _split(positions, m)
  k = q if jax.lax.axis_size(CONTEXT) == 1 else _split(
      jax.lax.all_gather(positions, CONTEXT, axis=1, tiled=True), m)       # [M, b/M, S]
  return model.Positions(q, _own(q, sp, axis=2), k)


def _at(pos, i):
  """Microbatch i's Positions [b/M, ..] of `_positions`' [M, b/M, ..]."""
  return jax.tree.map(lambda a: a[i], pos)


def _stage_layout(cfg, ep_size, opts):
  """A stage's layers on one device: the MoE ep.py's moe_body with its padded all-to-all over
  expert; with c = |context| > 1, cp's all-gather exchange by hand (each device's queries are
  its S/c positions of the load-balanced order; K and V, MLA's latent, all-gathered over
  context per layer, their cotangents reduce-scattered; opts.kv_exchange=ring: around the
  context ring instead, modeling/ring_attention.py's manual ring; the router statistics summed
  over context, the capacity rule's expert ids gathered over it: it orders whole sequences);
  with t = |tensor| > 1, Megatron's tensor parallelism by hand. Every tensor rank holds the
  same residual; attention runs its H/t heads, the dense and shared SwiGLUs their F/t slice, so
  each row-parallel output is a partial sum over tensor and scatter_out all-reduces it
  ("tp_psum": attention's; the MoE's, shared expert's and a dense FFN's, one for the block);
  opts.sequence_parallel: the residual holds this rank's S/(c t) positions, gather_in
  all-gathers each block's input over tensor and scatter_out reduce-scatters its output.
  The routed MoE, experts="split": every rank routes the same tokens and runs its F/t slice of
  the local experts (a partial sum, in the block's all-reduce), gpt-oss's expert down bias added
  by rank 0 (tensor.bias_once); "fold": the experts whole over (expert, tensor), rank r routes
  its S/t positions through the all-to-all over both and writes their outputs into its slice of
  a zero [b/M, S, D], which the block's all-reduce assembles. The router statistics are
  counted by tensor rank 0 (split: each rank holds the same; fold: summed over tensor first)."""
  t = jax.lax.axis_size(TENSOR)
  cp = (CONTEXT,) if jax.lax.axis_size(CONTEXT) > 1 else ()
  ring = bool(cp) and opts.kv_exchange == "ring"
  gather = context.sequence_gatherer(CONTEXT) if cp and cfg.capacity_factor > 0 else None
  body = functools.partial(ep.moe_body, cfg=cfg, ep_axes=(EXPERT,), ep=ep_size,
                           token_axes=TOKENS, exchange=ep.a2a_exchange, gather_sequence=gather,
                           seq_axes=cp)
  if t == 1:
    return model.Parallelism(moe=body, kv_axes=cp, kv_ring=ring)

  def scatter_out(y):                                    # [b/M, S, D] {U_t} -> the sum
    with jax.named_scope("tp_psum"):
      return jax.lax.psum(y, TENSOR)

  def gather_in(h):                                      # [b/M, S/(c t), ..] -> [b/M, S/c, ..]
    return jax.lax.all_gather(h, TENSOR, axis=1, tiled=True)

  def scatter_seq(y):                                    # [b/M, S/c, D] {U_t} -> its S/(c t)
    return jax.lax.psum_scatter(y, TENSOR, scatter_dimension=1, tiled=True)

  if opts.experts == "split":
    def moe(p, x, positions):                            # x [b/M, S, D], the same on every t
      return body(tensor.bias_once(p, TENSOR), x, positions)   # y [b/M, S, D] {U_t}, stats
    if opts.sequence_parallel:                           # Megatron's SP: AG / RS over tensor
      return model.Parallelism(moe=moe, gather_in=gather_in, scatter_out=scatter_seq,
                               kv_axes=cp, kv_ring=ring)
    return model.Parallelism(moe=moe, scatter_out=scatter_out, kv_axes=cp, kv_ring=ring)

  seq = cp + (TENSOR,)                                   # the axes splitting a routed sequence
  gather = context.sequence_gatherer(seq) if cfg.capacity_factor > 0 else None

  def moe_folded(p, x, positions):                       # x [b/M, S/c, D], the same on every t
    y, stats = ep.moe_body(p, _own(x, True), _own(positions, True), cfg=cfg,
                           ep_axes=(EXPERT, TENSOR), ep=ep_size * t,
                           token_axes=TOKENS + (TENSOR,), exchange=ep.a2a_exchange,
                           gather_sequence=gather, seq_axes=seq)   # y [b/M, S/(c t), D]
    at = jax.lax.axis_index(TENSOR) * y.shape[1]         # this rank's slice of the S/c
    return jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(x), y.astype(x.dtype), at,
                                               axis=1), stats   # [b/M, S/c, D], its slice
  return model.Parallelism(moe=moe_folded, scatter_out=scatter_out, kv_axes=cp, kv_ring=ring)


def _first_tensor_rank():
  """1.0 on tensor rank 0, else 0.0 (tensor.first_rank): the CE and the aux and z losses are
  counted once per tensor group (each rank holds the same logits and router statistics; the
  gradient reaches the other ranks through the layers' all-reduces)."""
  return tensor.first_rank(TENSOR)


def _stat_axes(experts) -> tuple:
  """The axes a stage's summed router statistics vary over: split, stage and tensor (each
  tensor rank's own copy, counted once by `_once`); fold, stage (summed over tensor where they
  are formed)."""
  return (STAGE, TENSOR) if experts == "split" else (STAGE,)


def _once(v, axes=()):
  """A value every tensor rank holds alike (router statistics, their losses), summed over `axes`
  and counted once: tensor rank 0's, in one all-reduce over `axes` and tensor (with |tensor| = 1
  the same devices as `axes`: none where `axes` is empty); a value typed invariant over tensor
  (experts=fold's statistics, summed over tensor where they are formed) as it is."""
  if TENSOR not in sharding.varying_axes(v):          # already the same sum on every rank
    return jax.lax.psum(v, axes) if axes else v
  return jax.lax.psum(v * tensor.first_rank(TENSOR, v.dtype),
                      (*sharding.entry_axes(axes), TENSOR))


def _ce_sum(y, tgt, ph, cfg):
  """The last stage's head on one microbatch: y [b/M, S, D], tgt [b/M, S] -> its CE sum."""
  logits = model.head(y[None], ph, cfg, model.Parallelism()).astype(jnp.float32)   # [1, b/M, S, V]
  return jnp.sum(model.cross_entropy(logits, tgt[None]))


def _use(p, specs, cfg):
  """This device's weights as the stage uses them, once per step, before the time loop: varying
  over every axis (each device sums its gradient over the ticks; the reduction runs once,
  after the loop), in the compute dtype (model.KEEP_F32 in float32), the matrices split over
  data ((stage, data)) all-gathered by sharding.gather_weight_manual: their gradient is
  reduce-scattered, then all-reduced by the pcast's transpose, in grad_reduce_dtype."""
  f32_sum = cfg.grad_reduce_dtype == "float32"

  def one(a, spec, role):
    dtype = a.dtype if role in model.KEEP_F32 else jnp.dtype(cfg.dtype)
    a = sharding.to_varying(a if f32_sum else a.astype(dtype), ALL)
    dim, axes = _split_dim(spec)
    return a.astype(dtype) if dim is None else sharding.gather_weight_manual(a, dim, axes, dtype)
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


def _stages(p, tokens, pos, *, cfg, n_stage, ep_size, opts, unroll=False):
  """The GPipe time loop on one device, p as `_use` returns it, pos as `_positions` -> (the
  last stage's outputs
  [M, b/M, S, D] (zeros on the other stages), this stage's router stats summed over the
  microbatches {name: [rows, ..]}). With v = chunks(cfg) > 1 (interleaved) a tick runs one of
  the stage's v chunks, and stage P-1's output feeds stage 0's next chunk (`schedule`)."""
  m, v = cfg.microbatches, chunks(cfg)
  tokens = _own(tokens, opts.sequence_parallel)                     # the residual's positions
  b, s = tokens.shape
  mb = b // m
  stage = jax.lax.axis_index(STAGE)
  first, last = stage == 0, stage == n_stage - 1
  # every microbatch's stage-0 input, [M, b/M, S, D]: the embedding and the leading dense layers
  # (DeepSeek's) on every device for its own rows (stages > 0 discard theirs: a zero gradient),
  # one microbatch at a time (lax.map: the working set of b/M rows, not of b)
  lay = _stage_layout(cfg, ep_size, opts)
  x0 = jax.lax.map(lambda tp: model.dense_prefix(p["embed"][tp[0]], p, tp[1], cfg, lay),
                   (_split(tokens, m), pos))
  mask, kinds = _stage_mask(cfg, n_stage), _stage_kinds(cfg, n_stage)
  rows = cfg.n_layer_slots // n_stage                               # this stage's stored rows
  per = rows // v                                                   # a chunk's rows

  stacks = {k: p[k] for k in _stack_names(cfg)}

  def run_chunk(x, pos_m, r):                                       # chunk r of this stage
    if v == 1:
      return model.moe_stack(x, stacks["layers"], pos_m, cfg, lay, mask,
                             stacks.get("dense_layers"), kinds)
    return _chunk(_bias_held(stacks), x, pos_m, r, v=v, mask=mask, kinds=kinds, cfg=cfg,
                  lay=lay)

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
    y, st = run_chunk(x, _at(pos, mc), r)                           # st: {name: [rows/v, ...]}
    add = (lambda a, u: a + jnp.where(valid, u, 0)) if v == 1 else (   # into chunk r's rows
        lambda a, u: jax.lax.dynamic_update_slice_in_dim(
            a, jax.lax.dynamic_slice_in_dim(a, r * per, per) + jnp.where(valid, u, 0), r * per, 0))
    stats = jax.tree.map(add, stats, st)
    done = valid & last & (r == v - 1)                              # the last stage keeps them
    outs = outs.at[mc].set(jnp.where(done, y, outs[mc]))
    with jax.named_scope("stage_permute"):
      recv = jax.lax.ppermute(y, STAGE, pairs)
    return (recv, outs, stats), None

  zeros = lambda shape: sharding.to_varying(jnp.zeros(shape, cfg.dtype), ALL)
  stat0 = jax.tree.map(
      lambda a: sharding.to_varying(jnp.zeros((rows,) + a.shape[1:], a.dtype),
                                    _stat_axes(opts.experts)),
      jax.eval_shape(run_chunk, zeros((mb, s, cfg.d_model)), _at(pos, 0), 0)[1])
  carry = (zeros((mb, s, cfg.d_model)), zeros((m, mb, s, cfg.d_model)), stat0)
  (_, outs, stats), _ = jax.lax.scan(step, carry, jnp.arange(ticks), unroll=unroll)
  return outs, stats


def _stack_names(cfg) -> tuple:
  """The stacks a stage's rows run: the MoE rows, and the dense rows inside the stack."""
  return ("layers", "dense_layers") if cfg.dense_inside else ("layers",)


def _bias_held(stacks):
  """The stacks with the router's bias (no gradient: routing selects with it under
  stop_gradient, and the bias update rule moves it) held out of autodiff: _chunk's vjp returns
  it a zero gradient that autodiff of the time loop would sum and all-reduce over the token
  axes."""
  moe = stacks["layers"].get("moe", {})
  if "bias" not in moe:
    return stacks
  held = {**moe, "bias": jax.lax.stop_gradient(moe["bias"])}
  return {**stacks, "layers": {**stacks["layers"], "moe": held}}


def _cut(a, r, v):
  """Chunk r of v of a stage's stacked rows a [rows, ...] (its MoE or dense stack, its rows'
  mask or kinds): rows r*rows/v .. (r+1)*rows/v - 1."""
  per = a.shape[0] // v
  return jax.lax.dynamic_slice_in_dim(a, r * per, per)


def _chunk(stacks, x, pos_m, r, *, v, mask, kinds, cfg, lay):
  """Chunk r of v of this stage's stacks ({"layers": the MoE rows, "dense_layers": the dense
  rows inside the stack, where the model has them}) on x [b/M, S, D] -> (y, stats), with
  a vjp that keeps the chunk's activations but not its weights: the weight slices that its
  residuals hold are dropped and re-cut from the stacks (loop-invariant, kept once) in the
  backward. Plain autodiff of a dynamic slice inside the time loop would save the chunk's
  weights at every tick ((v*M+P-1)/v x the stage's weights)."""
  cut = lambda t, r: jax.tree.map(lambda a: _cut(a, r, v), t)
  meta = {}                                   # the vjp's structure, from the forward's trace
  run = lambda lp, x, pos_m, mk, kd: model.moe_stack(x, lp["layers"], pos_m, cfg, lay, mk,
                                                     lp.get("dense_layers"), kd)

  @jax.custom_vjp
  def f(stacks, x, pos_m, r, mk, kd):
    return run(cut(stacks, r), x, pos_m, mk, kd)

  def f_fwd(stacks, x, pos_m, r, mk, kd):
    lp = cut(stacks, r)
    out, vj = jax.vjp(lambda lp, x: run(lp, x, pos_m, mk, kd), lp, x)
    kept, meta["tree"], meta["weight"] = _drop_weights(vj, lp)
    return out, (stacks, r, kept)

  def f_bwd(res, ct):
    stacks, r, kept = res
    lp = cut(stacks, r)                                         # the slices, cut again
    d_lp, dx = _with_weights(kept, meta["tree"], meta["weight"], lp)(ct)
    put = lambda a, d: jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros_like(a), d.astype(a.dtype), r * (a.shape[0] // v), 0)
    return jax.tree.map(put, stacks, d_lp), dx, None, None, None, None

  f.defvjp(f_fwd, f_bwd)
  return f(stacks, x, pos_m, r, None if mask is None else _cut(mask, r, v),
           None if kinds is None else _cut(kinds, r, v))


# ----------------------------------------------------------------------------- 1f1b: a table run
def _scheduled_loss(params, batch, *, cfg, mesh, opts):
  """The model under a 1f1b table: a custom_vjp whose forward rule runs the whole table
  (`_run_table`) and keeps the gradients as its residual, which the backward rule scales by the
  loss's cotangent. The primal alone (no gradient asked) is the GPipe forward."""
  specs, bspec = param_specs(cfg, mesh, opts), batch_spec(cfg, mesh)
  table = schedule(opts.schedule, mesh_lib.axis_size(mesh, STAGE), cfg.microbatches, chunks(cfg))
  body = functools.partial(_run_table, specs=specs, cfg=cfg, n_stage=mesh_lib.axis_size(mesh, STAGE),
                           ep_size=mesh_lib.axis_size(mesh, EXPERT), table=table,
                           pre_pass=counts_pre_pass(cfg, opts), opts=opts)
  run = jax.shard_map(body, in_specs=(specs,) + (bspec,) * 3, out_specs=((P(), METRICS), specs))

  @jax.custom_vjp
  def f(p, *b):
    return loss(p, dict(zip(KEYS, b)), cfg=cfg, mesh=mesh, opts=opts)

  def f_fwd(p, *b):                           # -> ((loss, metrics), the gradients)
    return run(p, *b)

  def f_bwd(grads, cot):
    g = cot[0]
    return (jax.tree.map(lambda a: (a * g).astype(a.dtype), grads),) + (None,) * len(KEYS)

  f.defvjp(f_fwd, f_bwd)
  return f(params, *(batch[k] for k in KEYS))


def _run_table(p, tokens, targets, positions, *, specs, cfg, n_stage, ep_size, table,
               pre_pass, opts):
  """One device: ((loss, metrics), grads) of its shards, running a 1f1b `table`: `_Run` sets up
  the stage and its carry, a scan runs `_Run.tick` at every tick, then each weight gradient is
  reduced once (`_reduce_grad`) and the loss terms are summed over the devices."""
  run = _Run(p, tokens, targets, positions, specs=specs, cfg=cfg, n_stage=n_stage,
             ep_size=ep_size, table=table, pre_pass=pre_pass, opts=opts)
  carry, _ = jax.lax.scan(run.tick, run.carry0(), jnp.arange(len(table["F"])))
  grads = {**carry["g_pre"], **carry["g_head"], **carry["g_layers"]}
  grads = jax.tree.map(functools.partial(_reduce_grad, cfg=cfg), grads, p, run.home, specs)
  st = carry["stats"]
  ce = jax.lax.psum(st["ce"], ALL)
  aux, z, dropped = (_once(jnp.sum(st[k]), STAGE) for k in ("aux", "z", "dropped"))
  total, metrics = model.loss_total(ce, aux, z, cfg)
  return (total, {**metrics, "dropped": dropped, "counts": _once(st["counts"])}), grads


def _reduce_grad(g, a, axes, spec, *, cfg):
  """A weight's float32 gradient sum -> its gradient as stored, in grad_reduce_dtype: scattered
  where it is stored split (`_split_dim`), then psum'd over the axes of ALL not in `axes`."""
  g = g if cfg.grad_reduce_dtype == "float32" else g.astype(cfg.dtype)
  dim, split = _split_dim(spec)
  g = g if dim is None else jax.lax.psum_scatter(g, split, scatter_dimension=dim, tiled=True)
  over = tuple(ax for ax in ALL if ax not in axes)
  return (jax.lax.psum(g, over) if over else g).astype(a.dtype)


class _Run:
  """One device's run of a 1f1b table: what every phase reads, set up once in the order the
  program computes it, and the phases: `vjp` (a chunk's forward), `forward` and `backward` (a
  phase on the carry), `tick` (both, then the sends). The carry (`carry0`): inboxes of the
  activations from s-1 and the cotangents from s+1 (each kept in its table slot until its
  reader runs), a ring of in_flight(table) chunk runs' vjp residuals (not the chunk's weights,
  which they share), the last stage's d(loss)/d(output) per ring slot, float32 gradient sums."""

  def __init__(self, p, tokens, targets, positions, *, specs, cfg, n_stage, ep_size, table,
               pre_pass, opts):
    m, v = cfg.microbatches, chunks(cfg)
    self.cfg, self.m, self.v, self.table, self.n_tokens = cfg, m, v, table, cfg.batch * cfg.seq_len
    self.stat_axes = _stat_axes(opts.experts)
    self.stage = jax.lax.axis_index(STAGE)
    self.first, self.last = self.stage == 0, self.stage == n_stage - 1
    sp = opts.sequence_parallel
    self.pos = _positions(positions, m, sp)
    self.tgt = _split(_own(targets, sp), m)                   # [M, b/M, S/c (/t)]
    self.ce_share = _ce_share(sp)
    self.home = jax.tree.map(sharding.varying_axes, p)     # the axes each weight varies over
    pc = _use(p, specs, cfg)          # gathered over data; its gradients are summed explicitly
    # the stage's stacks: the MoE rows, and the dense rows inside the stack
    self.layers = {k: pc[k] for k in _stack_names(cfg)}
    self.lay = _stage_layout(cfg, ep_size, opts)
    # the batch-wise loss's f needs the step's counts before the first backward: v = 1 unrolled
    # (a second while loop crashes XLA:CPU when reloaded from the persistent compilation cache);
    # v > 1 a loop (unrolled, XLA keeps every tick's share live)
    self.counts = None
    if pre_pass:
      self.counts = jax.lax.stop_gradient(
          _stages(pc, tokens, self.pos, cfg=cfg, n_stage=n_stage, ep_size=ep_size,
                  opts=opts, unroll=v == 1)[1]["counts"])
    # every row's kind as data where the period is longer than one (slot_kinds: the stack is
    # scanned as stored, so that the ring of residuals drops its weights)
    self.mask, self.kinds = _stage_mask(cfg, n_stage), _stage_kinds(cfg, n_stage, as_data=True)
    self.rows = cfg.n_layer_slots // n_stage        # the stage's stored MoE rows
    self.pe = {k: pc[k] for k in ("embed", "dense_layers")              # stage 0's phases'
               if k in pc and k not in self.layers}
    self.ph = {k: pc[k] for k in ("final_norm", "unembed")}              # the last stage's
    self.tok = _split(_own(tokens, sp), m)                          # [M, b/M, S/c (/t)]
    self.tab = {k: jnp.asarray(a) for k, a in table.items()}
    # the residuals' structure, from one traced (unused: compiled away) vjp on inputs typed as
    # the loop's: which leaves are the chunk's weights (never copied), which go into the ring
    act0 = sharding.to_varying(jnp.zeros(self.tok.shape[1:] + (cfg.d_model,), cfg.dtype), ALL)
    (self.y0, self.part0), self.ring0, self.tree, self.weight, self.aux0 = self.vjp(
        act0, jnp.clip(self.at("F", 0), 0, m - 1), jnp.maximum(self.at("CF", 0), 0))
    # with v chunks the sends go round the ring: stage P-1's output feeds stage 0's next chunk
    self.fwd_pairs = [(i, (i + 1) % n_stage) for i in range(n_stage - 1 + (v > 1))]
    self.bwd_pairs = [((i + 1) % n_stage, i) for i in range(n_stage - 1 + (v > 1))]
    # a phase is a conditional (a tick costs the longer of the stages' phases, not both);
    # measure/hlo.py counts its collectives at the share the scope names (TAKEN)
    self.taken = jax.named_scope(f"pp_phase.taken_{m * v}_of_{len(table['F'])}")
    self.act, self.ce0 = _zeros_like(self.y0), _vary(jnp.zeros((), jnp.float32), self.y0)

  def at(self, k, t):                         # this stage's entry of table k at tick t
    return self.tab[k][t, self.stage]

  def cut(self, a, r):                        # chunk r's rows of a stage's stack; v = 1: all
    return a if self.v == 1 else _cut(a, r, self.v)

  def into(self, a, r, u):                    # a with u added into chunk r's rows
    return a + u.astype(a.dtype) if self.v == 1 else jax.lax.dynamic_update_slice_in_dim(
        a, self.cut(a, r) + u.astype(a.dtype), r * (a.shape[0] // self.v), 0)

  def stage_fn(self, lp, pe, x, tok_m, pos_m, r):
    """Chunk r of the stage: x [b/M, S, D] -> ((y, its aux + z loss terms), (stats, aux, z)).
    Stage 0's first chunk reads its microbatch's tokens through the embedding and the dense
    prefix (a conditional: only stage 0 runs it), every other chunk what the stage before sent."""
    cfg = self.cfg
    x = jax.lax.cond(self.first & (r == 0),
                     lambda pe, x: model.dense_prefix(pe["embed"][tok_m], pe, pos_m, cfg,
                                                      self.lay),
                     lambda pe, x: x, pe, x)
    mk = None if self.mask is None else self.cut(self.mask, r)
    kd = None if self.kinds is None else self.cut(self.kinds, r)
    y, st = model.moe_stack(x, lp["layers"], pos_m, cfg, self.lay, mk,
                            lp.get("dense_layers"), kd)             # st: {name: [rows/v, ...]}
    cnt = None if self.counts is None else self.cut(self.counts, r)
    aux, z = routing.aux_losses(st if cnt is None else {**st, "counts": cnt}, self.n_tokens, cfg)
    part = (cfg.aux_loss_coef * jnp.sum(aux) + cfg.z_loss_coef * jnp.sum(z)) * _first_tensor_rank()
    return (y, part), (st, aux, z)

  def vjp(self, x, mc, r):
    """Chunk r's forward on microbatch mc -> ((y, part), its vjp's residuals but the weights,
    their treedef, {residual: weight} (`_drop_weights`), (stats, aux, z))."""
    lp = jax.tree.map(lambda a: self.cut(a, r), self.layers)
    out, vj, aux = jax.vjp(lambda lp, pe, x: self.stage_fn(lp, pe, x, self.tok[mc],
                                                           _at(self.pos, mc), r),
                           lp, self.pe, x, has_aux=True)
    return (out,) + _drop_weights(vj, (lp, self.pe)) + (aux,)

  def forward(self, c, x, mc, r, slot):
    """The forward phase: chunk r on microbatch mc, its residuals into ring slot `slot`; the
    last stage's last chunk then runs the head: its CE, its gradients, d(loss)/dy (into `slot`)."""
    (y, part), res, tree_f, weight_f, (st, aux, z) = self.vjp(x, mc, r)
    assert weight_f == self.weight and tree_f.num_leaves == self.tree.num_leaves, \
        "a stage's residuals changed structure between traces"
    c["ring"] = [_put(buf, slot, u) for buf, u in zip(c["ring"], res)]
    head = lambda ph, y, t: (_ce_sum(y, t, ph, self.cfg) / self.n_tokens   # CE sum / T, once
                             * self.ce_share)

    def head_step(dys, g):
      ce, (d_ph, dy) = jax.value_and_grad(head, argnums=(0, 1))(self.ph, y, self.tgt[mc])
      return _put(dys, slot, dy.astype(dys.dtype)), _add(g, d_ph), ce
    c["dy"], c["g_head"], ce = jax.lax.cond(self.last & (r == self.v - 1), head_step,
                                            lambda dys, g: (dys, g, self.ce0), c["dy"],
                                            c["g_head"])
    c["stats"] = {"ce": c["stats"]["ce"] + ce,
                  **{k: self.into(c["stats"][k], r, u) for k, u in
                     (("aux", aux), ("z", z), ("dropped", st["dropped"]),
                      ("counts", st["counts"]))}}
    return c, y

  def backward(self, c, dy, r, slot):
    """The backward phase: chunk r's vjp from its ring slot (the chunk's weights cut again) on
    dy -> the layers' and the prefix's gradient sums, and dx for the stage before."""
    ring = [_get(buf, slot) for buf in c["ring"]]
    lp = jax.tree.map(lambda a: self.cut(a, r), self.layers)
    vj = _with_weights(ring, self.tree, self.weight, (lp, self.pe))
    one = _vary(jnp.ones((), jnp.float32), self.part0)
    d_lp, d_pe, dx = vj((_vary(dy.astype(self.y0.dtype), self.y0), one))
    c["g_layers"] = jax.tree.map(lambda g, d: self.into(g, r, d), c["g_layers"], d_lp)
    c["g_pre"] = _add(c["g_pre"], d_pe)
    return c, dx

  def tick(self, c, t):
    """One tick: this stage's forward and backward phase where the table has them, then the
    sends both ways, each arrival kept in the inbox slot the table gives it."""
    m, at = self.m, self.at
    i, r = at("F", t), jnp.maximum(at("CF", t), 0)
    keys = ("ring", "dy", "g_head", "stats")
    with self.taken:
      sub, y = jax.lax.cond(i >= 0, self.forward, lambda c, *_: (c, self.act),
                            {k: c[k] for k in keys}, _get(c["recv"], at("XF", t)),
                            jnp.clip(i, 0, m - 1), r, jnp.maximum(at("RF", t), 0))
    c.update(sub)
    i, r, slot = at("B", t), jnp.maximum(at("CB", t), 0), jnp.maximum(at("RB", t), 0)
    dy = jnp.where(at("XB", t) < 0, _get(c["dy"], slot), _get(c["recv_ct"], at("XB", t)))
    keys = ("ring", "g_layers", "g_pre")
    with self.taken:
      sub, dx = jax.lax.cond(i >= 0, self.backward, lambda c, *_: (c, self.act),
                             {k: c[k] for k in keys}, dy, r, slot)
    c.update(sub)
    for k, buf, u, pairs in (("AF", "recv", y, self.fwd_pairs),
                             ("AB", "recv_ct", dx, self.bwd_pairs)):
      with jax.named_scope("stage_permute"):
        got = jax.lax.ppermute(u, STAGE, pairs)
      c[buf] = jnp.where(at(k, t) >= 0, _put(c[buf], jnp.maximum(at(k, t), 0), got), c[buf])
    return c, None

  def carry0(self):
    """The carry before the first tick: zeros typed as the loop's."""
    y0, table, ring = self.y0, self.table, in_flight(self.table)
    # [rows, ..] of [rows/v, ..], typed over the axes the step's statistics vary over
    stat = lambda a: _zeros_like(a[0], (self.rows,), also=self.stat_axes)
    f32 = lambda tree: jax.tree.map(lambda a: _zeros_like(a, dtype=jnp.float32), tree)
    # the inboxes: a slot per arrival the table keeps at once (one stage receives nothing, but
    # the tick reads slot 0 of an inbox whatever the table says)
    inbox = lambda k: _zeros_like(y0, (max(int(table[k].max()) + 1, 1),))
    return {"recv": inbox("AF"), "recv_ct": inbox("AB"),
            "ring": [_zeros_like(a, (ring,), also=(STAGE,)) for a in self.ring0],
            "dy": _zeros_like(y0, (ring,)),
            "g_layers": f32(self.layers), "g_head": f32(self.ph), "g_pre": f32(self.pe),
            "stats": {"ce": self.ce0,
                      **{k: stat(a) for k, a in zip(("aux", "z"), self.aux0[1:])},
                      **{k: stat(self.aux0[0][k]) for k in ("dropped", "counts")}}}


def _zeros_like(a, lead=(), also=(), dtype=None):   # [*lead, *a.shape], varying as a and `also`
  return sharding.to_varying(jnp.zeros(lead + a.shape, dtype or a.dtype),
                             sharding.varying_axes(a) | set(also))


def _vary(a, like):                           # a typed varying over the axes `like` varies over
  return sharding.to_varying(a, sharding.varying_axes(like))


def _put(buf, i, u):                          # buf with u at row i (a dynamic index)
  return jax.lax.dynamic_update_index_in_dim(buf, u, i, 0)


def _get(buf, i):                             # buf's row i (a dynamic index; -1 reads row 0)
  return jax.lax.dynamic_index_in_dim(buf, jnp.maximum(i, 0), keepdims=False)


def _add(acc, u):                             # gradient sums acc + u, in acc's dtype
  return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, u)


def _stage_mask(cfg, n_stage):
  """[slots per stage] bool, this device's rows of the padded MoE stack that hold a layer
  (--layer_layout), or None when the stack has no padding."""
  mask = model.slot_mask(cfg)
  return None if mask is None else jnp.asarray(mask.reshape(n_stage, -1))[
      jax.lax.axis_index(STAGE)]


def slot_kinds(cfg, n_stage: int, v: int, as_data: bool = False):
  """[n_layer_slots] int32: each stored row's attention kind, an index into
  cfg.layer_attentions (its layer's depth past the dense prefix, mod the period; 0 for a
  padding row), or None where every chunk of v on the n_stage stages starts on a period (then
  moe_stack's static kinds, row i's (first_k_dense_replace + i) % period, are each row's) and
  not as_data. Dense layers inside the stack, or as_data with a period longer than one: the
  kinds always (switched_periods and switched_rows scan their stacks as stored, where
  run_layers' view of a period's rows [reps, n, ...] would be a residual of 1f1b's explicit vjp,
  kept once per microbatch in flight; [n_layers] in depth order with dense layers inside)."""
  period = len(cfg.layer_attentions)
  if period == 1:
    return None
  if cfg.dense_inside:
    # [n_layers]: every layer's kind, each group's layers in depth order, the groups as stored
    # (model.switched_periods scans the stacks as stored)
    per = cfg.n_layers // len(cfg.layer_groups)
    depth = [d for g in cfg.group_order for d in range(g * per, (g + 1) * per)]
    return (np.asarray(depth) % period).astype(np.int32)
  slots = np.asarray(cfg.layer_slots)
  kinds = np.where(slots >= 0, (cfg.first_k_dense_replace + slots) % period, 0).astype(np.int32)
  per = len(slots) // n_stage // v
  static = (cfg.first_k_dense_replace + np.arange(len(slots)) % per) % period
  return None if not as_data and (kinds == static)[slots >= 0].all() else kinds


def _switched_moe(cfg, n_stage: int, v: int) -> bool:
  """Whether a chunk's MoE rows run as lax.switch branches over attention kinds
  (model.switched_rows: kinds data or padding among rows of different kinds;
  model.switched_periods: an MoE stack whose layers take more than one kind)."""
  if len(cfg.layer_attentions) == 1:
    return False
  if cfg.dense_inside:
    return model.switches(cfg, is_moe=True)
  return slot_kinds(cfg, n_stage, v) is not None or model.slot_mask(cfg) is not None


def _stage_kinds(cfg, n_stage, as_data=False):
  """[slots per stage] int32, this device's rows' attention kinds (slot_kinds), or None."""
  kinds = slot_kinds(cfg, n_stage, chunks(cfg), as_data)
  return None if kinds is None else jnp.asarray(kinds.reshape(n_stage, -1))[
      jax.lax.axis_index(STAGE)]


def _drop_weights(vj, layers) -> tuple:
  """A vjp (jax.vjp's function, a pytree of residuals) -> (its residual leaves but the weights
  `layers`, its treedef, {residual leaf index: weight leaf index}): the caller keeps the
  weights once, never a copy per microbatch or per tick."""
  leaves, tree = jax.tree.flatten(vj)
  w = jax.tree.leaves(layers)
  index = {i: j for i, leaf in enumerate(leaves) for j, v in enumerate(w) if leaf is v}
  return [l for i, l in enumerate(leaves) if i not in index], tree, index


def _with_weights(kept, tree, index, layers):
  """_drop_weights' inverse: the vjp from its kept residuals and the weights `layers`."""
  w, it = jax.tree.leaves(layers), iter(kept)
  return jax.tree.unflatten(tree, [w[index[i]] if i in index else next(it)
                                   for i in range(tree.num_leaves)])


def activation_shardings(cfg, mesh, opts):
  b = cfg.batch // mesh_lib.axis_size(mesh, *BATCH)
  c = mesh_lib.axis_size(mesh, CONTEXT)
  out = [("microbatch between stages", f"[{b // cfg.microbatches}, {cfg.seq_len // c}, "
          f"{cfg.d_model}] per device, {cfg.microbatches} microbatches"),
         ("bubble fraction", f"{bubble(cfg, mesh):.2f}")]
  if c > 1:
    out.append(("load-balanced positions per context rank",
                str(context.lb_positions(cfg.seq_len, c).tolist())))
  return out


def cost(cfg, mesh, opts):
  """Per-device collective bytes per step (measure/cost.py; the docstring's schedule)."""
  p, ep_size, v = mesh_lib.axis_size(mesh, STAGE), mesh_lib.axis_size(mesh, EXPERT), chunks(cfg)
  # the stage passes a device runs per step (`stage_passes`), and the MoE rows a pass runs
  ticks, local_layers = v * cfg.microbatches + p - 1, cfg.n_layer_slots // p // v
  steps, pre_steps = stage_passes(cfg, p, opts)
  sends = permutes(opts.schedule, schedule(opts.schedule, p, cfg.microbatches, v))
  mb = cfg.batch // mesh_lib.axis_size(mesh, *BATCH) // cfg.microbatches
  s_loc = cfg.seq_len // mesh_lib.axis_size(mesh, CONTEXT)         # a device's positions
  act = mb * s_loc * cfg.d_model * cost_lib.act_bytes(cfg)        # one [b/M, S/c, D]
  t = mesh_lib.axis_size(mesh, TENSOR)
  send = act / t if opts.sequence_parallel else act               # what a stage sends
  tp, fold = t > 1, opts.experts == "fold"
  # the exchange: over expert, or folded over (expert, tensor), each rank its S/t positions
  ep_axes, n_ep, s_ep = ((EXPERT, TENSOR), ep_size * t, s_loc // t) if fold else \
      ((EXPERT,), ep_size, s_loc)
  stat_axes = TOKENS + (TENSOR,) if fold else TOKENS     # each run's router statistics
  c = dispatch.send_rows(cfg, mb, s_ep, n_ep)
  buf = n_ep * c * cfg.d_model * cost_lib.act_bytes(cfg)          # [EP, C, D]
  runs = steps * local_layers                                       # moe_body calls per pass
  term = functools.partial(cost_lib.term, mesh)
  # each run's statistics and dropped count; dropless, the count is the constant 0, and under
  # autodiff's time loop (gpipe, interleaved) XLA hoists its all-reduce out: one per step, but
  # from a chunk's vjp (interleaved) whose MoE rows are switch branches
  hoist = cfg.capacity_factor == 0 and opts.schedule != "1f1b" and not (
      v > 1 and _switched_moe(cfg, p, v))
  stats = (cost_lib.stats_values(cfg) + (not hoist)) * cost_lib.F32
  stat_ops = cost_lib.STATS_OPS[cost_lib.STEP] + (not hoist)          # all-reduces a run
  pre = counts_pre_pass(cfg, opts)
  counts = cfg.n_layer_slots // p * cfg.n_experts * cost_lib.F32     # the step's [rows, E]
  if tp and opts.schedule == "1f1b":
    # measured with tensor parallelism: each phase's dropped count once, not per layer; with
    # the pre-pass giving the counts, each run's counts are summed only for the metric, and
    # XLA moves that sum out of the loop, folded into tensor rank 0's (below)
    stats = (cost_lib.stats_values(cfg) - pre * cfg.n_experts) * cost_lib.F32
    stat_ops = cost_lib.STATS_OPS[cost_lib.STEP] - pre
    stats_once = term("all-reduce", "fwd", "dropped count per phase", steps * cost_lib.F32,
                      stat_axes)
  else:
    stats_once = term("all-reduce", "fwd", cost_lib.HOISTED, hoist * cost_lib.F32, stat_axes)
  if tp and (pre or (cfg.bias_update_rate and not fold)):   # the counts metric, read
    stats_once += term("all-reduce", "fwd", "the step's counts [rows, E], tensor rank 0's",
                       counts, TOKENS + (TENSOR,) if pre else TENSOR)
  # the non-expert matrices gathered once per step: a stacked leaf keeps its L dim as stored
  # (the MoE stack's over stage: gathered over data; the prefix's: over (stage, data))
  kept_l = lambda spec: (P(spec[0], *sharding.without_axis(
      sharding.without_axis(P(*spec[1:]), STAGE), DATA)), AXES)
  gathered = {**{role: kept_l for role in model.D_DIM if role not in ("expert_in", "expert_out")},
              "embed": (P(), AXES), "unembed": (P(), AXES)}
  specs = param_specs(cfg, mesh, opts)
  out = (cost_lib.weight_terms(cfg, mesh, specs, AXES, gathered, once=True)
         + cost_lib.muon_terms(cfg, mesh, specs, SPREAD + (TENSOR,))
         + term("collective-permute", "fwd", "activations to the next stage", sends[0] * send,
                STAGE, calls=sends[0])
         + term("collective-permute", "bwd", "cotangents to the previous stage", sends[1] * send,
                STAGE, calls=sends[1])
         + ep.exchange_terms(cfg, mesh, "a2a", mb, mb * s_ep, ep_axes, calls=runs)
         + term("all-reduce", "fwd", "router stats per microbatch", runs * stats, stat_axes,
                calls=runs * stat_ops)
         + stats_once
         + _tensor_terms(cfg, mesh, act, steps, pre_steps, opts)
         + term("all-reduce", "fwd", "aux / z / dropped sums", 3 * cost_lib.F32,
                STAGE if fold else (STAGE, TENSOR), calls=3)
         + _context_terms(cfg, mesh, mb, steps, pre_steps, opts)
         + _split_sequence_terms(cfg, mesh, mb, runs, steps, pre_steps, opts)
         + term("all-reduce", "fwd", "CE sum", cost_lib.F32, AXES))
  if cfg.bias_update_rate and opts.schedule == "1f1b" and not pre:
    # the bias update reads the step's counts: under 1f1b summed over the token axes once (the
    # pre-pass sums them where it runs; under gpipe and interleaved XLA reuses each pass's
    # sums), measured; with tensor parallelism over tensor too
    out += term("all-reduce", "fwd", "the step's counts [L/P, E] for the bias update", counts,
                TOKENS + (TENSOR,))
  if pre:                                      # the GPipe forward time loop, once more
    out += (term("collective-permute", "fwd", "counts pre-pass: activations (v = 1, unrolled: "
                 "its last tick's send, read by no stage, compiled away)",
                 (ticks - (v == 1)) * send, STAGE, calls=ticks - (v == 1))
            + term("all-to-all", "fwd", "counts pre-pass: buffers and counts",
                   pre_steps * local_layers * (2 * buf + cfg.n_experts * 4), ep_axes)
            + term("all-reduce", "fwd", "counts pre-pass: the step's counts [L/P, E]",
                   (not tp) * counts, stat_axes))
    if v > 1 or tp:         # run in chunks (or with tensor parallelism), each tick's counts stay
      out += term("all-reduce", "fwd", "counts pre-pass: each tick's counts [E] per row "
                  "(measured: with one chunk per stage XLA folds them away)",
                  ticks * local_layers * cfg.n_experts * cost_lib.F32, stat_axes)
  return out


def _tensor_terms(cfg, mesh, act, steps, pre_steps, opts) -> list:
  """The stage's hand-written tensor parallelism (`_stage_layout`), act = one [b/M, S/c, D]:
  per layer run, forward, one all-reduce over tensor of attention's row-parallel output and one
  of the MLP block's (the MoE and shared expert's sum, or a dense FFN's); backward, the same two,
  each the transpose of the copy of the sum every rank's residual takes, per layer run
  (`_layer_runs`)."""
  runs, pre = _layer_runs(cfg, mesh, steps, pre_steps, opts)
  if opts.sequence_parallel:
    return _sequence_parallel_terms(cfg, mesh, act, runs, pre)
  term = functools.partial(cost_lib.term, mesh)
  # --remat=block recomputes attention's (the MLP block reads it), never the MLP block's (its
  # sum is the layer's output, which no gradient reads)
  return (term("all-reduce", "fwd", "attention's row-parallel output", runs * act, TENSOR,
               cost_lib.BLOCK_ONLY)
          + term("all-reduce", "fwd", "the MLP block's row-parallel output", runs * act, TENSOR)
          + term("all-reduce", "bwd", "their cotangents", 2 * runs * act, TENSOR)
          + term("all-reduce", "fwd", "counts pre-pass: row-parallel outputs", 2 * pre * act,
                 TENSOR))


def _sequence_parallel_terms(cfg, mesh, act, runs, pre) -> list:
  """sequence_parallel: per layer run, measure.cost's sequence-parallel terms (each block's
  normed input all-gathered over tensor, its output reduce-scattered, and the mirror backward);
  the counts pre-pass's forward ones. act = one gathered [b/M, S/c, D]; runs, pre: the layer
  runs of the step and of the pre-pass (`_layer_runs`)."""
  t = mesh_lib.axis_size(mesh, TENSOR)
  tokens = act / cost_lib.act_bytes(cfg) / cfg.d_model                   # b/M x S/c
  inputs = act * cost_lib.attn_gather_values(cfg) / cfg.d_model + act   # attention's + MLP's
  term = functools.partial(cost_lib.term, mesh)
  return (cost_lib.sequence_parallel_terms(cfg, mesh, TENSOR, tokens, runs, attn_layers=runs)
          + term("all-gather", "fwd", "counts pre-pass: the blocks' inputs", pre * inputs, TENSOR)
          + term("reduce-scatter", "fwd", "counts pre-pass: the blocks' outputs",
                 pre * 2 * act / t, TENSOR))


def _layer_runs(cfg, mesh, steps, pre_steps, opts) -> tuple:
  """(the layer runs of a step, the counts pre-pass's): per stage pass the stage's chunk of
  layers (dense ones inside the stack included); the dense prefix once per microbatch (gpipe:
  on every device before the loop), or per forward phase under 1f1b (a conditional that stage
  0's first chunk takes: measured as each phase's longer branch)."""
  p, v = mesh_lib.axis_size(mesh, STAGE), chunks(cfg)
  stack = (cfg.n_layer_slots + (cfg.n_dense_layers if cfg.dense_inside else 0)) // p // v
  prefix = (steps if opts.schedule == "1f1b" else cfg.microbatches) * cfg.first_k_dense_replace
  return steps * stack + prefix, pre_steps * stack + (pre_steps > 0) * prefix


def _context_terms(cfg, mesh, mb, steps, pre_steps, opts) -> list:
  """c = |context| > 1: cp's K/V exchange inside the stages (measure.cost.kv_exchange_terms),
  per layer run (`_layer_runs`) on K and V (their KV/t heads; MLA: the latent and RoPE key) of
  the b/M = mb whole sequences [mb, S, ..]: the all-gather and the reduce-scatter of d(K/V), or
  the ring's blocks; the counts pre-pass's gathers; the keys' positions [b, S] once per step."""
  c = mesh_lib.axis_size(mesh, CONTEXT)
  if c == 1:
    return []
  calls, pre = _layer_runs(cfg, mesh, steps, pre_steps, opts)
  # a run's K/V: GQA's KV heads are split over tensor; MLA's latent is whole on every rank
  heads = 1 if cfg.mla else mesh_lib.axis_size(mesh, TENSOR)
  kv = mb * cfg.seq_len * cost_lib.kv_values(cfg) // heads * cost_lib.act_bytes(cfg)
  ring = opts.kv_exchange == "ring"
  term = functools.partial(cost_lib.term, mesh)
  return (cost_lib.kv_exchange_terms(cfg, mesh, CONTEXT, kv, calls, ring)
          + term("all-gather", "fwd", "counts pre-pass: K/V", (not ring) * pre * kv, CONTEXT)
          + term("all-gather", "fwd", "kv_pos [b, S], once per step",
                 cfg.microbatches * mb * cfg.seq_len * 4, CONTEXT))


def _split_sequence_terms(cfg, mesh, mb, runs, steps, pre_steps, opts) -> list:
  """The collectives over the axes that split each routed sequence (context: a device's S/c;
  experts=fold: each tensor rank's S/(c t) of them), for the b/M = mb sequences a run routes:
  the sequence-wise loss's per-sequence partials [mb, E] (counts and probabilities) summed over
  them per run, and its scalar's cotangent summed back; under the capacity rule each run's
  expert ids [mb, S, K] and each pass's positions [mb, S] all-gathered over them (the rule
  orders whole sequences); fold under 1f1b, each phase's aux term's cotangent summed over tensor
  (tensor rank 0's counted)."""
  fold = opts.experts == "fold"
  axis = tuple(a for a, on in ((CONTEXT, True), (TENSOR, fold))
               if on and mesh_lib.axis_size(mesh, a) > 1)
  if not axis:
    return []
  term = functools.partial(cost_lib.term, mesh)
  pre_runs = pre_steps * runs // steps                   # the pre-pass's passes x local layers
  seq = cfg.aux_loss_kind == "sequence"
  tok = mb * cfg.seq_len
  return (term("all-reduce", "fwd", "sequence-wise loss: per-sequence counts and probs [b/M, E]",
               seq * runs * 2 * mb * cfg.n_experts * cost_lib.F32, axis)
          + term("all-reduce", "bwd", "sequence-wise loss: its cotangent", seq * runs * cost_lib.F32,
                 axis)
          + term("all-reduce", "bwd", "1f1b: each phase's aux term's cotangent",
                 (opts.schedule == "1f1b" and fold) * steps * cost_lib.F32, TENSOR)
          + term("all-gather", "fwd", "capacity: expert ids [b/M, S, K] per run, positions per pass "
                 "(the counts pre-pass's too; --remat gathers them again in the backward)",
                 (cfg.capacity_factor > 0) * ((runs + pre_runs) * cfg.top_k + steps + pre_steps)
                 * tok * 4, axis, cost_lib.RECOMPUTED))
