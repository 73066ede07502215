"""A Hugging Face checkpoint's tensors <-> the lab's parameters, per family.

`to_lab(family, tensors, model_config)` maps {name: numpy array} (as safetensors stores them:
torch.nn.Linear weights [out, in], GPT-2's Conv1D weights [in, out]) to {lab parameter path:
array}; every lab parameter must be filled and every tensor used (buffers that some checkpoints
carry, such as GPT-2's causal-mask `attn.bias`, aside), or ValueError lists what is missing or
left over. `from_lab` is the inverse for the Llama family (export).

Rotary layout (research/pretrained/hf_config.py): the query and key projections' channels of
each head are reordered from transformers' halves (i, i + H/2) to the lab's pairs (2i, 2i + 1):
lab[..., 2i] = hf[..., i], lab[..., 2i + 1] = hf[..., i + H/2].
"""

import re

import numpy as np

from research.model import attention

# Tensors some checkpoints carry that are not parameters (GPT-2's causal mask buffers).
IGNORED = (re.compile(r".*\.attn\.(masked_)?bias$"), re.compile(r".*rotary_emb\.inv_freq$"))


def rotary_order(head_dim: int) -> np.ndarray:
  """The lab's channel order in terms of transformers': [0, H/2, 1, H/2 + 1, ...]."""
  half = np.arange(head_dim // 2)
  return np.stack([half, half + head_dim // 2], axis=-1).reshape(-1)


class _Tensors:
  """The checkpoint's tensors by name, recording which were used."""

  def __init__(self, tensors: dict, prefix: str):
    self.tensors = {name.removeprefix(prefix): value for name, value in tensors.items()}
    self.used = set()

  def __call__(self, name):
    if name not in self.tensors:
      raise ValueError(f"the checkpoint has no tensor {name!r}")
    self.used.add(name)
    return np.asarray(self.tensors[name], np.float32)

  def get(self, name):
    return self(name) if name in self.tensors else None

  def unused(self):
    return sorted(n for n in self.tensors if n not in self.used
                  and not any(p.fullmatch(n) for p in IGNORED))


def _heads(weight_OxD, heads, head_dim, rotary):
  """A [heads * H, D] projection weight -> the lab's [D, heads, H] kernel."""
  kernel = weight_OxD.T.reshape(weight_OxD.shape[1], heads, head_dim)
  return kernel[..., rotary_order(head_dim)] if rotary else kernel


def _head_bias(bias_O, heads, head_dim, rotary):
  bias = bias_O.reshape(heads, head_dim)
  return bias[..., rotary_order(head_dim)] if rotary else bias


def _kv_heads(model_config):
  return attention.REGISTRY.lookup(model_config.attention).kv_heads(model_config)


def _llama(t, m):
  n, k, h = m.num_heads, _kv_heads(m), m.d_model // m.num_heads
  out = {("embed", "embedding"): t("model.embed_tokens.weight"),
         ("final_norm", "scale"): t("model.norm.weight")}
  for i in range(m.num_layers):
    p, layer = f"model.layers.{i}.", ("blocks", i)
    attention = layer + ("mixer",)
    out[layer + ("mixer_norm", "scale")] = t(p + "input_layernorm.weight")
    out[layer + ("mlp_norm", "scale")] = t(p + "post_attention_layernorm.weight")
    for lab, hf, heads, rotary in (("query", "q_proj", n, True), ("key", "k_proj", k, True),
                                   ("value", "v_proj", k, False)):
      out[attention + (lab, "kernel")] = _heads(t(f"{p}self_attn.{hf}.weight"), heads, h, rotary)
      if m.softmax.projection_bias != "none":
        out[attention + (lab, "bias")] = _head_bias(t(f"{p}self_attn.{hf}.bias"), heads, h,
                                                    rotary)
    out[attention + ("out", "kernel")] = t(p + "self_attn.o_proj.weight").T.reshape(n, h, -1)
    if m.softmax.projection_bias == "all":
      out[attention + ("out", "bias")] = t(p + "self_attn.o_proj.bias")
    for name in ("gate", "up", "down"):
      out[layer + ("mlp", name, "kernel")] = t(f"{p}mlp.{name}_proj.weight").T
  if not m.tie_embeddings:
    out[("head", "kernel")] = t("lm_head.weight").T
  else:
    t.get("lm_head.weight")  # a tied checkpoint may store the table twice
  return out


def _gpt2(t, m):
  n, d = m.num_heads, m.d_model
  h = d // n
  # The position table is one module shared by every layer, which nnx stores under the first
  # path it reaches: the first block's mixer's.
  out = {("embed", "embedding"): t("wte.weight"),
         ("blocks", 0, "mixer", "position", "table"): t("wpe.weight"),
         ("final_norm", "scale"): t("ln_f.weight"), ("final_norm", "bias"): t("ln_f.bias")}
  for i in range(m.num_layers):
    p, layer = f"h.{i}.", ("blocks", i)
    attention = layer + ("mixer",)
    for lab, hf in (("mixer_norm", "ln_1"), ("mlp_norm", "ln_2")):
      out[layer + (lab, "scale")] = t(f"{p}{hf}.weight")
      out[layer + (lab, "bias")] = t(f"{p}{hf}.bias")
    weights = np.split(t(p + "attn.c_attn.weight"), 3, axis=1)  # Conv1D: [in, out]
    biases = np.split(t(p + "attn.c_attn.bias"), 3)
    for lab, weight, bias in zip(("query", "key", "value"), weights, biases):
      out[attention + (lab, "kernel")] = weight.reshape(d, n, h)
      out[attention + (lab, "bias")] = bias.reshape(n, h)
    out[attention + ("out", "kernel")] = t(p + "attn.c_proj.weight").reshape(n, h, d)
    out[attention + ("out", "bias")] = t(p + "attn.c_proj.bias")
    for lab, hf in (("up", "c_fc"), ("down", "c_proj")):
      out[layer + ("mlp", lab, "kernel")] = t(f"{p}mlp.{hf}.weight")
      out[layer + ("mlp", lab, "bias")] = t(f"{p}mlp.{hf}.bias")
  if not m.tie_embeddings:
    out[("head", "kernel")] = t("lm_head.weight").T
  return out


def _mamba(t, m):
  out = {("embed", "embedding"): t("embeddings.weight"),
         ("final_norm", "scale"): t("norm_f.weight")}
  for i in range(m.num_layers):
    p, layer = f"layers.{i}.", ("blocks", i)
    mixer = layer + ("mixer",)
    out[layer + ("mixer_norm", "scale")] = t(p + "norm.weight")
    conv = t(p + "mixer.conv1d.weight")  # [E, 1, W]: tap W - 1 on the token itself, as the lab's
    conv_bias = t.get(p + "mixer.conv1d.bias")
    out[mixer + ("conv_kernel",)] = conv[:, 0, :].T
    out[mixer + ("conv_bias",)] = np.zeros(conv.shape[0], np.float32) if conv_bias is None \
        else conv_bias
    for name in ("in_proj", "x_proj", "dt_proj", "out_proj"):
      out[mixer + (name, "kernel")] = t(f"{p}mixer.{name}.weight").T
    out[mixer + ("dt_proj", "bias")] = t(p + "mixer.dt_proj.bias")
    out[mixer + ("A_log",)] = t(p + "mixer.A_log")
    out[mixer + ("D",)] = t(p + "mixer.D")
  if not m.tie_embeddings:
    out[("head", "kernel")] = t("lm_head.weight").T
  else:
    t.get("lm_head.weight")
  return out


PREFIXES = {"llama": "", "gpt2": "transformer.", "mamba": "backbone."}


def to_lab(family: str, tensors: dict, model_config) -> dict:
  """{lab parameter path: float32 array} from the checkpoint's tensors; ValueError naming the
  tensors left over (a layout this conversion does not know)."""
  t = _Tensors(tensors, PREFIXES[family])  # names without the prefix (old GPT-2 files) too
  out = {"llama": _llama, "gpt2": _gpt2, "mamba": _mamba}[family](t, model_config)
  unused = t.unused()
  if unused:
    raise ValueError(f"{len(unused)} tensor(s) of the checkpoint have no place in the lab's "
                     f"{family} model: {', '.join(unused[:8])}")
  return out


def from_lab(params: dict, model_config) -> dict:
  """{transformers tensor name: array} of a Llama-family checkpoint from the lab's parameters
  {path: array} (the inverse of to_lab's llama mapping)."""
  m = model_config
  n, k, h = m.num_heads, _kv_heads(m), m.d_model // m.num_heads
  back = np.argsort(rotary_order(h))
  out = {"model.embed_tokens.weight": params[("embed", "embedding")],
         "model.norm.weight": params[("final_norm", "scale")]}
  for i in range(m.num_layers):
    p, layer = f"model.layers.{i}.", ("blocks", i)
    attention = layer + ("mixer",)
    out[p + "input_layernorm.weight"] = params[layer + ("mixer_norm", "scale")]
    out[p + "post_attention_layernorm.weight"] = params[layer + ("mlp_norm", "scale")]
    for lab, hf, heads, rotary in (("query", "q_proj", n, True), ("key", "k_proj", k, True),
                                   ("value", "v_proj", k, False)):
      kernel = params[attention + (lab, "kernel")]
      kernel = kernel[..., back] if rotary else kernel
      out[f"{p}self_attn.{hf}.weight"] = kernel.reshape(m.d_model, heads * h).T
      if m.softmax.projection_bias != "none":
        bias = params[attention + (lab, "bias")]
        out[f"{p}self_attn.{hf}.bias"] = (bias[..., back] if rotary else bias).reshape(-1)
    out[p + "self_attn.o_proj.weight"] = params[attention + ("out", "kernel")].reshape(
        n * h, m.d_model).T
    if m.softmax.projection_bias == "all":
      out[p + "self_attn.o_proj.bias"] = params[attention + ("out", "bias")]
    for name in ("gate", "up", "down"):
      out[f"{p}mlp.{name}_proj.weight"] = params[layer + ("mlp", name, "kernel")].T
  if not m.tie_embeddings:
    out["lm_head.weight"] = params[("head", "kernel")].T
  return {name: np.ascontiguousarray(value, np.float32) for name, value in out.items()}
