"""RMSNorm (Zhang and Sennrich, arXiv:1910.07467), the lab's default norm:

  y = x / sqrt(mean(x^2) + eps) * scale,   statistics in float32, no bias, no centring.

eps 1e-6 is flax's default (every run before the setting used it); Llama-family checkpoints use
1e-5 or 1e-6 (their config.json's rms_norm_eps, which research/pretrained carries over).
"""

import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.RMSNorm):
  hyperparameters = {"eps": 1e-6}
  test_settings = {}

  @classmethod
  def validate(cls, settings):
    if not settings.eps > 0:
      raise ValueError(f"model.rms_norm.eps must be > 0, got {settings.eps}")

  def __init__(self, settings, d_model, *, rngs, dtype):
    # A subclass of nnx.RMSNorm, not a wrapper: the parameter keeps its path (<norm>/scale).
    super().__init__(d_model, epsilon=float(settings.eps), dtype=dtype, param_dtype=jnp.float32,
                     scale_metadata={"logical_axes": ("embed",), "weight_decay": False},
                     rngs=rngs)
