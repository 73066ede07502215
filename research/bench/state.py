"""Masks and decode state: sliding-window attention's cost, a rolling cache's size, prefill speed.

Three parts, one run, every time a median of interleaved repeats (research.bench.timing):
  window   blockwise attention forward + backward at 8192 tokens, sliding window W = 256 (each
           query sees its last W keys, itself included) against full causal attention, at the
           mixers suite's kernel shape (batch 1, 8 heads, head_dim 64, block 128). Tiles wholly
           outside the window are skipped, so the work falls from ~L^2 / 2 to ~L (W + block).
  cache    model.cache_bytes of the decode suite's model (2 layers, d_model 256, 8 heads) for
           every softmax variant, full KV cache against window 256 + 4 sinks (StreamingLLM,
           arXiv:2309.17453: a rolling buffer of sinks + window slots), at contexts 1K and 16K.
  prefill  one `model.prefill` of 4096 tokens against 4096 one-token `model.decode` steps (a
           jitted step per token, the cache donated, as research.evaluation.generate runs them) of
           the same tokens, for every mixer in research.model.attention.REGISTRY with RoPE, or no
           positions where it cannot take them; the training suite's reference model (2
           layers, d_model 128, 4 heads, 2 key/value heads for gqa).
A part that cannot run (say, a setting this code lacks) is recorded as skipped with its error.
"""

import dataclasses
import statistics

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import attention
from research.model import transformer as model_lib
from research.model.attention import core
from research.bench import decode
from research.bench import mixers
from research.bench import report
from research.bench import timing
from research.bench import train


@dataclasses.dataclass(frozen=True)
class Settings:
  window_length: int = 8192  # part window: sequence length, window, blockwise block
  window: int = 256
  block_size: int = 128
  contexts: tuple = (1024, 16384)  # part cache: contexts, and the rolling buffer's window + sinks
  cache_window: int = 256
  cache_sinks: int = 4
  prefill_length: int = 4096  # part prefill
  repeats: int = 5  # interleaved rounds (part prefill: prefill_repeats)
  prefill_repeats: int = 3


FULL = Settings()
QUICK = Settings(window_length=256, window=32, block_size=32, prefill_length=32, repeats=1,
                 prefill_repeats=1)
TARGETS = {"window": 1 / 8, "prefill": 10.0}  # window / full time at most; prefill speed-up


def _skipped(part, series, error, **fields):
  return {"part": part, "series": series, **fields,
          "skipped": report.error_reason(error)}


def _medians(calls, repeats):
  return {name: statistics.median(times)
          for name, times in timing.interleaved_seconds(calls, repeats).items()}


def window_rows(settings, dtype):
  """Part window: fwd+bwd time and compiled temp memory, full causal and sliding window."""
  length, block = settings.window_length, settings.block_size
  shapes = lambda n: [(mixers.BATCH, n, mixers.HEADS, mixers.HEAD_DIM)] * 3
  kernels = {
      "blockwise full causal": lambda q, k, v: core.attend(q, k, v, backend="blockwise",
                                                           block_size=block),
      f"blockwise window={settings.window}": lambda q, k, v: core.attend(
          q, k, v, backend="blockwise", block_size=block,
          mask=core.MaskSpec(window=settings.window))}
  calls, rows = {}, {}
  for series, fn in kernels.items():
    row = {"part": "window", "series": series, "length": length, "window": 0 if "full" in series
           else settings.window, "block_size": block}
    try:
      kernel = mixers.Kernel(series, "softmax", fn, shapes)
      inputs, cotangent = mixers.make_inputs(kernel, length, dtype)
      compiled = timing.compile_fn(mixers.forward_backward(kernel), *inputs, cotangent)
      row.update(timing.memory_bytes(compiled))
      calls[series] = lambda compiled=compiled, args=(*inputs, cotangent): compiled(*args)
    except Exception as error:  # pylint: disable=broad-except  # recorded, the others still run
      row = _skipped(**row, error=error)
    rows[series] = row
  for series, seconds in _medians(calls, settings.repeats).items():
    rows[series].update(time_ms=round(1e3 * seconds, 3), repeats=settings.repeats)
  return list(rows.values())


def cache_rows(settings, dtype):
  """Part cache: model.cache_bytes (from shapes alone) of every softmax variant, full and
  with a rolling window + sinks buffer."""
  rows = []
  rolling = f"window={settings.cache_window}+sinks={settings.cache_sinks}"
  for variant in decode.variants():
    config = decode.model_config(variant, dtype)
    if not attention.REGISTRY.lookup(config.attention).supports_sliding_window:
      continue
    for label, window, sinks in (("full", 0, 0),
                                 (rolling, settings.cache_window, settings.cache_sinks)):
      series = f"{variant} {label}"
      try:
        config[attention.REGISTRY.settings_key(config.attention)].update(
            dict(window=window, sinks=sinks))  # the mixer's own settings (sigmoid's, ...)
        model = nnx.eval_shape(lambda config=config: model_lib.build_model(config,
                                                                           rngs=nnx.Rngs(0)))
        rows += [{"part": "cache", "series": series, "variant": variant, "cache": label,
                  "context": context, "cache_bytes": model.cache_bytes(1, context)}
                 for context in settings.contexts]
      except Exception as error:  # pylint: disable=broad-except
        rows.append(_skipped("cache", series, error, variant=variant, cache=label))
  return rows


def prefill_rows(settings, dtype, only=()):
  """Part prefill: one prefill call against token-by-token decode steps, per mixer."""
  length, rows = settings.prefill_length, []
  tokens = jax.random.randint(jax.random.key(0), (1, length), 0, 256, jnp.int32)
  columns = [tokens[:, t:t + 1] for t in range(length)]
  for attention_name, position in train.mixer_variants():
    variant = f"{attention_name}/{position}"
    if only and variant not in only:
      continue
    config = train.reference_config(attention_name, position, length, 2, dtype).model
    model = model_lib.build_model(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    prefill = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).prefill(t, c), donate_argnums=2)
    step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c), donate_argnums=2)

    def run_prefill(model=model, prefill=prefill, state=state):
      return prefill(state, tokens, model.init_cache(1, length))

    def run_steps(model=model, step=step, state=state):
      cache = model.init_cache(1, length)
      for column in columns:
        logits, cache = step(state, column, cache)
      return logits, cache

    modes = {"prefill": run_prefill, "token_by_token": run_steps}
    try:
      seconds = _medians(modes, settings.prefill_repeats)
    except Exception as error:  # pylint: disable=broad-except
      rows += [_skipped("prefill", f"{variant} {mode}", error, variant=variant, mode=mode,
                        length=length) for mode in modes]
      continue
    for mode in modes:
      rows.append({"part": "prefill", "series": f"{variant} {mode}", "variant": variant,
                   "mode": mode, "length": length,
                   "time_ms": round(1e3 * seconds[mode], 3),
                   "tokens_per_second": round(length / seconds[mode], 1),
                   "repeats": settings.prefill_repeats})
      print(report.progress_line(rows[-1]), flush=True)
  return rows


def run(args):
  settings = QUICK if args.quick else FULL
  dtype = jnp.dtype(args.dtype)
  rows = window_rows(settings, dtype)
  rows += cache_rows(settings, args.dtype)
  for row in rows:
    print(report.progress_line(row), flush=True)
  return rows + prefill_rows(settings, args.dtype, args.only)


def _part(rows, part):
  return [row for row in rows if row["part"] == part]


def summary(rows):
  f = report.fmt_ratio
  lines = []
  window = {row["series"]: row for row in _part(rows, "window")}
  full = next((r for r in window.values() if not r.get("window") and "skipped" not in r), {})
  for series, row in window.items():
    if not row.get("window"):
      continue
    ratio = report.ratio(row.get("time_ms"), full.get("time_ms"))
    lines.append(f"{series} / full causal blockwise fwd+bwd time at {row['length']} = "
                 f"{f(ratio)} (target <= {TARGETS['window']:.3f}x = 1/8): "
                 f"{report.verdict(ratio, TARGETS['window'])}")
  cache = _part(rows, "cache")
  for variant in dict.fromkeys(row["variant"] for row in cache):
    sizes = {(row["cache"], row["context"]): row["cache_bytes"] for row in cache
             if row["variant"] == variant and "cache_bytes" in row}
    contexts = sorted({context for _, context in sizes})
    rolling = [sizes[key] for key in sorted(sizes) if key[0] != "full"]
    full_sizes = [sizes.get(("full", c)) for c in contexts]
    if len(rolling) < 2:
      lines.append(f"{variant} rolling window + sinks cache bytes: not measured in this run")
      continue
    same = len(set(rolling)) == 1
    lines.append(
        f"{variant} window + sinks cache bytes at contexts {', '.join(map(str, contexts))} = "
        f"{', '.join(f'{b / report.MIB:.3f}' for b in rolling)} MiB (target identical): "
        f"{'met' if same else 'MISSED'}; full KV cache "
        f"{', '.join('—' if b is None else f'{b / report.MIB:.3f}' for b in full_sizes)} MiB")
  prefill = _part(rows, "prefill")
  if prefill:
    length = prefill[0]["length"]
    verdicts = report.verdicts_over(_prefill_speedups(prefill), TARGETS["prefill"], at_most=False)
    lines.append(f"one prefill of {length} tokens >= {TARGETS['prefill']:.0f}x faster than "
                 f"{length} one-token decode steps: {verdicts}")
  return lines


def _prefill_speedups(prefill):
  """{variant: token-by-token time / prefill time} (None where either is missing)."""
  get = lambda variant, mode: report.lookup(prefill, "time_ms", variant=variant, mode=mode)
  return {variant: report.ratio(get(variant, "token_by_token"), get(variant, "prefill"))
          for variant in dict.fromkeys(row["variant"] for row in prefill)}


def _prefill_table(rows, ms):
  prefill = _part(rows, "prefill")
  get = lambda variant, mode: report.lookup(prefill, "time_ms", variant=variant, mode=mode)
  cell = lambda value: "skip" if value is None else ms(value)  # noqa: E731
  body = [[variant, cell(get(variant, "prefill")), cell(get(variant, "token_by_token")),
           report.fmt_ratio(speedup)] for variant, speedup in _prefill_speedups(prefill).items()]
  return report.markdown_table(["variant", "prefill", "token by token", "speed-up"], body)


def tables(rows):
  mib = lambda b: f"{b / report.MIB:.3f}"
  ms = lambda x: f"{x:.1f}"
  window = [[r["series"], r["length"], r["block_size"],
             ms(r["time_ms"]) if "time_ms" in r else "skip",
             mib(r["temp_bytes"]) if "temp_bytes" in r else "—"] for r in _part(rows, "window")]
  result = [
      ("blockwise attention fwd+bwd: sliding window against full causal", report.markdown_table(
          ["kernel", "length", "block", "time, ms (median)", "temp memory, MiB"], window)),
      ("decode cache bytes (model.cache_bytes), MiB",
       report.pivot([r for r in _part(rows, "cache") if "cache_bytes" in r], "series", "context",
                    "cache_bytes", mib)),
      ("prefill against token-by-token decode, ms (median)", _prefill_table(rows, ms)),
  ]
  skipped = [[r["part"], r["series"], r["skipped"]] for r in rows if r.get("skipped")]
  if skipped:
    result.append(("skipped", report.markdown_table(["part", "series", "reason"], skipped)))
  return result


SUITE = report.Suite(
    name="state",
    description=(
        f"Sliding-window blockwise attention against full causal (fwd+bwd, {FULL.window_length} "
        f"tokens, window {FULL.window}, block {FULL.block_size}, batch {mixers.BATCH}, "
        f"{mixers.HEADS} heads, head_dim {mixers.HEAD_DIM}); decode cache bytes of the decode "
        f"suite's model with window {FULL.cache_window} + {FULL.cache_sinks} sinks against the "
        f"full KV cache; one prefill of {FULL.prefill_length} tokens against as many one-token "
        f"decode steps, every mixer, 2 layers, d_model 128. Times: medians of interleaved "
        f"repeats ({FULL.repeats}; prefill part {FULL.prefill_repeats}) after a warm-up call. "
        f"--quick: {QUICK.window_length} tokens, window {QUICK.window}, block "
        f"{QUICK.block_size}, prefill of {QUICK.prefill_length}, one repeat."),
    run=run, tables=tables, summary=summary, takes_lengths=False,
    panels=(report.Panel("context", "cache_bytes", "series", "decode cache bytes", "MiB",
                         scale=report.MIB),))  # the times are single points: in the tables
