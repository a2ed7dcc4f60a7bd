"""What pp's tests read beside the strategy: the schedule tables' validators (`check_schedule`,
a tick-by-tick replay of a 1f1b table's slots), their renderer (`diagram`, as layout/schedule.py's
docstring draws them), and the pipeline's logits (`logits`, for the Hugging Face parity test)."""
import einops
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from modeling import model


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


def logits(pp, params, batch, *, cfg, mesh):
  """The model's logits [B, S, V] under pp's gpipe pipeline (`pp._use`, `pp._stages`), the last
  stage's outputs through model.head, summed over stage (the other stages add zeros) and
  tensor (tensor rank 0's)."""
  specs, bspec = pp.param_specs(cfg, mesh), pp.batch_spec(cfg, mesh)
  n_stage = mesh.shape[pp.STAGE]

  def body(p, tokens, positions):
    p = pp._use(p, specs, cfg)
    outs, _ = pp._stages(p, tokens, pp._positions(positions, cfg.microbatches), cfg=cfg,
                         n_stage=n_stage, ep_size=mesh.shape[pp.EXPERT], opts=pp.Options())
    out = model.head(outs, p, cfg, model.Parallelism()).astype(jnp.float32)   # [M, b/M, S, V]
    last = jax.lax.axis_index(pp.STAGE) == n_stage - 1
    # the last stage's, tensor rank 0's (every tensor rank holds the same)
    out = jax.lax.psum(jnp.where(last, out, 0.0) * pp._first_tensor_rank(), (pp.STAGE, pp.TENSOR))
    return einops.rearrange(out, "m mb s v -> (m mb) s v")              # [b, S, V]
  return jax.shard_map(body, in_specs=(specs, bspec, bspec),
                       out_specs=P(pp.BATCH, pp.CONTEXT, None))(
      params, batch["tokens"], batch["positions"])
