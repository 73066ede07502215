"""A run directory written by an earlier version of the code (tests/fixtures/run_e4f910a: a tiny
GQA / ALiBi run trained and evaluated at commit e4f910a, before the attention core and the
package layout) still loads: its config over today's defaults, its checkpoint into today's
model, which gives the logits that code computed, and its eval.json rows."""

import os
import shutil

import jax.numpy as jnp
import numpy as np
from flax import nnx

import research
from research.evaluation import results as eval_results
from research.runs import checkpoints, config_fields

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
