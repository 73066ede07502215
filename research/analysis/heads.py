"""What attention heads do, measured from their attention probabilities P [B, N, T, S] (query i,
key j; research.model.attention.softmax: `attention_weights`) and from the loss at each position.

  induction score (Olsson et al., arXiv:2209.11895)   on [A; A], A = P random tokens:
      mean over b and the second copy's queries i in [P, 2P) of P[b, n, i, i - P + 1],
      the attention from each token to the token right after its earlier occurrence
  previous-token score                                mean over b and i >= 1 of P[b, n, i, i - 1]
  attention mass by distance                          for d = i - j >= 0, the mean over b and
      queries i of P[b, n, i, i - d], summed in log-spaced buckets [0], [1], [2, 3], [4, 7], ...
      (every query's row sums to 1, so each head's buckets do too); mean distance sum_d d m(d)
  in-context-learning score (arXiv:2209.11895)        mean loss at late token positions minus at
      early ones: the paper's 500th minus 50th token of a 512-token context, here the mean over
      positions [40 L/512, 50 L/512) subtracted from the mean over [400 L/512, 500 L/512) of a
      window of L tokens (`icl_positions`); negative: later tokens, with more context, are easier.

A uniform causal head scores mean_{i in [P, 2P)} 1 / (i + 1) ~ ln(2) / P on induction.

Attention as explanation (Jain & Wallace, arXiv:1902.10186), for one prediction (the next token
after the last position t of a window) and one head's attention row a = P[b, n, t, :]:
  gradient importance      g_j = |e_j . d p_y / d e_j|, e_j the input embedding of token j and
      p_y the probability of the predicted token (the authors' gradient-times-embedding of the
      predicted class's probability, in absolute value); rankings are those of d log p_y
  kendall_tau(a, g)        Kendall's tau-b over the keys the row can see
  permutation TVD          TVD(y, y') = 1/2 sum_v |y_v - y'_v| between the output distributions
      with a and with a permuted over its visible keys (`permute_visible`), the median over
      permutations; small: other weights give the same output.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

# Olsson et al.'s token positions in their 512-token context, scaled to the window length.
ICL_EARLY = (40, 50)
ICL_LATE = (400, 500)
ICL_REFERENCE_LENGTH = 512


def repeated_random_tokens(rng: np.random.Generator, batch_size: int, period: int,
                           num_tokens: int) -> np.ndarray:
  """[B, 2P] int32: rows [A; A], A `period` tokens drawn from [0, num_tokens), without repeats
  within A where num_tokens allows (so that each token's earlier occurrence is unique)."""
  replace = period > num_tokens
  first = np.stack([rng.choice(num_tokens, period, replace=replace) for _ in range(batch_size)])
  return np.concatenate([first, first], axis=1).astype(np.int32)


def induction_score(probs_BxNxTxS: np.ndarray, period: int) -> np.ndarray:
  """[N]: the mean attention from query i in [P, 2P) to key i - P + 1 (the token after the
  earlier occurrence of token i in [A; A])."""
  queries = np.arange(period, 2 * period)
  return probs_BxNxTxS[:, :, queries, queries - period + 1].mean(axis=(0, 2))


def previous_token_score(probs_BxNxTxS: np.ndarray) -> np.ndarray:
  """[N]: the mean attention from query i >= 1 to key i - 1."""
  queries = np.arange(1, probs_BxNxTxS.shape[2])
  return probs_BxNxTxS[:, :, queries, queries - 1].mean(axis=(0, 2))


def distance_buckets(max_distance: int) -> list[tuple[int, int]]:
  """Inclusive distance ranges [0, 0], [1, 1], [2, 3], [4, 7], ... covering 0..max_distance."""
  buckets, low = [(0, 0)], 1
  while low <= max_distance:
    buckets.append((low, min(2 * low - 1, max_distance)))
    low *= 2
  return buckets


def mass_by_distance(probs_BxNxTxS: np.ndarray) -> np.ndarray:
  """[N, T]: m(d) = the mean over rows and queries of the attention to the key d tokens back."""
  b, n, t, s = probs_BxNxTxS.shape
  if t != s:
    raise ValueError(f"queries and keys must be the same sequence, got T={t}, S={s}")
  distance_TxS = np.arange(t)[:, None] - np.arange(s)[None, :]
  causal = distance_TxS >= 0
  summed_NxTxS = probs_BxNxTxS.sum(axis=0)
  return np.stack([np.bincount(distance_TxS[causal], weights=summed_NxTxS[h][causal],
                               minlength=t) for h in range(n)]) / (b * t)


def bucket_mass(mass_NxD: np.ndarray, buckets: list[tuple[int, int]]) -> np.ndarray:
  """[N, len(buckets)]: the mass of each inclusive distance bucket."""
  return np.stack([mass_NxD[:, low:high + 1].sum(axis=1) for low, high in buckets], axis=1)


def mean_distance(mass_NxD: np.ndarray) -> np.ndarray:
  """[N]: sum_d d m(d), how far back each head looks on average."""
  return mass_NxD @ np.arange(mass_NxD.shape[1])


def icl_positions(length: int) -> tuple[range, range]:
  """(early, late) token positions of a window of `length` tokens: Olsson et al.'s [40, 50) and
  [400, 500) of 512, scaled, each at least one position."""
  def scaled(low, high):
    start = min(length - 1, int(math.floor(low * length / ICL_REFERENCE_LENGTH)))
    return range(start, max(start + 1, int(math.floor(high * length / ICL_REFERENCE_LENGTH))))

  return scaled(*ICL_EARLY), scaled(*ICL_LATE)


def icl_score(loss_by_position: np.ndarray) -> dict:
  """{"icl_score": late - early, "early_loss", "late_loss"} of the mean loss at each position of
  windows of len(loss_by_position) tokens."""
  loss = np.asarray(loss_by_position, np.float64)
  early, late = icl_positions(len(loss))
  early_loss, late_loss = float(loss[list(early)].mean()), float(loss[list(late)].mean())
  return {"icl_score": late_loss - early_loss, "early_loss": early_loss, "late_loss": late_loss}


# ---- Head importance and pruning (Michel et al., arXiv:1905.10650)
#
# A head mask xi [layers, N] multiplies each head's output before the output projection
# o = sum_n xi_n y_n W_n: applied as xi_n W_n on the projection's [N, H, D] kernel, the same
# product, so no mixer changes and xi = 1 is exactly the model. Importance
# I_h = E_batches |dL/dxi_h| at the current mask, normalised per layer to unit l2 norm.
# With grouped-query attention a key/value head serves a group of query heads; removing the
# whole group is what shrinks the decode cache. A group's score is the sum of its query heads'
# normalised importances, and the groups are pruned as heads are.


def output_projections(model) -> list:
  """Per layer, its mixer's output projection if it mixes heads (a kernel [N, H, D] whose first
  logical axis is "heads": softmax attention, linear attention, retention), else None."""
  return [block.mixer.head_output_projection() for block in model.blocks]


def mask_heads(model, mask_LxN):
  """Multiply head n of layer l's output by mask_LxN[l, n], in place (layers without heads:
  their row is ignored)."""
  for layer, out in enumerate(output_projections(model)):
    if out is not None:
      kernel_NxHxD = out.kernel[...]
      out.kernel[...] = kernel_NxHxD * mask_LxN[layer][:, None, None].astype(kernel_NxHxD.dtype)


def kv_group_sizes(model) -> list[int]:
  """Per layer, the query heads that share each key/value head (N / K: grouped-query softmax
  attention), 1 for every other layer."""
  return [block.mixer.kv_group_size() for block in model.blocks]


def normalise_per_layer(importance_LxN: np.ndarray) -> np.ndarray:
  """Each layer's importances divided by their l2 norm (the authors' normalisation)."""
  norm = np.sqrt((importance_LxN ** 2).sum(axis=1, keepdims=True))
  return importance_LxN / (norm + 1e-20)


def heads_to_remove(scores_LxN: np.ndarray, alive_LxN: np.ndarray, fraction: float) -> list:
  """The (layer, head) pairs of the lowest-scoring `fraction` of the alive heads (at least one),
  never the last alive head of a layer; fewer if only last heads remain."""
  if not 0 < fraction < 1:
    raise ValueError(f"the pruning fraction must be in (0, 1), got {fraction}")
  alive = alive_LxN.copy()
  count = max(1, int(round(fraction * alive.sum())))
  order = sorted(zip(*np.nonzero(alive)), key=lambda lh: scores_LxN[lh])
  removed = []
  for layer, head in order:
    if len(removed) == count:
      break
    if alive[layer].sum() > 1:
      alive[layer, head] = False
      removed.append((int(layer), int(head)))
  return removed


def group_scores(scores_LxN: np.ndarray, group_sizes: list[int]) -> np.ndarray:
  """[L, max groups]: each key/value group's score, the sum over its query heads (layer l's
  query head n reads key/value head n // group_sizes[l]); 0 where a layer has fewer groups."""
  num_layers, num_heads = scores_LxN.shape
  grouped = np.zeros((num_layers, num_heads // min(group_sizes)))
  for layer, size in enumerate(group_sizes):
    grouped[layer, :num_heads // size] = scores_LxN[layer].reshape(-1, size).sum(axis=1)
  return grouped


def groups_of_heads(alive_LxN: np.ndarray, group_sizes: list[int]) -> np.ndarray:
  """[L, max groups] bool: a key/value group is alive while one of its query heads is."""
  num_layers, num_heads = alive_LxN.shape
  groups = np.zeros((num_layers, num_heads // min(group_sizes)), bool)
  for layer, size in enumerate(group_sizes):
    groups[layer, :num_heads // size] = alive_LxN[layer].reshape(-1, size).any(axis=1)
  return groups


def heads_of_groups(groups_LxK: np.ndarray, group_sizes: list[int], num_heads: int) -> np.ndarray:
  """[L, N] bool: query head n of layer l is alive if its key/value group n // size is."""
  return np.stack([np.repeat(groups_LxK[layer, :num_heads // size], size)
                   for layer, size in enumerate(group_sizes)]).astype(bool)


# ---- Attention as explanation (Jain & Wallace, arXiv:1902.10186)


def permute_visible(row_S: jax.Array, visible_S: jax.Array, key: jax.Array) -> jax.Array:
  """The attention row with its weights on the visible keys in a random order (the invisible
  keys keep their zeros)."""
  size = row_S.shape[0]
  in_order = jnp.argsort(jnp.where(visible_S, 0, 1), stable=True)  # visible keys first
  shuffled = jnp.argsort(jnp.where(visible_S, jax.random.uniform(key, (size,)), 2.0))
  return row_S.at[in_order].set(row_S[shuffled])


def total_variation(p_V: np.ndarray, q_V: np.ndarray) -> np.ndarray:
  """1/2 sum_v |p_v - q_v| over the last axis."""
  return 0.5 * np.abs(np.asarray(p_V, np.float64) - np.asarray(q_V, np.float64)).sum(axis=-1)


def kendall_tau(attention_S: np.ndarray, importance_S: np.ndarray) -> float:
  """Kendall's tau-b between a head's weights and the tokens' importances (nan if constant)."""
  return float(stats.kendalltau(attention_S, importance_S).statistic)
