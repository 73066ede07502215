"""Converting a multi-head checkpoint to grouped-query attention (Ainslie et al., arXiv:2305.13245,
section 2.1): the key and value projection heads of each group are mean-pooled into one head,
and the model is then uptrained. Query and output projections are unchanged.
"""

import jax.numpy as jnp
from flax import nnx


def mha_to_gqa(state, num_heads, num_kv_heads, layers=None):
  """A copy of an MHA model's nnx.State with key/value kernels [D, N, H] pooled to [D, K, H],
  and their biases [N, H] (model.softmax.projection_bias) to [K, H] (N: the key/value heads of
  the source, its query heads for MHA; a GQA source with N key/value heads pools to K the same
  way), in every block or in the blocks `layers`."""
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
  flat = []
  for path, variable in nnx.to_flat_state(state):
    pooled_layer = layers is None or (path[0] == "blocks" and path[1] in layers)
    if len(path) >= 3 and path[-3] == "mixer" and path[-2] in ("key", "value") and pooled_layer:
      value = variable.value
      heads_axis = value.ndim - 2  # [D, N, H] kernels, [N, H] biases
      n = value.shape[heads_axis]
      if n != num_heads:
        raise ValueError(f"{'.'.join(map(str, path))} has {n} heads, expected {num_heads}")
      grouped = (value.shape[:heads_axis] + (num_kv_heads, n // num_kv_heads)
                 + value.shape[heads_axis + 1:])
      pooled = jnp.mean(value.reshape(grouped), axis=heads_axis + 1)
      variable = variable.replace(pooled)
    flat.append((path, variable))
  return nnx.from_flat_state(flat)
