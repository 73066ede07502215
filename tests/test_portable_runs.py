"""A run's data.tokenizer is stored relative to the run when the run holds it, so a copied or
moved run reads its own (research.data.tokenizer.for_run / from_run, through
research.runs.config_fields.load_saved); absolute paths of older runs and relative ones a
command line gave keep their meaning. The round trip of an imported checkpoint through a moved
run and an export is tests/test_pretrained.py's (it needs transformers)."""

import json
import os
import shutil

import pytest

from research import defaults
from research.data import tokenizer
from research.runs import config_fields
from research.training import checks


def _run(directory, tokenizer_value):
  """A run directory whose config.json has data.tokenizer = `tokenizer_value` and which holds a
  tokenizer directory RUN/tokenizer."""
  os.makedirs(os.path.join(directory, "tokenizer"))
  config = defaults.get_config()
  config.data.tokenizer = tokenizer_value
  with open(os.path.join(directory, "config.json"), "w") as f:
    f.write(config.to_json())
  return str(directory)


def test_a_tokenizer_inside_the_run_is_stored_relative_to_it_and_others_absolute(tmp_path):
  run = str(tmp_path / "run")
  assert tokenizer.for_run(os.path.join(run, "tokenizer"), run) == "tokenizer"
  assert tokenizer.for_run(os.path.join(run, "a", "b"), run) == os.path.join("a", "b")
  assert tokenizer.for_run(str(tmp_path / "shared"), run) == str(tmp_path / "shared")
  assert tokenizer.for_run(str(tmp_path / "run_other"), run) == str(tmp_path / "run_other")
  assert tokenizer.for_run("bytes", run) == "bytes"


def test_a_copied_run_reads_its_own_tokenizer_and_the_original_may_go(tmp_path):
  run = _run(tmp_path / "run", "tokenizer")
  assert config_fields.load_saved(run).data.tokenizer == os.path.join(run, "tokenizer")
  copy = str(tmp_path / "elsewhere" / "copy")
  shutil.copytree(run, copy)
  shutil.rmtree(run)
  assert config_fields.load_saved(copy).data.tokenizer == os.path.join(copy, "tokenizer")
  with open(os.path.join(copy, "config.json")) as f:
    assert json.load(f)["data"]["tokenizer"] == "tokenizer"  # reading changes nothing stored


def test_older_runs_keep_their_absolute_and_command_line_paths(tmp_path, monkeypatch):
  shared = str(tmp_path / "shared_tokenizer")
  old = _run(tmp_path / "old", shared)
  assert config_fields.load_saved(old).data.tokenizer == shared
  # A relative --config.data.tokenizer that the run does not hold: from the current directory.
  monkeypatch.chdir(tmp_path)
  trained = _run(tmp_path / "trained", "shared_tokenizer")
  assert config_fields.load_saved(trained).data.tokenizer == "shared_tokenizer"
  assert config_fields.load_saved(_run(tmp_path / "bytes", "bytes")).data.tokenizer == "bytes"


def test_a_command_lines_relative_tokenizer_is_saved_absolute_and_resumes(tmp_path, monkeypatch):
  """experiments.train saves config_fields.as_saved(config): a relative --config.data.tokenizer
  outside the run as an absolute path (so the run reads it from any directory); the resume check
  compares configs in that form, so the same command resumes, a run saved with the relative path
  too, and another tokenizer is refused."""
  monkeypatch.chdir(tmp_path)
  os.makedirs("shared_tokenizer")
  config = defaults.get_config()
  config.data.tokenizer = "shared_tokenizer"
  run = str(tmp_path / "run")
  assert config_fields.as_saved(config, run).data.tokenizer == str(tmp_path / "shared_tokenizer")
  assert config.data.tokenizer == "shared_tokenizer"  # the config itself is left as given
  monkeypatch.setattr(checks.checkpoints, "steps", lambda workdir: [10])  # a checkpointed run
  for stored in (str(tmp_path / "shared_tokenizer"), "shared_tokenizer"):
    _run(tmp_path / "run", stored)
    checks.check_workdir(run, config)
    other = config.copy_and_resolve_references()
    other.data.tokenizer = "bytes"
    with pytest.raises(ValueError, match="data.tokenizer"):
      checks.check_workdir(run, other)
    shutil.rmtree(run)
