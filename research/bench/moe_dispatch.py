"""Mixture of experts: dense dispatch against the sorted ones (jax.lax.ragged_dot; by blocks).

  python -m research.bench.moe_dispatch [--quick] [--repeats N]

Two measurements, float32, each jitted and timed as the median of interleaved repeats after a
warm-up call of each (research.bench.timing.interleaved_seconds: a busy machine's drift falls on
every dispatch alike), for model.moe.dispatch = dense, sorted (ragged_dot) and blocked
(research/model/feed_forward/grouped_matmul.py):
  layer  one MixtureOfExperts (research/model/feed_forward/moe.py) at d_model 512, mlp_ratio 4,
         16 experts, top-2, on 4096 tokens (batch 8 x length 512):
           loss = <layer(x), cotangent>,   jax.grad w.r.t. the parameters and x;
  model  a 2-layer language model (mha, rope, d_model 512, 8 heads, the moe feed-forward in both
         blocks) on the same 8 x 512 tokens: the training loss (research.training.loop.loss_sum,
         auxiliary losses included) and its gradient w.r.t. the parameters (no optimizer update).
--quick: small shapes (d_model 64, 8 experts, batch 2 x 64), a check that everything runs.

Besides time, each row gives the FLOPs of the compiled fwd+bwd from XLA's cost analysis: where a
backend expands ragged_dot into a masked dense matmul (JAX's CPU lowering of ragged_dot; XLA's
GPU RaggedDotRewriter unless a grouped-matmul backend takes it), the sorted dispatch costs about
top_k times the dense one's expert FLOPs instead of top_k / X of them, and the count shows it.
XLA counts a loop body once, so the blocked dispatch's count omits all but one block of its
expert matmuls. The issue's target: a training step >= 3x faster with blocked dispatch than
with dense.
"""

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
from flax import nnx

from research import defaults
from research.model import feed_forward
from research.model import transformer as model_lib
from research.bench import report
from research.bench import timing
from research.model.feed_forward import moe
from research.training import loop as train_lib

DISPATCHES = moe.DISPATCHES
TARGET = 3.0  # dense / blocked time of a training step


@dataclasses.dataclass(frozen=True)
class Shape:
  d_model: int
  mlp_ratio: int
  num_experts: int
  top_k: int
  batch: int
  length: int
  num_heads: int
  vocab_size: int


FULL = Shape(d_model=512, mlp_ratio=4, num_experts=16, top_k=2, batch=8, length=512,
             num_heads=8, vocab_size=32000)
QUICK = Shape(d_model=64, mlp_ratio=4, num_experts=8, top_k=2, batch=2, length=64, num_heads=4,
              vocab_size=256)


def model_config(shape, dispatch, num_layers=2):
  config = defaults.get_config().model
  config.update(dict(attention="mha", position="rope", feed_forward="moe", num_layers=num_layers,
                     d_model=shape.d_model, num_heads=shape.num_heads, mlp_ratio=shape.mlp_ratio,
                     vocab_size=shape.vocab_size, compute_dtype="float32"))
  config.moe.update(dict(num_experts=shape.num_experts, top_k=shape.top_k, dispatch=dispatch))
  return config


def layer_step(shape, dispatch):
  """(jitted fwd+bwd of one MoE layer, its arguments)."""
  config = model_config(shape, dispatch)
  layer = moe.MixtureOfExperts(config, feed_forward.REGISTRY.settings("moe", config),
                               rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(layer)
  x_key, cotangent_key = jax.random.split(jax.random.key(1))
  x = jax.random.normal(x_key, (shape.batch, shape.length, shape.d_model), jnp.float32)
  cotangent = jax.random.normal(cotangent_key, x.shape, jnp.float32)

  def loss(params, x):
    return jnp.sum(nnx.merge(graphdef, params)(x) * cotangent)

  return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def model_step(shape, dispatch):
  """(jitted training loss and gradient w.r.t. the parameters of the 2-layer model, arguments)."""
  model = model_lib.build_model(model_config(shape, dispatch), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(2), (shape.batch, shape.length + 1), 0,
                              shape.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "loss_mask": jnp.ones((shape.batch, shape.length), jnp.float32)}

  def loss(params, batch):
    objective, _ = train_lib.loss_sum(nnx.merge(graphdef, params), batch)
    return objective

  return jax.jit(jax.value_and_grad(loss)), (params, batch)


def compiled_flops(fn, args):
  try:
    cost = fn.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])
  except (KeyError, TypeError, IndexError, NotImplementedError):
    return None


def measure(name, make_step, shape, repeats):
  """Rows {case, dispatch, time_ms, gflops} of both dispatches of one case, timed interleaved."""
  steps = {dispatch: make_step(shape, dispatch) for dispatch in DISPATCHES}
  calls = {dispatch: (lambda fn=fn, args=args: fn(*args)) for dispatch, (fn, args) in steps.items()}
  times = timing.interleaved_seconds(calls, repeats)
  rows = []
  for dispatch, (fn, args) in steps.items():
    flops = compiled_flops(fn, args)
    rows.append({"case": name, "dispatch": dispatch,
                 "time_ms": 1e3 * statistics.median(times[dispatch]), "repeats": repeats,
                 "gflops": None if flops is None else flops / 1e9})
  return rows


def table(rows):
  """Markdown: per case, each dispatch's median time and compiled GFLOPs, and dense / each."""
  sparse = DISPATCHES[1:]
  lines = ["| case | " + " | ".join(f"{d} ms" for d in DISPATCHES) + " | "
           + " | ".join(f"dense / {d}" for d in sparse) + " | "
           + " | ".join(f"{d} GFLOP" for d in DISPATCHES) + " |",
           "|---" * (1 + 2 * len(DISPATCHES) + len(sparse)) + "|"]
  fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
  for case in dict.fromkeys(row["case"] for row in rows):
    get = lambda dispatch, field: report.lookup(rows, field, case=case, dispatch=dispatch)
    times = [fmt(get(d, "time_ms"), ".2f") for d in DISPATCHES]
    speedups = [fmt(report.ratio(get("dense", "time_ms"), get(d, "time_ms")), ".2f") + "x"
                for d in sparse]
    flops = [fmt(get(d, "gflops"), ".3f") for d in DISPATCHES]
    lines.append(f"| {case} | " + " | ".join(times + speedups + flops) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small shapes: a check that it runs")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed rounds after warm-up (default 10, 3 with --quick)")
  args = parser.parse_args(argv)
  shape = QUICK if args.quick else FULL
  repeats = args.repeats or (3 if args.quick else 10)
  command = "python -m research.bench.moe_dispatch" + (" --quick" if args.quick else "")
  meta = report.metadata(command)
  print(f"{meta['date']}  {meta['hardware']}  backend {meta['backend']}  jax {meta['jax_version']}")
  tokens = shape.batch * shape.length
  print(f"d_model {shape.d_model}, mlp_ratio {shape.mlp_ratio}, {shape.num_experts} experts, "
        f"top-{shape.top_k}, {tokens} tokens ({shape.batch} x {shape.length}), float32, "
        f"median of {repeats} interleaved fwd+bwd calls\n")
  rows = measure("layer (fwd+bwd)", layer_step, shape, repeats)
  rows += measure(f"2-layer model, mha + moe, {shape.num_heads} heads (training loss fwd+bwd)",
                  model_step, shape, repeats)
  print(table(rows))
  step = report.ratio(report.lookup(rows, "time_ms", case=rows[-1]["case"], dispatch="dense"),
                      report.lookup(rows, "time_ms", case=rows[-1]["case"], dispatch="blocked"))
  print(f"\ntarget: model step dense / blocked >= {TARGET}x: "
        f"{report.verdict(step, TARGET, at_most=False)}")
  return rows


if __name__ == "__main__":
  main()
