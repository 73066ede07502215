"""Text generation from a trained run: prefill the prompt, then one decode step per
new token.

  logits_P, cache = prefill(x_1 .. x_P)                 one chunk-parallel pass over the prompt
  x_{t+1} = sample(logits_t);  logits_{t+1}, cache = decode(x_{t+1}, cache)    t = P, P+1, ...
  sample(z) = argmax_v z_v                                 temperature 0 (greedy)
            ~ softmax(z / temperature) over the top_k largest z_v   temperature > 0 (top_k 0: all)
Top-k sampling: Fan et al., arXiv:1805.04833 (logits tied with the k-th largest are kept too).
The token at sequence position p is drawn with the key fold_in(key(seed), p): a seed gives the
same text on every run and with any cache length.

Both the prefill and the one-token step are compiled ahead of time, once per (prompt length,
cache length) whatever the sampling settings (temperature and top_k are traced), so the reported
times exclude compilation: prefill tokens/s = P / its seconds; decode tokens/s = (N - 1) / the
seconds of the N - 1 jitted steps (the first new token comes from the prefill's logits).

Tokens are the run's data.tokenizer's (research.data.tokenizer): UTF-8 bytes by default, or a
Hugging Face tokenizer.json (an imported checkpoint's); the text of the new tokens ends at the
first end-of-document token (the tokenizer's end of sequence), bytes decoded with
errors="replace".
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from research.runs import checkpoints
from research.runs import config_fields
from research import data
from research.model import transformer as model_lib
from research.model import positions
from research.model import sharding
from research.runs import workdirs
from research.data import tokenizer

# Config fields a generation may change: they change how the trained weights are applied, not
# their shapes (the rotary context extensions, the softmax backend, and a sliding window with
# sinks, which StreamingLLM, arXiv:2309.17453, applies to models trained with full attention).
GENERATION_FIELDS = config_fields.ROTARY_SCALING_FIELDS + (
    "model.attention_backend", "model.softmax.window", "model.softmax.sinks",
    "model.softmax.sink_positions")


def encode(text: str) -> list[int]:
  """The UTF-8 bytes of `text` (a byte-level run's tokens)."""
  return tokenizer.ByteTokenizer.encode(text).tolist()


def text(tokens) -> str:
  """The bytes of `tokens` up to the first end-of-document token, as UTF-8 (errors replaced)."""
  return tokenizer.ByteTokenizer().decode(tokens)


def sample(logits_BxV, key, temperature, top_k):
  """Next tokens [B]: argmax if temperature == 0, else a draw from softmax(logits / temperature)
  over the top_k largest logits (all if top_k == 0). temperature and top_k may be traced."""
  vocab_size = logits_BxV.shape[-1]
  k = jnp.where(top_k > 0, top_k, vocab_size)
  kth_largest_Bx1 = jnp.take(jnp.sort(logits_BxV, axis=-1), vocab_size - k, axis=-1)[..., None]
  kept = jnp.where(logits_BxV >= kth_largest_Bx1, logits_BxV, -jnp.inf)
  drawn = jax.random.categorical(key, kept / jnp.maximum(temperature, 1e-6), axis=-1)
  return jnp.where(temperature > 0, drawn, jnp.argmax(logits_BxV, axis=-1)).astype(jnp.int32)


def check_settings(prompt_tokens, max_new_tokens, temperature, top_k, cache_length, vocab_size):
  """Raise ValueError naming every setting out of range and what is valid."""
  problems = []
  if not prompt_tokens:
    problems.append("the prompt is empty; give at least one character")
  if max_new_tokens < 1:
    problems.append(f"max_new_tokens={max_new_tokens} must be >= 1")
  if temperature < 0:
    problems.append(f"temperature={temperature} must be >= 0 (0: greedy)")
  if not 0 <= top_k <= vocab_size:
    problems.append(f"top_k={top_k} must be in [0, {vocab_size}] (the vocabulary; 0: all tokens)")
  if cache_length < 0:
    problems.append(f"cache_length={cache_length} must be >= 0 (0: prompt + new tokens)")
  if problems:
    raise ValueError("; ".join(problems))


def check_positions(model_config, length, what):
  """ValueError if `length` tokens (`what`, as the message names them) reach past the position
  table of the model's scheme (learned positions; positions.max_length): the positions beyond it
  have no embedding."""
  table = positions.max_length(model_config)
  if table is not None and length > table:
    raise ValueError(
        f"{what} exceed the {table} positions of the {model_config.position!r} table (model."
        f"{positions.REGISTRY.settings_key(model_config.position)}.max_length); use at most "
        f"{table} tokens in all")


def check_lengths(model, model_config, total, cache_length):
  """The cache length to use for `total` = prompt + new tokens: `cache_length` (0: `total`).
  ValueError if a cache whose size grows with the context is too small for `total` tokens (a
  recurrent state or the rolling buffer of a sliding window never is), or if the position scheme
  has no embedding for the last position."""
  check_positions(model_config, total, f"prompt + max_new_tokens = {total} tokens")
  cache_length = cache_length or total
  if model.cache_bytes(1, cache_length) < model.cache_bytes(1, total):
    raise ValueError(
        f"prompt + max_new_tokens = {total} tokens do not fit a cache of cache_length="
        f"{cache_length} (this model's cache grows with the context); use cache_length >= "
        f"{total}, or 0 for exactly prompt + new tokens")
  return cache_length


def run_config(workdir):
  """The saved config of the trained run in `workdir` (config_fields.load_saved); ValueError for a
  sweep or a directory that holds no run, FileNotFoundError for a run without a checkpoint, each
  saying what to give instead."""
  runs = workdirs.runs(workdir)
  if workdirs.is_sweep(workdir):
    raise ValueError(f"{workdir} is a sweep; give one of its runs, {workdir}/runs/<name>, with "
                     f"<name> one of: {', '.join(run.name for run in runs)}")
  config = config_fields.load_saved(workdir)
  if not checkpoints.steps(workdir):
    raise FileNotFoundError(f"{workdir} has no checkpoint yet; train it first (python -m "
                            "experiments.train with this --workdir), or give a trained run")
  return config


def generation_config(workdir, overrides=None):
  """The config of the run in `workdir` with `overrides` ({field: value} of GENERATION_FIELDS),
  checked; ValueError or FileNotFoundError naming what is wrong, before anything is built."""
  config = run_config(workdir)
  overrides = dict(overrides or {})
  others = sorted(name for name in overrides if name not in GENERATION_FIELDS)
  if others:
    raise ValueError(f"generation may change only {', '.join(GENERATION_FIELDS)}, not "
                     f"{', '.join(others)} (they would not match the trained weights)")
  config.update_from_flattened_dict(overrides)
  if not data.is_text(config):
    raise ValueError(f"data.name={config.data.name!r} is a synthetic task with its own symbols; "
                     "generation needs a text run (a corpus or a needle task)")
  model_lib.validate(config.model)
  return config


def abstract_model(config):
  return nnx.eval_shape(lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0)))


def restore(config, workdir, log=print, step=None):
  """(checkpoint step, model) of the newest readable checkpoint (or of checkpoint `step`), on one
  device."""
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  graphdef, abstract_state = nnx.split(abstract_model(config))
  step, state = checkpoints.restore_params(
      workdir, sharding.sharded_abstract(abstract_state, mesh), log=log, step=step)
  return step, nnx.merge(graphdef, state)


@dataclasses.dataclass(frozen=True)
class Generation:
  prompt: tuple
  tokens: tuple  # the new tokens
  prefill_seconds: float
  decode_seconds: float  # the N - 1 one-token steps
  compile_seconds: float
  # The run's tokenizer (research.data.tokenizer, data.tokenizer), which `text` decodes with.
  decoder: object = dataclasses.field(default=tokenizer.ByteTokenizer(), repr=False,
                                      compare=False)

  @property
  def text(self):
    return self.decoder.decode(self.tokens)

  @property
  def prefill_tokens_per_second(self):
    return len(self.prompt) / self.prefill_seconds

  @property
  def decode_tokens_per_second(self):
    """None when only one token was asked for (it comes from the prefill)."""
    steps = len(self.tokens) - 1
    return steps / self.decode_seconds if steps else None


class Generator:
  """Generates from `model`; compiled functions are kept per (prompt length, cache length)."""

  def __init__(self, model):
    self.model = model
    self.graphdef, self.state = nnx.split(model)
    self._compiled = {}

  def _functions(self, prompt_length, cache_length):
    key = (prompt_length, cache_length)
    if key in self._compiled:
      return self._compiled[key], 0.0
    graphdef = self.graphdef

    def prefill(state, prompt_1xP, cache, seed_key, temperature, top_k, position):
      model = nnx.merge(graphdef, state)
      logits, cache = model.prefill(prompt_1xP, cache)
      token = sample(logits[:, -1], jax.random.fold_in(seed_key, position), temperature, top_k)
      return token[:, None], cache

    def step(state, token_1x1, cache, seed_key, temperature, top_k, position):
      logits, cache = nnx.merge(graphdef, state).decode(token_1x1, cache)
      token = sample(logits[:, -1], jax.random.fold_in(seed_key, position), temperature, top_k)
      return token[:, None], cache

    start = time.perf_counter()
    cache = jax.eval_shape(lambda: self.model.init_cache(1, cache_length))
    scalars = (jax.eval_shape(lambda: jax.random.key(0)), np.float32(0), np.int32(0),
               np.int32(0))
    token = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    prompt = jax.ShapeDtypeStruct((1, prompt_length), jnp.int32)
    functions = (jax.jit(prefill, donate_argnums=2).lower(self.state, prompt, cache, *scalars)
                 .compile(),
                 jax.jit(step, donate_argnums=2).lower(self.state, token, cache, *scalars)
                 .compile())
    self._compiled[key] = functions
    return functions, time.perf_counter() - start

  def generate(self, prompt_tokens, max_new_tokens, *, temperature=0.0, top_k=0, seed=0,
               cache_length):
    """The `max_new_tokens` tokens that follow `prompt_tokens`, and the times (see module doc)."""
    prompt_length = len(prompt_tokens)
    (prefill, step), compile_seconds = self._functions(prompt_length, cache_length)
    seed_key = jax.random.key(seed)
    temperature, top_k = np.float32(temperature), np.int32(top_k)
    cache = self.model.init_cache(1, cache_length)
    prompt = jnp.asarray([prompt_tokens], jnp.int32)
    jax.block_until_ready((prompt, cache))
    start = time.perf_counter()
    token, cache = prefill(self.state, prompt, cache, seed_key, temperature, top_k,
                           np.int32(prompt_length))
    new = [jax.block_until_ready(token)]
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for position in range(prompt_length + 1, prompt_length + max_new_tokens):
      token, cache = step(self.state, token, cache, seed_key, temperature, top_k,
                          np.int32(position))
      new.append(token)
    jax.block_until_ready(token)
    decode_seconds = time.perf_counter() - start
    return Generation(tuple(prompt_tokens), tuple(int(t[0, 0]) for t in jax.device_get(new)),
                      prefill_seconds, decode_seconds, compile_seconds)


def generate_from_run(workdir, prompt, max_new_tokens, *, temperature=0.0, top_k=0, seed=0,
                      cache_length=0, overrides=None, log=print):
  """(checkpoint step, Generation) of `prompt` (text) continued by the run in `workdir`; every
  check of the run and the settings comes before anything is restored or compiled."""
  config = generation_config(workdir, overrides)
  tokens = tokenizer.get(config)
  prompt_tokens = tokens.encode(prompt).tolist()
  check_settings(prompt_tokens, max_new_tokens, temperature, top_k, cache_length,
                 config.model.vocab_size)
  cache_length = check_lengths(abstract_model(config), config.model,
                               len(prompt_tokens) + max_new_tokens, cache_length)
  step, model = restore(config, workdir, log=log)
  generation = Generator(model).generate(prompt_tokens, max_new_tokens, temperature=temperature,
                                         top_k=top_k, seed=seed, cache_length=cache_length)
  return step, dataclasses.replace(generation, decoder=tokens)
