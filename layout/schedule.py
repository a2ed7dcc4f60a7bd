"""Pipeline schedules as data: which microbatch's forward and backward each stage runs at each
tick. strategies/pp.py runs these tables; the planner (planning/plan.py) reads their ticks and
ring sizes; tests/pipeline.py replays every table (`check_schedule`) and draws it (`diagram`),
and tests/test_pp.py holds the drawings below to the tables and the compiled permutes to
`permutes`.

  schedule(name, P, M, v) -> {"F": [ticks, P], "B": [ticks, P], ..} numpy int tables (-1: idle)
  in_flight(table)        -> the microbatches (1f1b: chunk runs) whose residuals a stage holds
  permutes(name, table)   -> (forward, backward) collective-permutes over stage per step
  stored_config(cfg, mesh, opts) -> the model as the schedule stores it (its layer layout, the
                             interleaved schedules' round-robin stack); layout_note says so,
                             check_layout refuses what no schedule runs
  chunks, bubble, counts_pre_pass, stage_passes: a run's v, idle fraction, whether 1f1b runs the
                             counts pre-pass, and its stage passes (what pp's cost model counts)

A tick is one forward phase (then the activations' collective-permute to s+1) and one backward
phase (then the cotangents' to s-1). Drawn F<m> / B<m> (F<m><chunk> with v chunks per stage),
'.' idle, P = 4:
gpipe, M = 4 (all forwards, then all backwards: autodiff of the forward time loop runs it
reversed); M+P-1 ticks each way, the bubble (P-1)/(M+P-1):
  tick     0  1  2  3  4  5  6  7  8  9  10 11 12 13
  stage 0  F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
  stage 1  .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
  stage 2  .  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .  .
  stage 3  .  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .
1f1b, M = 8 (Megatron's: stage s runs the forwards of microbatches 0..P-s-1 at ticks s.., then
alternates: F(i) at tick 2i+s, B(i) at 2P-1-s+2i; one phase per stage and tick, 2(M+P-1)
ticks, min(M, P) microbatches in flight):
  tick     0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21
  stage 0  F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
  stage 1  .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
  stage 2  .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
  stage 3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
1f1b with v > 1 (Megatron's interleaved 1F1B, `_one_f_one_b`): each stage walks Megatron's task
order (microbatches in rounds of P, chunk by chunk; (P-s-1)*2 + (v-1)*P warm-up forwards, then
one forward and one backward in turn) and runs its next task at the first tick its input has
arrived. A send may wait ticks for its reader: each direction has an inbox of slots, and the
table names the slot each send is kept in and each read comes from, and the ring slot of each
chunk's residuals (up to 2(P-1) + (v-1)P + 1). P = 2, M = 4, v = 2:
  tick     0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17
  stage 0  F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a .   B2b .   B3b B2a B3a
  stage 1  .   F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a .
interleaved (v chunks per stage, placed round-robin; "C": the chunk each entry runs): gpipe's
order over v*M+P-1 ticks of one chunk each way, the bubble (P-1)/(v*M+P-1); stage s runs round
g, chunk r, microbatch g*P + i at tick s + g*v*P + r*P + i, so chunk r of stage P-1 feeds chunk
r+1 of stage 0 the next tick (M a multiple of P). P = 3, M = 3, v = 2:
  tick     0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15
  stage 0  F0a F1a F2a F0b F1b F2b .   .   .   .   B2b B1b B0b B2a B1a B0a
  stage 1  .   F0a F1a F2a F0b F1b F2b .   .   B2b B1b B0b B2a B1a B0a .
  stage 2  .   .   F0a F1a F2a F0b F1b F2b B2b B1b B0b B2a B1a B0a .   .
"""
import numpy as np

from layout.mesh import STAGE, axis_size, require_divisible
from modeling.config import ConfigError, balanced_layout


def schedule(name: str, n_stage: int, m: int, v: int = 1) -> dict:
  """The schedule as data: {"F": [ticks, P], "B": [ticks, P]} numpy int arrays, the microbatch
  whose forward / backward stage s runs at tick t (-1: none). gpipe: the M+P-1 forward ticks of
  the time loop, then its autodiff, the same loop reversed. 1f1b: `_one_f_one_b`, with its
  chunk, ring and inbox slots. interleaved (v chunks per stage; "C": [ticks, P], the chunk each
  entry runs): gpipe's order over v*M+P-1 ticks of one chunk each (module docstring)."""
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


def permutes(name: str, table: dict) -> tuple[int, int]:
  """(forward, backward) collective-permutes over stage per step, each of one microbatch's
  [b/M, S, D]: gpipe's (interleaved's) autodiff sends at every one of its forward ticks, and
  at every tick of its reverse; 1f1b's table run sends both ways at every tick of the table."""
  ticks = len(table["F"])
  return (ticks // 2,) * 2 if name in ("gpipe", "interleaved") else (ticks,) * 2


def round_robin(opts) -> bool:
  """The stack stored as v chunks per stage: interleaved, or 1f1b with virtual_stages > 1."""
  return opts.schedule == "interleaved" or (opts.schedule == "1f1b" and opts.virtual_stages > 1)


def check_layout(cfg, mesh, opts):
  """pp.check's share: the schedule's options against the model's layer layout (one group per
  stage; the interleaved schedules' P x v groups stored round-robin, microbatches in rounds of
  P), or without --layer_layout, MoE layers that the stages divide (stored_config balances the
  others)."""
  p, v = axis_size(mesh, STAGE), opts.virtual_stages
  if opts.schedule == "gpipe" and v != 1:
    raise ConfigError(f"--opt=virtual_stages={v} is the interleaved schedule's; "
                      f"schedule={opts.schedule} runs one chunk per stage")
  if round_robin(opts):
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
  if cfg.layer_layout and not round_robin(opts):          # one group of the stack per stage
    groups = len(cfg.layer_groups)
    if groups != axis_size(mesh, STAGE):
      raise ConfigError(f"layer_layout={cfg.layer_layout} has {groups} groups, mesh axis "
                        f"stage={axis_size(mesh, STAGE)}: one group per stage")
  elif not cfg.layer_layout:                 # stored_config gives the uneven ones a layout
    name = "n_layers - first_k_dense_replace" if cfg.first_k_dense_replace else "n_layers"
    if cfg.n_moe_layers < p:
      raise ConfigError(f"{name}={cfg.n_moe_layers} < mesh axis stage={p}: fewer MoE layers "
                        f"than stages, no layer layout gives each stage one")
    require_divisible(name, cfg.n_moe_layers, mesh, STAGE)


def stored_config(cfg, mesh, opts):
  """The model as this schedule stores it: interleaved holds v chunks per stage, group j of a
  P x v group layout on stage j mod P (layer_stages = P; the layout balanced_layout's when
  --layer_layout is not given). Every other schedule: one group per stage, cfg as given, or
  where P does not divide the MoE layers and --layer_layout is not given, balanced_layout's
  (3 on 2 stages: 2,1); with fewer MoE layers than stages cfg as given, for pp.check to refuse."""
  p = axis_size(mesh, STAGE)
  if not round_robin(opts):
    n = cfg.n_moe_layers
    if cfg.layer_layout or n % p == 0 or n < p or cfg.dense_inside:
      return cfg
    return cfg.replace(layer_layout=balanced_layout(n, p)).validate()
  if cfg.layer_stages or p < 2:                                     # (check refuses p < 2)
    return cfg
  groups = p * opts.virtual_stages
  if cfg.dense_inside and cfg.n_layers % (groups * cfg.mlp_period):
    return cfg                  # chunks that split a dense/MoE period: pp.check refuses them
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
  p = axis_size(mesh, STAGE)
  where = f"on {p} stages" if len(groups) == p else f"in {len(groups)} chunks on {p} stages"
  return (f"pp: {cfg.n_moe_layers} MoE layers {where}: --layer_layout={stored.layer_layout} "
          f"(balanced)")


def chunks(cfg) -> int:
  """v: the layer chunks each stage holds (> 1: the stack stored round-robin for the interleaved
  schedules, layer_stages = P)."""
  return len(cfg.layer_groups) // cfg.layer_stages if cfg.layer_stages else 1


def bubble(cfg, mesh) -> float:
  """The idle share of a stage's ticks, (P-1)/(v*M+P-1)."""
  p, v = axis_size(mesh, STAGE), chunks(cfg)
  return (p - 1) / (v * cfg.microbatches + p - 1)


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
