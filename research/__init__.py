"""A JAX/Flax NNX lab for attention variants and length extrapolation."""

from research.model import build_model, count_params
