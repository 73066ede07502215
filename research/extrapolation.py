"""Length extrapolation: evaluate a trained run at every eval length and mode, without retraining.

For each length in config.eval.lengths and mode in config.eval.modes, one row with loss,
perplexity, accuracy and exact match, their 95% bootstrap intervals (research.evaluate), and the
loss at each token position. Needle tasks get one row per depth in config.eval.depths as well,
each with its `depth`; the row without a depth pools every depth's examples. RoPE runs get extra
rows for each scaling in config.eval.rope_scalings (PI, NTK, YaRN; arXiv:2309.00071) with
factor s = max(1, eval_length / train_length): the same weights, a different position scheme,
evaluated with non-overlapping windows. Tasks have a single mode (exact answers).
"""

import copy
import functools

import jax
from flax import nnx

from research import data
from research import evaluate
from research import model as model_lib
from research import sharding
from research import train


def _variants(config):
  """(rope_scaling label, model config) pairs to evaluate, as functions of the eval length."""
  yield "none", lambda length: config.model
  if config.model.position == "rope":
    for scaling in config.eval.rope_scalings:
      def scaled(length, scaling=scaling):
        model_config = copy.deepcopy(config.model)
        model_config.rope_scaling = scaling
        model_config.rope_scaling_factor = max(1.0, length / config.train.seq_len)
        model_config.rope_original_length = config.train.seq_len
        return model_config
      yield scaling, scaled


def length_sweep(config, workdir, progress=functools.partial(print, flush=True)):
  """Rows of metrics for the run in `workdir` at each eval length x mode x RoPE scaling."""
  mesh = sharding.make_mesh(sharding.mesh_shape(config.mesh.shape, jax.device_count()))
  rows = []
  with jax.set_mesh(mesh):
    params = train.load_params(config, workdir, mesh)
    for scaling, model_config_at in _variants(config):
      for length in config.eval.lengths:
        model_config = model_config_at(length)
        graphdef = nnx.graphdef(nnx.eval_shape(
            lambda: model_lib.build_model(model_config, rngs=nnx.Rngs(0))))
        eval_step = evaluate.make_eval_step(graphdef)
        modes = config.eval.modes
        if scaling != "none" or not data.is_language_modeling(config):
          modes = ("nonoverlapping",)
        for mode in modes:
          sums = {depth: evaluate.row_sums(
                      eval_step, params, data.eval_batches(config, length, mode, depth=depth),
                      mesh, config.eval.batch_size)
                  for depth in data.eval_depths(config)}
          if None not in sums:  # needle tasks: and one row of all depths together
            sums[None] = evaluate.concatenate(list(sums.values()))
          for depth, depth_sums in sums.items():
            metrics = evaluate.metrics(depth_sums, config.eval.bootstrap_samples,
                                       config.eval.bootstrap_seed)
            rows.append({"eval_length": length, "eval_mode": mode, "rope_scaling": scaling,
                         "depth": depth, **metrics})
            at = "" if depth is None else f" depth {depth:<5}"
            progress(f"  eval {length:>6} {mode:<15} rope_scaling={scaling:<5}{at} "
                     f"loss {metrics['loss']:.4f}  ppl {metrics['perplexity']:.3f}  "
                     f"acc {metrics['accuracy']:.3f}  exact {metrics['exact_match']:.3f}")
  return rows
