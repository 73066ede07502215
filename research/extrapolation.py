"""Length extrapolation: evaluate a trained run at every eval length and mode, without retraining.

For each length in config.eval.lengths and mode in config.eval.modes, one row with loss,
perplexity, accuracy and exact match (and the loss at each token position). RoPE runs get extra
rows for each scaling in config.eval.rope_scalings (PI, NTK, YaRN; arXiv:2309.00071) with
factor s = max(1, eval_length / train_length): the same weights, a different position scheme,
evaluated with non-overlapping windows. Tasks have a single mode (exact answers).
"""

import copy
import functools

import jax
from flax import nnx

from research import checkpoints
from research import data
from research import evaluate
from research import model as model_lib
from research import sharding


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
    abstract = nnx.state(nnx.eval_shape(
        lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0))))
    _, params = checkpoints.restore_params(
        workdir, sharding.sharded_abstract(abstract, mesh), log=progress)
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
          progress(f"  eval {length:>6} {mode:<15} rope_scaling={scaling:<5} "
                   f"loss {metrics['loss']:.4f}  ppl {metrics['perplexity']:.3f}  "
                   f"acc {metrics['accuracy']:.3f}")
  return rows
