"""A trained run in a notebook: `research.load_run(workdir)`, a thin facade over the functions the
commands use, so that a notebook measures what they measure.

  run = load_run("runs/alibi")     its config, checkpoint step, model (one device) and tokenizer
  run.logits("def main():")        float32 [B, T, V]: the model's forward on the run's tokens
  run.loss("import os\\n")         mean next-token cross-entropy, nats
  run.generate("def ", 40)         text: research.evaluation.generate's prefill and decode
  run.evaluate(lengths=(128,))     rows of research.evaluation.extrapolation.evaluate_run
  run.attention_maps("x = 1")      {layer: [heads, T, T]} of the softmax layers

The model is restored from the newest complete checkpoint (or `step`) on one device, whatever
mesh the run trained on (generate.restore). Nothing is written into the run's directory:
`evaluate` runs evaluate_run on a scratch directory that links the run's checkpoints and returns
its rows rather than appending them to RUN/eval.json, where a notebook's settings (a smaller
eval.num_tokens, say) would replace the run's own rows of the same step, length and mode in its
results and figures (research.evaluation.results.latest); experiments.evaluate records rows.
"""

import os
import tempfile
from typing import Callable, Sequence

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx

from research import data
from research.data import tokenizer as tokenizers
from research.evaluation import extrapolation
from research.evaluation import generate
from research.model import sharding
from research.runs import checkpoints
from research.training import checks


class LoadedRun:
  """A trained run's config, checkpoint step, model and tokenizer, and what the commands measure
  with them; its forward and attention maps are jitted once per input shape."""

  def __init__(self, workdir: str, config: ml_collections.ConfigDict, step: int,
               model: nnx.Module, log: Callable[[str], None]):
    self.workdir, self.config, self.step, self.model, self.log = workdir, config, step, model, log
    self.tokenizer = tokenizers.get(config)
    graphdef, self._state = nnx.split(model)
    self._forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    self._attention = jax.jit(
        lambda state, tokens: nnx.merge(graphdef, state).attention_weights(tokens))
    self._generator = None  # made on the first generate, keeping its compiled functions

  def __repr__(self):
    return (f"LoadedRun({self.workdir!r}, step={self.step}, "
            f"{self.config.model.attention}/{self.config.model.position})")

  def _encode(self, text: str) -> np.ndarray:
    if not data.is_text(self.config):
      raise ValueError(f"data.name={self.config.data.name!r} is a synthetic task with its own "
                       "symbols, not text; give token ids instead")
    return self.tokenizer.encode(text)

  def _tokens(self, ids_or_text) -> np.ndarray:
    """int32 [B, T] of a text (its tokens) or of token ids [T] or [B, T], checked."""
    tokens = np.asarray(self._encode(ids_or_text) if isinstance(ids_or_text, str)
                        else ids_or_text)
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    vocab_size = self.config.model.vocab_size
    if tokens.ndim != 2 or not tokens.size or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"give a text or integer token ids of shape [T] or [B, T], not "
                       f"{tokens.dtype} of shape {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
      raise ValueError(f"token ids must be in [0, {vocab_size}) (model.vocab_size), not "
                       f"{tokens.min()}..{tokens.max()}")
    generate.check_positions(self.config.model, tokens.shape[1],
                             f"the input's {tokens.shape[1]} tokens")
    return tokens.astype(np.int32)

  def logits(self, ids_or_text) -> np.ndarray:
    """float32 [B, T, V]: the model's next-token logits at each position of a text (encoded with
    the run's tokenizer) or of token ids [T] or [B, T]."""
    return np.asarray(self._forward(self._state, self._tokens(ids_or_text)), np.float32)

  def loss(self, ids_or_text) -> float:
    """The mean next-token cross-entropy in nats over a text's (or ids') tokens after the first:
    the training loss of one window."""
    tokens = self._tokens(ids_or_text)
    if tokens.shape[1] < 2:
      raise ValueError("the loss needs at least two tokens (the first one is not predicted)")
    return float(optax.softmax_cross_entropy_with_integer_labels(
        self.logits(tokens)[:, :-1], tokens[:, 1:]).mean())

  def generate(self, prompt: str, max_new_tokens: int = 64, *, temperature: float = 0.0,
               top_k: int = 0, seed: int = 0) -> str:
    """The text that the model continues `prompt` with (up to an end-of-document token), as
    experiments.generate makes it: greedy at temperature 0, else sampled from the top_k largest
    logits (0: all), the same text for the same seed."""
    prompt_tokens = self._encode(prompt).tolist()
    generate.check_settings(prompt_tokens, max_new_tokens, temperature, top_k, 0,
                            self.config.model.vocab_size)
    cache_length = generate.check_lengths(self.model, self.config.model,
                                          len(prompt_tokens) + max_new_tokens, 0)
    if self._generator is None:
      self._generator = generate.Generator(self.model)
    generation = self._generator.generate(prompt_tokens, max_new_tokens, temperature=temperature,
                                          top_k=top_k, seed=seed, cache_length=cache_length)
    return self.tokenizer.decode(generation.tokens)

  def evaluate(self, lengths: Sequence[int] | None = None, modes: Sequence[str] | None = None,
               **eval_settings) -> list[dict]:
    """The rows of experiments.evaluate (extrapolation.evaluate_run: loss, perplexity, accuracy,
    their intervals and the loss by position, per length x mode x RoPE scaling) at `lengths`,
    `modes` and other eval.* fields given by name (num_tokens=4096); None keeps the run's. They
    come from the newest complete checkpoint, as experiments.evaluate's do: `step` here unless
    the run trained on since it was loaded (each row says its step). Returned, not written into
    the run (the module's docstring)."""
    config = self.config.copy_and_resolve_references()
    settings = dict(eval_settings)
    if lengths is not None:
      settings["lengths"] = lengths
    if modes is not None:
      settings["modes"] = modes
    unknown = sorted(name for name in settings if name not in config.eval)
    if unknown:
      raise ValueError(f"unknown eval settings {', '.join(unknown)}; valid: "
                       f"{', '.join(config.eval)}")
    for name, value in settings.items():
      config.eval[name] = tuple(value) if isinstance(config.eval[name], tuple) else value
    config.mesh.shape, note = sharding.fitting_mesh_shape(config.mesh.shape, jax.device_count(),
                                                          config.eval.batch_size)
    if note:
      self.log(note)
    checks.validate_config(config, jax.device_count(), training=False)
    with tempfile.TemporaryDirectory(prefix="load_run_eval_") as scratch:
      os.symlink(checkpoints.directory(self.workdir), checkpoints.directory(scratch))
      return extrapolation.evaluate_run(config, scratch, progress=self.log)

  def attention_maps(self, ids_or_text) -> dict[int, np.ndarray]:
    """{layer: float32 [heads, T, T]} of one sequence (a text, or ids [T]): the attention
    probabilities of each softmax layer (query rows, key columns; the model's
    attention_weights, as research.analysis.attention_maps draws them); {} for a model without
    softmax layers."""
    tokens = self._tokens(ids_or_text)
    if tokens.shape[0] != 1:
      raise ValueError(f"attention maps are of one sequence; give one, not {tokens.shape[0]}")
    weights = self._attention(self._state, tokens)
    return {layer: np.asarray(w[0]) for layer, w in enumerate(weights) if w is not None}


def load_run(workdir: str, *, step: int | None = None,
             log: Callable[[str], None] = print) -> LoadedRun:
  """The trained run in `workdir` (a run directory that experiments.train or experiments.run
  wrote) at its newest readable complete checkpoint, or at checkpoint `step`, restored on one
  device. ValueError for a sweep or a directory without config.json, FileNotFoundError for a run
  without a checkpoint, each saying what to give instead; `log` takes the lines of a skipped
  unreadable checkpoint and of evaluate's progress."""
  config = generate.run_config(workdir)
  step, model = generate.restore(config, workdir, log=log, step=step)
  return LoadedRun(workdir, config, step, model, log)
