"""What `run.py --plan` prints and draws: the ranked table, why candidates were kept or dropped,
the compiled check beside the prediction, and a PNG of every candidate (memory against
predicted step time)."""
from __future__ import annotations

import collections

from planning import plan
from report import fmt_bytes, markdown_table


def verdict(c: plan.Candidate, best: plan.Candidate | None, hbm: float) -> str:
  """Why a ranked candidate is where it is, in a few words."""
  if not c.fits:
    return f"dropped: {fmt_bytes(c.memory)} > {fmt_bytes(hbm)} (params+opt {fmt_bytes(c.param_opt)})"
  if c is best:
    return "kept: fits, fastest"
  return f"kept: fits, {c.step_s / best.step_s:.2f}x the fastest's step"


def table(ranked: list[plan.Candidate], top: int, hbm: float) -> str:
  """The first `top` ranked candidates (those that fit first, by predicted step time)."""
  best = next((c for c in ranked if c.fits), None)
  head = ["#", "layout", "memory/dev (params+opt + temp)", "step s", "tok/s/dev", "MFU",
          "dominant collective", "why"]
  rows = [[str(i + 1), c.layout(),
           f"{fmt_bytes(c.memory)} ({fmt_bytes(c.param_opt)} + {fmt_bytes(c.temp)})",
           f"{c.step_s:.3f}", f"{c.tokens_per_s:,.0f}", f"{c.mfu:.1%}",
           dominant(c, 3),
           verdict(c, best, hbm)] for i, c in enumerate(ranked[:top])]
  return markdown_table(head, rows)


def dominant(c: plan.Candidate, digits: int | None = None) -> str:
  """The candidate's dominant collective and its time to `digits` (None: no time), "(hidden)"
  where it runs under compute."""
  if not c.dominant:
    return "none"
  return (c.dominant + ("" if digits is None else f" {c.dominant_s:.{digits}f}s")
          + (" (hidden)" if c.dominant_hidden else ""))


def refused(cands: list[plan.Candidate], most: int = 6) -> str:
  """The check() errors that dropped candidates, the most frequent first, with their counts."""
  errs = collections.Counter(c.error for c in cands if c.error)
  if not errs:
    return "refused by check(): none"
  lines = [f"refused by check(): {sum(errs.values())} candidates, {len(errs)} distinct reasons; "
           "the most frequent:"]
  lines += [f"  {n:>5} x {e}" for e, n in errs.most_common(most)]
  return "\n".join(lines)


def found(cands: list[plan.Candidate], ranked: list[plan.Candidate], name: str,
          sizes: dict) -> str:
  """Where the candidates of one strategy on one mesh (sizes; axes of size 1 may be omitted)
  rank: the first six, the least memory, and the best of each placement, remat policy and
  option setting not among them; or
  the check() line that refused them."""
  want = {a: n for a, n in sizes.items() if n > 1}
  mine = [c for c in cands if c.strategy == name
          and {a: n for a, n in c.sizes if n > 1} == want]
  label = f"{name} {','.join(f'{a}:{n}' for a, n in want.items())}"
  if not mine:
    return (f"{label}: not enumerated (its axes are not {name}'s, they do not multiply to N, or "
            "the flags that constrain --plan leave it out)")
  pos = {id(c): i + 1 for i, c in enumerate(ranked)}
  kept = sorted((c for c in mine if not c.error), key=lambda c: pos[id(c)])
  lines = [f"{label}: {len(mine)} candidates, {len(kept)} admitted"]
  least = min(kept, key=lambda c: (c.memory, c.step_s), default=None)
  shown = kept[:6] + ([least] if least is not None and least not in kept[:6] else [])
  # the best-ranked of each placement (the axes inside a node), remat policy and option setting
  # that the lines above leave out
  kind = lambda c: (c.inner, c.remat, tuple(sorted(plan._varied(c.strategy, c.opts).items())))
  best = {}
  for c in kept:
    best.setdefault(kind(c), c)
  placed = [c for c in best.values() if all(kind(s) != kind(c) for s in shown)]
  for c in shown + placed:
    tag = ("least memory: " if c is least else
           f"best with node[{','.join(c.inner) or '-'}], remat={c.remat}"
           + "".join(f", {k}={v}" for k, v in kind(c)[2]) + ": "
           if any(c is p for p in placed) else "")
    lines.append(f"  {tag}rank {pos[id(c)]} of {len(ranked)}: "
                 f"{c.layout()}: {'fits' if c.fits else 'does NOT fit'}, {fmt_bytes(c.memory)} "
                 f"({fmt_bytes(c.param_opt)} + {fmt_bytes(c.temp)}), {c.step_s:.3f} s/step, "
                 f"{c.tokens_per_s:,.0f} tok/s/dev, MFU {c.mfu:.1%}")
  for e in sorted({c.error for c in mine if c.error}):
    lines.append(f"  refused: {e}")
  return "\n".join(lines)


def checked(results) -> str:
  """One block per compiled candidate: memory and bytes per (kind, axes), predicted vs compiled."""
  out = []
  for r in results:
    c = r.candidate
    if r.refused_over:
      # the size the compiler asked for when it gave up, not a compiled program's temp
      out.append(f"compiled {c.layout()}: refused by the compiler in {r.compile_s:.1f}s, over "
                 f"the {fmt_bytes(r.refused_over)} of HBM a device has: it asked for "
                 f"{fmt_bytes(r.compiled_temp)} of temporaries (predicted: memory/dev "
                 f"{fmt_bytes(c.memory)}, temp {fmt_bytes(c.temp)}); no program to read")
      continue
    out.append(f"compiled {c.layout()} in {r.compile_s:.1f}s: memory/dev predicted "
               f"{fmt_bytes(c.memory)} vs compiled {fmt_bytes(r.compiled_memory)} "
               f"(ratio {r.memory_ratio:.3f}; temp {fmt_bytes(c.temp)} vs "
               f"{fmt_bytes(r.compiled_temp)})")
    for (kind, axes), v in r.bytes_by_axes.items():
      out.append(f"  {kind:<20} over {','.join(sorted(axes)) or '-':<22} predicted "
                 f"{fmt_bytes(v['predicted']):>8}  compiled {fmt_bytes(v['measured']):>8}  "
                 f"ratio {v['ratio']:.4f}")
    if r.rewrites:
      out.append(f"  {r.rewrites}")
  return "\n".join(out)


def compiled_verdict(results, hbm: float) -> str:
  """The verdict the compiles support: the best-ranked compiled candidate whose compiled memory
  fits, naming those ranked above it that the compiler puts over `hbm`."""
  fit = [i for i, r in enumerate(results) if r.compiled_memory <= hbm]
  ok = results[fit[0]] if fit else None
  why = "; ".join(f"{r.candidate.layout()} "
                  f"{'is refused by the compiler at' if r.refused_over else 'compiles to'} "
                  f"{fmt_bytes(r.compiled_memory)} (predicted {fmt_bytes(r.candidate.memory)}): over"
                  for r in results[:fit[0] if fit else len(results)])   # all over hbm
  if ok is None:
    return (f"verdict after compiling {len(results)}: none fits in {fmt_bytes(hbm)} when "
            f"compiled; {why}")
  c = ok.candidate
  return (f"verdict after compiling {len(results)}: {c.layout()}: compiles to "
          f"{fmt_bytes(ok.compiled_memory)} per device (predicted {fmt_bytes(c.memory)}), "
          f"{c.step_s:.3f} s/step predicted" + (f"; ranked above it: {why}" if why else ""))


def png(ranked: list[plan.Candidate], hbm: float, path: str, title: str) -> str:
  """Memory against predicted step time, one point per ranked candidate, those that fit marked,
  the first one labelled. -> the line to print (written, or why not)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "no PNG: matplotlib is not importable"
  fig, ax = plt.subplots(figsize=(8, 5.5))
  for fits, style in ((False, dict(c="0.7", marker="x", label="does not fit")),
                      (True, dict(c="tab:blue", marker="o", label="fits"))):
    pts = [c for c in ranked if c.fits == fits]
    ax.scatter([c.step_s for c in pts], [c.memory / 2**30 for c in pts], s=10, **style)
  ax.axhline(hbm / 2**30, color="tab:red", lw=1, ls="--", label="HBM")
  best = next((c for c in ranked if c.fits), None)
  if best is not None:
    ax.scatter([best.step_s], [best.memory / 2**30], s=80, facecolors="none",
               edgecolors="tab:green", linewidths=2, label="chosen")
    ax.annotate(best.layout(), (best.step_s, best.memory / 2**30), fontsize=7,
                xytext=(8, 8), textcoords="offset points")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("predicted step time (s)")
  ax.set_ylabel("predicted memory per device (GiB)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return f"wrote {path}"
