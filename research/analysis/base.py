"""What an analysis is, and the helpers the analyses share: the settings of the command line,
the inputs they measure on (validation windows, [A; A] rows of random tokens) and the files they
write (a tidy CSV, summary.md). Each analysis is one file and one registry line
(research/analysis/__init__.py)."""

import csv
import dataclasses

import numpy as np
from flax import nnx

from research.model import attention
from research import data
from research import defaults
from research.model import transformer as model_lib
from research.analysis import heads


# Jain & Wallace's caveat, written next to every attention-map figure.
CAVEAT = ("Attention weights show where a head reads from, not why the output is what it is: "
          "they can disagree with gradient-based importance, and other weights can give the same "
          "output (Jain & Wallace, arXiv:1902.10186).")


@dataclasses.dataclass(frozen=True)
class Settings:
  text: str = ""  # attention_maps: the text of the maps; "" for [A; A]
  num_sequences: int = 8  # sequences (windows or [A; A] rows) each measure averages over
  length_factors: tuple = (1, 8)  # attention_maps: distance mass at these x train.seq_len
  seed: int = 0  # of the random tokens and of the random pruning order
  prune_fraction: float = 0.1  # head_importance: share of the remaining heads removed per round
  num_permutations: int = 16  # explanation: random permutations of each attention row


def softmax_variants() -> list[str]:
  """The registered mixers that have attention maps."""
  return [name for name, cls in attention.REGISTRY.items() if cls.has_attention_weights]


def map_layers(config) -> list[int]:
  """Indices of the layers whose mixer has attention maps."""
  return [i for i, name in enumerate(model_lib.layer_types(config.model))
          if attention.REGISTRY.lookup(name).has_attention_weights]


def multi_head_variants() -> list[str]:
  """The registered mixers whose output mixes heads (research.analysis.heads.output_projections)."""
  def has_heads(name):
    model_config = defaults.get_config().model
    model_config.update(dict(attention=name, position="none", layer_pattern=()))
    model = nnx.eval_shape(lambda: model_lib.build_model(model_config, rngs=nnx.Rngs(0)))
    return any(heads.output_projections(model))

  return [name for name in attention.REGISTRY if has_heads(name)]


def no_maps(config) -> str:
  types = sorted(set(model_lib.layer_types(config.model)))
  return (f"its mixer ({', '.join(types)}) has no attention maps; the variants that have them: "
          f"{', '.join(softmax_variants())}")


def token_range(config) -> int:
  """Token ids that random sequences draw from: the bytes, or a task's symbols."""
  return 256 if data.is_language_modeling(config) else config.data.task_vocab_size


def repeated(config, settings: Settings) -> tuple[dict, int]:
  """({"inputs": [A; A] rows}, period) at the training length."""
  period = max(2, config.train.seq_len // 2)
  rng = np.random.default_rng(settings.seed)
  return {"inputs": heads.repeated_random_tokens(rng, settings.num_sequences, period,
                                                 token_range(config))}, period


def windows(config, length: int, settings: Settings) -> tuple[list[dict], str]:
  """(batches of one sequence of `length` tokens, what they are): validation windows for
  language modeling, random tokens for tasks."""
  if not data.is_language_modeling(config):
    rng = np.random.default_rng(settings.seed)
    tokens = rng.integers(0, token_range(config), (settings.num_sequences, length), np.int32)
    return [{"inputs": row[None]} for row in tokens], "random tokens"
  config = config.copy_and_resolve_references()
  config.eval.num_tokens = max(config.eval.num_tokens, length * settings.num_sequences)
  config.eval.batch_size = 1
  batches = []
  for batch in data.eval_batches(config, length, "nonoverlapping"):
    batches.append({k: v for k, v in batch.items() if k in ("inputs", "positions", "segments")})
    if len(batches) == settings.num_sequences:
      break
  return batches, "validation text"


def write_csv(path: str, rows: list[dict]):
  columns = list(dict.fromkeys(k for row in rows for k in row))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, columns)
    writer.writeheader()
    writer.writerows(rows)


def write_summary(path: str, lines: list[str]):
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def table(header: list[str], rows: list[list]) -> list[str]:
  cell = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


class Analysis:
  """One analysis of a trained run. `run` measures one run's checkpoints and writes its files in
  `out`, returning its tidy rows; `compare` draws the figure of a sweep's rows (all runs') into
  `out` and returns the summary lines that describe it; `problem` says why a run's config
  cannot be analysed (None when it can). An analysis keeps no state."""

  name = ""  # as registered
  csv_name = ""  # the tidy CSV a sweep's comparison writes
  needs_attention_maps = False  # a run whose mixers have no attention weights is refused

  @classmethod
  def problem(cls, config) -> str | None:
    if cls.needs_attention_maps and not map_layers(config):
      return f"{cls.name} needs attention maps, but {no_maps(config)}"
    return None

  @staticmethod
  def run(run, name: str, out: str, settings: Settings) -> list[dict]:
    raise NotImplementedError

  @classmethod
  def compared_rows(cls, rows: list[dict]) -> list[dict]:
    """The rows of a sweep's runs that the comparison shows and writes (all of them)."""
    return rows

  @classmethod
  def compare(cls, rows: list[dict], out: str) -> list[str]:
    raise NotImplementedError
