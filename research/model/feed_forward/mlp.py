"""The position-wise MLP of the Transformer (arXiv:1706.03762), with GELU (arXiv:1606.08415):

  y = W_down act(W_up x [+ b_up]) [+ b_down],   W_up [D, F], W_down [F, D],
  F = model.mlp_ratio * d_model.

`activation`: gelu_tanh (GELU's tanh approximation, jax.nn.gelu's default and GPT-2's "gelu_new";
every run before the setting used it), gelu (the exact erf form), relu or silu. `bias` adds the
two biases (GPT-2's c_fc and c_proj have them), zeros at init.
"""

import jax

from research.model import nn
from research.model.feed_forward import base

ACTIVATIONS = {"gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "relu": jax.nn.relu, "silu": jax.nn.silu}


class MLP(base.FeedForward):
  hyperparameters = {"activation": "gelu_tanh", "bias": False}

  @classmethod
  def validate(cls, settings, model_config):
    if settings["activation"] not in ACTIVATIONS:
      raise ValueError(f"unknown model.mlp.activation {settings['activation']!r}; valid: "
                       f"{', '.join(ACTIVATIONS)}")

  def __init__(self, model_config, settings, *, rngs):
    d, dtype = model_config.d_model, nn.compute_dtype(model_config)
    hidden = model_config.mlp_ratio * d
    bias = bool(settings["bias"])
    self.activation = str(settings["activation"])
    self.up = nn.dense("BLD,DF->BLF", (d, hidden), ("embed", "mlp"), rngs=rngs, dtype=dtype,
                       bias_shape=(hidden,) if bias else None, bias_axes=("mlp",) if bias else None)
    self.down = nn.dense("BLF,FD->BLD", (hidden, d), ("mlp", "embed"), rngs=rngs, dtype=dtype,
                         bias_shape=(d,) if bias else None, bias_axes=("embed",) if bias else None)

  def __call__(self, x_BxLxD, segments_BxL=None):
    del segments_BxL
    return self.down(ACTIVATIONS[self.activation](self.up(x_BxLxD)))
