"""moe-sharding command line.

  python run.py                                   # compare every strategy (8 simulated CPU devices)
  python run.py --strategy=ep --mesh=data:2,expert:4 --steps=3 --metrics_file=m.jsonl
  python run.py --compare=dp,ep --model=deepseek-test --report_dir=report
  python run.py --compare=all --devices=64 --model=mixtral-8x7b --compile_only
  python run.py --strategy=ep --mesh=data:2,expert:4 --devices=4 \
      --coordinator_address=127.0.0.1:1234 --num_processes=2 --process_id=0   # and =1
  python run.py --strategy=ep --steps=3 --checkpoint_dir=ck                # then, any strategy:
  python run.py --strategy=fsdp --steps=2 --checkpoint_dir=ck --restore=latest
  python run.py --strategy=ep --opt=exchange=none                          # a strategy's options
  python run.py --plan --model=mixtral-8x7b --devices=64 --cluster=h100   # rank layouts (planning/)
  python run.py --strategy=ep --model=mixtral-8x7b --layers=2 --devices=64 --mesh=fsdp:8,expert:8 \
      --compile_only --dtype=bfloat16 --remat=block --target=tpu-v5p      # XLA:TPU on this host
"""
from __future__ import annotations

import functools
import sys

from absl import app, flags

import command_line as command
from command_line import UsageError
from runtime import target as target_lib

F = flags.FLAGS
flags.DEFINE_string("strategy", None, "strategy to train (see strategies/); omit to compare all")
flags.DEFINE_string("compare", None, "'all' or a comma list of strategies to compare; an "
                    "entry may carry its own options, NAME:key=value[:key=value] (e.g. "
                    "cp:kv_exchange=ring), which override --opt's for that row")
flags.DEFINE_string("model", "tiny", "a preset (tiny, mixtral-test, deepseek-test, "
                    "deepseek-v2-test, qwen2-test, glm-test run on CPU; mixtral-8x7b, "
                    "mixtral-8x22b, deepseek-v2-lite, deepseek-v3, qwen3-30b-a3b, "
                    "qwen3-235b-a22b, glm-4.5, kimi-k2 at real shapes: --compile_only / --plan "
                    "on CPU) or the path of a Hugging Face config.json or of its folder "
                    "(docs/models.md)")
flags.DEFINE_integer("steps", None, "steps to run (after --restore: more steps; default 20; 3 in compare mode; 0 = compile "
                     "and report only)")
flags.DEFINE_integer("batch", None, "global batch (sequences); default from the preset")
flags.DEFINE_integer("seq", None, "sequence length; default from the preset")
flags.DEFINE_integer("layers", None, "override the number of layers")
flags.DEFINE_string("layer_layout", None, "pp: MoE layers per stage, in depth order, e.g. 4,4,3 "
                    "(stages may differ; the stack is padded to the largest with inert rows). "
                    "Default: L / P each; the reference takes it too, other strategies refuse it")
flags.DEFINE_integer("microbatches", 1, "M microbatches per step, one optimizer update: gradient "
                     "accumulation (each microbatch sharded like the batch); pp: its pipeline's")
flags.DEFINE_string("mesh", None, "e.g. data:2,expert:4; omitted axes get size 1; "
                    "no flag = all devices on the strategy's main axis; 'search' (compare with "
                    "--compile_only --hbm_gb): per strategy, the mesh over its axes that fits "
                    "(compare.py search)")
flags.DEFINE_integer("devices", 8, "simulated CPU devices per process (ignored on GPU/TPU "
                     "hosts); with --target, the target's devices")
flags.DEFINE_string("remat", "none", "jax.checkpoint of each layer: none | block (recompute the "
                    "layer) | dots_saveable | dots_with_no_batch_dims_saveable (jax policies)")
flags.DEFINE_string("dtype", "float32", "compute dtype: float32 | bfloat16 (mixed precision: "
                    "float32 master params and optimizer state; router, norms, losses in float32)")
flags.DEFINE_string("grad_reduce_dtype", "float32", "with --dtype=bfloat16: the dtype weight "
                    "gradients are summed across devices in: float32 | bfloat16")
flags.DEFINE_enum("optimizer", "adamw", ["adamw", "muon"], "optimizer")
flags.DEFINE_float("lr", None, "learning rate")
flags.DEFINE_float("adam_eps", None, "Adam epsilon (default from the preset, 1e-8)")
flags.DEFINE_float("capacity_factor", 0.0, "expert capacity factor; 0 = dropless")
flags.DEFINE_string("attention", None, "the attention core: xla (scores [B, H, S, T] "
                    "materialised) | chunked (online softmax over key chunks, memory linear in S) "
                    "| cudnn (GPU, GQA: jax.nn.dot_product_attention); default from the preset")
flags.DEFINE_integer("attention_chunk", None, "keys per chunk of --attention=chunked (default 512)")
flags.DEFINE_string("aux_loss_kind", None, "load-balance loss: batch (f, P over the step's tokens) "
                    "| sequence (per sequence, DeepSeek-V3's); default from the preset")
flags.DEFINE_integer("seed", 0, "init and data seed")
flags.DEFINE_string("data", None, "train on a token file, read by memory map, instead of the "
                    "synthetic Markov chain: NAME.bin (uint16, as nanoGPT writes), NAME.u32.bin "
                    "(uint32) or NAME.npy (1-D integer); batch i is a pure function of (file, "
                    "--seed, i, batch, seq): a seeded order of its windows, epoch after epoch "
                    "(runtime/data.py)")
flags.DEFINE_string("gmm", "ragged_dot", "grouped-matmul backend: ragged_dot (= auto) | padded | "
                    "custom | scan (exact, one expert at a time: for compile-only memory studies "
                    "on CPU) | mgpu (Hopper kernels, opt-in: unmeasured on hardware)")
flags.DEFINE_string("opt", None, "the strategy's own options, key=value,... (each strategy's "
                    "Options in strategies/NAME.py; e.g. ep: exchange=a2a|ragged|none, "
                    "shard_exp_on_fsdp: mode=gather|ep, ep_tp: capacity=0..1)")
flags.DEFINE_string("metrics_file", None, "write JSON lines: one per step, then a summary")
flags.DEFINE_bool("describe", False, "print the model's total and activated-per-token parameter "
                  "counts (total_params N, activated_params N) and exit, compiling nothing")
flags.DEFINE_bool("dump_sharding", False, "print every parameter's and key activation's sharding")
flags.DEFINE_bool("hlo_stats", False, "with --strategy: print collectives, flops and memory of "
                  "the compiled step (the comparison table shows them for every strategy)")
flags.DEFINE_bool("compile_only", False, "compile from abstract shapes and report collectives and "
                  "memory without running (no parameter is allocated); compare mode or --strategy")
flags.DEFINE_bool("breakdown_all", False, "--breakdown naming every cost term in its 'what' "
                  "column (implies --breakdown)")
flags.DEFINE_bool("breakdown", False, "print each strategy's bytes per (kind, axes, phase) and per "
                  "layer: the cost model's named terms beside the compiled program's")
flags.DEFINE_bool("full_parity", False, "compare mode: hold every gradient and post-step parameter "
                  "to the reference's, not only the losses (Adam eps 1e-5, bf16: 1e-2 with experts "
                  "chosen by token position on both sides, unless --adam_eps; "
                  "measure/agreement.py)")
flags.DEFINE_bool("overwrite_checkpoint", False, "let a run delete the steps of --checkpoint_dir "
                  "its saves would collide with (without it, such a run is refused)")


flags.DEFINE(command.MemoryParser(), "hbm_gb", None, "with --compile_only (and --plan): per-device memory to fit in, "
             "in GiB (2^30 B) or with a unit: 80GB (10^9 B = 74.5 GiB, an '80 GB' card), "
             "74.5GiB, 512MiB; adds total/dev = params + optimizer + XLA temp, and whether it "
             "fits", serializer=flags.ArgumentSerializer())
flags.DEFINE_string("report_dir", None, "compare mode: write table.json, table.csv and PNG plots here")
flags.DEFINE_string("coordinator_address", None, "multi-process: host:port of process 0's "
                    "coordinator (default: $JAX_COORDINATOR_ADDRESS or the cluster's)")
flags.DEFINE_integer("num_processes", None, "multi-process: number of processes")
flags.DEFINE_integer("process_id", None, "multi-process: this process's id in [0, num_processes)")
flags.DEFINE_string("checkpoint_dir", None, "save (and --restore) orbax checkpoints here")
flags.DEFINE_integer("save_every", 0, "save every N steps (0 = only after the last step)")
flags.DEFINE_string("restore", None, "'latest' or a step: resume from --checkpoint_dir, in any "
                    "strategy and mesh (same model and --optimizer)")
flags.DEFINE_string("init_from", None, "--strategy: start from a Hugging Face checkpoint "
                    "directory (config.json + safetensors; modeling/export_hf.py): the model is "
                    "its config.json (--model omitted or the same path), the weights its "
                    "tensors, placed in the strategy's shardings; every tensor checked before "
                    "compiling")
flags.DEFINE_string("export_hf", None, "--strategy: after the last step, write the trained "
                    "weights here as a Hugging Face checkpoint (model.safetensors, float32, and "
                    "config.json: --init_from's, or one for the model's family)")
flags.DEFINE_bool("plan", False, "rank every admissible layout of --model on --devices devices of "
                  "--cluster by predicted step time, among those whose predicted memory fits "
                  "--hbm_gb (default: the cluster's), then compile the best --plan_compile "
                  "(planning/). Given with it, --strategy / --compare, --mesh, --microbatches, "
                  "--remat (none | block), --capacity_factor, --opt=key=value and --layer_layout "
                  "(pp only) restrict what it enumerates to their values")
flags.DEFINE_string("cluster", "h100", "--plan: the cluster profile (planning/clusters.py): "
                    "h100 | h800 | h200 | b200 | tpu-v5p | tpu-v6e | tpu-v7; on a TPU, "
                    "--plan_compile compiles with XLA:TPU where libtpu is installed")
flags.DEFINE_integer("plan_compile", 2, "--plan: compile (compile only) this many of the best "
                     "layouts and print predicted vs compiled memory and bytes (0 = none)")
flags.DEFINE_integer("plan_top", 15, "--plan: rows of the ranked table to print")
flags.DEFINE_string("plan_find", None, "--plan: also print where one layout ranks, or why it "
                    "was refused: STRATEGY@MESH, e.g. pp@stage:16,data:2,expert:64")
flags.DEFINE_float("plan_efficiency", 0.5, "--plan: the fraction of peak FLOP/s the step's "
                   "matmuls are assumed to reach")
flags.DEFINE_string("plan_overlap", "weights", "--plan: what communication runs under compute: "
                    "none (every collective serial with it: the upper bound) | weights (weight "
                    "gathers, gradient reductions and point-to-point sends hidden, as XLA:GPU's "
                    "asynchronous collectives run them) | schedule "
                    "(also the all-to-alls of 1f1b, which pairs two microbatches in a tick)")
flags.DEFINE_string("plan_a2a", "flat", "--plan: how an all-to-all that crosses nodes moves its "
                    "rows: flat (every routed copy over InfiniBand) | hierarchical (DeepEP: a "
                    "token crosses to each destination node once, NVLink fans it out there)")
flags.DEFINE_string("plan_ici", "torus", "--plan on a TPU cluster: what a slice's torus "
                    "gives a collective inside it: dimension (one torus dimension's links) | "
                    "torus (the links of every dimension its group spans: 4 chips one, 16 two, "
                    "64 or more three)")
flags.DEFINE_string("plan_gmm", "rows", "--plan: what the routed experts' grouped matmuls cost: "
                    "flat (at --plan_efficiency, whatever their rows) | rows (at efficiency x "
                    "r / (r + planning.plan.GMM_HALF_ROWS), r the rows per local expert of one "
                    "layer's call)")
flags.DEFINE_float("plan_imbalance", 0.0, "--plan: the busiest device's routed work over "
                   "balanced routing's, minus 1 (0.1: 10% more), at most the capacity factor; "
                   "it scales the routed experts' matmuls (the published runs measured real "
                   "routing 8-20% slower than forced-balanced; docs/planner.md)")
flags.DEFINE_string("target", None, "with --compile_only: compile for --devices devices of this "
                    "hardware, on this host, with its own compiler (runtime/target.py): "
                    + ", ".join(target_lib.PROFILES) + " (TPU: pip install -r "
                    "requirements-tpu.txt; GPU: -r requirements-gpu.txt); the report's memory is "
                    "that compiler's. With --plan: --plan_compile's candidates are compiled so, "
                    "on the target chip's --cluster")
flags.DEFINE_string("compilation_cache", "~/.cache/moe-sharding/jax",
                    "persistent XLA compilation cache ('' = off); reruns skip compiles")




class CheckFailed(Exception):
  """A check the run was asked for did not pass: one `error:` line, exit status 1."""


def on_compiled(job, strat, stats, mesh_desc, say, memory: str = "") -> None:
  """--strategy: what the flags ask about the compiled step (--dump_sharding, --hlo_stats,
  --compile_only's memory, whose compiler it comes from (memory: its Target's label), and its
  fit, --breakdown), printed before any step runs."""
  import report
  cfg, mesh, opts = job.cfg, job.mesh, job.opts
  if F.dump_sharding:
    for kind, rows in report.shardings(job, strat, with_batch=not F.compile_only):
      for path, t in rows:
        say(f"  {kind:<5s} {path:<40s} {t}")
  if F.hlo_stats or F.compile_only:
    say(report.hlo_lines(stats))
  if F.compile_only and mesh is not None:
    say(f"  memory: {memory}")
    say(report.fit_line(cfg, strat, mesh, opts, stats, F.hbm_gb))
  if (F.breakdown or F.breakdown_all) and mesh is not None:
    from measure import cost
    row = {"strategy": F.strategy, "mesh": mesh_desc, "terms": cost.step_terms(strat, cfg, mesh, opts),
           "collectives_by_axes": stats["collectives_by_axes"]}
    say(report.breakdown(row, cfg.n_layers, every_what=F.breakdown_all))


def train_one(cfg, opts, devices) -> None:
  """--strategy: its mesh over `devices` (a runtime.target.Target) and stored model (notes
  said), then runtime.session's run."""
  import jax

  from layout import mesh as mesh_lib
  from runtime import session
  import strategies
  say = print if jax.process_index() == 0 else (lambda *a, **k: None)
  strat = strategies.get(F.strategy)
  mesh = mesh_lib.for_strategy(strat, F.mesh, len(devices.devices), devices.devices)
  notes = [getattr(strat, "layout_note", lambda *a: None)(cfg, mesh, opts),  # pp: its layout
           mesh_lib.order_note(strat, F.mesh)]
  for note in filter(None, notes):
    say(f"note: {note}")
  cfg = strategies.stored_config(strat, cfg, mesh, opts)     # how its options store the model
  session.train_one(F, strat, cfg, mesh, opts,
                    functools.partial(on_compiled, memory=devices.memory_label()), say,
                    devices=devices)


def main(argv):
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if F.strategy and F.compare:
    raise UsageError("give --strategy or --compare, not both")
  if F.plan:
    if F.target is None:
      F.target = command.plan_target(F)
    if F.target is not None:
      command.check_target(F)
    else:
      command.host_backend_only()     # ranking reads no device, but jax may start a backend
    from planning import cli
    import strategies
    find = cli.check_flags(F)
    bases = dict.fromkeys(strategies.split_entry(n)[0] for n in command.strategy_names(F))
    cli.run(F, [n for n in bases if n != "reference"], find)
    return
  dist = command.check_flags(F)
  names = command.strategy_names(F)
  opts = command.strategy_options(F, names)
  cfg = command.make_config(F)
  from runtime import data
  data.check_run(cfg)                          # --data: format, length, vocab; before compiling
  if F.describe:
    from modeling import model
    total, active = model.param_counts(cfg)
    table = cfg.vocab * cfg.d_model
    print(f"total_params {total}\nactivated_params {active}\n"
          f"activated_params_with_embeddings {active - cfg.d_model + table}\n"
          f"model {F.model}: {total / 1e9:.2f}B total, {active / 1e9:.2f}B activated per token "
          f"({(active - cfg.d_model + table) / 1e9:.2f}B counting the embedding table whole); "
          f"{cfg.n_layers} layers ({cfg.n_dense_layers} dense), {cfg.n_experts} experts "
          f"top-{cfg.top_k}, {cfg.attention}, vocab {cfg.vocab}")
    return
  if F.full_parity and F.adam_eps is None:
    from measure import agreement
    cfg = cfg.replace(adam_eps=agreement.parity_eps(cfg))   # see measure/agreement.py
  devices = command.setup_devices(F.devices, dist, F.compilation_cache, F.target)
  cfg = command.compile_only_gmm(F, cfg, devices)
  if cfg.attention_impl == "cudnn":
    import jax
    from modeling.config import ConfigError
    if jax.default_backend() != "gpu":
      raise ConfigError(f"--attention=cudnn needs a GPU (this host's backend: "
                        f"{jax.default_backend()}); use --attention=chunked")
  if F.strategy:
    train_one(cfg, opts[F.strategy], devices)
    return
  import compare
  init = None
  if F.init_from:                       # every row, the reference's too, from the checkpoint
    from runtime import session
    init = session.init_every_row(F, cfg)
  rows = compare.main(cfg, names=names, mesh_spec=F.mesh, steps=3 if F.steps is None else F.steps,
                      report_dir=F.report_dir, compile_only=F.compile_only, model_name=F.model,
                      hbm_gb=F.hbm_gb, opts=opts, full_parity=F.full_parity,
                      breakdown=F.breakdown or F.breakdown_all, every_what=F.breakdown_all,
                      init=init, devices=devices)
  failures, skipped = compare.outcome(rows, F.compile_only)
  for line in skipped:
    print(f"skipped: {line}", file=sys.stderr)
  if failures:
    raise CheckFailed("compare did not pass: " + "; ".join(failures))


HELP = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def _parse_flags(argv):
  """absl's parse, with its two exits made this tool's: a bad flag value is a one-line error
  (exit 2, where absl exits 1 with a usage banner), and asked-for help exits 0."""
  command.retired(argv)
  argv = [argv[0]] + ["--help" if a == "-h" else a for a in argv[1:]]
  try:
    return F(argv)
  except flags.Error as e:
    raise UsageError(str(e)) from None
  except SystemExit:
    if any(a.split("=")[0] in HELP for a in argv[1:]):
      sys.exit(0)
    raise


def _run():
  """Exit status: 0 what was asked ran and passed; 1 a check failed (parity, a non-finite
  loss, a strategy that failed to build, nothing compared, a failed save, a plan with no
  candidate left, a --target's compiler refusing a step over its HBM); 2 bad input, before anything compiles (docs/command-line.md)."""
  from modeling.config import ConfigError
  from planning.constraints import NoCandidate
  from runtime.checkpoint import SaveError
  from runtime.session import NonFinite
  from runtime.target import OverHBM
  try:
    app.run(main, flags_parser=_parse_flags)
  except (ConfigError, UsageError, NonFinite, CheckFailed, SaveError, NoCandidate, OverHBM) as e:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2 if isinstance(e, (ConfigError, UsageError)) else 1)


if __name__ == "__main__":
  _run()
