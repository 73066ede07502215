"""Per-token decode latency and cache bytes against context length, per attention type.

A small reference model (2 layers, d_model 256, 8 heads, head_dim 32, no position scheme so
that only the mixer differs) decodes one token with its cache sized to the context being
measured and filled up to it: cache["index"] is set to context - 1
instead of prefilling, which does not change the work of a step, and every timed step keeps
that index, so each one attends over the whole context. The step is `nnx.split` / `merge`
inside `jax.jit` with the cache donated. Bytes: `model.cache_bytes` for every type, and for
softmax types the analytic KV cache 2 * layers * kv_heads * head_dim * bytes * tokens * batch
(plus what the mixer keeps per key: FoX's float32 log forget gate per head).
"""

import statistics

import jax
import jax.numpy as jnp
from flax import nnx

from research import defaults
import research
from research.model import attention
from research.bench import report
from research.bench import timing

BATCH, LAYERS, D_MODEL, HEADS = 1, 2, 256, 8
LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (256, 1024)
STEPS, WARMUP = 64, 3  # timed and warm-up decode steps per point


def variants():
  """name -> model-config overrides: every registered mixer, the head-count variants with their
  own key/value heads (attention.kv_head_variants: gqa) at 4 and 2 of the 8 heads."""
  table = {}
  grouped = attention.kv_head_variants()
  for name in attention.REGISTRY:
    if name in grouped:
      table.update({f"{name}_kv{k}": {"attention": name, "num_kv_heads": k} for k in (4, 2)})
    else:
      table[name] = {"attention": name}
  return table


def _grows(config):
  """Whether the mixer's decode cache grows with the context (a KV cache)."""
  return attention.REGISTRY.lookup(config.attention).cache_bytes_per_token(config) is not None


def model_config(variant, dtype):
  config = defaults.get_config().model
  config.update(num_layers=LAYERS, d_model=D_MODEL, num_heads=HEADS, position="none",
                compute_dtype=dtype, **variants()[variant])
  return config


def kv_heads(config):
  return attention.REGISTRY.lookup(config.attention).kv_heads(config)


def analytic_kv_bytes(config, context):
  """layers * the mixer's cache bytes per token * tokens * batch, for a cache that grows with
  the context: keys and values, 2 * kv_heads * head_dim * bytes (FoX adds a float32 log forget
  gate per head); None for a fixed state."""
  if not _grows(config):
    return None
  per_token = attention.REGISTRY.lookup(config.attention).cache_bytes_per_token(config)
  return config.num_layers * per_token * context * BATCH


def decode_step(graphdef):
  """A jitted step (state, token, cache) -> (logits, cache) that keeps the cache's index."""

  def step(state, token_Bx1, cache):
    logits, new_cache = nnx.merge(graphdef, state).decode(token_Bx1, cache)
    return logits, {**new_cache, "index": cache["index"]}

  return jax.jit(step, donate_argnums=2)


def step_latencies(step, state, token, cache, steps, warmup):
  """Seconds of each of `steps` calls after `warmup` calls, the cache threaded through."""
  times = []
  for i in range(warmup + steps):
    seconds, (_, cache) = timing.time_call(step, state, token, cache)
    if i >= warmup:
      times.append(seconds)
  return times


def measure_variant(variant, contexts, dtype, steps, warmup):
  """One row per context: the same model and jitted step, a cache sized to each context."""
  config = model_config(variant, dtype)
  model = research.build_model(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  step = decode_step(graphdef)
  token = jnp.zeros((BATCH, 1), jnp.int32)
  rows = []
  for context in contexts:
    cache = model.init_cache(BATCH, context)
    cache["index"] = jnp.asarray(context - 1, jnp.int32)
    times = step_latencies(step, state, token, cache, steps, warmup)
    rows.append({"variant": variant, "attention": config.attention,
                 "kv_heads": kv_heads(config),
                 "context": context, "dtype": dtype,
                 "latency_ms": round(1e3 * statistics.median(times), 4), "steps": steps,
                 "cache_bytes": model.cache_bytes(BATCH, context),
                 "analytic_kv_bytes": analytic_kv_bytes(config, context)})
    print(report.progress_line(rows[-1]), flush=True)
  return rows


def run(args):
  """Rows for every variant x context of `args` (lengths, dtype, quick)."""
  contexts = sorted(args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS))
  steps, warmup = (2, 1) if args.quick else (STEPS, WARMUP)
  return [row for variant in variants() if not args.only or variant in args.only
          for row in measure_variant(variant, contexts, args.dtype, steps, warmup)]


def summary(rows):
  """The targets, as ratios of this run's rows, between its shortest and longest context."""
  short, long = min(row["context"] for row in rows), max(row["context"] for row in rows)
  get = lambda field, variant, context: report.lookup(rows, field, variant=variant,
                                                       context=context)
  f = report.fmt_ratio
  lines = []
  constant_state = [v for v in dict.fromkeys(row["variant"] for row in rows)
                    if get("cache_bytes", v, short) == get("cache_bytes", v, long) is not None]
  growths = {variant: report.ratio(get("latency_ms", variant, long),
                                   get("latency_ms", variant, short))
             for variant in constant_state}  # latency must not grow with the context
  if growths:
    lines.append(f"constant-state mixers' latency {long}/{short} <= 1.5x: "
                 f"{report.verdicts_over(growths, 1.5)}")
  measured = {row["variant"] for row in rows}
  if {"gqa_kv2", "mha"} <= measured:  # not with --only leaving one of them out
    quarter = [report.ratio(get("cache_bytes", "gqa_kv2", c), get("cache_bytes", "mha", c))
               for c in sorted(set(row["context"] for row in rows))]
    exact = all(q == 0.25 for q in quarter)
    lines.append(f"gqa_kv2 / mha cache bytes = {', '.join(f'{q:.4f}' for q in quarter)} at "
                 f"every context (target exactly 0.25): {'met' if exact else 'MISSED'}")
    speed = report.ratio(get("latency_ms", "gqa_kv2", long), get("latency_ms", "mha", long))
    lines.append(f"gqa_kv2 / mha latency at {long} = {f(speed)} (target < 1x): "
                 f"{report.verdict(speed, 1) if speed != 1 else 'MISSED (equal)'}")
  # A growing cache is the analytic bytes per token x context plus, for some mixers, a part of
  # fixed size (a short convolution's window): the same at every context; 0 for a KV cache.
  fixed = {}
  for row in rows:
    if row["analytic_kv_bytes"] is not None:
      fixed.setdefault(row["variant"], set()).add(row["cache_bytes"] - row["analytic_kv_bytes"])
  agree = all(len(parts) == 1 for parts in fixed.values())
  nonzero = {variant: next(iter(parts)) for variant, parts in fixed.items()
             if len(parts) == 1 and 0 not in parts}
  named = ", ".join(f"{variant} {part / report.MIB:.3f} MiB" for variant, part in nonzero.items())
  lines.append(f"growing caches' cache_bytes = the analytic bytes (layers x cache bytes per token "
               f"x context) + a part of fixed size: {'yes' if agree else 'NO'} (the fixed part: "
               f"{named or 'none'}; 0 for the other {len(fixed) - len(nonzero)} growing caches)")
  return lines


def tables(rows):
  mib = lambda b: f"{b / report.MIB:.3f}"
  return [
      ("per-token decode latency, ms (median)",
       report.pivot(rows, "variant", "context", "latency_ms", lambda ms: f"{ms:.2f}")),
      ("cache bytes (model.cache_bytes), MiB",
       report.pivot(rows, "variant", "context", "cache_bytes", mib)),
  ]


SUITE = report.Suite(
    name="decode",
    description=(
        f"One-token decode steps of a {LAYERS}-layer, d_model {D_MODEL}, {HEADS}-head model "
        f"(MLP ratio 4, vocabulary 258, no position scheme), batch {BATCH}, cache sized to the "
        f"context and its index at context - 1; jitted step with the cache donated; median of "
        f"{STEPS} timed steps after {WARMUP} warm-up steps."),
    run=run, tables=tables, summary=summary,
    panels=(report.Panel("context", "latency_ms", "variant", "per-token decode latency",
                         "ms (median)"),
            report.Panel("context", "cache_bytes", "variant", "cache / state bytes", "MiB",
                         scale=report.MIB)))
