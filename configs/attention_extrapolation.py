"""Softmax-family mixers for length extrapolation: every registered mixer with a KV cache
(differential, latent, sparse, block-routed, natively sparse, stick-breaking and PaTH attention,
FoX, ...) beside MHA with RoPE, with ALiBi and with CoPE, byte LM.

Train at L = 128 bytes, evaluate perplexity at L..16L with non-overlapping and sliding windows
(the protocol and presets of configs/lm_extrapolation.py). The sweep enumerates
research.model.attention.REGISTRY: each mixer whose decode cache grows with the context (not
recurrent, `cache_bytes_per_token`) and is not a head-count variant of another (mqa, gqa) runs
once, with RoPE where it applies a
query/key scheme and with no position scheme otherwise (stick-breaking and FoX carry order in
their weights), so a new softmax-family mixer joins with no edit here (sigmoid attention with
its bias -log L); so does MHA with each position scheme that acts on whole rows of logits: CoPE,
which counts positions inside the mixer's rows, with its reference's table of L + 1 positions,
and SSMax, which scales each row by the log of its length. The block sizes of the
mixers that route or skip blocks are set from the training length L (`scaled_settings`), so that
training already sees the pattern: MoBA in blocks of L/4 (top-3: each query its own block and 2
of the earlier ones), NSA in blocks of L/8 with 3 selected and a window of L/4, the Sparse
Transformer's fixed pattern in strides of L/2 with summaries and tiles of L/8.

  python -m experiments.run --config=configs/attention_extrapolation.py:quick --workdir=runs/attention
      2 layers, d_model 128, one seed: about 2 minutes a run on 2 CPU cores.
  python -m experiments.run --config=configs/attention_extrapolation.py:full --workdir=runs/attention_full
      8 layers, d_model 512, bf16, 3 seeds each: for one GPU.
"""

from configs import base
from configs import lm_extrapolation
from research.model import attention
from research.model import positions


def get_config(preset="quick"):
  base.check_preset(preset)
  config = lm_extrapolation.get_config(preset)
  config.eval.rope_scalings = ()  # configs/lm_extrapolation.py has the RoPE-scaling rows
  defaults = base.get_config().model
  config.model.num_kv_heads = defaults.num_kv_heads  # no GQA member reads it
  config.model.learned.max_length = defaults.learned.max_length  # nor learned positions
  return config


def softmax_family():
  """(mixer, position) for every registered mixer with a KV cache that grows with the context
  (not recurrent) but MHA and its head-count variants: RoPE where the mixer rotates queries and
  keys, else none."""
  runs, model = [], base.get_config().model
  for name, cls in sorted(attention.REGISTRY.items()):
    grows = not cls.recurrent and cls.cache_bytes_per_token(model) is not None
    if not grows or name == "mha" or attention.REGISTRY.variant_of(name):
      continue
    runs.append((name, "rope" if positions.QK in cls.position_hooks else "none"))
  return runs


def row_schemes():
  """(mha, position) for every position scheme that changes whole rows of logits (CoPE) or
  scales each row by a function of its length (SSMax)."""
  return [("mha", name) for name, cls in sorted(positions.REGISTRY.items())
          if cls.hooks() & {positions.CONTEXT, positions.LENGTH}]


def scaled_settings(seq_len):
  """{mixer or position: overrides} that put its blocks inside the training length (see the
  docstring), CoPE's table at its reference's default (the training length + 1) and sigmoid
  attention's bias at -log(training length)."""
  return {"cope": {"model.cope.max_positions": seq_len + 1},
          "sigmoid": {"model.sigmoid.bias_length": seq_len},
          "moba": {"model.moba.chunk_size": seq_len // 4, "model.moba.topk": 3},
          "nsa": {"model.nsa.block_size": seq_len // 8, "model.nsa.num_selected": 3,
                  "model.nsa.window": seq_len // 4},
          "sparse": {"model.sparse.pattern": "fixed", "model.sparse.stride": seq_len // 2,
                     "model.sparse.summary": seq_len // 8,
                     "model.sparse.block_size": seq_len // 8}}


def get_sweep(preset="quick"):
  seeds = (0,) if preset == "quick" else (0, 1, 2)
  settings = scaled_settings(get_config(preset).train.seq_len)
  pairs = [("mha", "rope"), ("mha", "alibi")] + row_schemes() + softmax_family()
  return [{"model.attention": a, "model.position": p, **settings.get(a, {}),
           **settings.get(p, {}), "train.seed": seed} for a, p in pairs for seed in seeds]
