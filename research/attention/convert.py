"""Converting a multi-head checkpoint to grouped-query attention (Ainslie et al., arXiv:2305.13245,
section 2.1): the key and value projection heads of each group are mean-pooled into one head,
and the model is then uptrained. Query and output projections are unchanged.
"""

import jax.numpy as jnp
from flax import nnx


def mha_to_gqa(state, num_heads, num_kv_heads):
  """A copy of an MHA model's nnx.State with key/value kernels [D, N, H] pooled to [D, K, H]."""
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
  flat = []
  for path, variable in nnx.to_flat_state(state):
    if len(path) >= 3 and path[-3] == "mixer" and path[-2] in ("key", "value"):
      d, n, h = variable.value.shape
      if n != num_heads:
        raise ValueError(f"{'.'.join(map(str, path))} has {n} heads, expected {num_heads}")
      pooled = jnp.mean(variable.value.reshape(d, num_kv_heads, n // num_kv_heads, h), axis=2)
      variable = variable.replace(pooled)
    flat.append((path, variable))
  return nnx.from_flat_state(flat)
