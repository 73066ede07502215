"""Runs move between meshes: a run trained on a (2, 2, 2) mesh of the 8 fake devices evaluates on
one device (experiments.evaluate in a process that has one, where the run's mesh does not fit) and
on (4, 1, 2) to the losses it has on its own mesh, restores on one device for generation and
analysis, and resumes training on (8, 1, 1) from its checkpoint to the losses of the uninterrupted
run (docs/evaluation.md, docs/training.md)."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from research.evaluation import extrapolation
from research.evaluation import generate
from research.evaluation import results as eval_results
from research.model import sharding
from research.runs import checkpoints
from research.runs import config_fields
from research.training import loop as train
from tests import tiny_config
from tests.test_train import ROOT, _env, _final_params, _losses


@pytest.fixture(scope="module")
def run_222(tmp_path_factory):
  """(config, workdir) of tests/tiny_config.py trained on a (2, 2, 2) mesh: 8 steps,
  checkpoints 4 and 8. Tests that change the workdir work on a copy."""
  config = tiny_config.get_config()
  config.mesh.shape = (2, 2, 2)
  workdir = str(tmp_path_factory.mktemp("mesh_222") / "run")
  train.train_and_evaluate(config, workdir)
  return config, workdir


def _copy(trained, path):
  shutil.copytree(trained, path)
  return str(path)


def _losses_by_key(rows):
  return {eval_results.key(row): row["loss"] for row in rows}


def _evaluate(workdir, num_devices, *overrides):
  """experiments.evaluate of `workdir` in a process with `num_devices` CPU devices (started)."""
  return subprocess.Popen([sys.executable, "-m", "experiments.evaluate", f"--workdir={workdir}",
                           *overrides], env=_env(num_devices), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def test_a_run_evaluates_on_one_device_and_on_another_mesh_to_the_same_losses(run_222,
                                                                               tmp_path):
  config, trained = run_222
  one, other = _copy(trained, tmp_path / "one"), _copy(trained, tmp_path / "other")
  # On a machine with one device, given the run alone (its mesh needs 8); and on 8 devices with
  # --config.mesh.shape, a layout that evaluation may change.
  processes = {one: _evaluate(one, 1), other: _evaluate(other, 8, "--config.mesh.shape=(4,1,2)")}
  own = _losses_by_key(extrapolation.evaluate_run(config, _copy(trained, tmp_path / "own"),
                                                  progress=lambda line: None))
  assert len(own) == 4  # lengths 32 and 64, non-overlapping and sliding windows
  outputs = {}
  for workdir, process in processes.items():
    outputs[workdir], errors = process.communicate()
    assert process.returncode == 0, errors[-3000:]
    losses = _losses_by_key(eval_results.read(workdir))
    assert losses.keys() == own.keys()
    np.testing.assert_allclose([losses[key] for key in own], list(own.values()), rtol=1e-5)
  (note,) = [line for line in outputs[one].splitlines() if "mesh (" in line]
  assert note.startswith("one: mesh (1, 1, 1) (data, fsdp, tensor) instead of the run's "
                         "mesh.shape=(2, 2, 2), which does not fit 1 device"), note
  assert "mesh (" not in outputs[other]  # the mesh asked for fits: no note


def test_generation_and_analysis_restore_a_222_run_on_one_device(run_222):
  """generate.restore, which research.analysis.trained reads checkpoints with, gives the values
  that the checkpoint has on its own mesh, on one device."""
  _, trained = run_222
  config = config_fields.load_saved(trained)
  step, model = generate.restore(config, trained, log=lambda line: None)
  mesh = sharding.make_mesh(config.mesh.shape)
  _, own = checkpoints.restore_params(
      trained, sharding.sharded_abstract(nnx.state(generate.abstract_model(config)), mesh),
      log=lambda line: None)
  assert step == 8
  for got, want in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(own), strict=True):
    assert got.sharding.device_set == {jax.devices()[0]}
    assert len(want.sharding.device_set) == 8
    np.testing.assert_array_equal(got, want)


def test_a_222_run_resumes_on_811_from_its_checkpoint(run_222, tmp_path, capsys):
  config, trained = run_222
  workdir = _copy(trained, tmp_path / "run")
  shutil.rmtree(os.path.join(checkpoints.directory(workdir), "8"))  # stopped between 4 and 8
  moved = config.copy_and_resolve_references()
  moved.mesh.shape = (8, 1, 1)
  capsys.readouterr()
  train.train_and_evaluate(moved, workdir)
  assert f"resuming {workdir} from step 4" in capsys.readouterr().out
  assert checkpoints.steps(workdir) == [4, 8]
  np.testing.assert_allclose(_losses(workdir), _losses(trained), rtol=1e-4)
  for got, want in zip(_final_params(workdir), _final_params(trained), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
