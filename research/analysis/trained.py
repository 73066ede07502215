"""A trained run as the analyses read it: its config (softmax backend xla, the materialised
probabilities) and its model at any kept checkpoint, on one device, with the functions of the
model the analyses measure, each jitted once for all checkpoints."""

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from research import data
from research.model import transformer as model_lib
from research.model import sharding
from research.analysis import heads
from research.evaluation import evaluate
from research.evaluation import generate
from research.runs import checkpoints
from research.runs import config_fields


class Checkpoints:
  """A run's config (softmax backend xla) and its model at any kept checkpoint, on one device;
  functions jitted once for all checkpoints."""

  def __init__(self, run_dir: str, log: Callable[[str], None]):
    self.directory, self.log = run_dir, log
    self.config = config_fields.load_saved(run_dir)
    self.config.model.attention_backend = "xla"
    self.steps = checkpoints.steps(run_dir)
    if not self.steps:
      raise FileNotFoundError(f"{run_dir} has no checkpoint; train it first (python -m "
                              "experiments.train with this --workdir)")
    self.mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    self.graphdef = None
    self._weights, self._eval_step, self._masked = None, None, None
    self._importance, self._permuted = None, None

  def state(self, step: int | None = None):
    """(step, state) of checkpoint `step` (None: the newest readable one)."""
    step, model = generate.restore(self.config, self.directory, log=self.log, step=step)
    self.graphdef, state = nnx.split(model)
    return step, state

  def attention_weights(self, state, batch: dict) -> list:
    """Per layer, numpy [B, N, L, L] probabilities, None for a layer without maps."""
    if self._weights is None:
      graphdef = self.graphdef
      self._weights = jax.jit(lambda s, b: nnx.merge(graphdef, s).attention_weights(
          b["inputs"], b.get("positions"), b.get("segments")))
    return [None if w is None else np.asarray(w) for w in self._weights(state, batch)]

  def masked_gradient(self, state, mask_LxN: np.ndarray, batch: dict):
    """(dL/d mask, (nll sum, correct, tokens)) of the batch's mean loss with the head mask."""
    if self._masked is None:
      graphdef = self.graphdef

      def mean_loss(mask, state, batch):
        model = nnx.merge(graphdef, state, copy=True)  # its own Variables, which the mask sets
        heads.mask_heads(model, mask)
        logits = model_lib.apply_to_batch(model, batch)
        weights = batch["loss_mask"]
        nll = (optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
               * weights).sum()
        correct = ((jnp.argmax(logits, -1) == batch["targets"]) * weights).sum()
        tokens = weights.sum()
        return nll / jnp.maximum(tokens, 1.0), (nll, correct, tokens)

      self._masked = jax.jit(jax.grad(mean_loss, has_aux=True))
    return self._masked(jnp.asarray(mask_LxN, jnp.float32), state, batch)

  def gradient_importance(self, state, batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """(importance [B, L]: |e_j . d p_y / d e_j|, the predicted next token y's probability after
    the last position against each input embedding e_j; the output distribution there [B, V])."""
    if self._importance is None:
      graphdef = self.graphdef

      def predicted_probability(offset_BxLxD, state, batch):
        logits = nnx.merge(graphdef, state).probe(
            batch["inputs"], batch.get("positions"), batch.get("segments"),
            input_offset_BxLxD=offset_BxLxD)
        probs_BxV = jax.nn.softmax(logits[:, -1])
        predicted_B = jnp.argmax(probs_BxV, axis=-1)
        return jnp.take_along_axis(probs_BxV, predicted_B[:, None], axis=-1).sum(), probs_BxV

      def importance(state, batch):
        table_VxD = nnx.merge(graphdef, state).embed.embedding[...]
        embedded_BxLxD = jnp.take(table_VxD, batch["inputs"], axis=0)
        grad_BxLxD, probs_BxV = jax.grad(predicted_probability, has_aux=True)(
            jnp.zeros_like(embedded_BxLxD), state, batch)
        return jnp.abs((grad_BxLxD * embedded_BxLxD).sum(-1)), probs_BxV

      self._importance = jax.jit(importance)
    importance_BxL, probs_BxV = self._importance(state, batch)
    return np.asarray(importance_BxL), np.asarray(probs_BxV)

  def permuted_outputs(self, state, batch: dict, layer: int, head: int,
                       keys: jax.Array) -> np.ndarray:
    """[K, B, V]: the output distribution after the last position with the last query's
    attention row of `head` in `layer` permuted over its visible keys, one permutation per key."""
    if self._permuted is None:
      graphdef = self.graphdef

      def permuted(state, batch, layer, head, keys):
        def output(key):
          def edit(probs_BxNxTxS, mask):
            rows_BxS = probs_BxNxTxS[:, head, -1]
            visible_BxS = jnp.broadcast_to(mask[:, 0, -1], rows_BxS.shape)
            shuffled_BxS = jax.vmap(heads.permute_visible)(
                rows_BxS, visible_BxS, jax.random.split(key, rows_BxS.shape[0]))
            return probs_BxNxTxS.at[:, head, -1].set(shuffled_BxS)

          logits = nnx.merge(graphdef, state).probe(
              batch["inputs"], batch.get("positions"), batch.get("segments"),
              edit_attention={layer: edit})
          return jax.nn.softmax(logits[:, -1])

        return jax.lax.map(output, keys)  # one permutation at a time: memory of one forward

      self._permuted = jax.jit(permuted, static_argnums=2)
    return np.asarray(self._permuted(state, batch, layer, head, keys))

  def loss_by_position(self, state, length: int) -> np.ndarray:
    """The mean loss at each position of non-overlapping validation windows of `length`."""
    if self._eval_step is None:
      self._eval_step = evaluate.make_eval_step(self.graphdef)
    with jax.set_mesh(self.mesh):
      sums = evaluate.row_sums(self._eval_step, state,
                               data.eval_batches(self.config, length, "nonoverlapping"),
                               self.mesh, self.config.eval.batch_size)
    with np.errstate(invalid="ignore", divide="ignore"):
      return sums["nll_by_position"] / sums["tokens_by_position"]
