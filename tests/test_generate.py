"""Generation from a trained run: greedy decoding equals the argmax of the full forward pass on the
growing sequence, sampling is reproducible by seed, and every bad setting fails before any work."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.evaluation import generate
from research.model import transformer as model_lib
from tests.conftest import tiny_model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "the rotary "
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def generator(trained_run):
  _, workdir = trained_run
  config = generate.generation_config(workdir)
  _, model = generate.restore(config, workdir, log=lambda line: None)
  return generate.Generator(model)


def _generate(generator, **settings):
  return generator.generate(generate.encode(PROMPT), NEW_TOKENS,
                            cache_length=len(PROMPT) + NEW_TOKENS, **settings)


def _greedy_by_full_forward(generator):
  """The new tokens of an independent greedy loop: the full causal forward over a fixed-length
  buffer (tokens after t do not change the logits at t), its argmax at the last filled position
  appended each time."""
  forward = jax.jit(lambda state, tokens: nnx.merge(generator.graphdef, state)(tokens))
  buffer = np.zeros((1, len(PROMPT) + NEW_TOKENS), np.int32)
  buffer[0, :len(PROMPT)] = generate.encode(PROMPT)
  for t in range(len(PROMPT), len(PROMPT) + NEW_TOKENS):
    buffer[0, t] = int(jnp.argmax(forward(generator.state, buffer)[0, t - 1]))
  return tuple(buffer[0, len(PROMPT):])


def test_greedy_generation_is_the_argmax_of_the_full_forward_on_the_growing_sequence(generator):
  result = _generate(generator)
  assert result.tokens == _greedy_by_full_forward(generator)
  assert result.prompt == tuple(generate.encode(PROMPT))
  assert result.prefill_tokens_per_second > 0 and result.decode_tokens_per_second > 0
  # top_k = 1 leaves only the argmax to sample, at any temperature.
  assert _generate(generator, temperature=2.0, top_k=1, seed=3).tokens == result.tokens


def test_a_sliding_window_set_for_generation_rolls_its_cache(trained_run):
  # StreamingLLM on a model trained with full attention: window 6 and 2 sinks, a cache of 8
  # slots whatever cache_length says; the prompt alone is longer than the window.
  _, workdir = trained_run
  config = generate.generation_config(
      workdir, {"model.softmax.window": 6, "model.softmax.sinks": 2})
  _, model = generate.restore(config, workdir, log=lambda line: None)
  total = len(PROMPT) + NEW_TOKENS
  assert generate.check_lengths(model, config.model, total, 3) == 3
  assert model.cache_bytes(1, 3) == model.cache_bytes(1, total)
  generator = generate.Generator(model)
  result = generator.generate(generate.encode(PROMPT), NEW_TOKENS, cache_length=3)
  assert result.tokens == _greedy_by_full_forward(generator)


def test_sampling_is_reproducible_by_seed(generator):
  first = _generate(generator, temperature=1.0, seed=0)
  assert _generate(generator, temperature=1.0, seed=0).tokens == first.tokens
  others = {_generate(generator, temperature=1.0, seed=seed).tokens for seed in (1, 2, 3)}
  assert others - {first.tokens}, "four seeds gave the same sample"


def test_sample_greedy_top_k_and_all():
  logits = jnp.log(jnp.asarray([[0.1, 0.4, 0.05, 0.3, 0.15]]))
  keys = jax.random.split(jax.random.key(0), 2000)
  draw = jax.jit(jax.vmap(lambda key, t, k: generate.sample(logits, key, t, k)[0],
                          in_axes=(0, None, None)))
  assert set(np.asarray(draw(keys, 0.0, 0)).tolist()) == {1}  # greedy
  assert set(np.asarray(draw(keys, 1.0, 2)).tolist()) == {1, 3}  # the two largest
  counts = np.bincount(np.asarray(draw(keys, 1.0, 0)), minlength=5) / len(keys)
  np.testing.assert_allclose(counts, [0.1, 0.4, 0.05, 0.3, 0.15], atol=0.04)


def test_text_ends_at_the_end_of_document_and_replaces_bad_bytes():
  assert generate.text([104, 105, 256, 106]) == "hi"
  assert generate.text([0xE2, 0x82]) == "\ufffd"
  assert generate.text(generate.encode("é ok")) == "é ok"


def _copy_with_config(trained_run, tmp_path, **changes):
  _, workdir = trained_run
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  path = os.path.join(copy, "config.json")
  with open(path) as f:
    config = json.load(f)
  for name, value in changes.items():
    section, field = name.split(".")
    config[section][field] = value
  with open(path, "w") as f:
    json.dump(config, f)
  return copy


@pytest.mark.parametrize("settings,message", [
    (dict(prompt=""), "the prompt is empty"),
    (dict(max_new_tokens=0), r"max_new_tokens=0 must be >= 1"),
    (dict(temperature=-0.5), r"temperature=-0.5 must be >= 0 \(0: greedy\)"),
    (dict(top_k=-1), r"top_k=-1 must be in \[0, 258\]"),
    (dict(top_k=259), r"top_k=259 must be in \[0, 258\]"),
    (dict(cache_length=-1), r"cache_length=-1 must be >= 0"),
    (dict(max_new_tokens=10, cache_length=12),
     r"prompt \+ max_new_tokens = 13 tokens do not fit a cache of cache_length=12 .* use "
     r"cache_length >= 13"),
    (dict(overrides={"model.d_model": 64}), r"generation may change only .*model.rope.scaling.*"
                                            r"not model.d_model"),
])
def test_bad_settings_fail_before_anything_is_restored(trained_run, monkeypatch, settings,
                                                      message):
  monkeypatch.setattr(generate, "restore", lambda *a, **k: pytest.fail("restored"))
  arguments = dict(prompt="abc", max_new_tokens=4) | settings
  with pytest.raises(ValueError, match=message):
    generate.generate_from_run(trained_run[1], arguments.pop("prompt"),
                               arguments.pop("max_new_tokens"), **arguments)


def test_bad_workdirs_fail_naming_what_is_valid(trained_run, tmp_path):
  with pytest.raises(ValueError, match="holds neither a run"):
    generate.generation_config(str(tmp_path / "missing"))
  untrained = tmp_path / "untrained"
  untrained.mkdir()
  shutil.copy(os.path.join(trained_run[1], "config.json"), untrained)
  with pytest.raises(FileNotFoundError, match="has no checkpoint yet; train it first"):
    generate.generation_config(str(untrained))
  task = _copy_with_config(trained_run, tmp_path, **{"data.name": "copy"})
  with pytest.raises(ValueError, match="generation needs a text run"):
    generate.generation_config(task)


def test_lengths_a_cache_that_grows_must_hold_and_a_position_table_must_cover():
  mha = tiny_model_config(attention="mha", position="rope")
  model = nnx.eval_shape(lambda: model_lib.build_model(mha, rngs=nnx.Rngs(0)))
  assert generate.check_lengths(model, mha, 40, 0) == 40
  assert generate.check_lengths(model, mha, 40, 64) == 64
  with pytest.raises(ValueError, match="do not fit a cache of cache_length=39"):
    generate.check_lengths(model, mha, 40, 39)
  mamba = tiny_model_config(attention="mamba", position="none")
  model = nnx.eval_shape(lambda: model_lib.build_model(mamba, rngs=nnx.Rngs(0)))
  assert generate.check_lengths(model, mamba, 40, 8) == 8  # a state of fixed size
  learned = tiny_model_config(attention="mha", position="learned")  # a table of 64 positions
  model = nnx.eval_shape(lambda: model_lib.build_model(learned, rngs=nnx.Rngs(0)))
  assert generate.check_lengths(model, learned, 64, 0) == 64
  with pytest.raises(ValueError, match=r"65 tokens exceed the 64 positions of the 'learned' table"
                                       r" \(model.learned.max_length\); use at most 64"):
    generate.check_lengths(model, learned, 65, 0)


def test_command_prints_the_continuation_and_speeds_or_one_line_errors(trained_run):
  command = [sys.executable, "-m", "experiments.generate", f"--workdir={trained_run[1]}",
             "--max_new_tokens=5"]
  env = dict(os.environ, PYTHONPATH=ROOT)
  result = subprocess.run(command + ["--prompt=the ", "--temperature=0.7", "--top_k=5"],
                          env=env, cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("the ")
  assert "checkpoint step 8; prefill 4 tokens in" in result.stdout
  assert "decode 4 tokens in" in result.stdout and "tokens/s" in result.stdout
  result = subprocess.run(command + ["--prompt=", "--top_k=300"], env=env, cwd=ROOT,
                          capture_output=True, text=True)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      "error: the prompt is empty; give at least one character; top_k=300 must be in [0, 258] "
      "(the vocabulary; 0: all tokens)"]
