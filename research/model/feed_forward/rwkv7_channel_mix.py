"""RWKV-7's channel mixing, the feed-forward block of RWKV-7 (Peng et al., arXiv:2503.14456), as
the authors' RWKV-LM computes it (RWKV-v7/train_temp/src/model.py, RWKV_CMix_x070):
  x_k = x + (x' - x) * mu_k          (x' the previous token, 0 at a document's start)
  out = relu(x_k W_k)^2 W_v          W_k: D -> F, W_v: F -> D
RWKV-6's (research/model/feed_forward/rwkv_channel_mix.py) also shifts a receptance stream and gates
the output with sigmoid(x_r W_r); RWKV-7 drops both. The hidden width F is `hidden`, or with 0
model.mlp_ratio * d_model, the lab's MLP width (the reference's is 4 D). Initialisation:
mu_k = 1 - (i / D)^(rho1^4) for channel i, with the reference's rho1 = 1 - l / L at a depth the
feed-forward is not told, taken as 1/2 (a middle layer, as research/model/attention/rwkv6.py); W_k
orthogonal (generate_init_weight), W_v the lab's LeCun normal instead of the reference's zeros
(which make a fresh block output 0). mu takes no weight decay, the kernels do. The decode state
is the last token.

Reference: BlinkDL/RWKV-LM@524481d5099b38d9bc8ef1e89209161b86c8011b, RWKV-v7/train_temp/src/
model.py, RWKV_CMix_x070 (its commented "slow pytorch version"; the class in use runs the same
computation in a CUDA kernel) and RWKV.generate_init_weight.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import rwkv6
from research.model.feed_forward import rwkv_channel_mix


class RWKV7ChannelMix(rwkv_channel_mix.RWKVChannelMix):
  """RWKV-6's channel mix without the receptance stream and gate; its settings, checks, decode
  state and document resets."""

  def __init__(self, model_config, settings, *, rngs):
    self.validate(settings, model_config)
    d, f = model_config.d_model, self._hidden(settings, model_config)
    self.d_model = d
    self.dtype = dtype = nn.compute_dtype(model_config)
    power = (1.0 - rwkv6.DEPTH_RATIO) ** 4
    self.mix_k = nn.param(rwkv6.mix_coefficients(d, power), ("embed",), weight_decay=False)
    self.key = nn.dense("BLD,DF->BLF", (d, f), ("embed", "mlp"), rngs=rngs, dtype=dtype,
                        init=nnx.initializers.orthogonal())
    self.value = nn.dense("BLF,FD->BLD", (f, d), ("mlp", "embed"), rngs=rngs, dtype=dtype)

  def _mix(self, x_BxTxD, last_BxD, segments_BxT=None):
    previous, last = rwkv6.token_shift(x_BxTxD, last_BxD, segments_BxT)
    x_k = x_BxTxD + (previous - x_BxTxD) * self.mix_k[...].astype(x_BxTxD.dtype)
    return self.value(jnp.square(jax.nn.relu(self.key(x_k)))), last
