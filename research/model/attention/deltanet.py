"""DeltaNet: linear attention with the delta rule (Yang, Wang, Zhang, Shen & Kim,
arXiv:2406.06484; the rule from Schlag, Irie & Schmidhuber, arXiv:2102.11174).

Reference: fla-org/flash-linear-attention@bc3b101, fla/layers/delta_net.py (DeltaNet with its
defaults: expand_k = expand_v = 1, use_beta, short convolutions of width 4, SiLU on q and k,
qk_norm='l2', use_gate=False) and fla/ops/delta_rule/naive.py (delta_rule_recurrence). Per head:
  S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t
  beta_t = sigmoid(W_b x_t)   (2 sigmoid(W_b x_t) with allow_neg_eigval)
q, k, v from linear projections and short causal depthwise convolutions with SiLU; q and k
L2-normalised per head, q scaled by H^-0.5; the output RMS-normalised per head with a learned
gain (no output gate) before the output projection. Head dims d_model / num_heads for keys and
values. It is Gated DeltaNet without the forget gate (alpha_t = 1), so it runs the same chunked
WY form, decode state and packed-document resets (research/model/attention/gated_deltanet.py).
Initialisation is the lab's (LeCun normal projections), not fla's model-level init.
"""

from research.model.attention import gated_deltanet


class DeltaNet(gated_deltanet.GatedDeltaNet):
  settings_name = "deltanet"
  hyperparameters = {"head_dim": 0,  # 0: d_model / num_heads (fla's expand_k = 1)
                     "expand_v": 1.0,  # value head dim = expand_v * head_dim
                     "conv_width": 4,
                     "chunk_size": 64,  # tokens per chunk
                     "allow_neg_eigval": False}
  test_settings = {"chunk_size": 8}
  key_head_fraction = 1.0
  forget_gate = False
  output_gate = False
