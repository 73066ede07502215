"""research.load_run, a trained run in a notebook: on a tiny run trained on a (2, 2, 2) mesh of the
8 fake devices, its logits are the model's forward (and those of the checkpoint restored on its own
mesh), its loss their mean cross-entropy, its generation experiments.generate's, its evaluation
experiments.evaluate's rows without writing into the run, its attention maps probabilities; and the
example of docs/evaluation.md runs."""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research import load_run
from research.analysis import loaded
from research.evaluation import extrapolation
from research.evaluation import generate
from research.model import sharding
from research.runs import checkpoints
from research.training import loop as train
from tests import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "import os\nfor line in lines:\n"
PROMPT = "def "
QUIET = dict(log=lambda line: None)


@pytest.fixture(scope="module")
def run_222(tmp_path_factory):
  """(config, workdir) of tests/tiny_config.py (one mha / rope layer, byte tokens) trained on a
  (2, 2, 2) mesh: 8 steps, checkpoints 4 and 8."""
  config = tiny_config.get_config()
  config.mesh.shape = (2, 2, 2)
  workdir = str(tmp_path_factory.mktemp("load_run") / "run")
  train.train_and_evaluate(config, workdir)
  return config, workdir


@pytest.fixture(scope="module")
def run(run_222):
  return load_run(run_222[1], **QUIET)


def test_loads_the_newest_checkpoint_on_one_device_or_the_step_asked(run, run_222):
  assert run.step == 8 and run.config.to_dict() == generate.run_config(run_222[1]).to_dict()
  assert run.tokenizer.encode("ab").tolist() == [97, 98]
  assert {a.sharding.device_set == {jax.devices()[0]}
          for a in jax.tree.leaves(nnx.state(run.model))} == {True}
  assert load_run(run_222[1], step=4, **QUIET).step == 4


def test_logits_are_the_models_forward_on_the_runs_tokens(run):
  ids = run.tokenizer.encode(TEXT)
  logits = run.logits(TEXT)
  assert logits.dtype == np.float32 and logits.shape == (1, len(ids), 258)
  np.testing.assert_allclose(logits, run.model(jnp.asarray([ids], jnp.int32)), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(run.logits(ids.tolist()), logits)  # ids [T]
  np.testing.assert_allclose(run.logits(np.stack([ids, ids]))[1], logits[0], rtol=1e-5,
                             atol=1e-6)  # [B, T]


def test_loss_is_the_mean_next_token_cross_entropy_of_the_logits(run):
  ids = run.tokenizer.encode(TEXT)
  logits = run.logits(TEXT)[0].astype(np.float64)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -log_probs[np.arange(len(ids) - 1), ids[1:]].mean()
  assert run.loss(TEXT) == pytest.approx(nll, rel=1e-5)
  with pytest.raises(ValueError, match="at least two tokens"):
    run.loss("a")


def test_generation_is_experiments_generates(run, run_222):
  greedy = run.generate(PROMPT, max_new_tokens=8)
  assert isinstance(greedy, str) and run.generate(PROMPT, max_new_tokens=8) == greedy
  _, want = generate.generate_from_run(run_222[1], PROMPT, 8, **QUIET)
  assert greedy == want.text
  _, want = generate.generate_from_run(run_222[1], PROMPT, 8, temperature=1.0, seed=3, **QUIET)
  assert run.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=3) == want.text
  with pytest.raises(ValueError, match=r"the prompt is empty.*top_k=300 must be in \[0, 258\]"):
    run.generate("", top_k=300)


def test_evaluate_returns_evaluate_runs_rows_and_writes_nothing_into_the_run(run, run_222,
                                                                             tmp_path):
  config, workdir = run_222
  before = sorted(os.listdir(workdir))
  rows = run.evaluate(lengths=(32, 64), modes=("nonoverlapping",))
  assert sorted(os.listdir(workdir)) == before
  assert [(row["eval_length"], row["eval_mode"], row["step"]) for row in rows] == [
      (32, "nonoverlapping", 8), (64, "nonoverlapping", 8)]
  config = config.copy_and_resolve_references()
  config.eval.modes = ("nonoverlapping",)
  copy = shutil.copytree(workdir, tmp_path / "run")
  own = extrapolation.evaluate_run(config, str(copy), progress=lambda line: None)
  np.testing.assert_allclose([row["loss"] for row in rows], [row["loss"] for row in own],
                             rtol=1e-5)
  with pytest.raises(ValueError, match="unknown eval settings length; valid: .*lengths"):
    run.evaluate(length=(32,))


def test_attention_maps_are_the_softmax_layers_probabilities(run):
  tokens = len(run.tokenizer.encode(TEXT))
  maps = run.attention_maps(TEXT)
  assert list(maps) == [0]  # the one layer, mha
  assert maps[0].shape == (4, tokens, tokens)
  np.testing.assert_allclose(maps[0].sum(-1), 1.0, rtol=1e-5)
  assert np.all(np.triu(maps[0], k=1) == 0)  # causal: no query sees a later key


def test_a_run_trained_on_a_222_mesh_gives_the_logits_of_its_own_mesh(run, run_222):
  config, workdir = run_222
  mesh = sharding.make_mesh(config.mesh.shape)
  graphdef, abstract = nnx.split(generate.abstract_model(run.config))
  _, own = checkpoints.restore_params(workdir, sharding.sharded_abstract(abstract, mesh), **QUIET)
  assert {len(a.sharding.device_set) for a in jax.tree.leaves(own)} == {8}
  tokens = jnp.asarray([run.tokenizer.encode(TEXT)], jnp.int32)
  with jax.set_mesh(mesh):
    want = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))(own, tokens)
  np.testing.assert_allclose(run.logits(TEXT), want, rtol=1e-5, atol=1e-5)


def test_bad_workdirs_and_inputs_say_what_to_give(run, run_222, tmp_path):
  with pytest.raises(ValueError, match="holds neither a run"):
    load_run(str(tmp_path / "missing"))
  untrained = tmp_path / "untrained"
  untrained.mkdir()
  shutil.copy(os.path.join(run_222[1], "config.json"), untrained)
  with pytest.raises(FileNotFoundError, match="has no checkpoint yet; train it first"):
    load_run(str(untrained))
  with pytest.raises(ValueError, match=r"token ids must be in \[0, 258\)"):
    run.logits([[1, 300]])
  with pytest.raises(ValueError, match=r"of shape \[T\] or \[B, T\], not float64 of shape"):
    run.logits(np.zeros((2, 3)))
  with pytest.raises(ValueError, match="attention maps are of one sequence; give one, not 2"):
    run.attention_maps([[1, 2], [3, 4]])
  task = run.config.copy_and_resolve_references()
  task.data.name = "copy"
  with pytest.raises(ValueError, match="a synthetic task with its own symbols.*give token ids"):
    loaded.LoadedRun(run_222[1], task, run.step, run.model, print).logits("abc")


def _docs_example():
  """The python block of docs/evaluation.md's section on load_run."""
  with open(os.path.join(ROOT, "docs", "evaluation.md")) as f:
    section = f.read().split("## In a notebook: research.load_run", 1)[1]
  return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_the_docs_example_runs(run_222, capsys):
  example = _docs_example()
  assert len(example.splitlines()) <= 10 and '"runs/alibi"' in example
  exec(example.replace('"runs/alibi"', json.dumps(run_222[1])), {})  # noqa: S102 (our docs)
  printed = capsys.readouterr().out.splitlines()
  assert printed[0].startswith("8 (1, 11, 258) ")
  assert [line.split()[:2] for line in printed[-2:]] == [["128", "nonoverlapping"],
                                                         ["1024", "nonoverlapping"]]
