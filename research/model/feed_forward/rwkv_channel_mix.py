"""RWKV's channel mixing, the feed-forward block of RWKV-6 (Peng et al., arXiv:2404.05892), as
the authors' RWKV-LM computes it (RWKV-v5/src/model.py, RWKV_CMix_x060):
  dx = x' - x,   x_k = x + dx * mu_k,   x_r = x + dx * mu_r     (x' the previous token, 0 at a
                                                                 document's start)
  out = sigmoid(x_r W_r) * (relu(x_k W_k)^2 W_v)                  W_k: D -> F, W_v: F -> D
with a static token shift (RWKV-6's data-dependent one is the time mixing's). The hidden width F
is `hidden`, or with 0 model.mlp_ratio * d_model, the width of the lab's MLP, so that the two
feed-forward blocks compare at equal width (the reference uses 3.5 D rounded down to a multiple
of 32). Initialisation as the reference's at mid-depth (its layer_id / n_layer taken as 1/2, as
in research/model/attention/rwkv6.py): mu_k = mu_r = 1 - (i / D)^((1/2)^3) for channel i, W_k
orthogonal; W_r and W_v take the lab's LeCun normal instead of the reference's zeros (which make
a fresh block output 0). mu takes no weight decay, the kernels do. The decode state is the last
token.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import rwkv6
from research.model.feed_forward import base


class RWKVChannelMix(base.FeedForward):
  hyperparameters = {"hidden": 0}  # 0: model.mlp_ratio * d_model

  @classmethod
  def _hidden(cls, settings, model_config):
    return int(settings["hidden"]) or int(model_config.mlp_ratio * model_config.d_model)

  @classmethod
  def validate(cls, settings, model_config):
    if settings["hidden"] < 0:
      raise ValueError(f"the RWKV channel mix's hidden must be >= 1, or 0 for "
                       f"model.mlp_ratio * d_model; got {settings['hidden']}")
    if cls._hidden(settings, model_config) < 1:
      raise ValueError(f"the RWKV channel mix's hidden=0 takes model.mlp_ratio * d_model = "
                       f"{model_config.mlp_ratio} * {model_config.d_model} < 1; set hidden >= 1 "
                       f"or model.mlp_ratio >= 1")

  def __init__(self, model_config, settings, *, rngs):
    self.validate(settings, model_config)
    d, f = model_config.d_model, self._hidden(settings, model_config)
    self.d_model = d
    self.dtype = dtype = nn.compute_dtype(model_config)
    power = (1.0 - rwkv6.DEPTH_RATIO) ** 3
    self.mix_k, self.mix_r = (nn.param(rwkv6.mix_coefficients(d, power), ("embed",),
                                       weight_decay=False) for _ in range(2))
    self.key = nn.dense("BLD,DF->BLF", (d, f), ("embed", "mlp"), rngs=rngs, dtype=dtype,
                        init=nnx.initializers.orthogonal())
    self.value = nn.dense("BLF,FD->BLD", (f, d), ("mlp", "embed"), rngs=rngs, dtype=dtype)
    self.receptance = nn.dense("BLD,DE->BLE", (d, d), ("embed", "embed"), rngs=rngs,
                               dtype=dtype)

  def _mix(self, x_BxTxD, last_BxD, segments_BxT=None):
    previous, last = rwkv6.token_shift(x_BxTxD, last_BxD, segments_BxT)
    dx = previous - x_BxTxD
    x_k = x_BxTxD + dx * self.mix_k[...].astype(x_BxTxD.dtype)
    x_r = x_BxTxD + dx * self.mix_r[...].astype(x_BxTxD.dtype)
    hidden_BxTxF = jnp.square(jax.nn.relu(self.key(x_k)))
    return jax.nn.sigmoid(self.receptance(x_r)) * self.value(hidden_BxTxF), last

  def __call__(self, x_BxLxD, segments_BxL=None):
    return self._mix(x_BxLxD, self.init_cache(x_BxLxD.shape[0], 0), segments_BxL)[0]

  def init_cache(self, batch_size, max_length):
    del max_length  # the last token only
    return jnp.zeros((batch_size, self.d_model), self.dtype)

  def decode(self, x_BxTxD, cache, index, documents=None):
    """With packed documents (masks.DecodeDocuments) the token shift sees 0 before each
    document's first token."""
    del index
    if documents is None:
      return self._mix(x_BxTxD, cache)
    return self._mix(x_BxTxD, documents.restarted(cache, self.init_cache(x_BxTxD.shape[0], 0)),
                     documents.segments_BxT)
