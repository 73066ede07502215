"""State tracking: which recurrent mixers can count modulo 2 and walk a cycle of 5, and keep doing
it past the training length (Grazzi et al. arXiv:2411.12537; Gated DeltaProduct, Siems et al.
arXiv:2502.10297, Section 4).

The claim tested: a diagonal or delta-rule transition with eigenvalues in [0, 1] cannot track
parity; allowing eigenvalues in [-1, 1] (beta in (0, 2)) can, with one reflection per token; a
cycle of 5 (the cyclic group Z5: a rotation by 2 pi / 5 per step) needs a product of two
reflections per token, which Gated DeltaProduct's two Householder steps give and DeltaNet's one
does not. Tasks: parity_check and cycle_navigation of the algorithmic suite
(research/data/algorithmic.py), trained on U(1, 40) symbols and tested at 40, 100, 200 (quick)
symbols; accuracy of the answer token, as configs/algorithmic.py.

  python -m experiments.run --config=configs/state_tracking.py:quick --workdir=runs/state
      2 tasks x 5 variants (mha with RoPE as the softmax point of comparison; deltanet with beta
      in (0, 1) and in (0, 2); gated_deltaproduct with and without its forget gate), 1 seed,
      2 layers of width 64, 500 steps of 32: 10 runs for 2 CPU cores. Learning parity is an
      abrupt transition, so `make results` runs it with --seeds=3 (30 runs; docs/results.md).
  python -m experiments.run --config=configs/state_tracking.py:full --workdir=runs/state
      the same variants at the algorithmic suite's full size (5 layers, width 256, 10,000
      steps), 3 seeds, tested up to 500 symbols: for GPUs.
"""

from configs import algorithmic
from configs import base

TASKS = ("parity_check", "cycle_navigation")
VARIANTS = (
    {"model.attention": "mha", "model.position": "rope"},
    {"model.attention": "deltanet", "model.position": "none"},
    {"model.attention": "deltanet", "model.position": "none",
     "model.deltanet.allow_neg_eigval": True},
    {"model.attention": "gated_deltaproduct", "model.position": "none"},
    {"model.attention": "gated_deltaproduct", "model.position": "none",
     "model.gated_deltaproduct.use_forget_gate": False},
)


def get_config(preset="quick"):
  config = algorithmic.get_config(preset)
  # No member takes learned positions, whose table the algorithmic suite's full preset sizes.
  config.model.learned.max_length = base.get_config().model.learned.max_length
  return config


def get_sweep(preset="quick"):
  base.check_preset(preset)
  seeds = (0,) if preset == "quick" else (0, 1, 2)
  return [{"data.name": task, "train.seq_len": algorithmic.task_lengths(task, preset)[0],
           "eval.lengths": algorithmic.task_lengths(task, preset)[1], **variant, "train.seed": seed}
          for task in TASKS for variant in VARIANTS for seed in seeds]
