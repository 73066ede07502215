"""Training throughput and MFU: the shared loop (research.training.loop) against a minimal step.

For each variant at one reference model size (2 layers, d_model 128, 4 heads; the issue's CPU
reference), tokens per second of the whole training loop (data, sharded jit step, metrics), read
from its metrics.jsonl after compilation, and of a minimal hand-written Flax NNX step (nnx.jit,
nnx.value_and_grad, nnx.Optimizer with the same optax chain) on the same batches. MFU =
train FLOPs per token (research.model.flops) x tokens/s / peak, the peak being a large matmul
measured in the same run on CPU (datasheet bf16 peak x devices on accelerators).

Packed documents: the same loop and model (PACKING_VARIANT, the shortest length) with
data.packing = "concat" and "documents" (segment ids and per-document positions in every batch,
attention within documents), run alternately PACKING_REPEATS times; the median tokens/s of each
and their ratio (target: documents >= 0.9x concat).
"""

import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from research import defaults
from research.model import attention
from research import data
from research.model import flops
from research.model import positions
from research.model import transformer as model_lib
from research.training import loop as train_lib
from research.bench import report

QUICK_VARIANTS = (("mha", "rope"), ("linear", "rope"))


def mixer_variants():
  """(attention, position): every mixer with RoPE, or no positions where it cannot take them."""
  return [(name, "rope" if "rope" in model_lib.compatible_positions(cls) else "none")
          for name, cls in attention.REGISTRY.items()]


def variants():
  """Every mixer (mixer_variants), then MHA with every other position scheme: read from the
  registries."""
  return mixer_variants() + [("mha", p) for p in positions.REGISTRY if p != "rope"]
TOKENS_PER_BATCH = 4096  # batch 32 x length 128
LENGTHS, QUICK_LENGTHS = (128, 512), (32,)
PACKING_VARIANT = ("mha", "rope")
PACKING_REPEATS, QUICK_PACKING_REPEATS = 5, 1  # runs of each packing, alternating
PACKING_TARGET = 0.9  # documents / concat tokens/s


def reference_config(mixer, position, seq_len, num_steps, dtype):
  config = defaults.get_config()
  config.model.update(dict(attention=mixer, position=position, num_layers=2, d_model=128,
                           num_heads=4, compute_dtype=dtype))
  if mixer in attention.kv_head_variants():  # gqa at 2 of 4 heads (at 4 it is mha)
    config.model.num_kv_heads = 2
  config.train.update(dict(seq_len=seq_len, batch_size=max(TOKENS_PER_BATCH // seq_len, 1),
                           num_steps=num_steps, warmup_steps=1, log_every=num_steps // 2,
                           checkpoint_every=num_steps, eval_batches=1))
  config.mesh.shape = (-1, 1, 1)
  config.eval.update(dict(lengths=(seq_len,), modes=("nonoverlapping",), batch_size=jax.device_count(),
                          num_tokens=max(seq_len, 1024)))
  return config


def loop_tokens_per_second(config):
  """The loop's own measurement over its second logging window (compilation excluded)."""
  with tempfile.TemporaryDirectory() as workdir:
    train_lib.train_and_evaluate(config, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return json.loads(f.readlines()[-1])["tokens_per_second"]


def minimal_tokens_per_second(config):
  """A hand-written NNX train step on the same model, optimizer and batches."""
  model = model_lib.build_model(config.model, rngs=nnx.Rngs(config.train.seed))
  optimizer = nnx.Optimizer(model, train_lib.make_optimizer(config)[0], wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    def loss_fn(model):
      logits = model(batch["inputs"], positions_BxL=batch.get("positions"),
                     segments_BxL=batch.get("segments"))
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
      return (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  t = config.train
  batches = [jax.tree.map(jnp.asarray, data.train_batch(config, s)) for s in range(t.num_steps)]
  step(model, optimizer, batches[0]).block_until_ready()  # compile
  start = time.perf_counter()
  for batch in batches[1:]:
    loss = step(model, optimizer, batch)
  loss.block_until_ready()
  return (t.num_steps - 1) * t.batch_size * t.seq_len / (time.perf_counter() - start)


def _row(config, implementation, tokens_per_second, peak, **extra):
  attention, seq_len = config.model.attention, config.train.seq_len
  model = nnx.eval_shape(lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0)))
  flops_per_token = flops.train_flops_per_token(model, seq_len)
  row = {"variant": f"{attention}/{config.model.position}", "implementation": implementation,
         "series": f"{attention} {implementation}", "seq_len": seq_len,
         "batch_size": config.train.batch_size,
         "params": model_lib.count_params(model), "flops_per_token": flops_per_token,
         "tokens_per_second": tokens_per_second,
         "mfu": flops.mfu(flops_per_token, tokens_per_second, peak),
         "peak_flops": peak, **extra}
  print(report.progress_line(row), flush=True)
  return row


def packing_rows(seq_len, num_steps, repeats, dtype, peak, measured=None):
  """One row per data.packing: the median loop tokens/s over `repeats` alternating runs.
  `measured`: {config JSON: loop tokens/s} of runs made already; with one repeat, a packing whose
  config was run (the default packing of the loop row) takes that run instead of another."""
  configs = {}
  for packing in data.PACKINGS:
    configs[packing] = reference_config(*PACKING_VARIANT, seq_len, num_steps, dtype)
    configs[packing].data.packing = packing
  runs = {packing: [] for packing in data.PACKINGS}
  for _ in range(repeats):  # alternating, so that drifting machine load affects both alike
    for packing, config in configs.items():
      known = (measured or {}).get(config.to_json()) if repeats == 1 else None
      runs[packing].append(known or loop_tokens_per_second(config))
  return [_row(config, f"loop, packing={packing}", statistics.median(runs[packing]), peak,
               packing=packing, runs=runs[packing])
          for packing, config in configs.items()]


def run(args):
  lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
  num_steps = 4 if args.quick else 40
  peak = flops.total_peak_flops()
  rows, measured = [], {}
  for attention, position in QUICK_VARIANTS if args.quick else variants():
    if args.only and f"{attention}/{position}" not in args.only:
      continue
    for seq_len in lengths:
      config = reference_config(attention, position, seq_len, num_steps, args.dtype)
      tokens_per_second = measured[config.to_json()] = loop_tokens_per_second(config)
      rows.append(_row(config, "loop", tokens_per_second, peak))
      if seq_len == lengths[0]:
        rows.append(_row(config, "minimal", minimal_tokens_per_second(config), peak))
  if not args.only or {"packing", "/".join(PACKING_VARIANT)} & set(args.only):
    rows += packing_rows(lengths[0], num_steps,
                         QUICK_PACKING_REPEATS if args.quick else PACKING_REPEATS, args.dtype, peak,
                         measured)
  return rows


def _loop_over_minimal(rows):
  """{variant: loop / minimal tokens/s at the variant's shortest length}."""
  loop_rows = [row for row in rows if "packing" not in row]
  ratios = {}
  for variant in dict.fromkeys(row["variant"] for row in loop_rows):
    seq_len = min(row["seq_len"] for row in loop_rows if row["variant"] == variant)
    get = lambda impl: report.lookup(rows, "tokens_per_second", variant=variant,  # noqa: E731
                                     implementation=impl, seq_len=seq_len)
    ratios[variant] = report.ratio(get("loop"), get("minimal"))
  return ratios


def summary(rows):
  lines = [f"peak (measured large matmul on CPU, datasheet elsewhere): "
           f"{rows[0]['peak_flops'] / 1e9:.1f} GFLOP/s"]
  ratios = _loop_over_minimal(rows)
  if ratios:
    lengths = sorted({row["seq_len"] for row in rows if "packing" not in row})
    lines.append(f"loop / minimal NNX step tokens/s at length {lengths[0]} >= 0.95x: "
                 f"{report.verdicts_over(ratios, 0.95, at_most=False)}")
  get = lambda packing: report.lookup(rows, "tokens_per_second", packing=packing)
  ratio = report.ratio(get("documents"), get("concat"))
  runs = report.lookup(rows, "runs", packing="concat")
  lines.append(f"packed-document training loop: documents / concat tokens/s "
               f"({'/'.join(PACKING_VARIANT)}, medians of {len(runs or ())} alternating runs "
               f"each) = {report.fmt_ratio(ratio)} (target >= {PACKING_TARGET}x): "
               f"{report.verdict(ratio, PACKING_TARGET, at_most=False)}")
  return lines


def tables(rows):
  loop_rows = [row for row in rows if "packing" not in row]
  lengths = sorted({row["seq_len"] for row in loop_rows})
  ratios = _loop_over_minimal(rows)

  def cell(variant, impl, seq_len):
    row = next((r for r in loop_rows if (r["variant"], r["implementation"], r["seq_len"])
                == (variant, impl, seq_len)), None)
    return "—" if row is None else f"{row['tokens_per_second']:,.0f} ({100 * row['mfu']:.1f}%)"

  body = []
  for variant in ratios:
    first = next(r for r in loop_rows if r["variant"] == variant)
    flops = [report.lookup(loop_rows, "flops_per_token", variant=variant, seq_len=n)
             for n in lengths]
    body.append([variant, f"{first['params']:,}",
                 " / ".join("—" if x is None else f"{x / 1e6:.2f}" for x in flops),
                 cell(variant, "loop", lengths[0]), cell(variant, "minimal", lengths[0]),
                 report.fmt_ratio(ratios[variant])]
                + [cell(variant, "loop", n) for n in lengths[1:]])
  batches = {n: report.lookup(loop_rows, "batch_size", seq_len=n) for n in lengths}
  header = ["variant", "params", "MFLOP/token at " + " / ".join(map(str, lengths)),
            f"loop, {batches[lengths[0]]} x {lengths[0]}: tokens/s (MFU)",
            f"minimal, {batches[lengths[0]]} x {lengths[0]}", "loop / minimal"]
  header += [f"loop, {batches[n]} x {n}" for n in lengths[1:]]
  packed = [[r["variant"], r["packing"], r["seq_len"], r["batch_size"],
             ", ".join(f"{x:,.0f}" for x in r["runs"]), f"{r['tokens_per_second']:,.0f}"]
            for r in rows if "packing" in r]
  return [("training throughput", report.markdown_table(header, body)),
          ("packed documents (data.packing), alternating runs", report.markdown_table(
              ["variant", "packing", "length", "batch", "tokens/s of each run",
               "median tokens/s"], packed))]


SUITE = report.Suite(
    name="train",
    description=(
        "Training tokens/s and MFU at the reference size (2 layers, d_model 128, 4 heads, "
        f"{TOKENS_PER_BATCH} tokens per batch): the shared loop (`research.training.loop`, "
        "metrics.jsonl, "
        "compilation excluded) against a minimal hand-written Flax NNX step on the same batches; "
        "and the loop with packed documents (data.packing=documents) against concatenated "
        "windows (concat), alternating runs, median tokens/s."),
    run=run, tables=tables, summary=summary,
    panels=(report.Panel("seq_len", "tokens_per_second", "series", "training throughput",
                         "tokens / second"),))
