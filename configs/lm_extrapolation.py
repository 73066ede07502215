"""Byte-level language modeling on the embedded corpus: train short, evaluate long.

The ALiBi paper's experiment (arXiv:2108.12409, Figure 1 / Table 2) at laptop scale: train at
length L, evaluate perplexity at L, 2L, 4L, 8L, 16L with non-overlapping and sliding windows.
Both presets add two kinds of baselines (`baselines`):
- sliding-window attention: MHA with RoPE whose tokens see only the last L tokens
  (model.softmax.window = L), without and with 4 attention sinks (model.softmax.sinks = 4: the
  first tokens stay visible; StreamingLLM, arXiv:2309.17453);
- packed documents (data.packing = "documents"): MHA with ALiBi and with RoPE trained and
  evaluated with each token attending only within its document (research/data/packing.py).

  python -m experiments.run --config=configs/lm_extrapolation.py:quick --workdir=runs/demo
      10 runs (MHA x none/sinusoidal/rope/alibi, linear, mamba, and the four baselines): 8.4
      minutes on a 2-core Intel Xeon VM (make results RESULTS=demo, docs/made.md).
      Expected at 8L (non-overlapping): ALiBi within ~10% of its 1x perplexity, sinusoidal 2x or
      more, RoPE in between; RoPE also gets PI / static NTK / dynamic NTK / YaRN rows without
      retraining.
  python -m experiments.run --config=configs/lm_extrapolation.py:full --workdir=runs/full
      every attention type x compatible position, and the baselines, x 3 seeds, for one GPU.
Override anything, e.g. --config.train.num_steps=2000. Runs are labelled by what they change:
"mha / rope / window=128 / sinks=4", "mha / alibi / documents".
"""

from configs import base
from configs import sweeps


def get_config(preset="quick"):
  base.check_preset(preset)
  config = base.get_config()
  config.data.name = "stdlib_bytes"
  if preset == "quick":
    config.model.update(dict(num_layers=2, d_model=128, num_heads=4, mlp_ratio=4))
    # 800 updates of 8 x 128 tokens: at this scale the models are limited by updates, not
    # tokens; 200 updates of 32 x 128 (the same compute) leave sinusoidal and RoPE undertrained.
    config.train.update(dict(num_steps=800, batch_size=8, seq_len=128, learning_rate=3e-3,
                             warmup_steps=80, log_every=100, checkpoint_every=400))
    config.eval.update(dict(num_tokens=4096, batch_size=8, sliding_stride=128,
                            rope_scalings=("pi", "static_ntk", "dynamic_ntk", "yarn")))
  else:
    config.model.update(dict(num_layers=8, d_model=512, num_heads=8, num_kv_heads=2,
                             compute_dtype="bfloat16"))
    config.model.softmax.block_size = 256
    config.train.update(dict(num_steps=20000, batch_size=64, seq_len=512, learning_rate=1e-3,
                             warmup_steps=1000, log_every=200, checkpoint_every=2000,
                             eval_every=2000))
    config.eval.update(dict(num_tokens=262144, batch_size=8, sliding_stride=256,
                            rope_scalings=("pi", "static_ntk", "dynamic_ntk", "yarn")))
  config.eval.lengths = tuple(config.train.seq_len * k for k in (1, 2, 4, 8, 16))
  # Learned positions get a row for every evaluated position (untrained beyond seq_len unless
  # model.randomize_max_length spreads training over them).
  config.model.learned.max_length = max(config.eval.lengths)
  return config


STREAMING_SINKS = 4  # initial tokens kept visible, as StreamingLLM uses (arXiv:2309.17453)


def baselines(seq_len):
  """Sliding-window MHA + RoPE (window = the training length) without and with attention sinks,
  and packed documents with ALiBi and with RoPE."""
  window = {"model.attention": "mha", "model.position": "rope", "model.softmax.window": seq_len}
  return ([{**window, "model.softmax.sinks": sinks} for sinks in (0, STREAMING_SINKS)]
          + [{"model.attention": "mha", "model.position": p, "data.packing": "documents"}
             for p in ("alibi", "rope")])


def get_sweep(preset="quick"):
  seq_len = get_config(preset).train.seq_len
  if preset == "quick":
    return ([{"model.attention": "mha", "model.position": p}
             for p in ("none", "sinusoidal", "rope", "alibi")]
            + [{"model.attention": "linear", "model.position": "rope"},
               {"model.attention": "mamba", "model.position": "none"}]
            + baselines(seq_len))
  return [{**run, "train.seed": seed}
          for run in ([{"model.attention": a, "model.position": p}
                       for a, p in sweeps.every_variant()] + baselines(seq_len))
          for seed in (0, 1, 2)]
