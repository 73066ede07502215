"""Ahead-of-time compilation of a config's steps for devices that need not be here: the training
step that research.training.loop runs (loop.make_train_step, the same function), the evaluation
step (research.evaluation.evaluate.make_eval_step) and one decode step, each lowered with
sharded ShapeDtypeStructs and compiled; XLA's memory analysis then says what one device holds.

  per device:  arguments + outputs - aliased (the donated train state) + temporaries
               must fit the device's HBM (research.training.tpu_slices.hbm_bytes)

This is how a TPU slice is checked from a CPU host (MaxText's train_compile.py does the same):
the devices come from libtpu's topology description (research.training.tpu_slices), nothing is
allocated, and the numbers are the compiler's own. XLA's FLOPs are its cost analysis of one
device's program, times the devices; the model's are research.model.flops' count (6 N plus
attention per token, causal halved), so a ratio above 1 is the rematerialised and the
non-matmul work XLA counts too.
"""

import dataclasses
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from research.evaluation import evaluate
from research.model import flops
from research.model import sharding
from research.model.attention import core
from research.training import loop


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  name: str  # train, eval or decode
  shapes: str  # what it was compiled for, e.g. "64 x 2048 tokens"
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  xla_flops: float  # all devices
  model_flops: float | None  # research.model.flops, where it counts this step
  compile_seconds: float
  # The compiler's refusal when the step's temporaries exceed the device's memory (it then
  # reports those alone: the other byte counts are 0).
  out_of_memory: str | None = None

  @property
  def fits(self) -> bool | None:
    """False where the compiler refused for memory; None: compare peak_bytes with the HBM."""
    return False if self.out_of_memory else None

  @property
  def peak_bytes(self) -> int:
    """What one device holds while the step runs: its arguments, the outputs not written over
    donated arguments, and the temporaries."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def described_devices(platform: str, what: str, needs: str, requirements: str,
                      **options) -> list:
  """The devices of jax.experimental.topologies' description of a `platform` topology (no device
  needed, only its compiler: `needs`, from `requirements`); ValueError naming them when missing."""
  try:
    from jax.experimental import topologies  # noqa: PLC0415
    topology = topologies.get_topology_desc(platform=platform, **options)
  except Exception as e:  # noqa: BLE001 (a missing compiler surfaces as several error types)
    raise ValueError(f"cannot describe {what} without {needs}: install {requirements} "
                     f"(.venv/bin/pip install -r {requirements}); {type(e).__name__}: "
                     f"{str(e).splitlines()[0][:200]}") from e
  return list(topology.devices)


def _compile(name, shapes, jitted, args, num_devices, model_flops=None) -> CompiledStep:
  start = time.perf_counter()
  try:
    compiled = jitted.lower(*args).compile()
  except Exception as e:  # noqa: BLE001 (XLA's runtime error; only its memory refusal is ours)
    message = " ".join(str(e).split())
    if "RESOURCE_EXHAUSTED" not in message:
      raise
    # "... the total memory required for HLO temporaries (31.88G) exceeds available HBM (15.75G)"
    temporaries = re.search(r"temporaries \(([\d.]+)G\)", message)
    temp_bytes = int(float(temporaries.group(1)) * 2**30) if temporaries else 0
    return CompiledStep(name, shapes, 0, 0, 0, temp_bytes, 0.0, model_flops,
                        time.perf_counter() - start, out_of_memory=message[:300])
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return CompiledStep(name, shapes, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                      memory.alias_size_in_bytes, memory.temp_size_in_bytes,
                      float((cost or {}).get("flops", 0.0)) * num_devices, model_flops, seconds)


def _batch_sharded(tree, mesh):
  """ShapeDtypeStructs of `tree` with the leading (batch) axis over the mesh's batch axes where
  it divides, the rest replicated (a decode cache, an evaluation batch)."""

  def place(x):
    spec = sharding.partition_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh) if x.ndim \
        else jax.sharding.PartitionSpec()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

  return jax.tree.map(place, tree)


def compile_steps(config, mesh, steps=("train", "eval", "decode")) -> list[CompiledStep]:
  """Compile `steps` of `config` for `mesh`'s devices (any platform: those of a TPU topology
  description compile on a CPU host)."""
  num_devices = mesh.size
  t = config.train
  results = []
  with jax.set_mesh(mesh), core.compiling_for(mesh.devices.flat[0].platform):
    step_fn = loop.make_train_step(config, mesh)
    state = sharding.sharded_abstract(step_fn.abstract_state, mesh)
    model = nnx.merge(step_fn.graphdef, jax.eval_shape(lambda: state["params"]))
    if "train" in steps:
      tokens = t.batch_size * t.seq_len
      results.append(_compile(
          "train", f"{t.batch_size} x {t.seq_len} tokens", step_fn.train,
          (state, loop.abstract_batch(config, step_fn.batch_sharding)), num_devices,
          flops.train_flops_per_token(model, t.seq_len) * tokens))
    length = max(config.eval.lengths)
    rows = config.eval.batch_size
    if "eval" in steps:
      batch = {key: jax.ShapeDtypeStruct((rows, length), dtype)
               for key, dtype in (("inputs", jnp.int32), ("targets", jnp.int32),
                                  ("loss_mask", jnp.float32))}
      results.append(_compile(
          "eval", f"{rows} x {length} tokens", evaluate.make_eval_step(step_fn.graphdef),
          (state["params"], _batch_sharded(batch, mesh)), num_devices,
          flops.forward_flops_per_token(model, length) * rows * length))
    if "decode" in steps:
      results.append(_decode_step(step_fn.graphdef, state["params"], rows, length, mesh))
  return results


def _decode_step(graphdef, params, rows, length, mesh) -> CompiledStep:
  """One new token for each of `rows` sequences against a cache of `length` tokens."""

  def decode(params, tokens_Bx1, cache):
    return nnx.merge(graphdef, params).decode(tokens_Bx1, cache)

  cache = jax.eval_shape(lambda p: nnx.merge(graphdef, p).init_cache(rows, length), params)
  tokens = jax.ShapeDtypeStruct((rows, 1), jnp.int32)
  return _compile("decode", f"{rows} x 1 token, cache of {length}",
                  jax.jit(decode, donate_argnums=2),
                  (params, _batch_sharded(tokens, mesh), _batch_sharded(cache, mesh)),
                  mesh.size)


def summary(step: CompiledStep, hbm_bytes: int) -> dict[str, Any]:
  """The step's numbers for a table or a JSON line, with the verdict against `hbm_bytes`."""
  gib = 2**30
  fits = step.peak_bytes <= hbm_bytes if step.fits is None else step.fits
  needs = f"does not fit (needs {step.peak_bytes / gib:.1f} GiB of {hbm_bytes / gib:.0f})"
  if step.out_of_memory:
    left = re.search(r"available HBM \(([\d.]+)G\)", step.out_of_memory)
    needs = (f"does not fit (the compiler: temporaries need {step.temp_bytes / gib:.1f} GiB"
             + (f", {left.group(1)} GiB left)" if left else ")"))
  return {"step": step.name, "shapes": step.shapes, "argument_gib": step.argument_bytes / gib,
          "output_gib": step.output_bytes / gib, "alias_gib": step.alias_bytes / gib,
          "temp_gib": step.temp_bytes / gib, "peak_gib": step.peak_bytes / gib,
          "hbm_gib": hbm_bytes / gib, "fits": fits,
          "verdict": "fits" if fits else needs,
          "xla_tflops": step.xla_flops / 1e12,
          "model_tflops": None if step.model_flops is None else step.model_flops / 1e12,
          "compile_seconds": step.compile_seconds}
