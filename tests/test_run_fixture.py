"""A run directory written by an earlier version of the code (tests/fixtures/run_e4f910a: a tiny
GQA / ALiBi run trained and evaluated at commit e4f910a, before the attention core and the
package layout) still loads: its config over today's defaults, its checkpoint into today's
model, which gives the logits that code computed, and its eval.json rows; and a config of an
older schema version is migrated (research/runs/migrations.py) before it is read."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research import defaults
from research.evaluation import results as eval_results
from research.runs import checkpoints, config_fields, migrations
from research.training import checks

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "run_e4f910a")


def test_a_run_written_before_the_refactor_loads_and_computes_the_same_logits(tmp_path):
  run = tmp_path / "run"
  shutil.copytree(FIXTURE, run)  # orbax may write beside what it reads; keep the fixture clean
  config = config_fields.load_saved(str(run))
  assert (config.model.attention, config.model.position) == ("gqa", "alibi")
  model = research.build_model(config.model, rngs=nnx.Rngs(1))  # not the trained values
  _, params, _ = nnx.split(model, nnx.Param, ...)
  step, restored = checkpoints.restore_params(str(run), params, log=lambda _: None)
  nnx.update(model, restored)
  reference = np.load(run / "reference_logits.npz")
  assert step == 8
  np.testing.assert_allclose(model(jnp.asarray(reference["tokens"])), reference["logits"],
                             atol=1e-5, rtol=1e-5)
  rows = eval_results.latest(eval_results.read(str(run)))
  assert {(r["eval_length"], r["eval_mode"]) for r in rows} >= {(64, "nonoverlapping"),
                                                                (64, "sliding")}
  assert all(np.isfinite(r["loss"]) for r in rows)


def _nested(flat):
  """{"a": {"b": 1}} from {"a.b": 1}."""
  nested = {}
  for name, value in flat.items():
    *sections, field = name.split(".")
    node = nested
    for section in sections:
      node = node.setdefault(section, {})
    node[field] = value
  return nested


def test_a_config_of_an_older_schema_is_migrated_before_it_is_read(monkeypatch):
  """A schema change (the next version here: num_kv_heads renamed, the learning rate moved to
  another section, warmup given as a fraction of the steps) with its Migration: the fixture's
  config written in the older form (today's) loads as the fixture itself does and trains the
  same run."""
  with open(os.path.join(FIXTURE, "config.json")) as f:
    saved = migrations.migrate(defaults.flatten(json.load(f)), "fixture")  # today's schema
  expected = config_fields.load_saved(FIXTURE)
  older = dict(saved)
  older["model.kv_heads"] = older.pop("model.num_kv_heads")
  older["optimizer.lr"] = older.pop("train.learning_rate")
  older["train.warmup_fraction"] = older.pop("train.warmup_steps") / older["train.num_steps"]

  def warmup_in_steps(flat):
    flat = dict(flat)
    flat["train.warmup_steps"] = round(flat.pop("train.warmup_fraction") * flat["train.num_steps"])
    return flat

  new = defaults.VERSION + 1
  monkeypatch.setattr(defaults, "VERSION", new)
  monkeypatch.setattr(defaults, "_FLAT_DEFAULTS", {})  # its cache of today's defaults
  monkeypatch.setattr(migrations, "MIGRATIONS", (*migrations.MIGRATIONS, migrations.Migration(
      new, "a test's", moved={"model.kv_heads": "model.num_kv_heads",
                            "optimizer.lr": "train.learning_rate"}, convert=warmup_in_steps)))
  with pytest.raises(ValueError, match=r"fields this code does not know \(model.kv_heads, "
                                       r"optimizer.lr, train.warmup_fraction\)"):
    config_fields.merge_saved(_nested({**older, "version": new}), "unmigrated")  # as the new one
  loaded = config_fields.merge_saved(_nested(older), "older.json")
  assert loaded.version == new
  expected.version = new
  assert defaults.flatten(loaded) == defaults.flatten(expected)
  assert config_fields.training_differences(_nested(older), loaded) == []
  loaded.train.learning_rate *= 2
  assert config_fields.training_differences(_nested(older), loaded) == [
      f"train.learning_rate: {expected.train.learning_rate!r} -> "
      f"{expected.train.learning_rate * 2!r}"]


def test_a_config_of_a_newer_schema_or_a_field_in_both_forms_is_refused():
  with open(os.path.join(FIXTURE, "config.json")) as f:
    saved = json.load(f)
  with pytest.raises(ValueError, match=rf"config version 99; this code reads versions "
                                       rf"1..{defaults.VERSION}"):
    config_fields.merge_saved({**saved, "version": 99}, "newer.json")
  config = defaults.get_config()
  config.version = 1
  with pytest.raises(ValueError, match=rf"version=1 must be {defaults.VERSION}"):
    checks.check_fields(config)
  both = {"version": 1, "old.name": 1, "new.name": 2}
  table = (migrations.Migration(2, "a test's", moved={"old.name": "new.name"}),)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(migrations, "MIGRATIONS", table)
    with pytest.raises(ValueError, match="has both 'old.name' and 'new.name'"):
      migrations.migrate(both, "both.json")


def test_the_migration_table_covers_every_version_and_moves_to_fields_that_exist():
  assert [m.version for m in migrations.MIGRATIONS] == list(range(2, defaults.VERSION + 1))
  assert defaults.get_config().version == defaults.VERSION
  fields = set(defaults.flatten(defaults.get_config()))
  moved_later = set()
  for migration in reversed(migrations.MIGRATIONS):
    assert set(migration.moved.values()) <= fields | moved_later, migration
    moved_later |= set(migration.moved)


def test_what_older_runs_lacking_a_field_meant_is_in_the_migration_table():
  """Migration.predated: a config saved before version 2 without a field loads at what its
  absence meant (sink_positions "original" only with a window and sinks, RWKV-7 without the
  value residual, RetNet's rotation at RoPE's frequencies); one saved since then at its own
  values; every entry names a field of today's config."""
  fields = set(defaults.flatten(defaults.get_config()))
  for migration in migrations.MIGRATIONS:
    assert set(migration.predated) <= fields, migration
  today = defaults.flatten(defaults.get_config())
  lacking = {k: v for k, v in today.items()
             if k not in ("version", "model.rwkv7.value_residual",
                          "model.retention.rotary_frequencies", "model.softmax.sink_positions")}
  old = migrations.migrate({**lacking, "model.softmax.window": 8, "model.softmax.sinks": 2}, "v1")
  assert (old["model.rwkv7.value_residual"], old["model.retention.rotary_frequencies"],
          old["model.softmax.sink_positions"]) == (False, "rope", "original")
  assert "model.softmax.sink_positions" not in migrations.migrate(lacking, "v1 without sinks")
  new = migrations.migrate(today, "today's")
  assert (new["model.rwkv7.value_residual"], new["model.retention.rotary_frequencies"],
          new["model.softmax.sink_positions"]) == (True, "retnet", "cache")


def test_a_registered_subclass_with_settings_of_its_own_loads_every_saved_run(tmp_path):
  """A softmax-family subclass registered with its own settings (none of softmax's window and
  sinks) leaves saved runs loading and resuming: the fixture's, and a run of today's config
  (compatibility is the migration table's, keyed by field, not an attribute it inherits)."""
  from research.model import attention  # noqa: PLC0415
  from research.model.attention import softmax  # noqa: PLC0415

  class Plain(softmax.SoftmaxAttention):
    hyperparameters = {"block_size": 128}

  attention.REGISTRY.register("plain_for_a_test", Plain)
  try:
    assert config_fields.load_saved(FIXTURE).model.attention == "gqa"
    (tmp_path / "config.json").write_text(defaults.get_config().to_json())
    config = config_fields.load_saved(str(tmp_path))
    assert config_fields.training_differences(json.loads(defaults.get_config().to_json()),
                                              config) == []
  finally:
    attention.REGISTRY.unregister("plain_for_a_test")


def test_a_damaged_config_json_is_named_with_what_to_do(tmp_path):
  (tmp_path / "config.json").write_text('{"model": ')
  with pytest.raises(ValueError, match=rf"{tmp_path}/config.json is not valid JSON \(.*\); "
                                       "restore it from a copy"):
    config_fields.load_saved(str(tmp_path))
