"""The position-wise MLP of the Transformer (arXiv:1706.03762), with GELU (arXiv:1606.08415):

  y = W_down gelu(W_up x),   W_up [D, F], W_down [F, D],   F = model.mlp_ratio * d_model.
"""

import jax

from research import nn
from research.feed_forward import base


class MLP(base.FeedForward):

  def __init__(self, model_config, settings, *, rngs):
    del settings
    d, dtype = model_config.d_model, nn.compute_dtype(model_config)
    hidden = model_config.mlp_ratio * d
    self.up = nn.dense("BLD,DF->BLF", (d, hidden), ("embed", "mlp"), rngs=rngs, dtype=dtype)
    self.down = nn.dense("BLF,FD->BLD", (hidden, d), ("mlp", "embed"), rngs=rngs, dtype=dtype)

  def __call__(self, x_BxLxD, segments_BxL=None):
    del segments_BxL
    return self.down(jax.nn.gelu(self.up(x_BxLxD)))
