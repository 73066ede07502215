"""Passkey and needle retrieval beyond the training length (research.data.needles).

Byte-level models are trained on the retrieval task itself (the train split: random lengths up
to train.seq_len, random depths), then evaluated at every eval length x needle depth; exact
match = every digit of the answer right. Tasks: passkey (landmark attention arXiv:2305.16300,
YaRN arXiv:2309.00071) and RULER's (arXiv:2404.06654) needle_single, needle_multikey,
needle_multivalue. Outputs: needle_heatmap.png (length x depth per variant),
lost_in_the_middle.png, summary.md (both tables with 95% bootstrap intervals), and
extrapolation.png / results.csv rows that pool every depth.

  python -m experiments.run --config=configs/long_context.py:quick --workdir=runs/needles
      passkey and needle_single x 2 variants (MHA with RoPE, with ALiBi), 1 seed: 800 steps of
      training at 256 bytes, evaluation at 256, 512 and 1024 bytes x 5 depths x 64 examples.
      17 minutes with --parallel=2 on 2 idle CPU cores (target: 25). The multi-key and
      multi-value tasks need more training than a CPU preset affords (600 steps left all four
      tasks x both variants at exact match <= 0.006 except passkey, in 32 minutes), so they are
      in `full` only; `--config.data.name=needle_multikey` trains one with the quick settings.
  python -m experiments.run --config=configs/long_context.py:full --workdir=runs/needles
      4 tasks x every attention type x each compatible position x 3 seeds (RULER's 3
      distractors and 4 values): training at 1024 bytes, evaluation up to 16384 x 11 depths x 64
      examples; about 250 runs, for GPUs (--sweep_index spreads them over an array job).
"""

from configs import base
from configs import sweeps
from research.data import needles

TASKS = tuple(needles.TASKS)
QUICK_TASKS = ("passkey", "needle_single")
QUICK_VARIANTS = (("mha", "rope"), ("mha", "alibi"))


def get_config(preset="quick"):
  base.check_preset(preset)
  config = base.get_config()
  quick = preset == "quick"
  config.data.update(dict(name="passkey", needle_value_digits=5,
                          num_train_examples=20_000 if quick else 50_000,
                          num_eval_examples=64 if quick else 128))
  config.model.update(dict(num_layers=2 if quick else 4, d_model=128 if quick else 256))
  seq_len = 256 if quick else 1024
  config.train.update(dict(seq_len=seq_len, batch_size=16 if quick else 32,
                           num_steps=800 if quick else 5000,
                           learning_rate=2e-3 if quick else 1e-3,
                           warmup_steps=60 if quick else 500, log_every=100,
                           checkpoint_every=800 if quick else 1000))
  config.eval.update(dict(
      lengths=tuple(seq_len * k for k in ((1, 2, 4) if quick else (1, 2, 4, 8, 16))),
      depths=(0.0, 0.25, 0.5, 0.75, 1.0) if quick else tuple(i / 10 for i in range(11)),
      batch_size=16 if quick else 4))
  if not quick:  # what only the full sweep's members read (research.runs.unread)
    config.data.update(dict(num_distractors=3, num_values=4))  # needle_multikey, _multivalue
    config.model.learned.max_length = max(config.eval.lengths)  # a row per evaluated position
  return config


def get_sweep(preset="quick"):
  base.check_preset(preset)
  quick = preset == "quick"
  task_names = QUICK_TASKS if quick else TASKS
  variants = QUICK_VARIANTS if quick else sweeps.every_variant()
  seeds = (0,) if quick else (0, 1, 2)
  return [{"data.name": task, "model.attention": name, "model.position": position,
           "train.seed": seed}
          for task in task_names for name, position in variants for seed in seeds]
