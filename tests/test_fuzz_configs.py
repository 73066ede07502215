"""Config fuzzing: any configuration either trains two finite steps or is refused before any work
with a one-line error that writes nothing.

Hypothesis draws a tiny config, then perturbs a few fields with valid, boundary and invalid values:
the model's variants (every registry) and their own settings, the data, train, eval and mesh
fields. `make test` runs FUZZ_EXAMPLES (default 2) examples; the seed is printed (FUZZ_SEED=N
reproduces a run); a longer run is

  make fuzz            # FUZZ_EXAMPLES=300, about 15 minutes on 2 cores
"""

import collections
import math
import os
import random

import hypothesis
from hypothesis import strategies as st

from research.model import attention
from research import defaults
from research.model import feed_forward
from research.model import transformer as model_lib
from research.model import positions
from research.results import sweep
from research.runs import unread
from research.training import checks
from research.training import loop as train
from tests import tiny_config

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "2"))
SEED = int(os.environ.get("FUZZ_SEED", random.randrange(2 ** 32)))

# Fields of the data, train, eval and mesh sections, each with values to draw: valid, at the
# boundary of the valid range, and invalid.
FIELD_VALUES = {
    "model.num_layers": [0, 1, 2, -1],
    "model.d_model": [0, 16, 24, 32, 33],
    "model.num_heads": [0, 1, 2, 3, 4, 8],
    "model.num_kv_heads": [0, 1, 2, 3],
    "model.mlp_ratio": [0, 1, -1],
    "model.vocab_size": [0, 1, 258, 300],
    "model.attention_backend": ["auto", "xla", "blockwise", "cudnn", "pallas", "bogus"],
    "model.compute_dtype": ["float32", "bfloat16", "float16", "bogus"],
    "model.randomize_max_length": [0, 16, 64, -1],
    "model.layer_pattern": [(), ("mha",), ("mamba", "mha"), ("bogus",)],
    "model.feed_forward_pattern": [(), ("mlp", "moe"), ("bogus",)],
    "data.name": ["stdlib_bytes", "copy", "mqar", "passkey", "needle_multikey", "text_dir",
                  "pg19", "bogus"],
    "data.corpus_path": ["", "/nonexistent/dir"],
    "data.packing": ["concat", "documents", "bogus"],
    "data.task_vocab_size": [0, 2, 16],
    "data.train_min_length": [0, 1, 5],
    "data.train_max_length": [0, 4, 40, 400],
    "data.num_kv_pairs": [0, 1, 4, 100],
    "data.num_train_examples": [0, 64],
    "data.num_eval_examples": [0, 8],
    "data.needle_value_digits": [0, 1, 19],
    "train.num_steps": [0, 2, -1],
    "train.batch_size": [0, 7, 8, 16, -8],
    "train.seq_len": [0, 1, 16, 32, 48],
    "train.learning_rate": [0.0, -1.0, 1e-3],
    "train.warmup_steps": [0, 1, 2, -1],
    "train.end_learning_rate_fraction": [0.0, 1.0, 1.5],
    "train.weight_decay": [0.0, -0.1],
    "train.grad_clip_norm": [0.0, 1e-6, 1.0],
    "train.grad_accum_steps": [0, 1, 2, 3],
    "train.log_every": [0, 1, 3],
    "train.eval_every": [0, 1, 2, -1],
    "train.checkpoint_every": [0, 1, 2],
    "train.keep_checkpoints": [0, 1],
    "train.keep_checkpoints_at": [(), (1,), (0,), (5,)],
    "train.init_from": ["", "missing_run"],
    "eval.lengths": [(), (0,), (32,), (16, 64), (32, 4096)],
    "eval.modes": [(), ("sliding",), ("nonoverlapping",), ("bogus",)],
    "eval.sliding_stride": [-1, 0, 8, 1000],
    "eval.num_tokens": [0, 64, 512],
    "eval.batch_size": [0, 4, 8],
    "eval.rope_scalings": [(), ("yarn",), ("bogus",)],
    "eval.depths": [(), (0.0,), (1.5,), (0.5, 0.5)],
    "eval.bootstrap_samples": [0, 10],
    "mesh.shape": [(-1, 1, 1), (2, 2, 2), (3, 1, 1), (-1, 2, 1), (1, 1, 8), (-1, -1, 1)],
}


def _setting_values(value):
  """Values to draw for a variant's own setting of default `value`."""
  if isinstance(value, bool):
    return [value, not value]
  if isinstance(value, int):
    return [value, 0, 1, -1, 2 * value]
  if isinstance(value, float):
    return [value, 0.0, -1.0, 2 * value]
  return [value, "bogus"]


def _drawn_variants(m):
  """(class, settings key) of the model's mixer, position scheme and feed-forward that have
  settings."""
  for registry, name in [(attention.REGISTRY, m.attention), (positions.REGISTRY, m.position),
                         (feed_forward.REGISTRY, m.feed_forward)]:
    if registry.settings_key(name) in m:
      yield registry.lookup(name), registry.settings_key(name)


@st.composite
def configs(draw):
  config = tiny_config.get_config()
  config.train.update(dict(num_steps=2, warmup_steps=1, checkpoint_every=2, log_every=1))
  m = config.model
  m.attention = draw(st.sampled_from(list(attention.REGISTRY)))
  compatible = model_lib.compatible_positions(attention.REGISTRY.lookup(m.attention))
  m.position = draw(st.sampled_from(compatible if draw(st.integers(0, 7)) else  # mostly valid
                                    list(positions.REGISTRY)))
  m.feed_forward = draw(st.sampled_from(list(feed_forward.REGISTRY)))
  for cls, key in _drawn_variants(m):
    m[key].update(dict(cls.test_settings))  # small, as the conformance suite's
  # The tiny config's settings of variants not drawn (its rope's) would be refused as unread.
  config = unread.reset(config, unread.experiment_settings_not_read(config, {}))
  for cls, key in _drawn_variants(config.model):
    for setting, default in cls.hyperparameters.items():
      if draw(st.integers(0, 7)) == 0:  # perturb about one in eight
        config.model[key][setting] = draw(st.sampled_from(_setting_values(default)))
  fields = draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=2, unique=True))
  return sweep.apply_overrides(
      config, {name: draw(st.sampled_from(FIELD_VALUES[name])) for name in fields})


def _describe(config, base):
  now, before = defaults.flatten(config), defaults.flatten(base)
  return {name: value for name, value in now.items() if value != before.get(name)}


def test_every_config_trains_two_finite_steps_or_is_refused_in_one_line(tmp_path_factory, capsys):
  with capsys.disabled():
    print(f"\nconfig fuzzing: {EXAMPLES} examples, FUZZ_SEED={SEED}", flush=True)
  base = tiny_config.get_config()
  outcomes = {"trained": 0, "refused": 0}
  reasons = collections.Counter()

  @hypothesis.seed(SEED)
  @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None,
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(configs())
  def trains_or_is_refused(config):
    workdir = tmp_path_factory.mktemp("fuzz") / "run"
    changed = _describe(config, base)
    try:
      checks.validate_config(config, 8)
    except ValueError as e:
      message = str(e)
      assert message and "\n" not in message, (changed, message)
      assert not workdir.exists()
      outcomes["refused"] += 1
      reasons[message.split(":")[0][:50]] += 1
      return
    try:
      state = train.train_and_evaluate(config, str(workdir))
    except ValueError as e:  # refused later, but still before any work: nothing written
      assert "\n" not in str(e) and not workdir.exists(), (changed, str(e), FUZZ_HINT)
      outcomes["refused"] += 1
      return
    assert int(state["step"]) == config.train.num_steps, (changed, FUZZ_HINT)
    metrics = (workdir / "metrics.jsonl").read_text().splitlines()
    assert metrics and all(math.isfinite(float(line.split('"loss": ')[1].split(",")[0]))
                           for line in metrics), (changed, FUZZ_HINT)
    outcomes["trained"] += 1

  trains_or_is_refused()
  with capsys.disabled():
    print(f"config fuzzing: {outcomes}; refusals, most common first: "
          f"{reasons.most_common(6)}", flush=True)
  assert sum(outcomes.values()) >= 1


FUZZ_HINT = f"FUZZ_SEED={SEED} reproduces"
