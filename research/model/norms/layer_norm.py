"""LayerNorm (Ba et al., arXiv:1607.06450), GPT-2's norm:

  y = (x - mean(x)) / sqrt(var(x) + eps) * scale + bias,   biased variance, float32 statistics,

as torch.nn.LayerNorm computes it (the two-pass variance, not E[x^2] - E[x]^2). eps 1e-5 is
torch's default and GPT-2's layer_norm_epsilon; bias False drops the shift.
"""

import jax.numpy as jnp
from flax import nnx


class LayerNorm(nnx.LayerNorm):
  hyperparameters = {"eps": 1e-5, "bias": True}
  test_settings = {}

  @classmethod
  def validate(cls, settings):
    if not settings.eps > 0:
      raise ValueError(f"model.layer_norm.eps must be > 0, got {settings.eps}")

  def __init__(self, settings, d_model, *, rngs, dtype):
    super().__init__(d_model, epsilon=float(settings.eps), dtype=dtype, param_dtype=jnp.float32,
                     use_bias=bool(settings.bias), use_fast_variance=False,
                     scale_metadata={"logical_axes": ("embed",), "weight_decay": False},
                     bias_metadata={"logical_axes": ("embed",), "weight_decay": False},
                     rngs=rngs)
