"""Mixer kernels, forward + backward: median time and compiled temporary memory against length.

Kernels run at one reference shape, not inside a model: attention-like kernels take
[batch 1, length, 8 heads, head_dim 64] (d_model 512); the selective scans take d_inner 1024
(expand 2 x d_model 512) and state size N = 16. Each point is
  loss = <kernel(inputs), cotangent>   (a fixed random cotangent),   jax.grad w.r.t. all inputs,
compiled once (its memory read from XLA's analysis, at every length) and timed unless its
temporary memory or forecast run time is over budget (then the skip and its reason are recorded).

Kernels: softmax `xla` (jax.nn.dot_product_attention, causal), `blockwise` (exact, online
softmax), `blockwise_<scheme>` for every registered position scheme with a score bias (the bias
evaluated per tile, gradients to its parameters included), `blockwise_fox` (the Forgetting
Transformer's data-dependent forget-gate bias per tile, gradients to the gate logits), `cudnn`
(GPU only); `linear`
(chunked) against `linear_naive` (materialised cumulative sum); `mamba` (chunked scan,
model.mamba.scan="auto") against `mamba_assoc` (one associative scan over all states) and
`mamba_sequential` (lax.scan, one step per token).
"""

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from research import defaults
from research.model import attention
from research.model import positions
from research.model.attention import reference
from research.model.attention import core
from research.model.attention.fox import forget_bias
from research.model.attention.linear import FEATURE_MAPS, chunked_linear_attention
from research.model.attention.ssm import chunked_selective_scan, scan_for_backend
from research.bench import report
from research.bench import timing

BATCH, HEADS, HEAD_DIM = 1, 8, 64
D_INNER, STATE_SIZE = 1024, 16
BLOCK_SIZE = 128  # blockwise query/key block: model.softmax.block_size's default
LINEAR_CHUNK = SSM_CHUNK = 64  # model.linear.chunk_size and model.mamba.chunk_size defaults
LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (256, 1024)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A kernel to benchmark: `fn(*inputs[, params]) -> output`, inputs from `shapes(length)`;
  `params` (a position scheme's) are differentiated too."""
  name: str
  family: str
  fn: Callable
  shapes: Callable
  params: object = None


def _attention_shapes(length):
  qkv = (BATCH, length, HEADS, HEAD_DIM)
  return [qkv, qkv, qkv]


def _scan_shapes(length):
  return [(BATCH, length, D_INNER), (BATCH, length, D_INNER), (D_INNER, STATE_SIZE),
          (BATCH, length, STATE_SIZE), (BATCH, length, STATE_SIZE), (BATCH, D_INNER, STATE_SIZE)]


def _xla(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _cudnn(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _blockwise(q, k, v):
  return core.attend(q, k, v, backend="blockwise", block_size=BLOCK_SIZE)


def _pallas(q, k, v):
  return core.attend(q, k, v, backend="pallas")


def _bias_kernel(name):
  """blockwise attention with scheme `name`'s score bias, at its default settings."""
  config = defaults.get_config().model
  config.update(dict(position=name, num_heads=HEADS, d_model=HEADS * HEAD_DIM))
  graphdef, params = nnx.split(attention.position_scheme(config, rngs=nnx.Rngs(0)))

  def bias_fn(p, q_positions, k_positions):
    return nnx.merge(graphdef, p).bias(q_positions, k_positions)

  def fn(q, k, v, p):
    return core.attend(q, k, v, score_mod=core.ScoreMod(bias=bias_fn), score_params=p,
                       backend="blockwise", block_size=BLOCK_SIZE)

  return Kernel(f"blockwise_{name}", "softmax", fn, _attention_shapes, params)


def _fox_shapes(length):
  return _attention_shapes(length) + [(BATCH, length, HEADS)]


def _blockwise_fox(q, k, v, gate_logits):
  """FoX's blockwise path: the forget-gate bias c_i - c_j of each tile from the cumulative log
  gates c (research/model/attention/fox.py), differentiated through to the gate logits."""
  c_BxTxN = jnp.cumsum(jax.nn.log_sigmoid(gate_logits.astype(jnp.float32)), axis=1)
  return core.attend(q, k, v, inputs=c_BxTxN,
                     score_mod=core.ScoreMod(bias=lambda _, q_c, k_c: forget_bias(q_c, k_c)),
                     backend="blockwise", block_size=BLOCK_SIZE)


def _linear(q, k, v):
  state = (jnp.zeros((BATCH, HEADS, HEAD_DIM, HEAD_DIM), jnp.float32),
           jnp.zeros((BATCH, HEADS, HEAD_DIM), jnp.float32))
  return chunked_linear_attention(q, k, v, state, chunk_size=LINEAR_CHUNK)[0]


def _linear_naive(q, k, v):
  phi = FEATURE_MAPS["elu"]
  return reference.linear_attention(phi(q), phi(k), v)


def _mamba(*inputs):
  return chunked_selective_scan(*inputs, chunk_size=SSM_CHUNK,
                                scan=scan_for_backend("auto"))[0]


def _mamba_assoc(*inputs):
  return reference.associative_selective_scan(*inputs)[0]


def _mamba_sequential(*inputs):
  return reference.sequential_selective_scan(*inputs)[0]


def kernels(backend=None):
  """The kernels to measure on `backend` (default: JAX's); cudnn and pallas only on a GPU."""
  backend = backend or jax.default_backend()
  table = [Kernel("xla", "softmax", _xla, _attention_shapes),
           Kernel("blockwise", "softmax", _blockwise, _attention_shapes)]
  table += [_bias_kernel(name) for name, cls in positions.REGISTRY.items()
            if positions.BIAS in cls.hooks()]
  table.append(Kernel("blockwise_fox", "softmax", _blockwise_fox, _fox_shapes))
  if backend == "gpu":  # on a CPU pallas runs in interpret mode: a test, not a benchmark
    table += [Kernel("cudnn", "softmax", _cudnn, _attention_shapes),
              Kernel("pallas", "softmax", _pallas, _attention_shapes)]
  table += [Kernel("linear", "linear", _linear, _attention_shapes),
            Kernel("linear_naive", "linear", _linear_naive, _attention_shapes),
            Kernel("mamba", "ssm", _mamba, _scan_shapes),
            Kernel("mamba_assoc", "ssm", _mamba_assoc, _scan_shapes),
            Kernel("mamba_sequential", "ssm", _mamba_sequential, _scan_shapes)]
  return table


def _ssm_inputs(kernel, inputs):
  """Scan inputs as Mamba makes them: delta = softplus(.) > 0, A = -exp(log(1..N)), h0 = 0."""
  if kernel.family != "ssm":
    return inputs
  x, delta, _, B, C, h0 = inputs
  A = -jnp.tile(jnp.arange(1, STATE_SIZE + 1, dtype=jnp.float32), (D_INNER, 1))
  return (x, jax.nn.softplus(delta), A.astype(x.dtype), B, C, jnp.zeros_like(h0))


def make_inputs(kernel, length, dtype, seed=0):
  """Random inputs of `kernel` at `length`, plus a cotangent of its output's shape."""
  keys = jax.random.split(jax.random.key(seed), len(kernel.shapes(length)) + 1)
  inputs = tuple(jax.random.normal(key, shape, dtype)
                 for key, shape in zip(keys, kernel.shapes(length)))
  inputs = _ssm_inputs(kernel, inputs)
  out = jax.eval_shape(lambda *a: _apply(kernel, kernel.params, a), *inputs)
  return inputs, jax.random.normal(keys[-1], out.shape, out.dtype)


def _apply(kernel, params, inputs):
  return kernel.fn(*inputs) if params is None else kernel.fn(*inputs, params)


def forward_backward(kernel):
  """grad of <kernel(inputs), cotangent> w.r.t. every input; the cotangent is the last argument."""

  def loss(params, *args):
    *inputs, cotangent = args
    out = _apply(kernel, params, inputs)
    return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32))

  def grads(*args):  # w.r.t. the parameters (if any) and every input, not the cotangent
    return jax.grad(loss, argnums=tuple(range(len(args))))(kernel.params, *args)

  return grads


def _abstract(kernel, length, dtype):
  inputs, cotangent = jax.eval_shape(lambda: make_inputs(kernel, length, dtype))
  return (*inputs, cotangent)


def _blank_row(kernel, length, dtype):
  return {"kernel": kernel.name, "family": kernel.family, "length": length,
          "dtype": jnp.dtype(dtype).name, "time_ms": None, "repeats": 0, "skipped": "",
          "compile_s": None, "temp_bytes": None, "argument_bytes": None, "output_bytes": None}


def measure_point(kernel, length, dtype, budget, history=()):
  """One row: compiled memory always; time unless over budget (`history`: timed points)."""
  row = _blank_row(kernel, length, dtype)
  grads = forward_backward(kernel)
  start = time.perf_counter()
  compiled = timing.compile_fn(grads, *_abstract(kernel, length, dtype))
  row["compile_s"] = round(time.perf_counter() - start, 2)
  row.update(timing.memory_bytes(compiled))
  forecast = timing.forecast_seconds(history, length)
  if row["temp_bytes"] > budget.max_temp_bytes:
    row["skipped"] = (f"temp memory {row['temp_bytes'] / timing.GIB:.1f} GiB > "
                      f"{budget.max_temp_bytes / timing.GIB:.0f} GiB")
  elif forecast > budget.max_call_seconds:
    row["skipped"] = f"forecast {forecast:.0f} s per call > {budget.max_call_seconds:.0f} s"
  else:
    inputs, cotangent = make_inputs(kernel, length, dtype)
    seconds, row["repeats"] = timing.median_seconds(compiled, *inputs, cotangent, budget=budget)
    row["time_ms"] = round(1e3 * seconds, 3)
  return row


def run(args):
  """Rows for every kernel x length of `args` (lengths, dtype, quick)."""
  dtype = jnp.dtype(args.dtype)
  lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
  budget = timing.Budget(repeats=1 if args.quick else 5,
                         seconds_per_point=2.0 if args.quick else 8.0)
  rows = []
  for kernel in kernels():
    if args.only and kernel.name not in args.only:
      continue
    history = []
    for length in sorted(lengths):
      try:
        row = measure_point(kernel, length, dtype, budget, history)
      except Exception as error:  # pylint: disable=broad-except  # one kernel must not stop all
        row = _blank_row(kernel, length, dtype)
        row["skipped"] = report.error_reason(error, 120)
      if row["time_ms"] is not None:
        history.append((length, row["time_ms"] / 1e3))
      print(report.progress_line(row), flush=True)
      rows.append(row)
  return rows


def _temp_mib(rows, kernel, length):
  value = report.lookup(rows, "temp_bytes", kernel=kernel, length=length)
  return None if value is None else value / report.MIB


def summary(rows):
  """The targets, as ratios of this run's rows; 'not measured' where a point is missing."""
  get = lambda field, kernel, length: report.lookup(rows, field, kernel=kernel, length=length)
  blockwise_growth = report.ratio(get("temp_bytes", "blockwise", 8192),
                                  get("temp_bytes", "blockwise", 1024))
  xla_growth = report.ratio(get("temp_bytes", "xla", 8192), get("temp_bytes", "xla", 1024))
  blockwise_time = report.ratio(get("time_ms", "blockwise", 4096), get("time_ms", "xla", 4096))
  linear_speedup = report.ratio(get("time_ms", "xla", 4096), get("time_ms", "linear", 4096))
  linear_growth = report.ratio(get("temp_bytes", "linear", 8192),
                               get("temp_bytes", "linear", 1024))
  mamba_memory = report.ratio(get("temp_bytes", "mamba_assoc", 4096),
                              get("temp_bytes", "mamba", 4096))
  mamba_time = report.ratio(get("time_ms", "mamba", 4096),
                            get("time_ms", "mamba_sequential", 4096))
  f = report.fmt_ratio
  biases = sorted({row["kernel"] for row in rows if row["kernel"].startswith("blockwise_")}
                  - {"blockwise_alibi"})
  against_alibi = lambda field, name: report.ratio(  # noqa: E731
      get(field, name, 4096), get(field, "blockwise_alibi", 4096))
  bias_lines = [
      "score biases against blockwise_alibi at 4096, temp memory <= 2x: " + report.verdicts_over(
          {name: against_alibi("temp_bytes", name) for name in biases}, 2),
      "score biases against blockwise_alibi at 4096, fwd+bwd time <= 1.5x: " +
      report.verdicts_over({name: against_alibi("time_ms", name) for name in biases}, 1.5),
      "score biases' temp memory growth 8192/1024 <= 10x: " + report.verdicts_over(
          {name: report.ratio(get("temp_bytes", name, 8192), get("temp_bytes", name, 1024))
           for name in biases}, 10)] if biases else []
  lines = [
      f"blockwise temp memory 8192/1024 = {f(blockwise_growth)} (target <= 10x; xla = "
      f"{f(xla_growth)}): {report.verdict(blockwise_growth, 10)}",
      f"blockwise / xla fwd+bwd time at 4096 = {f(blockwise_time)} (target <= 1x): "
      f"{report.verdict(blockwise_time, 1)}",
      f"xla / linear fwd+bwd time at 4096 = {f(linear_speedup)} (target >= 10x): "
      f"{report.verdict(linear_speedup, 10, at_most=False)}",
      f"linear temp memory 8192/1024 = {f(linear_growth)} for 8x the length (target: at most "
      f"linear, <= 8x): {report.verdict(linear_growth, 8)}",
      f"mamba_assoc / mamba temp memory at 4096 = {f(mamba_memory)} (target >= 20x): "
      f"{report.verdict(mamba_memory, 20, at_most=False)}",
      f"mamba / mamba_sequential fwd+bwd time at 4096 = {f(mamba_time)} (target <= 1x): "
      f"{report.verdict(mamba_time, 1)}",
  ] + bias_lines
  for length in (1024, 4096):
    cells = [f"{kernel} {_fmt_mib(_temp_mib(rows, kernel, length))}"
             for kernel in ("xla", "blockwise")]
    lines.append(f"fwd+bwd compiled temp memory at {length}: " + ", ".join(cells))
  return lines


def _fmt_mib(value):
  return "not measured" if value is None else f"{value:.1f} MiB"


def tables(rows):
  skipped = [[row["kernel"], row["length"], row["skipped"]] for row in rows if row["skipped"]]
  result = [
      ("fwd+bwd time, ms (median)", report.pivot(rows, "kernel", "length", "time_ms",
                                                 lambda ms: f"{ms:.1f}", missing="skip")),
      ("compiled temp memory, MiB (fwd+bwd)",
       report.pivot(rows, "kernel", "length", "temp_bytes", lambda b: f"{b / report.MIB:.1f}")),
  ]
  if skipped:
    result.append(("skipped timings", report.markdown_table(["kernel", "length", "reason"],
                                                            skipped)))
  return result


SUITE = report.Suite(
    name="mixers",
    description=(
        f"Kernels alone, forward + backward (jax.grad of <out, random cotangent> w.r.t. all "
        f"inputs). Attention-like: batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}; blockwise "
        f"block {BLOCK_SIZE}, linear chunk {LINEAR_CHUNK}. Selective scan: d_inner {D_INNER}, "
        f"N {STATE_SIZE}, chunk {SSM_CHUNK}. Time: median after compile + warm-up. Memory: "
        f"`compile().memory_analysis().temp_size_in_bytes`, at every length."),
    run=run, tables=tables, summary=summary,
    panels=(report.Panel("length", "time_ms", "kernel", "fwd+bwd time", "ms (median)"),
            report.Panel("length", "temp_bytes", "kernel", "compiled temp memory", "MiB",
                         scale=report.MIB)))
