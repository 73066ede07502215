"""Induction heads over training (Olsson et al., arXiv:2209.11895) at laptop scale: 2-layer
attention-only byte-level models keep log-spaced checkpoints (train.keep_checkpoints_at), and
python -m experiments.analyze --analysis=induction scores every head at each of them; linear
attention and Mamba, which have no maps, get the in-context-learning score alone.

  python -m experiments.run --config=configs/induction_heads.py:quick --workdir=runs/heads
  python -m experiments.analyze --workdir=runs/heads --analysis=induction,attention_maps
      4 runs (MHA with RoPE and with ALiBi, linear attention, Mamba). The MHA + RoPE member
      trains in about a minute on 2 CPU cores (18k tokens/s) and keeps 12 checkpoints; at its
      600 steps (1.2M tokens) no head has formed yet: every induction score is at the uniform
      head's 0.011 and the ICL score is noise around 0. Olsson et al.'s phase change needs more
      tokens (--config.train.num_steps=5000 and keep_checkpoints_at to match), or the full preset.
  python -m experiments.run --config=configs/induction_heads.py:full --workdir=runs/heads_full
"""

import numpy as np

from configs import base


def log_spaced_steps(first: int, last: int, count: int) -> tuple[int, ...]:
  """About `count` integer steps from `first` to `last`, evenly spaced on a log axis."""
  return tuple(sorted({int(round(s)) for s in np.geomspace(first, last, count)}))


def get_config(preset="quick"):
  base.check_preset(preset)
  config = base.get_config()
  config.data.name = "stdlib_bytes"
  # Attention-only (mlp_ratio 0), as the paper's small models: the heads are all there is.
  config.model.update(dict(attention="mha", position="rope", num_layers=2, num_heads=4,
                           mlp_ratio=0))
  if preset == "quick":
    config.model.d_model = 128
    config.train.update(dict(num_steps=600, batch_size=16, seq_len=128, learning_rate=3e-3,
                             warmup_steps=60, log_every=50, checkpoint_every=600))
    config.eval.update(dict(lengths=(128,), modes=("nonoverlapping",), num_tokens=4096))
  else:
    config.model.update(dict(d_model=512, num_heads=8, num_kv_heads=8))
    config.train.update(dict(num_steps=20000, batch_size=64, seq_len=512, learning_rate=1e-3,
                             warmup_steps=1000, log_every=200, checkpoint_every=2000))
    config.eval.update(dict(lengths=(512,), modes=("nonoverlapping",), num_tokens=65536))
  config.train.keep_checkpoints_at = log_spaced_steps(10, config.train.num_steps, 12)
  return config


def get_sweep(preset="quick"):
  del preset
  return [{"model.attention": "mha", "model.position": "rope"},
          {"model.attention": "mha", "model.position": "alibi"},
          {"model.attention": "linear", "model.position": "rope"},
          {"model.attention": "mamba", "model.position": "none"}]
