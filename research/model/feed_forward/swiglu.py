"""The SwiGLU feed-forward (Shazeer, arXiv:2002.05202, "GLU Variants Improve Transformer"), the
gated MLP of Llama-family models and of MAD's blocks:

  y = W_down (silu(x W_gate) * (x W_up)),   W_gate, W_up [D, F], W_down [F, D],  no biases.

F is `hidden`, or with 0 the rule of MAD's and Llama's code: 2/3 of the MLP's width
(model.mlp_ratio * d_model) rounded up to a multiple of `multiple_of`, so that the three matrices
hold about as many parameters as the MLP's two: int(2 * 4 * D / 3) rounded up to 16 at
mlp_ratio 4 (352 at D = 128). Kernels are initialised as the lab's other dense layers (LeCun
normal), not torch.nn.Linear's uniform.

Reference: athms/mad-lab@6e7e4c903b7d4d1a31d12186b709f36fa3184041, mad/model/layers/mlp.py,
GLU and SwiGLU (act = SiLU on w1, times w2, then w3; multiple_of 16, bias False).
"""

import jax

from research.model import nn
from research.model.feed_forward import base


class SwiGLU(base.FeedForward):

  hyperparameters = {"hidden": 0, "multiple_of": 16}
  test_settings = {"hidden": 24}

  @classmethod
  def hidden_width(cls, settings, model_config) -> int:
    if int(settings["hidden"]):
      return int(settings["hidden"])
    multiple = int(settings["multiple_of"])
    width = int(2 * model_config.mlp_ratio * model_config.d_model / 3)
    return multiple * -(-width // multiple)

  @classmethod
  def validate(cls, settings, model_config):
    if settings["hidden"] < 0:
      raise ValueError(f"model.swiglu.hidden must be >= 1, or 0 for 2/3 of model.mlp_ratio * "
                       f"d_model rounded up to model.swiglu.multiple_of; got {settings['hidden']}")
    if settings["multiple_of"] < 1:
      raise ValueError(f"model.swiglu.multiple_of must be >= 1; got {settings['multiple_of']}")
    if cls.hidden_width(settings, model_config) < 1:
      raise ValueError(f"model.swiglu.hidden=0 takes 2/3 of model.mlp_ratio * d_model = "
                       f"{model_config.mlp_ratio} * {model_config.d_model}, which is < 1; set "
                       f"model.swiglu.hidden >= 1 or model.mlp_ratio >= 1")

  def __init__(self, model_config, settings, *, rngs):
    self.validate(settings, model_config)
    d, f = model_config.d_model, self.hidden_width(settings, model_config)
    dtype = nn.compute_dtype(model_config)
    self.gate = nn.dense("BLD,DF->BLF", (d, f), ("embed", "mlp"), rngs=rngs, dtype=dtype)
    self.up = nn.dense("BLD,DF->BLF", (d, f), ("embed", "mlp"), rngs=rngs, dtype=dtype)
    self.down = nn.dense("BLF,FD->BLD", (f, d), ("mlp", "embed"), rngs=rngs, dtype=dtype)

  def __call__(self, x_BxLxD, segments_BxL=None):
    del segments_BxL
    return self.down(jax.nn.silu(self.gate(x_BxLxD)) * self.up(x_BxLxD))
