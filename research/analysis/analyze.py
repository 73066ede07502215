"""Analyses of what a trained run's heads do, from its checkpoints (python -m experiments.analyze).

  attention_maps  softmax layers (mha, mqa, gqa; any position scheme, and the softmax layers of a
                  hybrid): the attention probabilities of every layer x head on a text (--text)
                  or on [A; A], A random tokens (maps.png), and the attention mass by distance in
                  log-spaced buckets at 1x and 8x the training length (distance.png,
                  distance.csv), on validation text for language modeling, random tokens for
                  tasks; newest checkpoint.
  induction       at every kept checkpoint (train.keep_checkpoints_at keeps log-spaced ones):
                  the induction and previous-token scores of every head on [A; A]
                  (A = train.seq_len / 2 random tokens) and, for language modeling, the
                  in-context-learning score on validation windows of train.seq_len tokens
                  (research.analysis.heads); mixers without maps (linear, retention, mamba) get the
                  ICL
                  score alone (scores.csv, induction.png).
  head_importance mixers with heads (softmax, linear attention, retention): each head's
                  importance I_h = E |dL/dxi_h| for a head mask xi (Michel et al.,
                  arXiv:1905.10650; research.analysis.heads), then iterative pruning by importance
                  against random order: perplexity (accuracy for tasks) against the fraction
                  of heads removed (pruning.png, pruning.csv, importance.csv); for
                  grouped-query runs also by whole key/value groups (order kv_groups); newest
                  checkpoint.
  explanation     softmax layers: attention as explanation (Jain & Wallace, arXiv:1902.10186)
                  for the prediction after the last position of --num_sequences validation
                  windows (random tokens for tasks) of train.seq_len: per example and head,
                  Kendall's tau between the head's attention row from the last position and the
                  gradient-times-input importance of the same tokens, and the median total
                  variation distance of the output distribution when that row is permuted over
                  its visible keys (--num_permutations); explanation.png, explanation.csv;
                  newest checkpoint.
  uptraining      any run: validation perplexity at the training length (its evaluation,
                  research.evaluation.extrapolation) against decode-cache bytes at that length, and
                  how the
                  run came to be: trained from scratch, converted from another run's MHA by
                  mean-pooling key/value heads (train.init_from, 0 steps), or uptrained after
                  the conversion (Ainslie et al., arXiv:2305.13245; configs/gqa_uptraining.py);
                  over a sweep, one table and figure (uptraining.csv, uptraining.png).
Each writes RUN/analysis/<name>/ (figures, a tidy CSV, summary.md); over a sweep, every finished
run's, then DIR/analysis/<name>/ compares the runs (all runs' rows in one CSV, a figure,
summary.md). Everything is computed with the xla softmax backend (the same function as the
others, to rounding) in float32 probabilities (research.attention.softmax.attention_weights).
"""

import csv
import dataclasses
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from research import defaults
from research import attention
from research.runs import checkpoints
from research.runs import config_fields
from research import data
from research.evaluation import results as eval_results
from research.evaluation import evaluate
from research.evaluation import generate
from research.analysis import plots as head_plots
from research.analysis import heads
from research.training import init_from
from research import model as model_lib
from research import positions
from research import sharding
from research.runs import workdirs
from research.attention import masks

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


def _map_layers(config) -> list[int]:
  """Indices of the layers whose mixer has attention maps."""
  return [i for i, name in enumerate(model_lib.layer_types(config.model))
          if attention.REGISTRY.lookup(name).has_attention_weights]


def _multi_head_variants() -> list[str]:
  """The registered mixers whose output mixes heads (research.analysis.heads.output_projections)."""
  def has_heads(name):
    model_config = defaults.get_config().model
    model_config.update(dict(attention=name, position="none", layer_pattern=()))
    model = nnx.eval_shape(lambda: model_lib.build_model(model_config, rngs=nnx.Rngs(0)))
    return any(heads.output_projections(model))

  return [name for name in attention.REGISTRY if has_heads(name)]


def _no_maps(config) -> str:
  types = sorted(set(model_lib.layer_types(config.model)))
  return (f"its mixer ({', '.join(types)}) has no attention maps; the variants that have them: "
          f"{', '.join(softmax_variants())}")


class Checkpoints:
  """A run's config (softmax backend xla) and its model at any kept checkpoint, on one device;
  functions jitted once for all checkpoints."""

  def __init__(self, run_dir: str, log: Callable[[str], None]):
    self.directory, self.log = run_dir, log
    self.config = config_fields.load_saved(run_dir)
    self.config.model.attention_backend = "xla"
    self.steps = checkpoints.steps(run_dir)
    if not self.steps:
      raise FileNotFoundError(f"{run_dir} has no checkpoint; train it first (python -m "
                              "experiments.train with this --workdir)")
    self.mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
    self.graphdef = None
    self._weights, self._eval_step, self._masked = None, None, None
    self._importance, self._permuted = None, None

  def state(self, step: int | None = None):
    """(step, state) of checkpoint `step` (None: the newest readable one)."""
    step, model = generate.restore(self.config, self.directory, log=self.log, step=step)
    self.graphdef, state = nnx.split(model)
    return step, state

  def attention_weights(self, state, batch: dict) -> list:
    """Per layer, numpy [B, N, L, L] probabilities, None for a layer without maps."""
    if self._weights is None:
      graphdef = self.graphdef
      self._weights = jax.jit(lambda s, b: nnx.merge(graphdef, s).attention_weights(
          b["inputs"], b.get("positions"), b.get("segments")))
    return [None if w is None else np.asarray(w) for w in self._weights(state, batch)]

  def masked_gradient(self, state, mask_LxN: np.ndarray, batch: dict):
    """(dL/d mask, (nll sum, correct, tokens)) of the batch's mean loss with the head mask."""
    if self._masked is None:
      graphdef = self.graphdef

      def mean_loss(mask, state, batch):
        model = nnx.merge(graphdef, state, copy=True)  # its own Variables, which the mask sets
        heads.mask_heads(model, mask)
        logits = evaluate.apply(model, batch)
        weights = batch["loss_mask"]
        nll = (optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
               * weights).sum()
        correct = ((jnp.argmax(logits, -1) == batch["targets"]) * weights).sum()
        tokens = weights.sum()
        return nll / jnp.maximum(tokens, 1.0), (nll, correct, tokens)

      self._masked = jax.jit(jax.grad(mean_loss, has_aux=True))
    return self._masked(jnp.asarray(mask_LxN, jnp.float32), state, batch)

  def gradient_importance(self, state, batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """(importance [B, L]: |e_j . d p_y / d e_j|, the predicted next token y's probability after
    the last position against each input embedding e_j; the output distribution there [B, V])."""
    if self._importance is None:
      graphdef = self.graphdef

      def predicted_probability(offset_BxLxD, state, batch):
        logits = nnx.merge(graphdef, state).probe(
            batch["inputs"], batch.get("positions"), batch.get("segments"),
            input_offset_BxLxD=offset_BxLxD)
        probs_BxV = jax.nn.softmax(logits[:, -1])
        predicted_B = jnp.argmax(probs_BxV, axis=-1)
        return jnp.take_along_axis(probs_BxV, predicted_B[:, None], axis=-1).sum(), probs_BxV

      def importance(state, batch):
        table_VxD = nnx.merge(graphdef, state).embed.embedding[...]
        embedded_BxLxD = jnp.take(table_VxD, batch["inputs"], axis=0)
        grad_BxLxD, probs_BxV = jax.grad(predicted_probability, has_aux=True)(
            jnp.zeros_like(embedded_BxLxD), state, batch)
        return jnp.abs((grad_BxLxD * embedded_BxLxD).sum(-1)), probs_BxV

      self._importance = jax.jit(importance)
    importance_BxL, probs_BxV = self._importance(state, batch)
    return np.asarray(importance_BxL), np.asarray(probs_BxV)

  def permuted_outputs(self, state, batch: dict, layer: int, head: int,
                       keys: jax.Array) -> np.ndarray:
    """[K, B, V]: the output distribution after the last position with the last query's
    attention row of `head` in `layer` permuted over its visible keys, one permutation per key."""
    if self._permuted is None:
      graphdef = self.graphdef

      def permuted(state, batch, layer, head, keys):
        def output(key):
          def edit(probs_BxNxTxS, mask):
            rows_BxS = probs_BxNxTxS[:, head, -1]
            visible_BxS = jnp.broadcast_to(mask[:, 0, -1], rows_BxS.shape)
            shuffled_BxS = jax.vmap(heads.permute_visible)(
                rows_BxS, visible_BxS, jax.random.split(key, rows_BxS.shape[0]))
            return probs_BxNxTxS.at[:, head, -1].set(shuffled_BxS)

          logits = nnx.merge(graphdef, state).probe(
              batch["inputs"], batch.get("positions"), batch.get("segments"),
              edit_attention={layer: edit})
          return jax.nn.softmax(logits[:, -1])

        return jax.lax.map(output, keys)  # one permutation at a time: memory of one forward

      self._permuted = jax.jit(permuted, static_argnums=2)
    return np.asarray(self._permuted(state, batch, layer, head, keys))

  def loss_by_position(self, state, length: int) -> np.ndarray:
    """The mean loss at each position of non-overlapping validation windows of `length`."""
    if self._eval_step is None:
      self._eval_step = evaluate.make_eval_step(self.graphdef)
    with jax.set_mesh(self.mesh):
      sums = evaluate.row_sums(self._eval_step, state,
                               data.eval_batches(self.config, length, "nonoverlapping"),
                               self.mesh, self.config.eval.batch_size)
    with np.errstate(invalid="ignore", divide="ignore"):
      return sums["nll_by_position"] / sums["tokens_by_position"]


def _token_range(config) -> int:
  """Token ids that random sequences draw from: the bytes, or a task's symbols."""
  return 256 if data.is_language_modeling(config) else config.data.task_vocab_size


def _repeated(config, settings: Settings) -> tuple[dict, int]:
  """({"inputs": [A; A] rows}, period) at the training length."""
  period = max(2, config.train.seq_len // 2)
  rng = np.random.default_rng(settings.seed)
  return {"inputs": heads.repeated_random_tokens(rng, settings.num_sequences, period,
                                                 _token_range(config))}, period


def _windows(config, length: int, settings: Settings) -> tuple[list[dict], str]:
  """(batches of one sequence of `length` tokens, what they are): validation windows for
  language modeling, random tokens for tasks."""
  if not data.is_language_modeling(config):
    rng = np.random.default_rng(settings.seed)
    tokens = rng.integers(0, _token_range(config), (settings.num_sequences, length), np.int32)
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


def _write_csv(path: str, rows: list[dict]):
  columns = list(dict.fromkeys(k for row in rows for k in row))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, columns)
    writer.writeheader()
    writer.writerows(rows)


def _write_summary(path: str, lines: list[str]):
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def _table(header: list[str], rows: list[list]) -> list[str]:
  cell = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
  return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
          + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


# ---- attention_maps


def attention_maps(run: Checkpoints, name: str, out: str, settings: Settings) -> list[dict]:
  config = run.config
  layers = _map_layers(config)
  step, state = run.state()
  if settings.text:
    if data.vocab_size(config) != data.BYTE_VOCAB_SIZE:
      raise ValueError(f"--text needs a byte-level run; {name} is the task "
                       f"{config.data.name!r} (leave --text empty for random tokens)")
    tokens = np.asarray([generate.encode(settings.text)], np.int32)
    table = positions.max_length(config.model)
    if table is not None and tokens.shape[1] > table:
      raise ValueError(f"--text has {tokens.shape[1]} bytes, more than the {table} positions of "
                       f"the {config.model.position!r} table")
    shown, labels = {"inputs": tokens}, [chr(t) if 32 <= t < 127 else "·" for t in tokens[0]]
  else:
    shown, _ = _repeated(config, dataclasses.replace(settings, num_sequences=1))
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
    batches, source = _windows(config, length, settings)
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
  _write_csv(os.path.join(out, "distance.csv"), rows)
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
  lines += _table(header, [[i, h] + [float(masses[f, i][1][h]) for f in factors]
                           + [f"{masses[factors[0], i][0][h][0]:.2f} / "
                              f"{masses[factors[0], i][0][h][1]:.2f}"]
                           for i in layers for h in range(config.model.num_heads)])
  lines += ["", CAVEAT]
  _write_summary(os.path.join(out, "summary.md"), lines)
  return rows


# ---- induction


def induction(run: Checkpoints, name: str, out: str, settings: Settings) -> list[dict]:
  config = run.config
  layers = _map_layers(config)
  language = data.is_language_modeling(config)
  repeated, period = _repeated(config, settings)
  rows = []
  for step in run.steps:
    _, state = run.state(step)
    if layers:
      weights = run.attention_weights(state, repeated)
      for i in layers:
        scores = {"induction": heads.induction_score(weights[i], period),
                  "previous_token": heads.previous_token_score(weights[i])}
        rows += [{"run": name, "step": step, "layer": i, "head": h, "measure": measure,
                  "value": float(values[h])}
                 for measure, values in scores.items() for h in range(len(values))]
    if language:
      icl = heads.icl_score(run.loss_by_position(state, config.train.seq_len))
      rows += [{"run": name, "step": step, "layer": "", "head": "", "measure": measure,
                "value": value} for measure, value in icl.items()]
    run.log(f"  {name}: step {step} done")
  _write_csv(os.path.join(out, "scores.csv"), rows)
  head_plots.save(head_plots.scores_over_training(rows, f"{name}"),
                  os.path.join(out, "induction.png"))

  last = run.steps[-1]
  early, late = heads.icl_positions(config.train.seq_len)
  lines = [f"# Induction heads over training: {name}", "",
           f"Checkpoints {', '.join(map(str, run.steps))}; {config.model.attention} with "
           f"{config.model.position}, {config.model.num_layers} layers x "
           f"{config.model.num_heads} heads.", ""]
  if layers:
    lines += [f"Induction score: on [A; A] ({settings.num_sequences} rows, A {period} random "
              "tokens), the mean attention from each token of the second copy to the token "
              "after its earlier occurrence (a uniform causal head scores "
              f"{np.mean(1 / np.arange(period + 1, 2 * period + 1)):.3f}); previous-token score:"
              " the mean attention to the token before.", ""]
    final = {(r["layer"], r["head"], r["measure"]): r["value"] for r in rows
             if r["step"] == last and r["head"] != ""}
    lines += _table(["layer", "head", f"induction (step {last})", "previous token"],
                    [[i, h, final[i, h, "induction"], final[i, h, "previous_token"]]
                     for i in layers for h in range(config.model.num_heads)]) + [""]
  else:
    lines += [f"No attention maps: {_no_maps(config)}; the ICL score alone.", ""]
  if language:
    icl = {r["step"]: r["value"] for r in rows if r["measure"] == "icl_score"}
    lines += [f"ICL score: mean loss at positions {late.start}-{late.stop - 1} minus at "
              f"{early.start}-{early.stop - 1} of validation windows of {config.train.seq_len} "
              "tokens (Olsson et al.'s 500th minus 50th token of 512, scaled): "
              + ", ".join(f"{icl[s]:+.3f} at step {s}" for s in run.steps) + "."]
  _write_summary(os.path.join(out, "summary.md"), lines)
  return rows


# ---- explanation


def _last_row_visible(config, batch: dict) -> np.ndarray:
  """[B, L] bool: the keys the last query of each row can see (window, sinks, documents)."""
  length = batch["inputs"].shape[1]
  index = np.arange(length)
  segments = batch.get("segments")
  settings = config.model.softmax
  document_index = (None if segments is None or not settings.sinks
                    else masks.positions_in_documents(segments))
  visible = masks.allowed(index[-1:], index, settings.window, settings.sinks,
                          None if segments is None else segments[:, -1:], segments,
                          document_index)
  return np.broadcast_to(np.asarray(visible)[:, 0, 0], batch["inputs"].shape)


def explanation(run: Checkpoints, name: str, out: str, settings: Settings) -> list[dict]:
  config = run.config
  layers = _map_layers(config)
  step, state = run.state()
  windows, source = _windows(config, config.train.seq_len, settings)
  batch = {key: np.concatenate([w[key] for w in windows]) for key in windows[0]}
  visible_BxL = _last_row_visible(config, batch)
  importance_BxL, probs_BxV = run.gradient_importance(state, batch)
  weights = run.attention_weights(state, batch)
  keys = jax.random.split(jax.random.key(settings.seed), settings.num_permutations)
  rows = []
  for layer in layers:
    for head in range(config.model.num_heads):
      permuted_KxBxV = run.permuted_outputs(state, batch, layer, head, keys)
      tvd_B = np.median(heads.total_variation(permuted_KxBxV, probs_BxV[None]), axis=0)
      for b, visible in enumerate(visible_BxL):
        row = weights[layer][b, head, -1][visible]
        common = {"run": name, "step": step, "example": b, "layer": layer, "head": head}
        rows += [dict(common, measure=measure, value=float(value)) for measure, value in (
            ("kendall_tau", heads.kendall_tau(row, importance_BxL[b][visible])),
            ("permutation_tvd", tvd_B[b]), ("max_attention", row.max()))]
    run.log(f"  {name}: layer {layer} done")
  _write_csv(os.path.join(out, "explanation.csv"), rows)
  head_plots.save(head_plots.explanation(rows, f"{name} (step {step})"),
                  os.path.join(out, "explanation.png"))

  values = lambda measure, **match: np.asarray(
      [r["value"] for r in rows if r["measure"] == measure
       and all(r[k] == v for k, v in match.items())])
  taus, tvds = values("kendall_tau"), values("permutation_tvd")
  lines = [f"# Attention as explanation: {name}", "",
           f"Checkpoint step {step}; {config.model.attention} with {config.model.position}; "
           f"{len(windows)} windows of {config.train.seq_len} tokens of {source}; the prediction "
           "after each window's last position (Jain & Wallace, arXiv:1902.10186).", "",
           "- Kendall's tau-b, per example and head, between the head's attention row from the "
           "last position and the gradient-times-input importance |e_j . d p_y / d e_j| of the "
           "same tokens (p_y: the probability of the predicted token; over the keys the row "
           "sees). A head in a later layer attends to hidden states, which mix earlier tokens, "
           "as the paper's encoder states do.",
           f"- Permutation: the row permuted over its visible keys ({settings.num_permutations} "
           "permutations), every other head and position as they were; the median total "
           "variation distance between the output distributions with and without.", "",
           f"Over all {len(taus)} (example, head) pairs: median tau {np.nanmedian(taus):+.3f} "
           f"(interquartile {np.nanpercentile(taus, 25):+.3f} to "
           f"{np.nanpercentile(taus, 75):+.3f}); median permutation TVD {np.median(tvds):.4f}, "
           f"below 0.01 for {np.mean(tvds < 0.01):.0%} of the pairs.", ""]
  lines += _table(["layer", "head", "median tau", "median permutation TVD",
                   "median max attention"],
                  [[layer, head, float(np.nanmedian(values("kendall_tau", layer=layer, head=head))),
                    float(np.median(values("permutation_tvd", layer=layer, head=head))),
                    float(np.median(values("max_attention", layer=layer, head=head)))]
                   for layer in layers for head in range(config.model.num_heads)])
  lines += ["", CAVEAT]
  _write_summary(os.path.join(out, "summary.md"), lines)
  return rows


# ---- head_importance


def _masked_evaluation(run: Checkpoints, state, mask_LxN, batches):
  """(importance E_batches |dL/d mask| [layers, N], loss, accuracy) on `batches`."""
  importance, nll, correct, tokens = 0.0, 0.0, 0.0, 0.0
  for batch in batches:
    grad, (batch_nll, batch_correct, batch_tokens) = run.masked_gradient(state, mask_LxN, batch)
    importance = importance + np.abs(np.asarray(grad))
    nll, correct = nll + float(batch_nll), correct + float(batch_correct)
    tokens += float(batch_tokens)
  return importance / len(batches), nll / tokens, correct / tokens


def head_importance(run: Checkpoints, name: str, out: str, settings: Settings) -> list[dict]:
  config = run.config
  step, state = run.state()
  model = nnx.merge(run.graphdef, state)
  projections = heads.output_projections(model)
  has_heads = np.asarray([p is not None for p in projections])
  num_heads = config.model.num_heads
  heads_alive = np.repeat(has_heads[:, None], num_heads, axis=1)
  group_sizes = [size if headed else 1
                 for size, headed in zip(heads.kv_group_sizes(model), has_heads)]
  groups_alive = heads.groups_of_heads(heads_alive, group_sizes)
  # Group pruning where some layer shares key/value heads and has more than one of them.
  grouped = any(1 < size < num_heads for size, headed in zip(group_sizes, has_heads) if headed)
  batches = list(data.eval_batches(config, config.train.seq_len, "nonoverlapping"))
  total, total_groups = int(heads_alive.sum()), int(groups_alive.sum())
  rows, initial = [], None
  for order in ("importance", "random") + (("kv_groups",) if grouped else ()):
    rng = np.random.default_rng(settings.seed)
    alive, groups = heads_alive.copy(), groups_alive.copy()
    while True:
      importance, loss, accuracy = _masked_evaluation(run, state, alive, batches)
      scores = heads.normalise_per_layer(importance)
      if initial is None:
        initial = np.where(heads_alive, scores, np.nan)
      rows.append({"run": name, "step": step, "order": order,
                   "heads_removed": total - int(alive.sum()),
                   "fraction_removed": float(1 - alive.sum() / total),
                   "kv_heads_removed": total_groups - int(groups.sum()) if grouped else "",
                   "loss": loss,
                   "perplexity": float(np.exp(min(loss, 700.0))), "accuracy": accuracy})
      if order == "kv_groups":
        removed = heads.heads_to_remove(heads.group_scores(scores, group_sizes), groups,
                                        settings.prune_fraction)
        for layer, group in removed:
          groups[layer, group] = False
        alive = heads.heads_of_groups(groups, group_sizes, num_heads) & heads_alive
      else:
        removed = heads.heads_to_remove(
            scores if order == "importance" else rng.random(alive.shape), alive,
            settings.prune_fraction)
        for layer, head in removed:
          alive[layer, head] = False
        groups = heads.groups_of_heads(alive, group_sizes)
      if not removed:
        break
    run.log(f"  {name}: {order} order pruned to {int(alive.sum())} heads")
  importance_rows = [{"run": name, "step": step, "layer": l, "head": h,
                      "importance": float(initial[l, h])}
                     for l in np.nonzero(has_heads)[0] for h in range(config.model.num_heads)]
  _write_csv(os.path.join(out, "pruning.csv"), rows)
  _write_csv(os.path.join(out, "importance.csv"), importance_rows)
  metric = "perplexity" if data.is_language_modeling(config) else "accuracy"
  head_plots.save(head_plots.pruning(rows, initial, metric, f"{name} (step {step})"),
                  os.path.join(out, "pruning.png"))

  base = rows[0][metric]
  within = [r["fraction_removed"] for r in rows if r["order"] == "importance"
            and (r[metric] <= 1.05 * base if metric == "perplexity" else r[metric] >= base - 0.01)]
  lines = [f"# Head importance and pruning: {name}", "",
           f"Checkpoint step {step}; {total} heads in {int(has_heads.sum())} layers. Importance "
           "I_h = E |dL/dxi_h| of a head mask xi at the current mask (xi_h scales head h's "
           "output before the output projection), averaged over batches of "
           f"{config.eval.batch_size} validation windows of {config.train.seq_len} tokens and "
           "normalised per layer (l2) (Michel et al., arXiv:1905.10650). Pruning removes the "
           f"least important {settings.prune_fraction:.0%} of the remaining heads (at least "
           "one, never a layer's last), re-estimates, and repeats; against heads removed in a "
           "random order."
           + (" Order kv_groups prunes whole key/value groups (a group's score: the sum of its "
              "query heads' importances; never a layer's last group), which is what shrinks the "
              "decode cache; kv_heads_removed counts the key/value heads gone." if grouped
              else ""), "",
           f"- `pruning.png`, `pruning.csv`: {metric} against the fraction of heads removed.",
           "- `importance.csv`: each head's normalised importance in the full model.", "",
           f"Removable by importance with {metric} "
           + ("within 5% of the full model's" if metric == "perplexity" else
              "within 0.01 of the full model's") + f": {max(within):.0%} of the heads.", ""]
  lines += _table(["order", "heads removed", "fraction"] + (["kv heads removed"] if grouped
                                                             else []) + [metric],
                  [[r["order"], r["heads_removed"], f"{r['fraction_removed']:.2f}"]
                   + ([r["kv_heads_removed"]] if grouped else []) + [r[metric]] for r in rows])
  _write_summary(os.path.join(out, "summary.md"), lines)
  return rows + importance_rows


# ---- uptraining


def _stage(config) -> str:
  """How a run came to be: from scratch, converted (train.init_from, 0 steps) or uptrained."""
  if not config.train.init_from:
    return "from scratch"
  return "converted" if config.train.num_steps == 0 else "uptrained"


def uptraining(run: Checkpoints, name: str, out: str, settings: Settings) -> list[dict]:
  del settings
  config = run.config
  length = config.train.seq_len
  rows = [r for r in eval_results.latest(eval_results.read(run.directory))
          if r["eval_length"] == length and r["eval_mode"] == "nonoverlapping"
          and r.get("rope_scaling", "none") == "none" and r.get("depth") is None]
  if not rows:
    raise ValueError(f"{name} has no non-overlapping evaluation at its training length {length}; "
                     f"evaluate it first (python -m experiments.evaluate --workdir="
                     f"{run.directory})")
  source_steps = 0
  if config.train.init_from:
    source = config_fields.load_saved(init_from.source_directory(config, run.directory))
    source_steps = source.train.num_steps
  model = nnx.eval_shape(lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0)))
  kv_heads = {attention.REGISTRY.lookup(name).kv_heads(config.model)
              for name in model_lib.layer_types(config.model)} - {None}
  evaluation = rows[-1]
  row = {"run": name, "attention": config.model.attention,
         "kv_heads": ",".join(map(str, sorted(kv_heads))), "stage": _stage(config),
         "steps": config.train.num_steps, "total_steps": source_steps + config.train.num_steps,
         "perplexity": evaluation["perplexity"],
         "perplexity_ci_low": evaluation.get("perplexity_ci_low"),
         "perplexity_ci_high": evaluation.get("perplexity_ci_high"),
         "cache_bytes": int(model.cache_bytes(1, length)), "eval_length": length,
         "tokens": evaluation.get("tokens")}
  _write_csv(os.path.join(out, "uptraining.csv"), [row])
  _write_summary(os.path.join(out, "summary.md"), [
      f"# Perplexity and decode cache: {name}", "",
      f"{row['stage']}, {row['steps']} steps ({row['total_steps']} in all); perplexity "
      f"{row['perplexity']:.3f} at {length} tokens; decode cache {row['cache_bytes']} bytes per "
      f"sequence of {length} tokens."])
  return [row]


def _uptraining_summary(rows: list[dict]) -> list[str]:
  lines = ["Validation perplexity at the training length (non-overlapping windows, 95% "
           "bootstrap interval) against the decode cache of one sequence of that length. "
           "Converted: another run's MHA with each group's key and value heads mean-pooled "
           "(Ainslie et al., arXiv:2305.13245), before any training; uptrained: the same, "
           "trained on with a fresh optimizer; total steps count the MHA run's too.", ""]
  return lines + _table(
      ["run", "attention", "kv heads", "stage", "steps", "total steps", "perplexity",
       "95% interval", "cache bytes"],
      [[r["run"], r["attention"], r["kv_heads"], r["stage"], r["steps"], r["total_steps"],
        float(r["perplexity"]),
        "" if r["perplexity_ci_low"] is None else
        f"{r['perplexity_ci_low']:.3f}-{r['perplexity_ci_high']:.3f}", r["cache_bytes"]]
       for r in rows])


ANALYSES = {"attention_maps": attention_maps, "induction": induction,
            "head_importance": head_importance, "explanation": explanation,
            "uptraining": uptraining}


def problem(analysis: str, config) -> str | None:
  """Why `analysis` cannot run on a run of `config`, naming what can; None if it can."""
  if analysis in ("attention_maps", "explanation") and not _map_layers(config):
    return f"{analysis} needs attention maps, but {_no_maps(config)}"
  if analysis == "head_importance" and not any(
      heads.output_projections(nnx.eval_shape(
          lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0))))):
    return (f"head_importance needs a mixer with heads, but {config.model.attention} has none; "
            f"valid: {', '.join(_multi_head_variants())}")
  if analysis == "induction" and not _map_layers(config) and not data.is_language_modeling(config):
    return (f"induction needs attention maps or language modeling (the ICL score), but "
            f"{_no_maps(config)} and data.name={config.data.name!r} is a task")
  return None


def check_names(names: list[str]):
  unknown = [n for n in names if n not in ANALYSES]
  if unknown or not names:
    raise ValueError(f"unknown analysis {', '.join(unknown) or '(none given)'}; valid: "
                     f"{', '.join(ANALYSES)}")


def _finished(run: workdirs.Run) -> bool:
  saved = checkpoints.steps(run.directory)
  if not saved:
    return False
  return saved[-1] >= config_fields.load_saved(run.directory).train.num_steps


def analyze(workdir: str, names: list[str], settings: Settings = Settings(),
            log: Callable[[str], None] = print) -> list[str]:
  """Run the analyses `names` on the run in `workdir`, or on every finished run of the sweep in
  `workdir` (then compare them in DIR/analysis/<name>/); returns the directories written."""
  check_names(names)
  sweep = workdirs.is_sweep(workdir)
  runs = workdirs.runs(workdir)
  if sweep:
    unfinished = [run.name for run in runs if not _finished(run)]
    runs = [run for run in runs if run.name not in unfinished]
    if unfinished:
      log(f"not finished, left out: {', '.join(unfinished)}")
    if not runs:
      raise FileNotFoundError(f"no run of the sweep {workdir} is finished; run it first "
                              f"(python -m experiments.run with this --workdir)")
  written = []
  for analysis in names:
    rows, skipped = [], []
    for run in runs:
      reason = problem(analysis, config_fields.load_saved(run.directory))
      if reason and not sweep:
        raise ValueError(f"{run.name}: {reason}")
      if reason:
        skipped.append(f"{run.name}: {reason}")
        log(f"{run.name}: {analysis} skipped: {reason}")
        continue
      checkpointed = Checkpoints(run.directory, log)
      out = os.path.join(run.directory, "analysis", analysis)
      os.makedirs(out, exist_ok=True)
      log(f"{run.name}: {analysis}")
      rows += ANALYSES[analysis](checkpointed, run.name, out, settings)
      written.append(out)
    if sweep:
      if not rows:
        raise ValueError(f"{analysis}: no run of {workdir} could be analysed: "
                         f"{'; '.join(skipped)}")
      out = os.path.join(workdir, "analysis", analysis)
      os.makedirs(out, exist_ok=True)
      _compare(analysis, rows, skipped, out)
      written.append(out)
  return written


def _compare(analysis: str, rows: list[dict], skipped: list[str], out: str):
  """A sweep's runs side by side: all their rows, one figure, a summary."""
  csv_name = {"attention_maps": "distance.csv", "induction": "scores.csv",
              "head_importance": "pruning.csv", "explanation": "explanation.csv",
              "uptraining": "uptraining.csv"}[analysis]
  if analysis == "head_importance":
    rows = [r for r in rows if "order" in r]
  _write_csv(os.path.join(out, csv_name), rows)
  runs = list(dict.fromkeys(r["run"] for r in rows))
  lines = [f"# {analysis} across the sweep", "", f"Runs: {', '.join(runs)}; each run's own "
           f"figures and summary are in runs/<name>/analysis/{analysis}/.", ""]
  if analysis == "attention_maps":
    head_plots.save(head_plots.mean_distance_by_run(rows), os.path.join(out, "distance.png"))
    lines += ["`distance.png`: the mean attention distance of every head (dots) and its mean "
              "over heads (bars), per run, at each evaluated length.", "", CAVEAT]
  elif analysis == "head_importance":
    head_plots.save(head_plots.pruning_by_run(rows), os.path.join(out, "pruning.png"))
    lines += ["`pruning.png`: per run, perplexity (or accuracy) against the fraction of heads "
              "removed, by importance (solid), in random order (dashed) and, for grouped-query "
              "runs, by whole key/value groups (dotted)."]
  elif analysis == "uptraining":
    head_plots.save(head_plots.uptraining(rows), os.path.join(out, "uptraining.png"))
    lines += ["`uptraining.png`: perplexity (left) and decode-cache bytes (right) per run.", ""]
    lines += _uptraining_summary(rows)
  elif analysis == "explanation":
    head_plots.save(head_plots.explanation_by_run(rows), os.path.join(out, "explanation.png"))
    lines += ["`explanation.png`: per run, the distribution over (example, head) pairs of "
              "Kendall's tau between attention and gradient-times-input importance, and of the "
              "median output change (total variation distance) when the attention row is "
              "permuted (Jain & Wallace, arXiv:1902.10186).", "", CAVEAT]
  else:
    head_plots.save(head_plots.scores_by_run(rows), os.path.join(out, "induction.png"))
    lines += ["`induction.png`: per run, the largest induction score of any head and the ICL "
              "score at every kept checkpoint."]
  if skipped:
    lines += ["", "Skipped: " + "; ".join(skipped)]
  _write_summary(os.path.join(out, "summary.md"), lines)
