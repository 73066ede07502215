"""Length extrapolation: evaluate a trained run at every eval length and mode, without retraining.

For each held-out split in config.eval.splits, length in config.eval.lengths and mode in
config.eval.modes, one row with loss, perplexity, accuracy and exact match, their 95% bootstrap
intervals (research.evaluation.evaluate), the loss at each token position, and `state_bytes`: the
decode state the model carries for one sequence of that length (model.cache_bytes: the KV cache of
softmax attention, the fixed state of a recurrent mixer, over all layers). Needle tasks get one
row per depth in config.eval.depths, each with its `depth`, and a row without a depth that pools
every depth's examples; all of them record the evaluated `depths`. Runs with a rotary scheme
(rope, xpos, prope) get extra rows for each scaling in config.eval.rope_scalings (PI, static /
dynamic NTK, YaRN; research.model.positions.rope) at s = max(1, eval_length / train_length): the
same weights, a different scaling, evaluated with non-overlapping windows. Tasks have a single
mode (exact answers).

`evaluate_run` evaluates a run's newest readable complete checkpoint (research.runs.checkpoints)
at the settings that its RUN/eval.json has no row for yet and appends their rows
(research.evaluation.results); it never retrains. It takes no writer lock and writes nothing but
its rows (under the run's results lock), so it runs beside the run's trainer, which goes on
writing and rotating checkpoints, and beside other evaluators. It evaluates on config.mesh.shape
where that fits the devices present, else on a mesh that does
(research.model.sharding.fitting_mesh_shape, with a line saying which): a run trained on 8
devices evaluates on 1, to the same losses.
"""

import copy
import functools
import itertools
import math
from typing import Callable

import jax
import ml_collections
from flax import nnx

from research.runs import checkpoints
from research import data
from research.evaluation import results as eval_results
from research.evaluation import evaluate
from research.model import transformer as model_lib
from research.model import positions
from research.model import sharding
from research.data import mad
from research.data import validation
from research.model.positions import rope


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


def _row_settings(settings, depths):
  """{depth: the settings of its row} of one evaluation: for a needle task one row per depth and
  one pooling them (depth None), all recording the evaluated depths; else just `settings`."""
  if depths == (None,):
    return {None: settings}
  pooled = dict(settings, depths=list(depths))
  return {**{depth: dict(pooled, depth=depth) for depth in depths}, None: pooled}


def _plan(config, step):
  """({depth: row settings}, model config at the length) of every evaluation `config` asks for."""
  language_modeling = data.is_language_modeling(config)  # tasks: per example, no token budget
  for scaling, model_config_at in _variants(config):
    modes = ("nonoverlapping",)
    if scaling == "none" and language_modeling:
      modes = config.eval.modes
    for split, length, mode in itertools.product(config.eval.splits, config.eval.lengths, modes):
      settings = {"step": step, "split": split, "eval_length": length, "eval_mode": mode,
                  "rope_scaling": scaling,
                  "num_tokens": config.eval.num_tokens if language_modeling else None,
                  "sliding_stride": validation.sliding_stride(config) if mode == "sliding" else 0,
                  "bootstrap_samples": config.eval.bootstrap_samples,
                  "bootstrap_seed": config.eval.bootstrap_seed}
      yield _row_settings(settings, data.eval_depths(config)), model_config_at(length)


def _to_do(config, workdir, step):
  done = {eval_results.key(row) for row in eval_results.read(workdir)}
  return [(rows, m) for rows, m in _plan(config, step)
          if any(eval_results.key(s) not in done for s in rows.values())]


def _row_sums(config, eval_step, params, mesh, split, length, mode, depths):
  """{depth: row sums} at every depth (one set for None: pooled over the depths)."""
  sums = {depth: evaluate.row_sums(eval_step, params,
                                   data.eval_batches(config, length, mode, split, depth), mesh,
                                   config.eval.batch_size)
          for depth in [d for d in depths if d is not None] or [None]}
  if None not in sums:
    sums[None] = evaluate.concatenate(list(sums.values()))
  return sums


def _scores(config, metrics) -> str:
  """A progress line's scores: loss and perplexity for language modeling (with bits per byte for
  a byte-level corpus: loss / ln 2), accuracy and exact match for tasks; a note where the 95%
  interval is a point, from one window or example."""
  if data.is_language_modeling(config):
    scores = f"loss {metrics['loss']:.4f}  ppl {metrics['perplexity']:.3f}"
    if config.data.tokenizer == "bytes":
      scores += f"  bits/byte {metrics['loss'] / math.log(2):.3f}"
  else:
    scores = (f"loss {metrics['loss']:.4f}  acc {metrics['accuracy']:.3f}  "
              f"exact {metrics['exact_match']:.3f}")
  if metrics["sequences"] == 1:
    scores += "  (one window or example: its interval is a point)"
  return scores


def evaluate_run(config: ml_collections.ConfigDict, workdir: str,
                 progress: Callable[[str], None] = functools.partial(print, flush=True)
                 ) -> list[dict]:
  """Evaluate the run in `workdir` at every eval length x mode x RoPE scaling (x needle depth) of
  `config` not in its eval.json yet, from its newest readable complete checkpoint (while the run
  trains too), on config.mesh.shape or, where that does not fit the devices present, a mesh that
  does (sharding.fitting_mesh_shape, noted through `progress`); appends and returns the new rows
  (those another evaluator appended meanwhile are left out)."""
  saved_steps = checkpoints.steps(workdir)
  if saved_steps and not _to_do(config, workdir, saved_steps[-1]):
    return []
  shape, note = sharding.fitting_mesh_shape(config.mesh.shape, jax.device_count(),
                                            config.eval.batch_size)
  if note:
    progress(note)
  mesh = sharding.make_mesh(shape)
  rows = []
  with jax.set_mesh(mesh):
    abstract = nnx.state(nnx.eval_shape(
        lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0))))
    step, params = checkpoints.restore_params(
        workdir, sharding.sharded_abstract(abstract, mesh), log=progress)
    eval_steps, state_bytes = {}, {}  # one compiled step (and state size) per (scaling, length)
    for row_settings, model_config in _to_do(config, workdir, step):
      split, length, mode, scaling = (row_settings[None][k] for k in
                                      ("split", "eval_length", "eval_mode", "rope_scaling"))
      if (scaling, length) not in eval_steps:
        model_at = nnx.eval_shape(lambda: model_lib.build_model(model_config, rngs=nnx.Rngs(0)))
        # MAD's tasks score macro accuracy as mad-lab does (research.evaluation.evaluate).
        classes = model_config.vocab_size if config.data.name in mad.TASKS else None
        eval_steps[scaling, length] = evaluate.make_eval_step(nnx.graphdef(model_at),
                                                              num_classes=classes)
        state_bytes[scaling, length] = model_at.cache_bytes(1, length)
      sums = _row_sums(config, eval_steps[scaling, length], params, mesh, split, length, mode,
                       list(row_settings))
      new = []
      for depth, settings in row_settings.items():
        metrics = evaluate.metrics(sums[depth], config.eval.bootstrap_samples,
                                   config.eval.bootstrap_seed)
        new.append({**settings, **metrics, "state_bytes": state_bytes[scaling, length]})
        at = "" if depth is None else f" depth {depth:<5}"
        progress(f"  eval {split:<10} {length:>6} {mode:<15} rope_scaling={scaling:<11}{at} "
                 f"{_scores(config, metrics)}  (step {step})")
      rows += eval_results.append(workdir, new)
  return rows
