"""A JAX/Flax NNX lab for attention variants and length extrapolation."""

from research.model.transformer import build_model, count_params
