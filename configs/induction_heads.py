"""Induction heads over training (Olsson et al., arXiv:2209.11895) at laptop scale: 2-layer
attention-only models keep log-spaced checkpoints (train.keep_checkpoints_at), and
python -m experiments.analyze --analysis=induction scores every head at each of them.

  python -m experiments.run --config=configs/induction_heads.py:quick --workdir=runs/heads
  python -m experiments.analyze --workdir=runs/heads --analysis=induction,attention_maps
      The repeated-random-token task (data.name=induction: P P, P 8-32 random symbols of 64,
      loss on the second copy), 4 runs (MHA with RoPE and with ALiBi, linear attention, Mamba)
      of 2000 steps of 32 x 64 tokens: 11 minutes on 2 CPU cores (2026-12-01; Mamba takes 7 of
      them). Both MHA runs show the phase change: the loss of MHA + RoPE falls from 3.6 at step
      200 to 0.22 at step 400, its largest induction score goes 0.05 (step 180) -> 0.19 (291)
      -> 0.81 (471) -> 0.93 (2000), with a previous-token head forming alongside (0.06 ->
      0.80); ALiBi 0.03 -> 0.25 -> 0.71. Accuracy on the second copy: RoPE 0.995, ALiBi 0.966,
      Mamba 0.354, linear attention 0.126 (these have no maps and, on a task, no ICL score).
  python -m experiments.run --config=configs/induction_heads.py:full --workdir=runs/heads_full
      byte-level text (the ICL score for every mixer, maps for the softmax ones), for a GPU.
"""

import numpy as np

from configs import base


def log_spaced_steps(first: int, last: int, count: int) -> tuple[int, ...]:
  """About `count` integer steps from `first` to `last`, evenly spaced on a log axis."""
  return tuple(sorted({int(round(s)) for s in np.geomspace(first, last, count)}))


def get_config(preset="quick"):
  base.check_preset(preset)
  config = base.get_config()
  # Attention-only (mlp_ratio 0), as the paper's small models: the heads are all there is.
  config.model.update(dict(attention="mha", position="rope", num_layers=2, num_heads=4,
                           mlp_ratio=0))
  if preset == "quick":
    # Repeated random tokens: in-context copying is all there is to learn, so the heads form
    # within the CPU budget (on bytes, 600 steps left every head at the uniform score).
    config.data.update(dict(name="induction", task_vocab_size=64, train_min_length=8,
                            train_max_length=32))
    config.model.update(dict(d_model=64, num_kv_heads=4, vocab_size=66))
    config.train.update(dict(num_steps=2000, batch_size=32, seq_len=64, learning_rate=3e-3,
                             warmup_steps=100, log_every=100, checkpoint_every=1000))
    config.eval.update(dict(lengths=(64,), batch_size=64))
  else:
    config.data.name = "stdlib_bytes"
    config.model.update(dict(d_model=512, num_heads=8))
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
