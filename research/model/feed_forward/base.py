"""The interface every feed-forward implements, and the auxiliary losses the training loss collects.

Shape letters: those of research/model/attention/base.py, and for feed-forwards F the hidden width
of an MLP or of one expert, X the number of experts, R the experts each token is routed to (top_k).

A feed-forward maps [batch, length, d_model] to the same shape, causally (most look at one token;
one that mixes tokens, as RWKV's channel mix shifts them, keeps within a document's segment). It
is built as `cls(model_config, settings, rngs=...)` and supports
  * the full-sequence forward `__call__(x_BxLxD, segments_BxL=None)` (training, evaluation),
  * `decode(x_BxTxD, cache, index) -> (y, cache)` for one or more new tokens from
    `init_cache(batch_size, max_length)` (None for one that looks at one token at a time),
  * `hyperparameters` (defaults; the config sub-dict model.<name>), checked by
    `validate(settings, model_config)`.
`model.mlp_ratio` = 0 drops the feed-forward of every block.

Auxiliary losses. A layer with a training objective of its own (a mixture of experts' load
balancing) sows it as an `AuxiliaryLoss` while the model runs under
`nnx.capture(..., AuxiliaryLoss)`, which the training loss does (research/training/loop.py) and
nothing else: evaluation and decoding compute none. A sown value is a scalar, which
`auxiliary_losses` averages over the layers (and calls) that sowed its name, or a `Pooled(a, b)`
pair of per-layer statistics, whose term is sum(mean_l a_l * mean_l b_l): a loss computed once
on statistics pooled over the layers (a mixture of experts' model.moe.pooled_load_balancing);
a name's value is the mean of its scalars plus the term of its Pooled values. The entry
OBJECTIVE is added to the training loss, every entry is logged.
"""

import collections
import typing

import jax
import jax.numpy as jnp
from flax import nnx

# The name of the sown value that the training loss adds (the others are logged beside it).
OBJECTIVE = "auxiliary_loss"


class AuxiliaryLoss(nnx.Intermediate):
  """A scalar a layer adds to the training objective, or reports beside it."""


def capturing(module: nnx.Module) -> bool:
  """Whether `module` runs under nnx.capture, so that what it sows is collected (elsewhere a
  sown value would be kept on the module)."""
  return hasattr(module, "__captures__")


class Pooled(typing.NamedTuple):
  """A sown term of statistics pooled over the layers: each layer sows its a and b (vectors of
  one shape, e.g. [X] means over its tokens), and the term is sum(mean_l a_l * mean_l b_l). When
  every layer sees the same tokens, mean_l of per-layer token means is the mean over the tokens
  of all the layers pooled: HF transformers' `load_balancing_loss_func`, which concatenates the
  router logits of every layer before computing f and P (research/model/feed_forward/moe.py)."""
  a: jax.Array
  b: jax.Array


def auxiliary_losses(sown: nnx.State) -> dict[str, jax.Array]:
  """{name: the mean of its scalars over the layers (and calls) that sowed them, plus the term of
  its Pooled values} from nnx.capture's AuxiliaryLoss state; empty for a model without such
  layers."""
  by_name = collections.defaultdict(list)
  for path, variable in nnx.to_flat_state(sown):
    by_name[path[-1]].extend(variable.get_value())  # a tuple: one value per call
  combined = {}
  for name, values in by_name.items():
    pooled = [v for v in values if isinstance(v, Pooled)]
    scalars = [v for v in values if not isinstance(v, Pooled)]
    terms = []
    if scalars:
      terms.append(jnp.mean(jnp.stack(scalars)))
    if pooled:
      mean_a, mean_b = (jnp.mean(jnp.stack(side), axis=0) for side in zip(*pooled))
      terms.append(jnp.sum(mean_a * mean_b))
    combined[name] = sum(terms[1:], terms[0])
  return combined


class FeedForward(nnx.Module):
  """Defaults for a feed-forward that looks at one token at a time."""

  hyperparameters = {}
  # Small settings for the conformance suite (see
  # research.model.attention.base.Mixer.test_settings).
  test_settings = {}

  @classmethod
  def validate(cls, settings, model_config):
    """Raise ValueError, naming what is valid, if this feed-forward cannot be built."""
    del settings, model_config

  def __call__(self, x_BxLxD, segments_BxL=None):
    raise NotImplementedError

  def init_cache(self, batch_size, max_length):
    del batch_size, max_length
    return None

  def decode(self, x_BxTxD, cache, index, documents=None):
    """One token at a time needs no cache; with packed documents (masks.DecodeDocuments) as
    without them. A feed-forward with a cache keeps each document's to itself."""
    del index, documents
    return self(x_BxTxD), cache

  def idle_params_per_token(self):
    """Parameters a token does not use (the experts it is not routed to), for FLOP counts."""
    return 0
