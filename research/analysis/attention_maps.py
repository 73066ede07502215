"""Attention maps of the softmax layers (mha, mqa, gqa, fox, and those of a hybrid; any position
scheme): the attention probabilities of every layer x head on a text (--text) or on [A; A], A
random tokens (maps.png), and the attention mass by distance in log-spaced buckets at 1x and 8x
the training length (distance.png, distance.csv), on validation text for language modeling,
random tokens for tasks; newest checkpoint. Jain & Wallace's caveat (arXiv:1902.10186) is written
beside every map.
"""

import dataclasses
import os

import numpy as np

from research import data
from research.model import positions
from research.analysis import base
from research.analysis import heads
from research.analysis import plots as head_plots
from research.analysis import trained
from research.data import tokenizer


def attention_maps(run: trained.Checkpoints, name: str, out: str,
                   settings: base.Settings) -> list[dict]:
  config = run.config
  layers = base.map_layers(config)
  step, state = run.state()
  if settings.text:
    if not data.is_text(config):
      raise ValueError(f"--text needs a text run; {name} is the task "
                       f"{config.data.name!r} (leave --text empty for random tokens)")
    text_tokens = tokenizer.get(config)
    tokens = np.asarray([text_tokens.encode(settings.text)], np.int32)
    table = positions.max_length(config.model)
    if table is not None and tokens.shape[1] > table:
      raise ValueError(f"--text has {tokens.shape[1]} tokens, more than the {table} positions of "
                       f"the {config.model.position!r} table")
    shown, labels = {"inputs": tokens}, [text_tokens.label(t) for t in tokens[0]]
  else:
    shown, _ = base.repeated(config, dataclasses.replace(settings, num_sequences=1))
    labels = None
  weights = run.attention_weights(state, shown)
  head_plots.save(head_plots.attention_grid({i: weights[i][0] for i in layers}, labels,
                                            f"{name} (step {step})"),
                  os.path.join(out, "maps.png"))

  rows, masses, skipped = [], {}, []
  table = positions.max_length(config.model)
  for factor in settings.length_factors:
    length = factor * config.train.seq_len
    if table is not None and length > table:
      skipped.append(f"{factor}x ({length} tokens: beyond the {table} positions of the table)")
      continue
    batches, source = base.windows(config, length, settings)
    sums = {i: 0.0 for i in layers}
    for batch in batches:
      for i, w in enumerate(run.attention_weights(state, batch)):
        if i in layers:
          sums[i] = sums[i] + heads.mass_by_distance(w)
    buckets = heads.distance_buckets(length - 1)
    for i in layers:
      mass = sums[i] / len(batches)
      masses[factor, i] = (heads.bucket_mass(mass, buckets), heads.mean_distance(mass))
      for h in range(mass.shape[0]):
        common = {"run": name, "step": step, "layer": i, "head": h, "eval_length": length,
                  "text": source}
        rows += [dict(common, measure="mass", distance_low=low, distance_high=high,
                      value=float(m)) for (low, high), m in zip(buckets, masses[factor, i][0][h])]
        rows.append(dict(common, measure="mean_distance", distance_low="", distance_high="",
                         value=float(masses[factor, i][1][h])))
  base.write_csv(os.path.join(out, "distance.csv"), rows)
  factors = [f for f in settings.length_factors if (f, layers[0]) in masses]
  head_plots.save(head_plots.distance_mass(
      {(f, i): m[0] for (f, i), m in masses.items()}, heads.distance_buckets(
          max(factors) * config.train.seq_len - 1), config.train.seq_len,
      f"{name} (step {step})"), os.path.join(out, "distance.png"))

  what = "the text given" if settings.text else (
      f"[A; A], A {config.train.seq_len // 2} random tokens")
  lines = [f"# Attention maps: {name}", "",
           f"Checkpoint step {step}; {config.model.attention} with {config.model.position}, "
           f"{config.model.num_layers} layers x {config.model.num_heads} heads, trained at "
           f"{config.train.seq_len} tokens.", "",
           f"- `maps.png`: attention probabilities of every layer x head on {what} (query rows, "
           "key columns; colour: square root of the probability).",
           f"- `distance.png`, `distance.csv`: attention mass by distance i - j in log-spaced "
           f"buckets, the mean over {settings.num_sequences} sequences of {source} and their "
           f"queries, at {', '.join(f'{f}x' for f in factors)} the training length.", ""]
  if skipped:
    lines += [f"Not evaluated: {'; '.join(skipped)}.", ""]
  header = ["layer", "head"] + [f"mean distance {f}x" for f in factors] + [
      f"mass at d=0 / d=1 ({factors[0]}x)"]
  lines += base.table(header, [[i, h] + [float(masses[f, i][1][h]) for f in factors]
                           + [f"{masses[factors[0], i][0][h][0]:.2f} / "
                              f"{masses[factors[0], i][0][h][1]:.2f}"]
                           for i in layers for h in range(config.model.num_heads)])
  lines += ["", base.CAVEAT]
  base.write_summary(os.path.join(out, "summary.md"), lines)
  return rows


class AttentionMaps(base.Analysis):
  name = "attention_maps"
  csv_name = "distance.csv"
  needs_attention_maps = True

  run = staticmethod(attention_maps)

  @classmethod
  def compare(cls, rows, out):
    head_plots.save(head_plots.mean_distance_by_run(rows), os.path.join(out, "distance.png"))
    return ["`distance.png`: the mean attention distance of every head (dots) and its mean "
            "over heads (bars), per run, at each evaluated length.", "", base.CAVEAT]
