"""Small building blocks shared by the mixers, the position schemes and the model.

Every parameter carries two pieces of metadata where it is created:
  logical_axes   one name per dimension; `research.model.sharding` maps names to mesh axes
                 (one table);
  weight_decay   whether AdamW decays it (`research.training.loop` builds its mask from this
                 alone).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def compute_dtype(model_config) -> jnp.dtype:
  name = model_config.compute_dtype
  if name not in DTYPES:
    raise ValueError(f"unknown model.compute_dtype {name!r}; valid: {', '.join(DTYPES)}")
  return DTYPES[name]


def param(value, axes, *, weight_decay: bool) -> nnx.Param:
  """A float32 parameter with its logical axis names and whether it takes weight decay."""
  if len(axes) != jnp.ndim(value):
    raise ValueError(f"parameter of shape {jnp.shape(value)} and axes {axes} differ in rank")
  return nnx.Param(jnp.asarray(value, jnp.float32), logical_axes=tuple(axes),
                   weight_decay=weight_decay)


def token_major_einsum(equation, x, kernel, **kwargs):
  """jnp.einsum of an activation x and a kernel, with the leading axes that x and the output
  share and the kernel lacks (batch and length: "BLD,DF->BLF") merged into one first, and the
  contracted axes too where they are adjacent in both (_merge_contracted_axes).

  The same result up to the order of summation; on XLA's CPU backend the backward of a
  [B, L, ...] einsum with a kept batch axis transposes the cotangent (and fuses its producers
  into that copy) for the weight gradient, while the [B * L, ...] form reads it in place: about
  2x on a dense layer's fwd+bwd.
  """
  inputs, output = equation.split("->")
  lhs, rhs = inputs.split(",")
  if x.ndim != len(lhs) or kernel.ndim != len(rhs):
    return jnp.einsum(equation, x, kernel, **kwargs)
  lhs, rhs, x, kernel = _merge_contracted_axes(lhs, rhs, output, x, kernel)
  shared = 0
  while (shared < min(len(lhs), len(output)) and lhs[shared] == output[shared]
         and lhs[shared] not in rhs):
    shared += 1
  if shared < 2:
    return jnp.einsum(f"{lhs},{rhs}->{output}", x, kernel, **kwargs)
  merged = _unused_letter(lhs + rhs + output)
  leading = x.shape[:shared]
  y = jnp.einsum(f"{merged}{lhs[shared:]},{rhs}->{merged}{output[shared:]}",
                 x.reshape((-1,) + x.shape[shared:]), kernel, **kwargs)
  return y.reshape(leading + y.shape[1:])


def _unused_letter(subscripts):
  return next(c for c in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in subscripts)


def _merge_contracted_axes(lhs, rhs, output, x, kernel):
  """Contracted axes that are adjacent and in the same order in both operands ("NH" in
  "BLNH,NHD->BLD") merged into one. jnp.einsum hands dot_general several contracted axes in an
  order of its own ((H, N) here), and XLA:CPU then copies both operands transposed to that
  order, the kernel at every call (a decode step) and the activation at every layer."""
  contracted = "".join(c for c in lhs if c in rhs and c not in output)
  if len(contracted) < 2 or contracted not in lhs or contracted not in rhs:
    return lhs, rhs, x, kernel
  merged = _unused_letter(lhs + rhs + output)

  def merge(subscripts, array):
    start = subscripts.index(contracted)
    shape = array.shape
    return (subscripts.replace(contracted, merged),
            array.reshape(shape[:start] + (-1,) + shape[start + len(contracted):]))

  (lhs, x), (rhs, kernel) = merge(lhs, x), merge(rhs, kernel)
  return lhs, rhs, x, kernel


def dense(einsum, shape, axes, *, rngs, dtype, bias_shape=None, bias_axes=None,
          init=nnx.initializers.lecun_normal(), bias_init=nnx.initializers.zeros_init()):
  """An `nnx.Einsum` with annotated parameters: the kernel decays, the bias does not.
  Evaluated by token_major_einsum (the batch and length axes merged)."""
  if len(shape) != len(axes):
    raise ValueError(f"kernel shape {shape} and axes {axes} differ in rank")
  return nnx.Einsum(
      einsum, shape, bias_shape, dtype=dtype, param_dtype=jnp.float32, kernel_init=init,
      bias_init=bias_init, einsum_op=token_major_einsum,
      kernel_metadata={"logical_axes": tuple(axes), "weight_decay": True},
      bias_metadata={"logical_axes": tuple(bias_axes or ()), "weight_decay": False}, rngs=rngs)


def embed(num_embeddings, features, axes, *, rngs, dtype, stddev, weight_decay=True):
  """An `nnx.Embed` table with normal(stddev) initialisation and annotated parameters."""
  return nnx.Embed(num_embeddings, features, dtype=dtype, param_dtype=jnp.float32,
                   embedding_init=nnx.initializers.normal(stddev),
                   embedding_metadata={"logical_axes": tuple(axes), "weight_decay": weight_decay},
                   rngs=rngs)


def cache_shapes(module, batch_size, max_length):
  """The shapes of module.init_cache(batch_size, max_length), computing nothing; the parameters
  go in as arguments, so that a cache computed from them (a long convolution's filter taps) has
  shapes also for a module built by nnx.eval_shape, whose parameters are shapes only."""
  graphdef, state = nnx.split(module)
  return jax.eval_shape(
      lambda state: nnx.merge(graphdef, state).init_cache(batch_size, max_length), state)


def tree_bytes(tree) -> int:
  """Bytes of the arrays (or ShapeDtypeStructs) of a pytree, e.g. a decode cache's shapes."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
