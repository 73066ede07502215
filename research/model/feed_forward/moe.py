"""Mixture of experts: top-k routing with a load-balancing loss, as in Jamba (arXiv:2403.19887),
Mixtral (arXiv:2401.04088) and the Switch Transformer (arXiv:2101.03961).

  p_t = softmax(W_r x_t)   over the X experts (router: no bias, float32, Switch's selective
                           precision)
  R_t = the top_k experts of p_t
  y_t = sum_{e in R_t} w_te MLP_e(x_t),   w_te = p_te (Jamba), or with `renormalize`
                                          p_te / sum_{e' in R_t} p_te' (Mixtral)
MLP_e is this project's MLP (research/model/feed_forward/mlp.py, hidden width mlp_ratio * d_model)
with weights of its own, so that a dense and a sparse model differ only in the routing; Jamba's and
Mixtral's experts are SwiGLU MLPs. Jamba uses X = 16, top_k = 2, an MoE every other layer.

Load balancing (Switch eqs. 4-6, as transformers' Jamba / Mixtral `load_balancing_loss_func`):
  f_e = (1/T) sum_t [e in R_t],   P_e = (1/T) sum_t p_te,   L_balance = X sum_e f_e P_e
over the T tokens of the (micro-)batch; f is not differentiable, P is. f counts each of a
token's top_k choices (sum_e f_e = top_k), so L_balance = top_k when either f or P is uniform,
its value at balance (1 for Switch's top-1). The training loss adds load_balancing_weight times
L_balance over the MoE layers, combined as model.moe.pooled_load_balancing says:
  False  (the default) the mean over the MoE layers of each layer's L_balance.
  True   one L_balance on the tokens of every MoE layer pooled, X sum_e F_e P_e with F, P the
         means of the layers' f, P (each layer routes the same T tokens): HF transformers'
         `load_balancing_loss_func` (huggingface/transformers@
         af3efdd71ee5b568dfdb71bb41d316df830147af, src/transformers/models/mixtral/
         modeling_mixtral.py; modeling_jamba.py@97bb61d0788015770945004a7db6285db68081c0 is
         a copy), which concatenates the router logits of all layers, then softmax, top_k and
         X sum(mean one_hot(top_k) * mean softmax) (no attention mask here: every token counts,
         below).
The two agree when every layer routes alike, and differ otherwise: pooled lets one layer's
imbalance be offset by another's opposite one. The per-layer mean stays the default because the
committed Jamba-style result (configs/jamba.py:quick, docs/results.md: two MoE layers) was made
with it; the pooled form is the published reference code of Mixtral and Jamba. The router
z-loss of ST-MoE (arXiv:2202.08906), mean_t (logsumexp_e W_r x_t)^2, enters with
router_z_loss_weight (off by default), averaged over the layers in either form.
Every input token counts, padding and tokens without loss weight included: each occupies its
experts like any other (MQAR scores only its answers), and language-model training windows have
no padding.

Dispatch (model.moe.dispatch): how the experts run. All compute the same function, exactly: no
token is dropped (no capacity), the outputs and gradients are those of running each token's
top_k experts alone, up to the order of floating-point sums.
  "dense"   (the default) every expert runs on every token and the combine weights are 0 outside
            R_t: y = down(gelu(up(x)) * w), activations [B, L, X, F], X / top_k times the FLOPs
            of the routed experts. Simple, and the reference: tests/test_moe_dispatch.py checks
            the sorted dispatches' outputs, gradients (input and every parameter) and auxiliary
            losses against it in float32.
  "sorted"  each (token, chosen expert) pair runs once, as MaxText's sparse matmul (megablox).
            Over the T = B L tokens, pair m = t top_k + r is token t's r-th choice e_m = R_t[r],
            with weight w_m. A stable argsort of e gives `order`, the pairs grouped by expert
            (in token order within an expert), g_e = #{m : e_m = e} (bincount) rows per expert;
            two grouped matmuls (jax.lax.ragged_dot: the i-th row of group e times W_e):
              h_i = gelu(x_{t(order_i)} W^up_{e(order_i)})                       [M, F]
              z_i = (w_{order_i} h_i) W^down_{e(order_i)}                       [M, D]
            then the un-sort: inverse = order^-1 (a scatter of 0..M-1 to `order`), and
            y_t = sum_r z_{inverse(t top_k + r)}, summed in float32. The parameters are the
            dense dispatch's (self.up, self.down kernels, which have no biases; cast to the
            compute dtype as nnx.Einsum does), and the routing and losses are shared.
            Cost: top_k / X of the dense expert-matmul FLOPs, plus a sort of M = T top_k
            integers and gathers of M rows; activations [M, F] instead of [T, X, F].
            That saving needs a backend that runs ragged_dot as a grouped matmul: TPU
            (chlo.ragged_dot). JAX's CPU lowering of ragged_dot (jax 0.10) expands it into a
            masked dense matmul over all X groups, X M D F multiply-adds, top_k times the dense
            dispatch's, and XLA's GPU compiler does the same (its RaggedDotRewriter) unless an
            experimental grouped-matmul backend takes the op.
  "blocked" the sorted pairs through research/model/feed_forward/grouped_matmul.py instead of
            ragged_dot: each expert's rows padded to a multiple of 128 and multiplied block by
            block (MegaBlocks' block-sparse form, arXiv:2211.15841), at the routed FLOPs plus
            fewer than X padded blocks, on every backend.
Measured on 2 CPU cores (BENCHMARKS.md, research/bench/moe_dispatch.py: d_model 512, 16 experts,
top-2, 4096 tokens, fwd+bwd; 2026-12-04, Intel Xeon): one layer 6519 ms dense, 7968 ms sorted, 774
ms blocked (8.4x faster than dense); a 2-layer model's training loss 18621, 16448 and 3843 ms
(4.85x). "dense" stays the default, the reference of the tests. Because the dispatches compute the
same function, a saved run (it predates the field, and loads with the default "dense", as it was
trained) would be as correct with another: no `Migration.predated` entry is needed.

research.model.flops counts the routed experts only (model FLOPs), so MFU states what a sparse layer
would need, whichever the dispatch. At scale one also dispatches into fixed-capacity expert
buffers with an all-to-all over an expert-parallel mesh axis (GShard, Switch), dropping tokens
over capacity; routing, weights and losses stay as here.

Sharding: the experts' weights are stacked on the logical axis `expert`, split over the mesh's
`tensor` axis. Dense: each device runs its experts on its tokens and the combine sums over
devices, as tensor parallelism does for an MLP. Sorted: the sort is over every token of the
batch, so under a mesh XLA all-gathers the expert ids over the batch axes and each device works
on the rows of the whole batch: the data-parallel split of the expert matmuls is lost inside the
layer. On CPU the expert weights stay split over `tensor` (no all-gather of them in the compiled
conformance-suite layer on a 2 x 2 x 2 mesh; the masked matmul is split by expert and
all-reduced); how XLA partitions a native ragged dot (TPU, GPU) was not checked here. Correct
(tests/test_conformance.py: sharded == unsharded runs the sorted dispatch), not efficient: a
sharded sorted dispatch sorts per data shard and exchanges rows with an all-to-all (MaxText under
shard_map), not done here.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.feed_forward import base
from research.model.feed_forward import grouped_matmul

# Each expert's kernels start as the MLP's do: fan-in of one expert, not of the stack.
EXPERT_INIT = nnx.initializers.lecun_normal(batch_axis=(0,))
# model.moe.dispatch: how the experts run (the module docstring); all compute the same function.
DISPATCHES = ("dense", "sorted", "blocked")


def routing_statistics(probs_TxX, chosen_TxX):
  """(f, P) [X]: f_e the fraction of tokens routed to e (chosen: 1 for each of a token's top_k
  experts; not differentiable), P_e the mean router probability of e, over every leading axis."""
  num_experts = probs_TxX.shape[-1]
  f_X = chosen_TxX.reshape(-1, num_experts).mean(0)
  p_X = probs_TxX.reshape(-1, num_experts).mean(0)
  return jax.lax.stop_gradient(f_X), p_X


def load_balancing_loss(probs_TxX, chosen_TxX):
  """X sum_e f_e P_e (routing_statistics) of one layer."""
  f_X, p_X = routing_statistics(probs_TxX, chosen_TxX)
  return probs_TxX.shape[-1] * jnp.sum(f_X * p_X)


def router_z_loss(logits_TxX):
  """mean_t (logsumexp_e logits_te)^2 (ST-MoE, arXiv:2202.08906): keeps the router logits small."""
  return jnp.mean(jax.nn.logsumexp(logits_TxX, axis=-1) ** 2)


class MixtureOfExperts(base.FeedForward):
  hyperparameters = {"num_experts": 16, "top_k": 2, "renormalize": False,
                     "load_balancing_weight": 0.01, "pooled_load_balancing": False,
                     "router_z_loss_weight": 0.0, "dispatch": "dense"}
  # The conformance suite runs the sorted dispatch (dense is the default, and the reference that
  # tests/test_moe_dispatch.py compares it with).
  test_settings = {"num_experts": 4, "top_k": 2, "dispatch": "sorted"}

  @classmethod
  def validate(cls, settings, model_config):
    experts, top_k = settings.num_experts, settings.top_k
    if not isinstance(top_k, int) or top_k < 1:
      raise ValueError(f"model.moe.top_k={top_k!r} must be an integer >= 1 (the experts each "
                       f"token is routed to)")
    if not isinstance(experts, int) or experts < top_k:
      raise ValueError(f"model.moe.num_experts={experts!r} is below model.moe.top_k={top_k}; "
                       f"valid: an integer >= {top_k}, or a smaller top_k")
    if settings.dispatch not in DISPATCHES:
      raise ValueError(f"model.moe.dispatch={settings.dispatch!r} is not a dispatch; valid: "
                       f"{', '.join(map(repr, DISPATCHES))}")
    if not isinstance(settings.pooled_load_balancing, bool):
      raise ValueError(f"model.moe.pooled_load_balancing={settings.pooled_load_balancing!r} must "
                       f"be True (one loss on the pooled tokens of all MoE layers, as HF "
                       f"transformers) or False (the mean of the layers' losses)")
    for name in ("load_balancing_weight", "router_z_loss_weight"):
      if settings[name] < 0:
        raise ValueError(f"model.moe.{name}={settings[name]} must be >= 0 (0 turns it off)")
    if not model_config.mlp_ratio:
      raise ValueError("model.mlp_ratio=0 drops every feed-forward, so a mixture of experts "
                       "would build nothing; its experts' hidden width is mlp_ratio * d_model: "
                       "use model.mlp_ratio >= 1")

  def __init__(self, model_config, settings, *, rngs):
    d, dtype = model_config.d_model, nn.compute_dtype(model_config)
    hidden, experts = model_config.mlp_ratio * d, settings.num_experts
    self.top_k, self.renormalize = settings.top_k, settings.renormalize
    self.load_balancing_weight = settings.load_balancing_weight
    self.pooled_load_balancing = settings.pooled_load_balancing
    self.router_z_loss_weight = settings.router_z_loss_weight
    self.dispatch = settings.dispatch
    # The router is small: replicated, so every device routes its tokens to all experts.
    self.router = nn.dense("BLD,DX->BLX", (d, experts), ("embed", None), rngs=rngs,
                           dtype=jnp.float32)
    self.up = nn.dense("BLD,XDF->BLXF", (experts, d, hidden), ("expert", "embed", "mlp"),
                       rngs=rngs, dtype=dtype, init=EXPERT_INIT)
    self.down = nn.dense("BLXF,XFD->BLD", (experts, hidden, d), ("expert", "mlp", "embed"),
                         rngs=rngs, dtype=dtype, init=EXPERT_INIT)

  def select(self, x_BxLxD):
    """(router logits, probabilities p [B, L, X], the top_k experts' combine weights w [B, L, R]
    (p, or renormalised p) and indices [B, L, R]), float32."""
    logits_BxLxX = self.router(x_BxLxD.astype(jnp.float32))
    probs_BxLxX = jax.nn.softmax(logits_BxLxX, axis=-1)
    top_probs_BxLxR, top_experts_BxLxR = jax.lax.top_k(probs_BxLxX, self.top_k)
    if self.renormalize:
      top_probs_BxLxR = top_probs_BxLxR / top_probs_BxLxR.sum(-1, keepdims=True)
    return logits_BxLxX, probs_BxLxX, top_probs_BxLxR, top_experts_BxLxR

  def route(self, x_BxLxD):
    """(router logits, probabilities p [B, L, X], combine weights w [B, L, X]: 0 outside the
    top_k experts, p or renormalised p on them, chosen [B, L, X]: 1 on the top_k), float32."""
    logits_BxLxX, probs_BxLxX, top_probs_BxLxR, top_experts_BxLxR = self.select(x_BxLxD)
    one_hot_BxLxRxX = jax.nn.one_hot(top_experts_BxLxR, probs_BxLxX.shape[-1])
    weights_BxLxX = jnp.einsum("blr,blrx->blx", top_probs_BxLxR, one_hot_BxLxRxX)
    return logits_BxLxX, probs_BxLxX, weights_BxLxX, one_hot_BxLxRxX.sum(-2)

  def __call__(self, x_BxLxD, segments_BxL=None):
    del segments_BxL  # token by token
    if self.dispatch in ("sorted", "blocked"):
      logits_BxLxX, probs_BxLxX, top_probs_BxLxR, top_experts_BxLxR = self.select(x_BxLxD)
      y_BxLxD = self._sorted_experts(x_BxLxD, top_probs_BxLxR, top_experts_BxLxR)
      chosen_BxLxX = jax.nn.one_hot(top_experts_BxLxR, probs_BxLxX.shape[-1]).sum(-2)
    else:
      logits_BxLxX, probs_BxLxX, weights_BxLxX, chosen_BxLxX = self.route(x_BxLxD)
      y_BxLxD = self._dense_experts(x_BxLxD, weights_BxLxX)
    if base.capturing(self):  # the training loss (research/training/loop.py)
      self._sow_losses(logits_BxLxX, probs_BxLxX, chosen_BxLxX)
    return y_BxLxD

  def _dense_experts(self, x_BxLxD, weights_BxLxX):
    """sum_e w_te MLP_e(x_t) with every expert run on every token (w_te = 0 outside R_t)."""
    hidden_BxLxXxF = jax.nn.gelu(self.up(x_BxLxD))
    return self.down(hidden_BxLxXxF * weights_BxLxX[..., None].astype(hidden_BxLxXxF.dtype))

  def _sorted_experts(self, x_BxLxD, top_probs_BxLxR, top_experts_BxLxR):
    """sum_{e in R_t} w_te MLP_e(x_t), each (token, chosen expert) pair run once: the M = T top_k
    pairs sorted by expert, two grouped matmuls (jax.lax.ragged_dot, or by blocks), un-sorted."""
    group_matmul = (jax.lax.ragged_dot if self.dispatch == "sorted"
                    else grouped_matmul.grouped_matmul)
    *leading, d = x_BxLxD.shape
    top_k, dtype = self.top_k, self.up.dtype
    # The kernels as nnx.Einsum evaluates them (promoted to the compute dtype; no biases).
    up_XxDxF = self.up.kernel[...].astype(dtype)
    down_XxFxD = self.down.kernel[...].astype(dtype)
    experts = up_XxDxF.shape[0]
    x_TxD = x_BxLxD.reshape(-1, d).astype(dtype)
    # Pair m = t top_k + r: token t's r-th choice. A stable sort keeps each expert's pairs in
    # token order; pair order[i] is row i of the sorted rows, and row inverse[m] holds pair m.
    experts_M = top_experts_BxLxR.reshape(-1)
    order_M = jnp.argsort(experts_M, stable=True)
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(
        jnp.arange(order_M.shape[0], dtype=order_M.dtype), unique_indices=True)
    group_sizes_X = jnp.bincount(experts_M, length=experts).astype(jnp.int32)
    x_MxD = jnp.take(x_TxD, order_M // top_k, axis=0)
    hidden_MxF = jax.nn.gelu(group_matmul(x_MxD, up_XxDxF, group_sizes_X,
                                          precision=self.up.precision))
    weights_M = jnp.take(top_probs_BxLxR.reshape(-1), order_M).astype(hidden_MxF.dtype)
    y_MxD = group_matmul(hidden_MxF * weights_M[:, None], down_XxFxD, group_sizes_X,
                         precision=self.down.precision, preferred_element_type=jnp.float32)
    # Un-sort (a gather by the inverse permutation) and add each token's top_k rows, in float32
    # as the dense path's down projection accumulates its sum over experts.
    y_TxRxD = jnp.take(y_MxD, inverse_M, axis=0).reshape(-1, top_k, d)
    return y_TxRxD.sum(1).astype(dtype).reshape(*leading, d)

  def _sow_losses(self, logits_BxLxX, probs_BxLxX, chosen_BxLxX):
    """This layer's part of the auxiliary losses (research/model/feed_forward/base.py combines the
    layers): its L_balance, or when pooled its (X f, P) for the loss on the pooled tokens."""
    z_loss = router_z_loss(logits_BxLxX)
    self.sow(base.AuxiliaryLoss, "router_z_loss", z_loss)
    if self.pooled_load_balancing:
      f_X, p_X = routing_statistics(probs_BxLxX, chosen_BxLxX)
      scaled_f_X = probs_BxLxX.shape[-1] * f_X
      self.sow(base.AuxiliaryLoss, "load_balancing_loss", base.Pooled(scaled_f_X, p_X))
      self.sow(base.AuxiliaryLoss, base.OBJECTIVE,
               base.Pooled(self.load_balancing_weight * scaled_f_X, p_X))
      self.sow(base.AuxiliaryLoss, base.OBJECTIVE, self.router_z_loss_weight * z_loss)
      return
    balance = load_balancing_loss(probs_BxLxX, chosen_BxLxX)
    self.sow(base.AuxiliaryLoss, "load_balancing_loss", balance)
    self.sow(base.AuxiliaryLoss, base.OBJECTIVE,
             self.load_balancing_weight * balance + self.router_z_loss_weight * z_loss)

  def idle_params_per_token(self):
    """Parameters of the experts a token is not routed to (not part of its matmul FLOPs)."""
    experts = self.up.kernel.shape[0]
    expert_params = self.up.kernel.size + self.down.kernel.size
    return expert_params * (experts - self.top_k) // experts
