"""Recurrent mixers: each one's chunked training form against its own token-by-token recurrence.

Every mixer of research.model.attention.REGISTRY whose decode state does not grow with the context
(`cache_bytes` equal at two contexts: linear attention, retention, Mamba, and any recurrent
mixer registered later) is built alone at the mixers suite's width (d_model 512, 8 heads,
head_dim 64, batch 1, no positions) and run two ways on the same inputs:
  chunked     loss = <mixer(x), cotangent>: the full-sequence (chunk-parallel) forward
  recurrence  the same loss through `lax.scan` of `mixer.decode`, one token at a time (the
              naive recurrent form, compiled: no per-token dispatch)
both differentiated with jax.grad w.r.t. the parameters and x. Times: medians of interleaved
repeats after a warm-up call, at 4096 tokens; memory: XLA's compiled temp bytes of the chunked
fwd+bwd at 1024 and 8192 tokens. Targets: chunked at least 5x faster than the recurrence at
4096; chunked temp memory 8192 / 1024 at most 10x (linear in the length).
"""

import dataclasses
import statistics

import jax
import jax.numpy as jnp
from flax import nnx

from research import defaults
from research.model import attention
from research.model import transformer as model_lib
from research.bench import mixers
from research.bench import report
from research.bench import timing


@dataclasses.dataclass(frozen=True)
class Settings:
  time_length: int = 4096
  memory_lengths: tuple = (1024, 8192)
  repeats: int = 3


FULL = Settings()
QUICK = Settings(time_length=256, memory_lengths=(128, 1024), repeats=1)
TARGETS = {"speedup": 5.0, "memory_growth": 10.0}


def mixer_config(name, dtype):
  config = defaults.get_config().model
  config.update(attention=name, position="none", num_layers=1,
                d_model=mixers.HEADS * mixers.HEAD_DIM, num_heads=mixers.HEADS,
                compute_dtype=jnp.dtype(dtype).name)
  return config


def _mixer(name, dtype):
  model = model_lib.build_model(mixer_config(name, dtype), rngs=nnx.Rngs(0))
  return model.blocks[0].mixer


def constant_state_mixers(dtype, among=None):
  """Registered mixers (those named in `among`, if given) whose cache is the same size at a short
  and a long context."""
  names = []
  for name in [n for n in attention.REGISTRY if among is None or n in among]:
    mixer = nnx.eval_shape(lambda name=name: _mixer(name, dtype))  # shapes only, no compute
    if mixer.cache_bytes(1, 256) == mixer.cache_bytes(1, 16384):
      names.append(name)
  return names


def forms(name, dtype):
  """{form: jitted grad(loss) of (params, x, cotangent)} and the mixer's parameters."""
  graphdef, params = nnx.split(_mixer(name, dtype))

  def chunked(params, x_BxLxD, cotangent):
    mixer = nnx.merge(graphdef, params)
    positions = jnp.arange(x_BxLxD.shape[1])[None]
    return jnp.vdot(mixer(x_BxLxD, positions), cotangent)

  def recurrence(params, x_BxLxD, cotangent):
    mixer = nnx.merge(graphdef, params)
    length = x_BxLxD.shape[1]

    def step(cache, x_and_index):
      x_BxD, index = x_and_index
      y, cache = mixer.decode(x_BxD[:, None], cache, index)
      return cache, y[:, 0]

    cache = mixer.init_cache(x_BxLxD.shape[0], length)
    _, y_LxBxD = jax.lax.scan(step, cache, (x_BxLxD.swapaxes(0, 1), jnp.arange(length)))
    return jnp.vdot(y_LxBxD.swapaxes(0, 1), cotangent)

  grads = {form: jax.jit(jax.grad(fn, argnums=(0, 1)))
           for form, fn in (("chunked", chunked), ("recurrence", recurrence))}
  return grads, params


def _inputs(length, dtype):
  shape = (mixers.BATCH, length, mixers.HEADS * mixers.HEAD_DIM)
  x = jax.random.normal(jax.random.key(0), shape, dtype)
  return x, jax.random.normal(jax.random.key(1), shape, dtype)


def _skipped(name, part, form, length, error):
  return {"mixer": name, "part": part, "form": form, "length": length,
          "skipped": report.error_reason(error)}


def mixer_rows(name, settings, dtype):
  grads, params = forms(name, dtype)
  rows = []
  for length in settings.memory_lengths:
    try:
      compiled = timing.compile_fn(grads["chunked"], params, *_inputs(length, dtype))
      rows.append({"mixer": name, "part": "memory", "form": "chunked", "length": length,
                   **timing.memory_bytes(compiled)})
    except Exception as error:  # pylint: disable=broad-except
      rows.append(_skipped(name, "memory", "chunked", length, error))
  length = settings.time_length
  x, cotangent = _inputs(length, dtype)
  calls = {form: (lambda fn=fn: fn(params, x, cotangent)) for form, fn in grads.items()}
  try:
    times = timing.interleaved_seconds(calls, settings.repeats)
  except Exception as error:  # pylint: disable=broad-except
    return rows + [_skipped(name, "time", form, length, error) for form in calls]
  for form, seconds in times.items():
    rows.append({"mixer": name, "part": "time", "form": form, "length": length,
                 "time_ms": round(1e3 * statistics.median(seconds), 3),
                 "repeats": settings.repeats})
  return rows


def run(args):
  settings = QUICK if args.quick else FULL
  rows = []
  for name in constant_state_mixers(args.dtype, among=args.only or None):
    for row in mixer_rows(name, settings, args.dtype):
      print(report.progress_line(row), flush=True)
      rows.append(row)
  return rows


def _ratios(rows):
  """{mixer: (time length, chunked speed-up over the recurrence, (short, long) memory lengths,
  chunked temp memory growth between them)}, None where a point is missing."""
  result = {}
  for name in dict.fromkeys(row["mixer"] for row in rows):
    get = lambda field, **match: report.lookup(rows, field, mixer=name, **match)  # noqa: E731
    timed = [r for r in rows if r["mixer"] == name and r["part"] == "time"]
    speedup = report.ratio(get("time_ms", part="time", form="recurrence"),
                           get("time_ms", part="time", form="chunked"))
    memory = sorted((r["length"], r.get("temp_bytes")) for r in rows
                    if r["mixer"] == name and r["part"] == "memory")
    growth = report.ratio(memory[-1][1], memory[0][1]) if len(memory) > 1 else None
    result[name] = (timed[0]["length"] if timed else None, speedup,
                    (memory[0][0], memory[-1][0]) if memory else None, growth)
  return result


def summary(rows):
  ratios = _ratios(rows)
  if not ratios:
    return ["no mixer measured"]
  length, _, memory_lengths, _ = next(iter(ratios.values()))
  long_, short = (memory_lengths or (None, None))[::-1]
  speedups = report.verdicts_over({n: r[1] for n, r in ratios.items()}, TARGETS["speedup"],
                                  at_most=False)
  growths = report.verdicts_over({n: r[3] for n, r in ratios.items()}, TARGETS["memory_growth"])
  return [f"chunked fwd+bwd at {length} >= {TARGETS['speedup']:.0f}x faster than its "
          f"token-by-token recurrence: {speedups}",
          f"chunked temp memory {long_}/{short} <= {TARGETS['memory_growth']:.0f}x: {growths}"]


def tables(rows):
  ratios = _ratios(rows)
  lengths = sorted({r["length"] for r in rows if r["part"] == "memory"})
  time_length = next((r["length"] for r in rows if r["part"] == "time"), "")
  cell = lambda value, fmt: "skip" if value is None else fmt(value)  # noqa: E731
  body = []
  for name, (_, speedup, _, growth) in ratios.items():
    get = lambda field, **match: report.lookup(rows, field, mixer=name, **match)  # noqa: E731
    body.append([name, cell(get("time_ms", part="time", form="chunked"), "{:.1f}".format),
                 cell(get("time_ms", part="time", form="recurrence"), "{:.1f}".format),
                 report.fmt_ratio(speedup)]
                + [cell(get("temp_bytes", part="memory", length=n),
                        lambda b: f"{b / report.MIB:.1f}") for n in lengths]
                + [report.fmt_ratio(growth)])
  header = ["mixer", f"chunked ms at {time_length}", "recurrence ms", "speed-up"]
  header += [f"temp MiB {n}" for n in lengths] + ["growth"]
  result = [("chunked against the recurrence (fwd+bwd, medians; chunked form's temp memory)",
             report.markdown_table(header, body))]
  skipped = [[r["mixer"], r["part"], r["form"], r["length"], r["skipped"]] for r in rows
             if r.get("skipped")]
  if skipped:
    result.append(("skipped", report.markdown_table(
        ["mixer", "part", "form", "length", "reason"], skipped)))
  return result


SUITE = report.Suite(
    name="recurrent",
    description=(
        f"Every registered mixer with a constant-size decode state, alone at d_model "
        f"{mixers.HEADS * mixers.HEAD_DIM} ({mixers.HEADS} heads, batch {mixers.BATCH}, no "
        f"positions): its chunked forward against lax.scan of its one-token decode, fwd+bwd "
        f"(jax.grad w.r.t. parameters and input), at {FULL.time_length} tokens (medians of "
        f"{FULL.repeats} interleaved repeats after a warm-up); compiled temp memory of the "
        f"chunked form at {' and '.join(map(str, FULL.memory_lengths))} tokens. --quick: "
        f"{QUICK.time_length} tokens, memory at {' and '.join(map(str, QUICK.memory_lengths))}."),
    run=run, tables=tables, summary=summary, takes_lengths=False,
    panels=(report.Panel("length", "temp_bytes", "mixer", "chunked fwd+bwd temp memory", "MiB",
                         scale=report.MIB),))
