"""Evaluation: loss, perplexity and accuracy of a trained model at any length, with intervals.

For language modeling, windows come from research.data.eval_batches in the ALiBi paper's two
modes (arXiv:2108.12409): non-overlapping windows, and sliding windows that score only their last
`stride` tokens. Each token of the same evaluated text is scored once in either mode, so the loss
is a mean over the same tokens at every length. With packed documents (data.packing="documents")
the batches carry segments and positions, which the model is given (`apply`): a token sees only
its own document, and END_OF_DOCUMENT inputs are not scored. For tasks, accuracy is exact match
over the scored (answer) positions, per token and per sequence.

Macro accuracy (MAD's, athms/mad-lab@0f49a45 mad/metrics.py: torchmetrics' MulticlassAccuracy,
average="macro", over the model's vocabulary): with per class c, over the scored positions, tp_c
(target c, predicted c), support_c (target c) and predicted_c (predicted c),
  macro_accuracy = mean over {c : tp_c + fp_c + fn_c > 0} of tp_c / support_c   (0 where no support)
(fp_c + fn_c = predicted_c + support_c - 2 tp_c), from the counts pooled over the rows: what the
metric's compute() gives over a split. mad-lab logs each test batch's value and Lightning
averages them over the epoch; the two differ only where a batch lacks a class. Computed when
make_eval_step is given num_classes (the MAD tasks, research.evaluation.extrapolation).

The jitted step returns sums per row (window or example), so every metric also gets a 95%
percentile bootstrap interval over rows (research.evaluation.bootstrap): loss = sum nll / sum
tokens, perplexity = exp(loss), accuracy = sum correct / sum tokens, exact_match = rows entirely
right / rows.
"""

import math
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from research.evaluation import bootstrap
from research import data
from research.model import sharding

def macro_accuracy(tp, support, predicted):
  """The module docstring's macro accuracy from class counts [..., V] (the last axis classes)."""
  present = (support + predicted - tp) > 0  # tp + fp + fn > 0
  recall = np.where(support > 0, tp / np.maximum(support, 1), 0.0)
  return (recall * present).sum(-1) / np.maximum(present.sum(-1), 1)


STATISTICS = {
    "loss": lambda s: s["nll"] / s["tokens"],
    "perplexity": lambda s: np.exp(np.minimum(s["nll"] / s["tokens"], 700.0)),
    "accuracy": lambda s: s["correct"] / s["tokens"],
    "exact_match": lambda s: s["exact"] / s["sequences"],
}
CLASS_STATISTICS = {  # with class counts (make_eval_step's num_classes)
    "macro_accuracy": lambda s: macro_accuracy(s["tp"], s["support"], s["predicted"]),
}


# Windows longer than this are scored SCORE_CHUNK positions at a time: the [B, L, vocab] float32
# logits of a pretrained model's vocabulary at long lengths would not fit (150k ids x 16k
# positions: 10 GB per row); the per-token values are the same either way.
SCORE_CHUNK = 2048


def _scores(model, batch, chunk):
  """Per token: the negative log-likelihood of the target and the argmax, [B, L] each, from the
  logits of `chunk` positions at a time (all at once for a shorter window)."""
  x = model.features(batch["inputs"], batch.get("positions"), batch.get("segments"))
  targets = batch["targets"]

  def score(x_BxCxD, targets_BxC):
    logits = model.head_logits(x_BxCxD)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, targets_BxC),
            jnp.argmax(logits, -1))

  length = x.shape[1]
  if chunk is None or length <= chunk:
    return score(x, targets)
  pad = -length % chunk
  x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets, ((0, 0), (0, pad)))
  to_chunks = lambda a: jnp.moveaxis(a.reshape(a.shape[0], -1, chunk, *a.shape[2:]), 1, 0)
  nll, predictions = jax.lax.map(lambda c: score(*c), (to_chunks(x), to_chunks(targets)))
  from_chunks = lambda a: jnp.moveaxis(a, 0, 1).reshape(a.shape[1], -1)[:, :length]
  return from_chunks(nll), from_chunks(predictions)


def _class_counts(targets, predictions, mask, num_classes):
  """Per row, [B, V] each: tp (target and prediction c), support (target c), predicted (c)."""
  target_hot = jax.nn.one_hot(targets, num_classes) * mask[..., None]
  predicted_hot = jax.nn.one_hot(predictions, num_classes) * mask[..., None]
  return {"tp": (target_hot * predicted_hot).sum(1), "support": target_hot.sum(1),
          "predicted": predicted_hot.sum(1)}


def make_eval_step(graphdef, score_chunk=SCORE_CHUNK, num_classes=None):
  """jit-compiled sums of per-token statistics: per row of the batch, and per position; with
  num_classes, also each row's class counts (the macro accuracy's, module docstring)."""

  def eval_step(params, batch):
    nll, predictions = _scores(nnx.merge(graphdef, params), batch, score_chunk)
    mask = batch["loss_mask"]
    correct = ((predictions == batch["targets"]) * mask).sum(1)
    tokens = mask.sum(1)
    rows = {"nll": (nll * mask).sum(1), "tokens": tokens, "correct": correct,
            "exact": ((tokens > 0) & (correct == tokens)).astype(jnp.float32)}
    if num_classes:
      rows.update(_class_counts(batch["targets"], predictions, mask, num_classes))
    # Replicated, so that every process reads every row.
    rows = {k: sharding.constrain(v, (None,) * v.ndim) for k, v in rows.items()}
    return {"rows": rows, "nll_by_position": (nll * mask).sum(0),
            "tokens_by_position": mask.sum(0)}

  return jax.jit(eval_step)


def _pad_rows(batch, rows):
  """Pad a short final batch with unscored rows, so every batch has the same shape (every key:
  zeros, which are valid segment ids and positions too)."""
  missing = rows - len(batch["inputs"])
  return {k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}


def _fewest_rows(rows, mesh):
  """`rows` rounded up to a multiple of what the mesh's batch axes and the processes split
  evenly (a short evaluation, e.g. 2 windows of 2048 tokens, runs 2 rows, not eval.batch_size)."""
  multiple = math.lcm(mesh.shape["data"] * mesh.shape["fsdp"], jax.process_count())
  return -(-rows // multiple) * multiple


def global_batch(batch, mesh):
  """A global batch (the same numpy arrays on every process) as arrays sharded over the mesh,
  every key (inputs, targets, loss_mask, and segments and positions if present) by its rows."""
  per_process = len(batch["inputs"]) // jax.process_count()
  rows = slice(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)
  return {k: jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, v.ndim), v[rows],
                                                     v.shape)
          for k, v in batch.items()}


def row_sums(eval_step: Callable, params, batches: Iterable[dict], mesh: jax.sharding.Mesh,
             batch_size: int, max_batches: int | None = None) -> dict:
  """{"rows": {column: one value per row}, "nll_by_position": [L], "tokens_by_position": [L]}:
  the sums of every row with scored tokens (padding rows dropped), and per-position sums.
  Batches are padded to batch_size rows, but one short batch alone to _fewest_rows."""
  parts = []
  for i, batch in enumerate(batches):
    if max_batches is not None and i >= max_batches:
      break
    if i == 0:  # a short first batch is the only one: no idle rows
      rows_per_batch = min(batch_size, _fewest_rows(len(batch["inputs"]), mesh))
    sums = jax.device_get(eval_step(params, global_batch(_pad_rows(batch, rows_per_batch), mesh)))
    rows = {k: v[:len(batch["inputs"])] for k, v in sums.pop("rows").items()}
    parts.append({"rows": {k: v[rows["tokens"] > 0] for k, v in rows.items()}, **sums})
  if not parts:
    raise ValueError("evaluation saw no batches; check eval.num_tokens and the lengths")
  return concatenate(parts)


def concatenate(parts: list[dict]) -> dict:
  """Row sums of several evaluations as one: rows joined, per-position sums added."""
  return {"rows": {k: np.concatenate([p["rows"][k] for p in parts]) for k in parts[0]["rows"]},
          **{k: sum(p[k] for p in parts) for k in ("nll_by_position", "tokens_by_position")}}


def _totals(rows):
  """Column sums (as length-1 arrays, the shape STATISTICS take) over rows with scored tokens."""
  if not rows["tokens"].sum():
    raise ValueError("evaluation saw no scored tokens; check eval.num_tokens and the lengths")
  return {k: v.sum(axis=0, keepdims=True) for k, v in rows.items()}


def metrics(sums: dict, bootstrap_samples: int, bootstrap_seed: int) -> dict:
  """loss, perplexity, accuracy, exact_match and their `<name>_ci_low` / `<name>_ci_high`
  (95% bootstrap over rows), tokens and sequences scored, and the loss at each position."""
  rows = dict(sums["rows"], sequences=np.ones_like(sums["rows"]["tokens"]))
  totals = _totals(rows)
  statistics = dict(STATISTICS, **(CLASS_STATISTICS if "tp" in rows else {}))
  result = {name: float(statistic(totals)[0]) for name, statistic in statistics.items()}
  result.update(tokens=int(totals["tokens"][0]), sequences=int(totals["sequences"][0]))
  for name, (low, high) in bootstrap.intervals(rows, statistics, bootstrap_samples,
                                               bootstrap_seed).items():
    result[f"{name}_ci_low"], result[f"{name}_ci_high"] = low, high
  with np.errstate(invalid="ignore", divide="ignore"):
    by_position = sums["nll_by_position"] / sums["tokens_by_position"]
  result["loss_by_position"] = [None if np.isnan(x) else float(x) for x in by_position]
  return result


def validation_loss(eval_step, params, config, mesh):
  """Mean loss at the training length on the validation split (for periodic checks)."""
  batches = data.eval_batches(config, config.train.seq_len, "nonoverlapping")
  rows = row_sums(eval_step, params, batches, mesh, config.eval.batch_size,
                  config.train.eval_batches)["rows"]
  return float(STATISTICS["loss"](_totals(rows))[0])
