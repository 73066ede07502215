"""Evaluation: loss, perplexity and accuracy of a trained model at any length.

For language modeling, windows come from research.data.eval_batches in the ALiBi paper's two
modes (arXiv:2108.12409): non-overlapping windows, and sliding windows that score only their last
`stride` tokens. Each token of the same evaluated text is scored once in either mode, so the loss
is a mean over the same tokens at every length. For tasks, accuracy is exact match over the scored
(answer) positions, per token and per sequence.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from research import data
from research import sharding


def make_eval_step(graphdef):
  """jit-compiled sums of per-token statistics over one batch."""

  def eval_step(params, batch):
    logits = nnx.merge(graphdef, params)(batch["inputs"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    correct = (jnp.argmax(logits, -1) == batch["targets"]) * mask
    scored_rows = mask.sum(1) > 0
    return {
        "nll": (nll * mask).sum(),
        "tokens": mask.sum(),
        "correct": correct.sum(),
        "sequences": scored_rows.sum(),
        "exact": (scored_rows & (correct.sum(1) == mask.sum(1))).sum(),
        "nll_by_position": (nll * mask).sum(0),
        "tokens_by_position": mask.sum(0),
    }

  return jax.jit(eval_step)


def _pad_rows(batch, rows):
  """Pad a short final batch with unscored rows, so every batch has the same shape."""
  missing = rows - len(batch["inputs"])
  return {k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}


def global_batch(batch, mesh):
  """A global batch (the same numpy arrays on every process) as arrays sharded over the mesh."""
  per_process = len(batch["inputs"]) // jax.process_count()
  rows = slice(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)
  return {k: jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, v.ndim), v[rows],
                                                     v.shape)
          for k, v in batch.items()}


def evaluate(eval_step, params, batches, mesh, batch_size, max_batches=None):
  """Aggregate metrics over `batches`: loss, perplexity, accuracy, exact_match, loss by position."""
  totals = None
  for i, batch in enumerate(batches):
    if max_batches is not None and i >= max_batches:
      break
    sums = jax.device_get(eval_step(params, global_batch(_pad_rows(batch, batch_size), mesh)))
    totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
  if totals is None or totals["tokens"] == 0:
    raise ValueError("evaluation saw no scored tokens; check eval.num_tokens and the lengths")
  loss = float(totals["nll"] / totals["tokens"])
  with np.errstate(invalid="ignore", divide="ignore"):
    by_position = totals["nll_by_position"] / totals["tokens_by_position"]
  return {
      "loss": loss,
      "perplexity": math.exp(min(loss, 700.0)),
      "accuracy": float(totals["correct"] / totals["tokens"]),
      "exact_match": float(totals["exact"] / max(totals["sequences"], 1)),
      "tokens": int(totals["tokens"]),
      "loss_by_position": [None if np.isnan(x) else float(x) for x in by_position],
  }


def validation_loss(eval_step, params, config, mesh):
  """Mean loss at the training length on the validation split (for periodic checks)."""
  batches = data.eval_batches(config, config.train.seq_len, "nonoverlapping")
  return evaluate(eval_step, params, batches, mesh, config.eval.batch_size,
                  config.train.eval_batches)["loss"]
