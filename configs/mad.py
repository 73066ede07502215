"""MAD, the mechanistic architecture design suite (Poli et al., arXiv:2403.17844): six synthetic
tasks (research.data.mad) whose scores track compute-optimal perplexity at scale.

The protocol is athms/mad-lab@0f49a452b84ca0d13f8eb9c1ffa649032376fb1b: benchmark.py (two blocks
of mixer + SwiGLU at width 128), mad/configs.py (make_benchmark_mad_configs: every task's baseline
and each of its `changes` values alone, x learning rate {1e-4, 5e-4, 1e-3} x weight decay
{0, 0.1}; batch 128, 200 epochs, AdamW, cosine decay per epoch to 1e-6, 1,280 test examples),
mad/analysis.py (score = per task setting, the best test accuracy over the lr x wd grid; averaged
per task, then over tasks).

  python -m experiments.run --config=configs/mad.py:full --workdir=runs/mad    (GPUs)
      The protocol: 66 task settings x 6 (lr, wd) x every mixer of research.model.attention.REGISTRY
      (with RoPE where it takes it; MAD's attention is rotary over its 8-dim heads): 396 runs
      per mixer; steps = 200 epochs of ceil(examples / 128) batches (20,000 at 12,800 examples;
      400 for memorization's 256). Width 128, 2 layers, 16 heads (MAD's mh-attention).
  python -m experiments.run --config=configs/mad.py:quick --workdir=runs/mad --parallel=2
      What it cuts: each task's baseline setting only (6 of the 66 settings); one point,
      lr 3e-3 (no warmup, as mad-lab) and weight decay 0, instead of the 6-point (lr, wd) grid;
      FAMILIES' representatives only (7 mixers; `full` has every registered one); width 64
      and 4 heads instead of 128 and 16; 120 steps of batch 64 instead of 200 epochs of 128
      (20,000 steps at 12,800 examples), from 4,096 training examples (memorization keeps its
      256, ~30 epochs instead of 200); 256 test examples instead of 1,280; gradients clipped
      at the lab's 1.0. 42 runs: 20 min with --parallel=2 on 2 idle Intel Xeon cores
      (2026-12-04; results in docs/results.md). It checks the pipeline and separates
      mixers only coarsely: there DeltaNet and RWKV-6 solve in-context recall (0.99, 1.00) while
      MHA stays at 0.32 (also with 1 head, or 240 steps of 32, in earlier probes), and no mixer
      learns fuzzy recall or selective copying; the protocol's 20,000 steps are what the tasks
      are sized for.

Blocks are mad-lab's: the mixer, then SwiGLU (model.feed_forward=swiglu: inner width
int(8 D / 3) rounded up to 16, 352 at D = 128, no biases), each behind a pre-norm residual.
Every run is evaluated on the validation and the test split (eval.splits); the sweep's
directory then holds mad.md, MAD's score selected on test as mad-lab does and selected on
validation beside it, with intervals, and mad_state.png, score against the decode state each
mixer carries (research/results/mad_table.py).

What differs from mad-lab in both presets, by what this lab has:
  - training batches are drawn with replacement (research.data.pipeline) rather than epochs of
    the shuffled set; the cosine schedule is per step, not per epoch; gradients are clipped at
    train.grad_clip_norm (full: out of reach, 1e9, as mad-lab does not clip); float32 rather than
    bf16; no early stop at 99.9% test accuracy (mad-lab stops there);
  - the score is macro accuracy as mad-lab's torchmetrics MulticlassAccuracy computes it over a
    split (research/evaluation/evaluate.py); mad-lab logs it per test batch and Lightning
    averages those, which differs only where a batch lacks a class;
  - compression is a decoder-only form, not mad-lab's autoencoder (research/data/mad.py says how,
    and that attention-like mixers are not bottlenecked by it).
"""

import math

from configs import base
from configs import sweeps
from research.data import mad

LEARNING_RATES = (1e-4, 5e-4, 1e-3)  # mad/configs.py make_benchmark_mad_configs
WEIGHT_DECAYS = (0.0, 0.1)
EPOCHS, BATCH_SIZE, MIN_LEARNING_RATE = 200, 128, 1e-6  # mad/configs.py MADConfig
# quick: one mixer per family, by its registered name (absent ones are left out)
FAMILIES = {"softmax attention": "mha", "linear attention": "linear", "gated linear": "gla",
            "delta rule": "deltanet", "state space": "mamba", "long convolution": "hyena",
            "rwkv": "rwkv6"}
QUICK_STEPS = 120
QUICK_BATCH_SIZE = 64
QUICK_WIDTH = 64
QUICK_LEARNING_RATE, QUICK_WARMUP = 3e-3, 0
QUICK_TRAIN_EXAMPLES = 4096  # memorization keeps its 256 (what it memorizes is the map)
QUICK_EVAL_EXAMPLES = 256


def get_config(preset="quick"):
  base.check_preset(preset)
  quick = preset == "quick"
  config = base.get_config()
  config.data.update(dict(  # the first task's baseline; each member sets its own
      name="mad_in_context_recall", task_vocab_size=16, num_train_examples=12_800,
      num_eval_examples=QUICK_EVAL_EXAMPLES if quick else mad.NUM_TEST_EXAMPLES))
  config.model.update(dict(num_layers=2, d_model=QUICK_WIDTH if quick else 128,
                           num_heads=4 if quick else 16,
                           feed_forward="swiglu", mlp_ratio=4, vocab_size=16 + 2))
  config.train.update(dict(seq_len=127, batch_size=QUICK_BATCH_SIZE if quick else BATCH_SIZE,
                           learning_rate=QUICK_LEARNING_RATE if quick else 1e-3,
                           weight_decay=0.0, warmup_steps=QUICK_WARMUP if quick else 0,
                           end_learning_rate_fraction=MIN_LEARNING_RATE / (
                               QUICK_LEARNING_RATE if quick else 1e-3),
                           grad_clip_norm=1.0 if quick else 1e9,
                           num_steps=QUICK_STEPS if quick else 20_000,
                           log_every=100, checkpoint_every=QUICK_STEPS if quick else 2000))
  config.eval.update(dict(lengths=(127,), batch_size=64 if quick else 128,
                          splits=("validation", "test")))
  return config


def mixers(preset):
  if preset == "quick":
    return [(name, position) for name, position in sweeps.every_mixer_family()
            if name in FAMILIES.values()]
  return sweeps.every_mixer()


def task_settings(preset):
  """(task, mad-lab setting) of the preset: the full grid, or each task's baseline (quick, with
  at most QUICK_TRAIN_EXAMPLES training examples)."""
  if preset == "full":
    return [(task, setting) for task in mad.TASKS for setting in mad.settings_grid(task)]
  return [(task, {**t.baseline, "num_train_examples": min(t.baseline["num_train_examples"],
                                                          QUICK_TRAIN_EXAMPLES)})
          for task, t in mad.TASKS.items()]


def _training(setting, preset):
  """full: the steps of 200 epochs and each (lr, wd) of the grid, the cosine ending at 1e-6;
  quick: nothing (get_config's one point), so that --config.train.* overrides apply."""
  if preset == "quick":
    return [{}]
  steps = EPOCHS * math.ceil(setting["num_train_examples"] / BATCH_SIZE)
  return [{"train.num_steps": steps, "train.learning_rate": lr, "train.weight_decay": wd,
           "train.end_learning_rate_fraction": MIN_LEARNING_RATE / lr}
          for lr in LEARNING_RATES for wd in WEIGHT_DECAYS]


def get_sweep(preset="quick"):
  base.check_preset(preset)
  return [{"model.attention": attention_type, "model.position": position,
           **mad.overrides(task, setting), "model.vocab_size": setting["vocab_size"] + 2,
           **training}
          for attention_type, position in mixers(preset)
          for task, setting in task_settings(preset) for training in _training(setting, preset)]
