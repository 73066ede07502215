"""Gated DeltaProduct: several delta-rule (Householder) steps per token (Siems, Carstensen,
Zela, Hutter, Pontil & Grazzi, arXiv:2502.10297).

Reference: fla-org/flash-linear-attention@bc3b101, fla/layers/gated_deltaproduct.py
(GatedDeltaProduct with its defaults: num_householder = 2, allow_neg_eigval, the forget gate,
the output gate, expand_v = 2, short convolutions of width 4; its fused_recurrent path shows the
interleaving: g on each token's first step, q on its last). Per head, for token t with S steps:
  S_{t,0} = alpha_t S_{t-1}
  S_{t,j} = (I - beta_tj k_tj k_tj^T) S_{t,j-1} + beta_tj k_tj v_tj^T     for j = 1..S
  o_t = S_{t,S}^T q_t
  alpha_t = exp(-exp(A_log) softplus(W_a x_t + dt_bias)),  beta_tj = 2 sigmoid(W_b x_t)_j
Each step has its own key and value (projections S times wider, through the short
convolutions), L2-normalised keys, and q scaled by H^-0.5; the output is RMSNorm(o) * silu(W_g x)
as Gated DeltaNet's. The product of S generalised Householder transitions, with beta in (0, 2)
(eigenvalues in (-1, 1)), is what lets the state track permutations (the paper's Section 4).
It runs as the gated delta rule over the interleaved steps
(research/model/attention/gated_deltanet.py), chunk_size tokens (S * chunk_size steps) per chunk.
Key head dim 3/4 of d_model / num_heads by default (fla's head_dim 256 at hidden size 2048 and 6
heads, as Gated DeltaNet's); the lab's initialisation (LeCun normal projections), not fla's
xavier_uniform with gain 2^-2.5.
"""

from research.model.attention import gated_deltanet


class GatedDeltaProduct(gated_deltanet.GatedDeltaNet):
  settings_name = "gated_deltaproduct"
  hyperparameters = {"head_dim": 0,  # 0: 3/4 of d_model / num_heads
                     "expand_v": 2.0,
                     "conv_width": 4,
                     "chunk_size": 32,  # tokens per chunk: 64 delta-rule steps at 2 steps
                     "num_householder": 2,
                     "allow_neg_eigval": True,
                     "use_forget_gate": True}  # False: alpha_t = 1 (fla's use_forget_gate)
  test_settings = {"chunk_size": 4}
