"""Tests of research.evaluation.evaluate and research.evaluation.bootstrap: per-row sums and their
intervals."""

import math

import jax
import numpy as np
import pytest
import optax
from flax import nnx

from research.evaluation import bootstrap
from research.evaluation import evaluate
from research.model import transformer as model_lib
from research.model import sharding


def test_bootstrap_matches_the_normal_approximation_of_a_proportion():
  rng = np.random.default_rng(1)
  rate = {"rate": lambda sums: sums["hits"] / sums["rows"]}
  for num_rows in (100, 10_000):
    rows = {"hits": (rng.random(num_rows) < 0.3).astype(float), "rows": np.ones(num_rows)}
    ((low, high),) = bootstrap.intervals(rows, rate, samples=2000, seed=0).values()
    p = rows["hits"].mean()
    normal_width = 2 * 1.96 * math.sqrt(p * (1 - p) / num_rows)
    assert low < p < high and abs((high - low) / normal_width - 1) < 0.15, (num_rows, low, high)
  seeded = lambda seed: bootstrap.intervals(rows, rate, 500, seed=seed)
  assert seeded(3) == seeded(3) != seeded(4)


@pytest.mark.parametrize("score_chunk", [evaluate.SCORE_CHUNK, 5])
def test_eval_step_sums_per_row_and_intervals_cover_the_metrics(model_config, score_chunk):
  """Scored all at once, and 5 positions at a time (16 = 3 chunks and a padded one)."""
  model = model_lib.build_model(model_config, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  batches = []
  for rows in (8, 8, 3):  # the last batch is short: padded, and its padding dropped
    mask = (rng.random((rows, 16)) < 0.5).astype(np.float32)
    mask[0] = 0  # a row without scored tokens is no evaluation row
    tokens = rng.integers(0, model_config.vocab_size, (rows, 17)).astype(np.int32)
    batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask})
  mesh = sharding.make_mesh((-1, 1, 1))
  with jax.set_mesh(mesh):
    sums = evaluate.row_sums(evaluate.make_eval_step(graphdef, score_chunk), params,
                             iter(batches), mesh, 8)
  scored = [(b, i) for b in batches for i in range(len(b["inputs"])) if b["loss_mask"][i].any()]
  assert len(sums["rows"]["tokens"]) == len(scored) == 16
  for column, (b, i) in enumerate(scored):
    logits = model(b["inputs"][i:i + 1])[0]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"][i])
    correct = (np.argmax(logits, -1) == b["targets"][i]) * b["loss_mask"][i]
    np.testing.assert_allclose(sums["rows"]["nll"][column], (nll * b["loss_mask"][i]).sum(),
                               rtol=1e-5)
    assert sums["rows"]["tokens"][column] == b["loss_mask"][i].sum()
    assert sums["rows"]["correct"][column] == correct.sum()
    assert sums["rows"]["exact"][column] == (correct.sum() == b["loss_mask"][i].sum())
  metrics = evaluate.metrics(sums, bootstrap_samples=300, bootstrap_seed=0)
  rows = sums["rows"]
  np.testing.assert_allclose(metrics["loss"], rows["nll"].sum() / rows["tokens"].sum(), rtol=1e-6)
  assert metrics["tokens"] == rows["tokens"].sum() and metrics["sequences"] == 16
  for name in ("loss", "perplexity", "accuracy", "exact_match"):
    assert metrics[f"{name}_ci_low"] <= metrics[name] <= metrics[f"{name}_ci_high"]
  assert metrics["loss_ci_low"] < metrics["loss_ci_high"]
  np.testing.assert_allclose(np.log(metrics["perplexity_ci_high"]), metrics["loss_ci_high"],
                             rtol=1e-4)  # the quantiles interpolate between resamples
  both = evaluate.concatenate([sums, sums])
  assert len(both["rows"]["nll"]) == 32
  np.testing.assert_allclose(both["tokens_by_position"], 2 * sums["tokens_by_position"])


def test_a_packed_row_scores_each_document_as_if_it_were_alone(model_config):
  """Segments and positions reach the model through row_sums (padded, sharded batches): a row of
  three documents gets the nll of the three evaluated one by one."""
  model = model_lib.build_model(model_config, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(1)
  lengths = (5, 7, 4)
  tokens = rng.integers(0, model_config.vocab_size, (sum(lengths) + 1,)).astype(np.int32)
  batch = {"inputs": tokens[None, :-1], "targets": tokens[None, 1:],
           "loss_mask": np.ones((1, sum(lengths)), np.float32),
           "segments": np.repeat(np.arange(3), lengths)[None].astype(np.int32),
           "positions": np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32)}
  mesh = sharding.make_mesh((-1, 1, 1))
  with jax.set_mesh(mesh):
    sums = evaluate.row_sums(evaluate.make_eval_step(graphdef), params, iter([batch]), mesh, 8)
  # Each document alone at the start of a row (causality: what follows it cannot matter), and the
  # whole row without segments, in one compiled call.
  starts = np.cumsum((0,) + lengths[:-1])
  rows = np.stack([np.roll(batch["inputs"][0], -start) for start in starts] + [batch["inputs"][0]])
  logits = jax.jit(lambda params, rows: nnx.merge(graphdef, params)(rows))(params, rows)
  alone = sum(optax.softmax_cross_entropy_with_integer_labels(
      logits[i, :n], tokens[start + 1:start + n + 1]).sum()
              for i, (start, n) in enumerate(zip(starts, lengths)))
  np.testing.assert_allclose(sums["rows"]["nll"], [alone], rtol=1e-5)
  whole = optax.softmax_cross_entropy_with_integer_labels(logits[-1], batch["targets"][0]).sum()
  assert abs(whole - alone) > 1e-3  # without the segments the documents would see each other


def _torchmetrics_macro(targets, predictions, num_classes):
  """MulticlassAccuracy(average="macro")'s rule, written out: per class recall tp / (tp + fn),
  averaged over the classes with tp + fp + fn > 0 (a class only predicted counts as 0)."""
  recalls = []
  for c in range(num_classes):
    tp = np.sum((targets == c) & (predictions == c))
    fn = np.sum((targets == c) & (predictions != c))
    fp = np.sum((targets != c) & (predictions == c))
    if tp + fp + fn:
      recalls.append(tp / (tp + fn) if tp + fn else 0.0)
  return np.mean(recalls)


def test_macro_accuracy_counts_classes_as_torchmetrics_macro_average(model_config):
  model = model_lib.build_model(model_config, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(1)
  inputs = rng.integers(0, 6, (8, 12)).astype(np.int32)
  predictions = np.argmax(np.asarray(model(inputs)), -1)
  # Targets: the model's own prediction at about half the positions (hits), else one of a few
  # classes (misses; some classes are only predicted, never targets).
  targets = np.where(rng.random((8, 12)) < 0.5, predictions,
                     rng.integers(0, 6, (8, 12))).astype(np.int32)
  mask = (rng.random((8, 12)) < 0.7).astype(np.float32)
  batch = {"inputs": inputs, "targets": targets, "loss_mask": mask}
  mesh = sharding.make_mesh((-1, 1, 1))
  with jax.set_mesh(mesh):
    sums = evaluate.row_sums(evaluate.make_eval_step(graphdef, num_classes=model_config.vocab_size),
                             params, iter([batch]), mesh, 8)
  metrics = evaluate.metrics(sums, bootstrap_samples=200, bootstrap_seed=0)
  scored = mask > 0
  expected = _torchmetrics_macro(batch["targets"][scored], predictions[scored],
                                 model_config.vocab_size)
  assert metrics["macro_accuracy"] == pytest.approx(expected, abs=1e-6)
  assert metrics["macro_accuracy_ci_low"] <= metrics["macro_accuracy"] <= \
      metrics["macro_accuracy_ci_high"]
  accuracy = np.mean(predictions[scored] == targets[scored])
  assert metrics["accuracy"] == pytest.approx(accuracy)
  assert 0.3 < accuracy and abs(metrics["macro_accuracy"] - accuracy) > 0.05  # tells them apart


@pytest.mark.parametrize("mesh_shape,lengths,expected", [
    ((1, 1, 8), (2,), [2]),  # one short batch: its rows only
    ((2, 1, 4), (3,), [4]),  # rounded up to what the batch axes split evenly
    ((8, 1, 1), (8, 8, 2), [8, 8, 8]),  # several batches: one shape, eval.batch_size
])
def test_a_short_evaluation_runs_no_idle_rows(mesh_shape, lengths, expected):
  """Two windows of 2048 tokens run 2 rows, not eval.batch_size: rows pad to a multiple of the
  mesh's batch axes, and a short last batch after full ones to the full size (one program)."""
  seen = []

  def eval_step(params, batch):
    del params
    seen.append(batch["inputs"].shape[0])
    rows = batch["inputs"].shape[0]
    return {"rows": {"tokens": np.ones(rows)}, "nll_by_position": np.zeros(4),
            "tokens_by_position": np.zeros(4)}

  batches = [{"inputs": np.zeros((n, 4), np.int32)} for n in lengths]
  sums = evaluate.row_sums(eval_step, None, iter(batches), sharding.make_mesh(mesh_shape), 8)
  assert seen == expected
  assert len(sums["rows"]["tokens"]) == sum(lengths)


def test_progress_scores_say_what_applies_to_the_task():
  """Language modeling: loss, perplexity and, on bytes, bits per byte (no exact-match column);
  tasks: accuracy and exact match; a point interval (one window) is said."""
  from configs import base  # noqa: PLC0415
  from research.evaluation import extrapolation  # noqa: PLC0415
  metrics = {"loss": math.log(2) * 1.5, "perplexity": 2.83, "accuracy": 0.5, "exact_match": 0.25,
             "sequences": 4}
  config = base.get_config()
  line = extrapolation._scores(config, metrics)
  assert "bits/byte 1.500" in line and "exact" not in line and "interval" not in line, line
  config.data.name = "mqar"
  line = extrapolation._scores(config, dict(metrics, sequences=1))
  assert "acc 0.500  exact 0.250" in line and "ppl" not in line and "is a point" in line, line
