"""No setting is silently ignored (research.runs.unread): every field of configs/base.py, set away
from its default, is either read by the run (training, then evaluation) or refused before any
work. Which fields a run reads is recorded, not declared: the run executes with every config
access watched."""

import contextlib
import os
import subprocess
import sys

import ml_collections
import pytest

from configs import base
from research import defaults
from research.evaluation import extrapolation
from research.results import sweep
from research.runs import unread
from research.training import checks
from research.training import loop as train
from tests import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATH = "_recorded_path"  # the dotted path of a ConfigDict node, kept in its __dict__


def _tag(node, path):
  object.__setattr__(node, _PATH, path)
  for key, value in node._fields.items():  # pylint: disable=protected-access
    if isinstance(value, ml_collections.ConfigDict):
      _tag(value, f"{path}.{key}" if path else key)


@contextlib.contextmanager
def recorded_reads(config):
  """Yields the set of dotted fields read through `config` (or a copy of it) while inside.
  Serialising and comparing configs (config.json, flatten, equality) is not reading them: it
  neither uses a field nor depends on which were chosen."""
  cls = ml_collections.ConfigDict
  reads, quiet = set(), [0]
  originals = {name: getattr(cls, name) for name in (
      "__getitem__", "to_json", "__repr__", "__str__", "__eq__", "copy_and_resolve_references")}

  def getitem(self, key):
    value = originals["__getitem__"](self, key)
    path = self.__dict__.get(_PATH)
    if not quiet[0] and path is not None and not isinstance(value, cls) and "." not in key:
      reads.add(f"{path}.{key}" if path else key)
    return value

  def silent(name):
    def method(self, *args, **kwargs):
      quiet[0] += 1
      try:
        result = originals[name](self, *args, **kwargs)
      finally:
        quiet[0] -= 1
      if name == "copy_and_resolve_references" and _PATH in self.__dict__:
        _tag(result, self.__dict__[_PATH])
      return result
    return method

  _tag(config, "")
  try:
    cls.__getitem__ = getitem
    for name in originals:
      if name != "__getitem__":
        setattr(cls, name, silent(name))
    yield reads
  finally:
    for name, method in originals.items():
      setattr(cls, name, method)


def _non_default(name, value):
  """A valid-looking value other than the default `value` of field `name`."""
  special = {"model.attention": "gqa", "model.position": "alibi", "model.feed_forward": "moe",
             "model.attention_backend": "xla", "model.compute_dtype": "bfloat16",
             "model.layer_pattern": ("mha",), "model.feed_forward_pattern": ("mlp",),
             "data.name": "passkey", "data.packing": "documents", "data.corpus_path": "/nonexistent",
             "eval.modes": ("nonoverlapping",), "eval.rope_scalings": ("yarn",),
             "eval.depths": (0.5,), "mesh.shape": (-1, 2, 1), "train.keep_checkpoints_at": (1,),
             "distributed.coordinator_address": "127.0.0.1:1", "model.rope.scaling": "yarn",
             "model.softmax.sink_positions": "original"}
  if name in special:
    return special[name]
  if isinstance(value, bool):
    return not value
  if isinstance(value, int):
    return value + 1
  if isinstance(value, float):
    return value / 2 if value else 0.5
  if isinstance(value, (tuple, list)):
    return tuple(value[:1]) if len(value) > 1 else tuple(value) * 2 or (1,)
  return f"{value}_other"


def _base_configs():
  language = tiny_config.get_config()
  language.train.update(dict(num_steps=2, checkpoint_every=2, log_every=1, warmup_steps=1))
  needle = language.copy_and_resolve_references()
  needle.data.update(dict(name="needle_multikey", num_train_examples=16, num_eval_examples=8))
  needle.train.seq_len = 320
  needle.eval.update(dict(lengths=(320,), depths=(0.0, 1.0),
                          num_tokens=base.get_config().eval.num_tokens))  # corpora only
  return {"language_modeling": language, "needle": needle}


@pytest.mark.parametrize("kind", list(_base_configs()))
def test_every_field_is_read_by_the_run_or_refused(kind, tmp_path, capsys):
  config = _base_configs()[kind]
  with recorded_reads(config) as reads:
    train.train_and_evaluate(config, str(tmp_path / "run"))
    extrapolation.evaluate_run(config, str(tmp_path / "run"), progress=lambda line: None)
  capsys.readouterr()
  declared = unread.not_read(config)
  # What the rule refuses is truly unread: no field it declares unread was read by the run.
  assert not {name for name in reads for section in declared if unread.within(name, section)}
  silently_ignored = []
  for name, value in defaults.flatten(base.get_config()).items():  # every field of the schema
    changed = sweep.apply_overrides(config, {name: _non_default(name, value)})
    try:
      checks.validate_config(changed, 8)
    except ValueError:
      continue  # refused before any work
    if name not in reads:
      silently_ignored.append(name)
  assert not silently_ignored, f"accepted at a non-default value but never read: {silently_ignored}"
  assert len(reads) > 40  # the recorder sees the run's reads


def test_a_setting_the_chosen_dataset_does_not_read_is_refused_naming_who_reads_it():
  config = tiny_config.get_config()
  config.data.corpus_path = "/nonexistent/dir"
  with pytest.raises(ValueError, match=r"data.corpus_path='/nonexistent/dir' is read only by "
                                       r"data.name=text_dir"):
    checks.validate_config(config, 8)
  config = tiny_config.get_config()
  config.model.fire.hidden = 8  # a position scheme this model does not use
  with pytest.raises(ValueError, match=r"model.fire.hidden=8 is read only by a model with "
                                       r"model.position=fire"):
    checks.validate_config(config, 8)


def test_a_sweeps_shared_settings_apply_where_read_and_one_read_by_no_member_is_refused():
  config = tiny_config.get_config()
  config.eval.rope_scalings = ("yarn",)
  members = sweep.expand([{"model.position": "rope"}, {"model.position": "alibi"}], config, 8)
  assert [tuple(m.config.eval.rope_scalings) for m in members] == [("yarn",), ()]
  with pytest.raises(ValueError, match="no member of its sweep reads: .*eval.rope_scalings is read only by the rotary"):
    sweep.expand([{"model.position": "alibi"}, {"model.position": "none"}], config, 8)
  with pytest.raises(ValueError, match=r"sweep member 0 .*model.fire.hidden=8 is read only"):
    sweep.expand([{"model.position": "rope", "model.fire.hidden": 8}], config, 8)


def test_train_refuses_an_ignored_command_line_setting_and_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", f"--config={ROOT}/tests/tiny_config.py",
       f"--workdir={workdir}", "--config.data.corpus_path=/nonexistent/dir"],
      env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 1, result.stderr[-2000:]
  assert result.stderr.strip().splitlines() == [
      "error: settings this run would not read (no setting is silently ignored): "
      "data.corpus_path='/nonexistent/dir' is read only by data.name=text_dir; remove them, or "
      "choose what reads them"]
  assert not workdir.exists()
