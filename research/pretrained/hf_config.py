"""A Hugging Face checkpoint's config.json <-> the lab's model config.

`to_lab(hf)` gives the lab's model fields ({"model.attention": "gqa", ...}, dotted) of a
checkpoint of a supported family, or ValueError naming the setting the lab cannot represent and
what it can; `from_lab(model_config, max_length)` the config.json of an exportable run (llama,
qwen2 or mistral). Field names follow transformers 5 (`rope_parameters`) and read the older
layout too (`rope_theta` with `rope_scaling`).

Rotary layout: Llama, Mistral and Qwen2 rotate the two halves of a head, channel i with channel
i + H/2 (`rotate_half`); the lab rotates adjacent pairs (2i, 2i + 1), each by the same theta_i.
hf_weights permutes the query and key projections' output channels between the two, so the same
weights give the same logits; nothing else changes (values and outputs are not rotated).
"""

import math

from research.model import attention
from research.model import feed_forward

FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2",
            "mamba": "mamba"}
# transformers' rope_type -> the lab's model.rope.scaling.
ROPE_SCALINGS = {"default": "none", "linear": "pi", "dynamic": "dynamic_ntk", "yarn": "yarn",
                 "llama3": "llama3"}
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                    "relu": "relu", "silu": "silu"}
EXPORTED = {"none": "llama", "all": "llama", "qkv": "qwen2"}  # projection biases -> model_type


def family(hf: dict) -> str:
  """The lab's family of a config.json: llama, gpt2 or mamba."""
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(f"model_type {model_type!r} is not supported; valid: "
                     f"{', '.join(sorted(FAMILIES))}")
  return FAMILIES[model_type]


def _refuse(what, value, valid):
  raise ValueError(f"{what}={value!r} has no equivalent in the lab; supported: {valid}")


def rope_parameters(hf: dict) -> dict:
  """{"rope_type", "rope_theta", "factor", ...} from either config layout."""
  params = dict(hf.get("rope_parameters") or {})
  if not params:
    params = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
  params.setdefault("rope_type", params.pop("type", "default"))
  return params


def _rope(hf: dict) -> dict:
  params = rope_parameters(hf)
  kind = params["rope_type"]
  if kind not in ROPE_SCALINGS:
    _refuse("rope_type", kind, ", ".join(ROPE_SCALINGS))
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    _refuse("partial_rotary_factor", params["partial_rotary_factor"], "1.0")
  fields = {"model.position": "rope", "model.rope.base": float(params["rope_theta"]),
            "model.rope.scaling": ROPE_SCALINGS[kind]}
  if kind == "default":
    return fields
  factor = params.get("factor")
  original = params.get("original_max_position_embeddings") or hf["max_position_embeddings"]
  if kind == "dynamic":  # transformers scales from max_position_embeddings
    original = hf["max_position_embeddings"]
  if kind == "yarn":
    factor = factor or hf["max_position_embeddings"] / original
    expected = {"beta_fast": 32, "beta_slow": 1, "truncate": True, "mscale": None,
                "mscale_all_dim": None}
    for name, value in expected.items():
      if params.get(name) not in (None, value):
        _refuse(f"rope_parameters.{name}", params[name], f"{value} (YaRN's defaults)")
    attention_factor = params.get("attention_factor")
    if attention_factor is not None and not math.isclose(
        attention_factor, 0.1 * math.log(factor) + 1 if factor > 1 else 1.0, rel_tol=1e-6):
      _refuse("rope_parameters.attention_factor", attention_factor, "0.1 ln(factor) + 1")
  if kind == "llama3":
    fields["model.rope.low_freq_factor"] = float(params["low_freq_factor"])
    fields["model.rope.high_freq_factor"] = float(params["high_freq_factor"])
  fields["model.rope.scaling_factor"] = float(factor)
  fields["model.rope.original_length"] = int(original)
  return fields


def _window(hf: dict) -> int:
  """The sliding window of every layer (0: none); a window on some layers only is refused."""
  if hf["model_type"] == "mistral":
    return int(hf.get("sliding_window") or 0)
  if hf["model_type"] == "qwen2" and hf.get("use_sliding_window") and hf.get("sliding_window"):
    layer_types = hf.get("layer_types") or []
    if set(layer_types) != {"sliding_attention"}:
      _refuse("a sliding window on some layers only (layer_types)", layer_types,
              "the same window on every layer")
    return int(hf["sliding_window"])
  return 0


def _llama(hf: dict) -> dict:
  d, n = hf["hidden_size"], hf["num_attention_heads"]
  k = hf.get("num_key_value_heads") or n
  if (hf.get("head_dim") or d // n) != d // n:
    _refuse("head_dim", hf["head_dim"], f"hidden_size / num_attention_heads = {d // n}")
  if hf.get("hidden_act", "silu") != "silu":
    _refuse("hidden_act", hf["hidden_act"], "silu (SwiGLU)")
  if hf.get("mlp_bias"):
    _refuse("mlp_bias", True, "False")
  if hf["model_type"] == "qwen2":
    bias = "qkv"
  else:
    bias = "all" if hf.get("attention_bias") else "none"
  attention = "mha" if k == n else ("mqa" if k == 1 else "gqa")
  fields = {"model.attention": attention, "model.num_layers": hf["num_hidden_layers"],
            "model.d_model": d, "model.num_heads": n, "model.num_kv_heads": k,
            "model.vocab_size": hf["vocab_size"], "model.feed_forward": "swiglu",
            "model.swiglu.hidden": hf["intermediate_size"], "model.norm": "rms_norm",
            "model.rms_norm.eps": float(hf.get("rms_norm_eps", 1e-6)),
            "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "model.softmax.projection_bias": bias, "model.softmax.window": _window(hf)}
  return {**fields, **_rope(hf)}


def _gpt2(hf: dict) -> dict:
  d, n = hf["n_embd"], hf["n_head"]
  inner = hf.get("n_inner") or 4 * d
  if inner % d:
    _refuse("n_inner", inner, f"a multiple of n_embd = {d}")
  activation = hf.get("activation_function", "gelu_new")
  if activation not in GPT2_ACTIVATIONS:
    _refuse("activation_function", activation, ", ".join(GPT2_ACTIVATIONS))
  if hf.get("scale_attn_by_inverse_layer_idx"):
    _refuse("scale_attn_by_inverse_layer_idx", True, "False")
  if not hf.get("scale_attn_weights", True):
    _refuse("scale_attn_weights", False, "True (logits / sqrt(head_dim))")
  return {"model.attention": "mha", "model.position": "learned",
          "model.learned.max_length": hf["n_positions"], "model.num_layers": hf["n_layer"],
          "model.d_model": d, "model.num_heads": n, "model.vocab_size": hf["vocab_size"],
          "model.feed_forward": "mlp", "model.mlp_ratio": inner // d,
          "model.mlp.activation": GPT2_ACTIVATIONS[activation], "model.mlp.bias": True,
          "model.norm": "layer_norm", "model.layer_norm.eps": float(hf["layer_norm_epsilon"]),
          "model.tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
          "model.softmax.projection_bias": "all"}


def _mamba(hf: dict) -> dict:
  d, inner = hf["hidden_size"], hf["intermediate_size"]
  if inner % d:
    _refuse("intermediate_size", inner, f"a multiple of hidden_size = {d} (expand)")
  if hf.get("use_bias"):
    _refuse("use_bias", True, "False (the lab's in_proj and out_proj have no bias)")
  if hf.get("hidden_act", "silu") != "silu":
    _refuse("hidden_act", hf["hidden_act"], "silu")
  return {"model.attention": "mamba", "model.position": "none", "model.mlp_ratio": 0,
          "model.num_layers": hf["num_hidden_layers"], "model.d_model": d, "model.num_heads": 1,
          "model.vocab_size": hf["vocab_size"], "model.mamba.state_size": hf["state_size"],
          "model.mamba.conv_width": hf["conv_kernel"], "model.mamba.expand": inner // d,
          "model.mamba.dt_rank": hf["time_step_rank"], "model.norm": "rms_norm",
          "model.rms_norm.eps": float(hf.get("layer_norm_epsilon", 1e-5)),
          "model.tie_embeddings": bool(hf.get("tie_word_embeddings", True))}


def context_length(hf: dict) -> int | None:
  """The context the checkpoint was trained at (the original one of a rotary scaling), or None
  for a family without one (Mamba)."""
  if family(hf) == "gpt2":
    return hf["n_positions"]
  if family(hf) == "llama":
    params = rope_parameters(hf)
    if params["rope_type"] in ("yarn", "llama3"):
      return params.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    return hf["max_position_embeddings"]
  return None


def to_lab(hf: dict) -> dict:
  """The lab's model fields (dotted) of config.json `hf`; ValueError for what it cannot hold."""
  return {"llama": _llama, "gpt2": _gpt2, "mamba": _mamba}[family(hf)](hf)


def exportable(model_config) -> list[str]:
  """Why a run cannot be exported as a Llama-family checkpoint (empty: it can)."""
  m = model_config
  reasons = []
  wanted = {"attention": ("mha", "mqa", "gqa"), "position": ("rope",),
            "feed_forward": ("swiglu",), "norm": ("rms_norm",)}
  for field, valid in wanted.items():
    if m[field] not in valid:
      reasons.append(f"model.{field}={m[field]!r} (exportable: {', '.join(valid)})")
  if m.layer_pattern or m.feed_forward_pattern:
    reasons.append("a layer or feed-forward pattern (exportable: one kind of layer)")
  if m.softmax.sinks:
    reasons.append("attention sinks (model.softmax.sinks)")
  if m.softmax.window and m.softmax.projection_bias != "none":
    reasons.append("a sliding window with projection biases (Mistral has none)")
  if m.rope.scaling not in ROPE_SCALINGS.values() or m.rope.scaling == "static_ntk":
    reasons.append(f"model.rope.scaling={m.rope.scaling!r} (transformers has no equivalent)")
  if m.randomize_max_length:
    reasons.append("model.randomize_max_length (positions beyond the training length)")
  return reasons


def from_lab(model_config, max_length: int) -> dict:
  """The config.json of a Llama-family checkpoint equal to the lab's model (`exportable`);
  `max_length` becomes max_position_embeddings (unless a scaling needs its original length)."""
  reasons = exportable(model_config)
  if reasons:
    raise ValueError("this run cannot be exported as a Llama-family checkpoint: "
                     + "; ".join(reasons))
  m = model_config
  heads = attention.REGISTRY.lookup(m.attention).kv_heads(m)
  bias = m.softmax.projection_bias
  window = int(m.softmax.window)
  model_type = "mistral" if window else EXPORTED[bias]
  rope = {"rope_theta": float(m.rope.base),
          "rope_type": {v: k for k, v in ROPE_SCALINGS.items()}[m.rope.scaling]}
  if m.rope.scaling != "none":
    rope["factor"] = float(m.rope.scaling_factor)
    if m.rope.scaling == "dynamic_ntk":
      max_length = int(m.rope.original_length)
    else:
      rope["original_max_position_embeddings"] = int(m.rope.original_length)
      max_length = max(max_length, int(m.rope.original_length))
    if m.rope.scaling == "llama3":
      rope["low_freq_factor"] = float(m.rope.low_freq_factor)
      rope["high_freq_factor"] = float(m.rope.high_freq_factor)
  architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mistral": "MistralForCausalLM"}[model_type]
  hf = {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
        "hidden_size": m.d_model, "intermediate_size": _swiglu_width(m),
        "num_attention_heads": m.num_heads, "num_key_value_heads": heads,
        "head_dim": m.d_model // m.num_heads, "num_hidden_layers": m.num_layers,
        "vocab_size": m.vocab_size, "rms_norm_eps": float(m.rms_norm.eps),
        "max_position_embeddings": int(max_length), "rope_parameters": rope,
        "tie_word_embeddings": bool(m.tie_embeddings), "dtype": "float32"}
  if model_type == "llama":
    hf.update(attention_bias=bias == "all", mlp_bias=False)
  if model_type == "mistral":
    hf["sliding_window"] = window
  return hf


def _swiglu_width(model_config) -> int:
  return feed_forward.REGISTRY.lookup("swiglu").hidden_width(
      feed_forward.REGISTRY.settings("swiglu", model_config), model_config)
