"""Small building blocks shared by the mixers and the model: parameters with logical axis names.

Every parameter carries `logical_axes` metadata (one name per dimension); `research.sharding`
maps those names to mesh axes with one rules table.
"""

import jax.numpy as jnp
from flax import nnx

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def compute_dtype(model_config):
  name = model_config.compute_dtype
  if name not in DTYPES:
    raise ValueError(f"unknown model.compute_dtype {name!r}; valid: {', '.join(DTYPES)}")
  return DTYPES[name]


def dense(einsum, shape, axes, *, rngs, dtype, bias_shape=None, bias_axes=None,
          init=nnx.initializers.lecun_normal(), bias_init=nnx.initializers.zeros_init()):
  """An `nnx.Einsum` whose kernel (and bias) are annotated with logical axis names."""
  if len(shape) != len(axes):
    raise ValueError(f"kernel shape {shape} and axes {axes} differ in rank")
  return nnx.Einsum(
      einsum, shape, bias_shape, dtype=dtype, param_dtype=jnp.float32, kernel_init=init, bias_init=bias_init,
      kernel_metadata={"logical_axes": tuple(axes)},
      bias_metadata={"logical_axes": tuple(bias_axes or ())}, rngs=rngs)


def rms_norm(d_model, *, rngs, dtype):
  return nnx.RMSNorm(d_model, dtype=dtype, param_dtype=jnp.float32,
                     scale_metadata={"logical_axes": ("embed",)}, rngs=rngs)
