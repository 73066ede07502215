"""The algorithmic length-generalization suite (Deletang et al. arXiv:2207.02098; protocol of
Ruoss et al. arXiv:2305.16843): train on inputs of U(1, 40) symbols, test on longer ones.

Tasks: research.data.algorithmic (parity_check ... bucket_sort). Accuracy is over the answer
tokens (with the end token of variable-length answers), per test length; summary.md gives mean
+/- std over seeds, the best seed and 95% bootstrap intervals; tasks.png one panel per task.
Every run gets its own train.seq_len (the tokens of a 40-symbol example) and eval.lengths (the
tokens of examples of TEST_SIZES symbols): lengths count tokens, sizes count input symbols.

  python -m experiments.run --config=configs/algorithmic.py:quick --workdir=runs/algorithmic
      4 tasks (one regular, one context-free, two context-sensitive) x 3 variants, 1 seed, tested
      up to 200 symbols. 8 to 16 minutes with --parallel=2 on 2 idle CPU cores (target: 25).
      `make results` runs it with --seeds=3 (36 runs): whether a task is learned, and how far
      it generalises, varies with the seed (docs/results.md).
  python -m experiments.run --config=configs/algorithmic.py:full --workdir=runs/algorithmic
      all 10 tasks x every attention type x each compatible position x 3 seeds, tested up to 500
      symbols: about 600 runs, for GPUs (--sweep_index spreads them over an array job).
"""

from configs import base
from configs import sweeps
from research.data import algorithmic
from research.data import tasks

TRAIN_SIZES = (1, 40)
TEST_SIZES = {"quick": (40, 100, 200), "full": (40, 50, 100, 200, 300, 400, 500)}
QUICK_TASKS = ("parity_check", "stack_manipulation", "duplicate_string", "bucket_sort")
QUICK_VARIANTS = (("mha", "rope"), ("mha", "alibi"), ("mamba", "none"))


def task_lengths(task, preset):
  """train.seq_len and eval.lengths (tokens) of `task` for the preset's sizes (symbols)."""
  inputs_for_size = tasks.TASKS[task].inputs_for_size
  return (inputs_for_size(TRAIN_SIZES[1]),
          tuple(inputs_for_size(size) for size in TEST_SIZES[preset]))


def get_config(preset="quick"):
  base.check_preset(preset)
  config = base.get_config()
  quick = preset == "quick"
  alphabet = max(a.alphabet for a in algorithmic.SUITE.values())
  config.data.update(dict(name=QUICK_TASKS[0], task_vocab_size=alphabet,
                          train_min_length=TRAIN_SIZES[0], train_max_length=TRAIN_SIZES[1],
                          num_train_examples=20_000 if quick else 100_000,
                          num_eval_examples=128 if quick else 256))
  config.model.update(dict(num_layers=2 if quick else 5, d_model=64 if quick else 256))
  seq_len, lengths = task_lengths(config.data.name, preset)
  config.train.update(dict(seq_len=seq_len, batch_size=32 if quick else 128,
                           num_steps=500 if quick else 10_000, learning_rate=1e-3,
                           warmup_steps=50 if quick else 1000, log_every=100,
                           checkpoint_every=500 if quick else 2000))
  config.eval.update(dict(lengths=lengths, batch_size=32))
  if not quick:  # learned positions (full sweep): a row for every position any task reaches
    config.model.learned.max_length = max(max(task_lengths(task, preset)[1])
                                          for task in algorithmic.SUITE)
  return config


def get_sweep(preset="quick"):
  base.check_preset(preset)
  quick = preset == "quick"
  task_names = QUICK_TASKS if quick else tuple(algorithmic.SUITE)
  variants = QUICK_VARIANTS if quick else sweeps.every_variant()
  seeds = (0,) if quick else (0, 1, 2)
  return [{"data.name": task, "train.seq_len": task_lengths(task, preset)[0],
           "eval.lengths": task_lengths(task, preset)[1], "model.attention": attention,
           "model.position": position, "train.seed": seed}
          for task in task_names for attention, position in variants for seed in seeds]
