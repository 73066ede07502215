"""Synthetic length generalization: train on short examples, test on up to 10x longer ones.

Protocol of arXiv:2305.16843: training examples of U(1, 40) symbols, test lengths far beyond,
accuracy (exact match over the answer positions) per length; summary.md gives mean +/- std over
seeds and the best seed. Tasks: copy, reverse, sort, induction (research.data).

  python -m experiments.run --config=configs/tasks_extrapolation.py:quick --workdir=runs/tasks
      4 tasks x (MHA x every position scheme, linear, mamba), 1 seed: about 2 hours on 2 CPU
      cores (4 tasks x 5 variants took 40 minutes).
  python -m experiments.run --config=configs/tasks_extrapolation.py:full --workdir=runs/tasks
      3 seeds and 10000 steps each, for one GPU.
Lengths count input tokens; an example of n symbols takes about 2n + 1 of them.
"""

from configs import base
from research.model import positions

TASKS = ("copy", "reverse", "sort", "induction")
# MHA with every registered position scheme, plus the recurrent and linear mixers.
VARIANTS = tuple(("mha", p) for p in positions.REGISTRY) + (("linear", "rope"), ("mamba", "none"))


def get_config(preset="quick"):
  base.check_preset(preset)
  config = base.get_config()
  config.data.update(dict(name="copy", task_vocab_size=16, train_min_length=1,
                          train_max_length=40, num_train_examples=100_000, num_eval_examples=256))
  config.model.update(dict(num_layers=2, d_model=128, num_heads=4, vocab_size=18))
  config.train.update(dict(seq_len=96, batch_size=32, learning_rate=1e-3, log_every=100,
                           num_steps=1000 if preset == "quick" else 10_000,
                           warmup_steps=100, checkpoint_every=1000))
  config.eval.update(dict(lengths=(96, 192, 384, 960), batch_size=32))
  return config


def get_sweep(preset="quick"):
  seeds = (0,) if preset == "quick" else (0, 1, 2)
  return [{"data.name": task, "model.attention": attention, "model.position": position,
           "train.seed": seed}
          for task in TASKS for attention, position in VARIANTS for seed in seeds]
