"""MHA to GQA uptraining (Ainslie et al., arXiv:2305.13245) at laptop scale.

A multi-head model is trained for N steps; its key and value heads are mean-pooled into GQA
with K = 1 (MQA) and K = 2 key/value heads (train.init_from, research/training/init_from.py),
evaluated as converted (0 steps), and uptrained for 5% of N steps (the paper's alpha = 0.05) with
a fresh optimizer and the same recipe; GQA with the same K trained from scratch for 1.05 N steps is the
equal-compute baseline. python -m experiments.analyze --analysis=uptraining then tabulates
validation perplexity at the training length against decode-cache bytes.

  python -m experiments.run --config=configs/gqa_uptraining.py:quick --workdir=runs/gqa
  python -m experiments.analyze --workdir=runs/gqa --analysis=uptraining
      7 runs of a 2-layer, d_model 128, 8-head byte-level LM (N = 1000 steps of 8 x 128 bytes),
      one after the other (the converted runs read the MHA run's final checkpoint: with
      --parallel they fail until it has finished; rerun the same command).
  python -m experiments.run --config=configs/gqa_uptraining.py:full --workdir=runs/gqa_full
      (one GPU) 8 layers, d_model 512, 8 heads, N = 20000 steps of 64 x 512 bytes.

The uptraining runs start the data stream again at step 0 (the batch of step s is a function
of the seed and s), so they see the first 5% of the MHA run's batches once more, where the
paper continues on new pre-training data.
"""

from configs import base
from research.results import sweep

UPTRAIN_FRACTION = 0.05  # of the MHA run's steps (Ainslie et al.: alpha = 0.05)
KV_HEADS = (1, 2)


def get_config(preset="quick"):
  base.check_preset(preset)
  config = base.get_config()
  config.data.name = "stdlib_bytes"
  config.model.attention = "mha"
  if preset == "quick":
    config.model.update(dict(num_layers=2, d_model=128, num_heads=8, mlp_ratio=4))
    config.train.update(dict(num_steps=1000, batch_size=8, seq_len=128, learning_rate=3e-3,
                             warmup_steps=100, log_every=100, checkpoint_every=500))
    config.eval.update(dict(lengths=(128,), modes=("nonoverlapping",), num_tokens=16384,
                            batch_size=16))
  else:
    config.model.update(dict(num_layers=8, d_model=512, num_heads=8, compute_dtype="bfloat16"))
    config.train.update(dict(num_steps=20000, batch_size=64, seq_len=512, learning_rate=1e-3,
                             warmup_steps=1000, log_every=200, checkpoint_every=2000))
    config.eval.update(dict(lengths=(512,), modes=("nonoverlapping",), num_tokens=262144,
                            batch_size=8))
  return config


def members(steps: int) -> list[dict]:
  """MHA for `steps`; per K: converted (0 steps), uptrained for 5% of `steps`, and from scratch
  for 1.05 x `steps`."""
  uptrain = max(1, round(UPTRAIN_FRACTION * steps))
  mha = {"model.attention": "mha"}
  runs = [mha]
  for kv in KV_HEADS:
    gqa = {"model.attention": "gqa", "model.num_kv_heads": kv}
    converted = {**gqa, "train.init_from": sweep.run_name(mha)}  # the MHA member's directory
    runs += [{**converted, "train.num_steps": 0, "train.warmup_steps": 0},
             {**converted, "train.num_steps": uptrain,
              "train.warmup_steps": max(1, uptrain // 10)},
             {**gqa, "train.num_steps": steps + uptrain}]
  return runs


def get_sweep(preset="quick"):
  # From the preset's N: a --config.train.num_steps override changes the MHA run alone.
  return members(get_config(preset).train.num_steps)
