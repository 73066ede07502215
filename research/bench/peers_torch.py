"""The PyTorch side of the peers suite (research/bench/peers.py), written as a PyTorch user would.

  GPT                        a nanoGPT-style decoder (fused qkv Linear, F.scaled_dot_product_attention
                             with is_causal=True, tanh GELU MLP, no biases) with the project's
                             pre-RMSNorm blocks, untied head and, when asked, its RoPE convention
                             (pairs x[2i], x[2i+1] rotated by position * base^(-2i/d)); decoding
                             with a preallocated [batch, heads, length, head_dim] KV cache (as
                             gpt-fast keeps it), SDPA over the whole cache with a position mask.
  chunk_linear_attention     the chunk form of fla's naive_chunk_linear_attn: per-chunk k^T v, an
                             exclusive cumulative sum over chunks, masked intra-chunk scores; with
                             the project's elu + 1 features and normaliser phi(q) . sum phi(k).
  selective_scan_reference   mamba_ssm's selective_scan_ref: exp(delta A) and delta B u for all
                             steps at once, then a Python loop over the tokens (unbound once,
                             so that the backward stays linear in the length).
Imported only once torch is known to be installed (peers.require_torch).
"""

import torch
import torch.nn.functional as F
from torch import nn

RMS_EPSILON = 1e-6  # nnx.RMSNorm's default, as the project's model uses it
LINEAR_EPSILON = 1e-6  # research.model.attention.linear.EPSILON


def rotate(x_BxTxNxH, cos_Tx1xF, sin_Tx1xF):
  even, odd = x_BxTxNxH[..., 0::2], x_BxTxNxH[..., 1::2]
  rotated = torch.stack([even * cos_Tx1xF - odd * sin_Tx1xF, even * sin_Tx1xF + odd * cos_Tx1xF],
                        dim=-1)
  return rotated.flatten(-2)


class CausalSelfAttention(nn.Module):

  def __init__(self, d_model, num_heads):
    super().__init__()
    self.num_heads, self.head_dim = num_heads, d_model // num_heads
    self.c_attn = nn.Linear(d_model, 3 * d_model, bias=False)
    self.c_proj = nn.Linear(d_model, d_model, bias=False)
    self.cache_k = self.cache_v = None

  def forward(self, x, rotation=None, start=None):
    """x [B, T, C]; start: None for a whole sequence, else the cache slot of the first token."""
    b, t, c = x.shape
    q, k, v = (y.view(b, t, self.num_heads, self.head_dim)
               for y in self.c_attn(x).split(c, dim=2))
    if rotation is not None:
      q, k = rotate(q, *rotation), rotate(k, *rotation)
    q, k, v = (y.transpose(1, 2) for y in (q, k, v))
    if start is None:
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
      self.cache_k[:, :, start:start + t] = k
      self.cache_v[:, :, start:start + t] = v
      slots = torch.arange(self.cache_k.shape[2])
      mask = slots[None, :] <= start + torch.arange(t)[:, None]
      y = F.scaled_dot_product_attention(q, self.cache_k, self.cache_v, attn_mask=mask)
    return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):

  def __init__(self, d_model, hidden):
    super().__init__()
    self.c_fc = nn.Linear(d_model, hidden, bias=False)
    self.c_proj = nn.Linear(hidden, d_model, bias=False)

  def forward(self, x):
    return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):

  def __init__(self, d_model, num_heads, mlp_ratio):
    super().__init__()
    self.ln_1 = nn.RMSNorm(d_model, eps=RMS_EPSILON)
    self.attn = CausalSelfAttention(d_model, num_heads)
    self.ln_2 = nn.RMSNorm(d_model, eps=RMS_EPSILON)
    self.mlp = MLP(d_model, mlp_ratio * d_model)

  def forward(self, x, rotation=None, start=None):
    x = x + self.attn(self.ln_1(x), rotation, start)
    return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):

  def __init__(self, *, vocab_size, num_layers, d_model, num_heads, mlp_ratio=4,
               rope_base=None):
    super().__init__()
    self.head_dim = d_model // num_heads
    self.rope_base = rope_base
    self.wte = nn.Embedding(vocab_size, d_model)
    self.h = nn.ModuleList(Block(d_model, num_heads, mlp_ratio) for _ in range(num_layers))
    self.ln_f = nn.RMSNorm(d_model, eps=RMS_EPSILON)
    self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

  def _rotation(self, positions_T):
    if self.rope_base is None:
      return None
    theta = self.rope_base ** -(torch.arange(0, self.head_dim, 2, dtype=torch.float32)
                                / self.head_dim)
    angle = positions_T.float()[:, None, None] * theta
    return torch.cos(angle), torch.sin(angle)

  def forward(self, idx_BxT, start=None):
    """Logits [B, T, vocab]; start: None (training, causal SDPA) or the first token's position
    (decoding through the caches of setup_caches)."""
    t = idx_BxT.shape[1]
    rotation = self._rotation(torch.arange(t) + (start or 0))
    x = self.wte(idx_BxT)
    for block in self.h:
      x = block(x, rotation, start)
    return self.lm_head(self.ln_f(x))

  def setup_caches(self, batch_size, max_length):
    for block in self.h:
      attn = block.attn
      shape = (batch_size, attn.num_heads, max_length, attn.head_dim)
      attn.cache_k, attn.cache_v = torch.zeros(shape), torch.zeros(shape)


def load_weights(model, named_arrays):
  """Copies {parameter name: numpy array} into `model`; every parameter must be given."""
  params = dict(model.named_parameters())
  if set(params) != set(named_arrays):
    raise ValueError(f"parameter names differ: only in PyTorch {sorted(set(params) - set(named_arrays))}, "
                     f"only given {sorted(set(named_arrays) - set(params))}")
  with torch.no_grad():
    for name, value in named_arrays.items():
      if tuple(params[name].shape) != value.shape:
        raise ValueError(f"{name}: PyTorch shape {tuple(params[name].shape)}, given {value.shape}")
      params[name].copy_(torch.from_numpy(value))


def adamw(model, learning_rate, weight_decay):
  """nanoGPT's optimizer groups: matrices and embeddings decay, norm scales do not."""
  params = [p for p in model.parameters() if p.requires_grad]
  groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
  return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


def train_step(model, optimizer, inputs_BxT, targets_BxT, clip_norm):
  """One step as nanoGPT's loop runs it: loss, backward, clip, AdamW step, zero the grads."""
  logits = model(inputs_BxT)
  loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets_BxT.view(-1))
  loss.backward()
  torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
  optimizer.step()
  optimizer.zero_grad(set_to_none=True)
  return loss


def loss_and_grads(model, inputs_BxT, targets_BxT):
  """Mean cross-entropy, logits and {name: gradient}, the gradients left out of the model."""
  logits = model(inputs_BxT)
  loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets_BxT.view(-1))
  names, params = zip(*model.named_parameters())
  grads = torch.autograd.grad(loss, params)
  return loss, logits, dict(zip(names, grads))


def elu_plus_one(x):
  return F.elu(x) + 1.0


def chunk_linear_attention(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH, chunk_size=64):
  """Causal linear attention, phi = elu + 1, o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps), in
  chunks as fla's naive chunk form computes it (L a multiple of chunk_size)."""
  b, length, n, h = q_BxLxNxH.shape
  q, k = elu_plus_one(q_BxLxNxH), elu_plus_one(k_BxLxNxH)
  chunks = lambda x: x.reshape(b, length // chunk_size, chunk_size, n, h).permute(0, 3, 1, 2, 4)
  qc, kc, vc = chunks(q), chunks(k), chunks(v_BxLxNxH)  # [B, N, chunks, C, H]
  kv = (kc.transpose(-1, -2) @ vc).cumsum(2)
  kv = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1]], dim=2)  # state before each chunk
  future = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool), diagonal=1)
  intra = (qc @ kc.transpose(-1, -2)).masked_fill(future, 0.0) @ vc
  numerator = (qc @ kv + intra).permute(0, 2, 3, 1, 4).reshape(b, length, n, h)
  denominator = (q * k.cumsum(1)).sum(-1, keepdim=True)
  return numerator / (denominator + LINEAR_EPSILON)


def selective_scan_reference(u_BxDxL, delta_BxDxL, A_DxN, B_BxNxL, C_BxNxL):
  """h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t, y_t = C_t h_t from h_0 = 0, token by token
  (mamba_ssm's layout: channels before length). Returns y [B, D, L].

  The steps are taken with unbind rather than by indexing [:, :, i] as selective_scan_ref does:
  the same forward, but the backward of an index allocates a full-length gradient per token
  (quadratic in the length: 20 s for fwd+bwd at 512 tokens on 2 cores), that of unbind one stack.
  """
  decay = torch.exp(torch.einsum("bdl,dn->bdln", delta_BxDxL, A_DxN))
  drive = torch.einsum("bdl,bnl,bdl->bdln", delta_BxDxL, B_BxNxL, u_BxDxL)
  h = u_BxDxL.new_zeros(u_BxDxL.shape[0], u_BxDxL.shape[1], A_DxN.shape[1])
  ys = []
  for decay_t, drive_t, C_t in zip(decay.unbind(2), drive.unbind(2), C_BxNxL.unbind(2)):
    h = decay_t * h + drive_t
    ys.append(torch.einsum("bdn,bn->bd", h, C_t))
  return torch.stack(ys, dim=2)
