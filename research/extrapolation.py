"""Length extrapolation: evaluate a trained run at every eval length and mode, without retraining.

For each length in config.eval.lengths and mode in config.eval.modes, one row with loss,
perplexity, accuracy and exact match (and the loss at each token position). Runs with a rotary
scheme (rope, xpos, prope) get extra rows for each scaling in config.eval.rope_scalings (PI,
static / dynamic NTK, YaRN; research.positions.rope) at s = max(1, eval_length / train_length):
the same weights, a different scaling, evaluated with non-overlapping windows. Tasks have a
single mode (exact answers).
"""

import copy
import functools

import jax
from flax import nnx

from research import data
from research import evaluate
from research import model as model_lib
from research import positions
from research import sharding
from research import train
from research.positions import rope


def _variants(config):
  """(rope_scaling label, model config) pairs to evaluate, as functions of the eval length."""
  yield "none", lambda length: config.model
  if positions.rotary(config.model.position):
    key = positions.REGISTRY.settings_key(config.model.position)
    for scaling in config.eval.rope_scalings:
      def scaled(length, scaling=scaling):
        model_config = copy.deepcopy(config.model)
        model_config[key].update(rope.scaling_for_length(scaling, length, config.train.seq_len))
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
          metrics = evaluate.evaluate(eval_step, params, data.eval_batches(config, length, mode),
                                      mesh, config.eval.batch_size)
          rows.append({"eval_length": length, "eval_mode": mode, "rope_scaling": scaling,
                       **metrics})
          progress(f"  eval {length:>6} {mode:<15} rope_scaling={scaling:<11} "
                   f"loss {metrics['loss']:.4f}  ppl {metrics['perplexity']:.3f}  "
                   f"acc {metrics['accuracy']:.3f}")
  return rows
