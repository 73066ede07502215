"""Scalable-Softmax (SSMax; Nakanishi, arXiv:2501.19399) on RoPE: a length-aware temperature.

  SSMax(z)_j = n^(s z_j) / sum_j' n^(s z_j') = softmax_j((s log n) z_j)

for a query whose logits z (q . k / sqrt(H), after RoPE) run over the n keys it sees; s is learned,
one per head and layer (the paper's section 3). Softmax's largest weight fades as 1 / n when n
grows; with s log n the logits sharpen as the context grows, so attention to one key holds up
(the paper's Figure 1, drawn with s = 0.43, the initial value here; the paper's models also use
RoPE). n is counted per query by the attention core (core.QueryContext): causally the query's
index in its document + 1, and under a sliding window with sinks the window's keys plus the sinks
outside it, in the sequence path and in both decode caches, so the same number reaches a token
however it is computed. The authors published no code with the paper; tests/test_ssmax.py
checks these equations written out against the core's backends and caches.

Everything else is RoPE's (research/model/positions/rope.py, its scalings included): the scheme's
qk hook rotates, its length hook scales.
"""

import jax.numpy as jnp

from research.model import nn
from research.model.positions import rope


class SSMax(rope.RoPE):
  hyperparameters = {**rope.RoPE.hyperparameters, "s_init": 0.43}
  shared_across_layers = False  # one s per head and layer

  def __init__(self, settings, geometry, *, rngs):
    super().__init__(settings, geometry, rngs=rngs)
    self.s = nn.param(jnp.full((geometry.num_heads,), float(settings.s_init), jnp.float32),
                      ("position_heads",), weight_decay=False)

  @classmethod
  def validate(cls, settings, geometry):
    super().validate(settings, geometry)
    if not settings.s_init > 0:
      raise ValueError(f"model.ssmax.s_init must be > 0 (SSMax's s; the paper's Figure 1 uses "
                       f"0.43), got {settings.s_init}")

  def length_scale(self, keys_seen_BxT, document_index_BxT):
    del document_index_BxT
    log_n = jnp.log(keys_seen_BxT.astype(jnp.float32))
    return self.s[...][None, :, None] * log_n[:, None, :]
