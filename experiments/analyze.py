"""What the heads of a trained run (or of every finished run of a sweep) do, from its checkpoints.

  python -m experiments.analyze --workdir='runs/demo/runs/attention=mha,position=rope' \
      --analysis=attention_maps [--text='def main(argv):']
  python -m experiments.analyze --workdir=runs/heads --analysis=induction,attention_maps
  python -m experiments.analyze --workdir=runs/demo --analysis=explanation
  python -m experiments.analyze --workdir=runs/gqa --analysis=uptraining,head_importance

Analyses (research.analysis.analyze): attention_maps (every layer x head's attention on --text or
on a repeated random sequence, and the attention mass by distance at 1x and 8x the training length;
softmax attention only), induction (induction, previous-token and in-context-learning scores at
every kept checkpoint; see train.keep_checkpoints_at), head_importance (Michel et al.'s head
importance and iterative pruning against random order; for GQA also by key/value group),
explanation (Jain & Wallace's tests: Kendall's tau between attention and gradient importance,
and the output change when attention is permuted), uptraining (perplexity against decode-cache
bytes of runs trained from scratch, converted from MHA by train.init_from, or uptrained; see
configs/gqa_uptraining.py). Each writes RUN/analysis/<name>/: PNG
figures, a CSV and summary.md; a sweep also gets DIR/analysis/<name>/ comparing its runs.
"""

from absl import flags
from absl import logging

from experiments import cli
from research.analysis import analyze

_WORKDIR = cli.workdir_flag("A trained run (config.json, checkpoints/) or a "
                            "sweep (sweep.json): each finished run is analysed.")
_ANALYSIS = flags.DEFINE_list("analysis", None, f"Analyses to run: {', '.join(analyze.ANALYSES)}.")
_TEXT = flags.DEFINE_string("text", "", "attention_maps: the text to map (byte-level runs); "
                            "empty: [A; A], A random tokens.")
_NUM_SEQUENCES = flags.DEFINE_integer("num_sequences", analyze.Settings.num_sequences,
                                      "Sequences each measure averages over.")
_LENGTH_FACTORS = flags.DEFINE_list("length_factors", ["1", "8"], "attention_maps: lengths of "
                                    "the distance mass, as multiples of train.seq_len.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random tokens and the random pruning order.")
_PRUNE_FRACTION = flags.DEFINE_float(
    "prune_fraction", analyze.Settings.prune_fraction,
    "head_importance: share of the remaining heads removed in each round, in (0, 1).")
_NUM_PERMUTATIONS = flags.DEFINE_integer(
    "num_permutations", analyze.Settings.num_permutations,
    "explanation: random permutations of each attention row (the paper: 100).")
flags.mark_flags_as_required(["workdir", "analysis"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  try:
    factors = tuple(int(f) for f in _LENGTH_FACTORS.value)
  except ValueError:
    factors = ()
  if not factors or min(factors) < 1:
    raise ValueError(f"--length_factors={','.join(_LENGTH_FACTORS.value)} must be positive "
                     "integers, e.g. 1,8")
  if not 0 < _PRUNE_FRACTION.value < 1:
    raise ValueError(f"--prune_fraction={_PRUNE_FRACTION.value} must be in (0, 1): the share of "
                     "the remaining heads removed in each round, e.g. 0.1")
  if _NUM_SEQUENCES.value < 1:
    raise ValueError(f"--num_sequences={_NUM_SEQUENCES.value} must be >= 1")
  if _NUM_PERMUTATIONS.value < 1:
    raise ValueError(f"--num_permutations={_NUM_PERMUTATIONS.value} must be >= 1")
  settings = analyze.Settings(text=_TEXT.value, num_sequences=_NUM_SEQUENCES.value,
                              length_factors=factors, seed=_SEED.value,
                              prune_fraction=_PRUNE_FRACTION.value,
                              num_permutations=_NUM_PERMUTATIONS.value)
  written = analyze.analyze(_WORKDIR.value, _ANALYSIS.value, settings,
                            log=lambda line: print(line, flush=True))
  print(f"wrote {', '.join(written)}", flush=True)


if __name__ == "__main__":
  cli.run(main)
