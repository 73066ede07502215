"""Test set-up: 8 fake CPU devices (before JAX initialises its backend) and shared helpers."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One prepared-data directory for the session, shared with the subprocesses tests start.
os.environ.setdefault("RESEARCH_DATA_DIR", tempfile.mkdtemp(prefix="research_data_"))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
# Tests run tiny shapes: compile time dominates, so skip most XLA optimisation passes.
jax.config.update("jax_disable_most_optimizations", True)

import pytest  # noqa: E402

from configs import base  # noqa: E402


def tiny_model_config(**overrides):
  """A model small enough to compile in about a second, with several blocks and chunks.

  A dict value updates that variant's settings: tiny_model_config(rope=dict(scaling="yarn")).
  """
  config = base.get_config().model
  config.update(dict(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, mlp_ratio=2,
                     vocab_size=61))
  settings = {"softmax": dict(block_size=8), "linear": dict(chunk_size=8),
              "mamba": dict(chunk_size=8, state_size=4), "learned": dict(max_length=64)}
  settings.update({key: dict(original_length=16) for key in ("rope", "xpos", "prope")})
  for key, values in list(settings.items()) + list(overrides.items()):
    if isinstance(values, dict):
      config[key].update(values)
    else:
      config[key] = values
  return config


@pytest.fixture
def model_config():
  return tiny_model_config()
