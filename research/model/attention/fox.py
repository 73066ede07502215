"""The Forgetting Transformer, FoX (Lin, Nikishin, He & Courville, arXiv:2503.02130): softmax
attention with a data-dependent scalar forget gate per head and token.

  f_t = sigmoid(w_f^T x_t + b_f)                        one gate per head, from the layer's input
  o_i = sum_j softmax_j(q_i k_j^T / sqrt(d) + D[i, j]) v_j   over the visible keys j <= i
  D[i, j] = sum_{l=j+1..i} log f_l = c_i - c_j,   c_i = sum_{l<=i} log f_l
c is the cumulative log forget gate (float32): attention to key j decays by the product of the
gates that came after it. A constant gate per head gives ALiBi's bias, -slope (i - j) with
slope = -log f.

D is a score bias of per-token inputs, so FoX takes SoftmaxAttention's one score path: `xla`
materialises it, [B, N, T, S]; the `blockwise` kernel computes each (query block, key block)
tile from the c of the two blocks and returns dc, forward and backward, skipping masked tiles
as for any bias; the gradient reaches the gate through the cumulative sum. Sliding windows and
sinks (model.softmax.window, .sinks) compose; in packed documents c restarts at each document
start (the mask already hides cross-document pairs; restarting keeps c as small as the
document alone). The decode cache keeps c_j of every cached key beside k_j and v_j (N float32
values per token and layer), and new tokens continue c from the last cached token's, or from a
document cache restart it at each document they start, as the packed forward pass does.

As the authors' basic FoX ("FoX (LLaMA)" in their code, zhixuan-lin/forgetting-transformer):
no position scheme (model.position "none", or an embedding scheme; RoPE and bias schemes are
refused, so sweeps that prefer RoPE run FoX as published), as many key/value heads as heads,
the gate's bias initialised to 0 (f near 1/2 at the start) and its weight like the other
projections. Their "Pro" block (output gate and normalisation, QK-norm, data-dependent key and
value shift) is not implemented. attention_backend "cudnn" is refused: the data-dependent bias
could reach cuDNN only materialised, O(length^2) memory per layer.
"""

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.attention import masks
from research.model.attention import softmax


def forget_bias(q_log_forget_BxTxN, k_log_forget_BxSxN):
  """D[b, n, i, j] = c_i - c_j, [B, N, T, S], from the cumulative log forget gates of the
  queries and of the keys."""
  return (q_log_forget_BxTxN.transpose(0, 2, 1)[:, :, :, None]
          - k_log_forget_BxSxN.transpose(0, 2, 1)[:, :, None, :])


class ForgettingAttention(softmax.SoftmaxAttention):
  position_hooks = frozenset()
  backends = ("auto", "xla", "blockwise")

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_heads

  @classmethod
  def validate(cls, settings, model_config):
    if model_config.attention_backend == "cudnn":
      raise ValueError(
          "attention 'fox' does not run on attention_backend 'cudnn': its forget-gate bias is "
          "data-dependent ([batch, heads, length, length]), which jax.nn.dot_product_attention's "
          "cuDNN path takes only materialised (O(length^2) memory per layer, in bfloat16); use "
          "'blockwise' (the bias per tile, O(length) memory) or 'xla'")
    super().validate(settings, model_config)

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    super().__init__(settings, model_config, position, rngs=rngs, layer_index=layer_index)
    d, n = model_config.d_model, model_config.num_heads
    self.forget_gate = nn.dense("BLD,DN->BLN", (d, n), ("embed", "heads"), rngs=rngs,
                                dtype=self.dtype, bias_shape=(n,), bias_axes=("heads",))

  def project(self, x_BxTxD, positions_BxT, segments_BxT=None, cache=None, index=0,
              documents=None):
    q, tokens = super().project(x_BxTxD, positions_BxT)
    log_forget_BxTxN = jax.nn.log_sigmoid(self.forget_gate(x_BxTxD).astype(jnp.float32))
    c_BxTxN = jnp.cumsum(log_forget_BxTxN, axis=1)
    if segments_BxT is not None:  # restart at each document's first token
      first_BxT = jnp.arange(x_BxTxD.shape[1]) - masks.positions_in_documents(segments_BxT)
      c_BxTxN = c_BxTxN - jnp.take_along_axis(c_BxTxN, first_BxT[:, :, None], axis=1)
    if cache is not None:  # continue from c of the last cached token (0 before the first)
      carried_BxTxN = self.kv_cache.last(cache, "log_forget", index)[:, None, :]
      if documents is not None:  # or restart at a document's first new token, as above
        first_BxT = documents.starts_BxT - index  # < 0: the document began in the cache
        restarted_BxTxN = -jnp.take_along_axis(
            c_BxTxN, jnp.maximum(first_BxT, 0)[:, :, None], axis=1)
        carried_BxTxN = jnp.where((first_BxT >= 0)[:, :, None], restarted_BxTxN, carried_BxTxN)
      c_BxTxN = c_BxTxN + carried_BxTxN
    return q, {**tokens, "log_forget": c_BxTxN}

  def score_inputs(self, positions_BxT, arrays):
    return positions_BxT, arrays["log_forget"]

  def score_bias(self, position, q_inputs, k_inputs):
    (q_positions, q_log_forget), (k_positions, k_log_forget) = q_inputs, k_inputs
    bias = forget_bias(q_log_forget, k_log_forget)
    scheme = super().score_bias(position, q_positions, k_positions)
    return bias if scheme is None else bias + scheme

  def init_cache(self, batch_size, max_length):
    return self.kv_cache.init(batch_size, max_length, key_dim=self.head_dim,
                              value_dim=self.value_head_dim, dtype=self.dtype,
                              extra={"log_forget": ((self.num_heads,), jnp.float32)})

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    return super().cache_bytes_per_token(model_config) + 4 * model_config.num_heads
