"""training_curves.png: each run's metrics.jsonl drawn against the step and the tokens trained on,
for one run and for a sweep, from fake run directories (config.json and metrics.jsonl written
here, no training); the plotted series are checked, not only that a file exists."""

import json
import os

import pytest

from research.evaluation import results as eval_results
from research.results import plots
from research.results import report
from research.results import sweep
from research.results.training_curves import Curve
from tests import tiny_config
from tests import tiny_sweep


def _records(num_steps, log_every=2, eval_every=4, scale=1.0):
  """metrics.jsonl records as research.training.loop writes them (the fields plotted and a few
  others), validation_loss every eval_every steps and at the end."""
  records = []
  for step in range(log_every, num_steps + 1, log_every):
    record = {"step": step, "loss": scale * 4.0 * 0.8 ** step, "learning_rate": 1e-3,
              "tokens_per_second": 1e4}
    if step % eval_every == 0 or step == num_steps:
      record["validation_loss"] = scale * 4.5 * 0.8 ** step
    records.append(record)
  return records


def _write_run(directory, config, records=None, evaluated=False):
  """A run directory: config.json, metrics.jsonl of `records` (none: no file) and, if evaluated,
  an eval.json row per evaluation length."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    f.write(config.to_json())
  if records is not None:
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
      f.writelines(json.dumps(record) + "\n" for record in records)
  if evaluated:
    eval_results.append(directory, [
        {"step": config.train.num_steps, "eval_length": length, "eval_mode": "nonoverlapping",
         "rope_scaling": "none", "num_tokens": 0, "sliding_stride": 0, "bootstrap_samples": 10,
         "bootstrap_seed": 0, "loss": 1.0, "perplexity": 2.7, "accuracy": 0.5,
         "exact_match": 0.0, "tokens": 64, "sequences": 2, "loss_by_position": [1.0] * length}
        for length in config.eval.lengths])


def _lines(figure):
  """{gid: (x, y)} of the lines of each panel: [step panel, tokens panel]."""
  return [{line.get_gid(): (list(line.get_xdata()), list(line.get_ydata()))
           for line in ax.get_lines()} for ax in figure.axes]


def test_a_single_run_s_curves_hold_its_logged_steps_and_tokens(tmp_path):
  config = tiny_config.get_config()
  workdir = str(tmp_path / "alibi")
  records = _records(config.train.num_steps)
  _write_run(workdir, config, records)
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write('{"step": 10, "lo')  # a record being appended by the run still training
  written = report.write(workdir)
  assert written.files == ["results.csv", "summary.md", "training_curves.png"]
  assert written.missing == ["alibi"]  # not evaluated yet, but its curves are drawn
  assert os.path.getsize(os.path.join(workdir, "training_curves.png")) > 0

  curves, title, without = report.curves(workdir)
  assert without == [] and [curve.run for curve in curves] == ["alibi"]
  assert title == "Training loss of run alibi on stdlib_bytes: 8 steps of 8 sequences x 32 tokens"
  figure = plots.training_curves(curves, title)
  by_step, by_tokens = _lines(figure)
  steps, losses = [2, 4, 6, 8], [r["loss"] for r in records]
  assert by_step["alibi"] == (steps, losses)
  assert by_step["alibi validation"] == ([4, 8], [r["validation_loss"] for r in records[1::2]])
  assert by_tokens["alibi"] == ([s * 8 * 32 for s in steps], losses)
  assert by_tokens["alibi validation"][0] == [4 * 256, 8 * 256]
  assert figure.get_suptitle() == title
  assert figure.axes[0].get_xlabel() == "training step"
  assert "step x train.batch_size x train.seq_len" in figure.axes[1].get_xlabel()
  assert figure.axes[0].get_ylabel().startswith("loss")
  assert figure.axes[0].get_yscale() == "linear"  # losses within a decade
  (legend,) = figure.legends
  assert [text.get_text() for text in legend.get_texts()] == ["alibi"]  # nothing swept
  plots.plt.close(figure)


def test_a_run_without_metrics_draws_no_curves_and_misses_none(tmp_path):
  """Results copied without their training logs: the other figures as before, no empty figure."""
  config = tiny_config.get_config()
  _write_run(str(tmp_path), config, evaluated=True)
  written = report.write(str(tmp_path))
  assert "training_curves.png" not in written.files and "extrapolation.png" in written.files
  assert written.missing == []


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
  """Two seeds of mha / alibi and mha / rope at length 64 (logged and evaluated), gqa / rope
  evaluated without metrics.jsonl, linear / alibi skipped (no run directory)."""
  workdir = str(tmp_path_factory.mktemp("sweep"))
  config = tiny_sweep.get_config()
  members = sweep.expand([
      {"model.attention": "mha", "model.position": "alibi", "train.seed": 0},
      {"model.attention": "mha", "model.position": "alibi", "train.seed": 1},
      {"model.attention": "mha", "model.position": "rope", "train.seq_len": 64},
      {"model.attention": "gqa", "model.position": "rope"},
      {"model.attention": "linear", "model.position": "alibi"}], config, num_devices=8)
  sweep.check_sweep_workdir(workdir, config, members)
  for index, member in enumerate(members[:4]):
    records = _records(member.config.train.num_steps, scale=1 + index) if index < 3 else None
    _write_run(sweep.run_dir(workdir, member), member.config, records, evaluated=True)
  return workdir, members


def test_a_sweep_draws_one_line_per_logged_member_and_names_the_others(sweep_dir):
  workdir, members = sweep_dir
  names = [member.name for member in members]
  written = report.write(workdir)
  assert "training_curves.png" in written.files and "extrapolation.png" in written.files
  assert os.path.getsize(os.path.join(workdir, "training_curves.png")) > 0
  assert written.missing == [names[4], names[3]]  # skipped; evaluated but no metrics.jsonl

  curves, title, without = report.curves(workdir)
  assert without == names[3:]
  assert [(curve.run, curve.label, curve.tokens_per_step) for curve in curves] == [
      (names[0], "mha / alibi / seq_len=32", 8 * 32),
      (names[1], "mha / alibi / seq_len=32", 8 * 32),
      (names[2], "mha / rope / seq_len=64", 8 * 64)]
  assert title == (f"Training loss of sweep {os.path.basename(workdir)} (3 runs) on "
                   "stdlib_bytes: 4 steps of 8 sequences x 32/64 tokens")
  figure = plots.training_curves(curves, title)
  by_step, by_tokens = _lines(figure)
  for index, name in enumerate(names[:3]):
    records = _records(4, scale=1 + index)
    assert by_step[name] == ([2, 4], [r["loss"] for r in records])
    assert by_step[f"{name} validation"] == ([4], [records[1]["validation_loss"]])
    assert by_tokens[name][0] == [2 * curves[index].tokens_per_step,
                                  4 * curves[index].tokens_per_step]
  (legend,) = figure.legends
  assert [text.get_text() for text in legend.get_texts()] == [
      "mha / alibi / seq_len=32 (2 seeds)", "mha / rope / seq_len=64"]
  colors = {gid: line.get_color() for gid, line in
            ((line.get_gid(), line) for line in figure.axes[0].get_lines())}
  assert colors[names[0]] == colors[names[1]] != colors[names[2]]  # the seeds share a colour
  assert colors[f"{names[2]} validation"] == colors[names[2]]
  plots.plt.close(figure)

  # The variants' colours are those of the other figures showing the same runs.
  rows = [row for row in report.collect(workdir)[0] if row["run"] in names[:3]]
  extrapolation = plots.extrapolation(rows, "perplexity", train_length=32)
  assert {line.get_label(): line.get_color() for line in extrapolation.axes[0].get_lines()
          if not line.get_label().startswith("_")} == {
              "mha / alibi / seq_len=32": colors[names[0]],
              "mha / rope / seq_len=64": colors[names[2]]}
  plots.plt.close(extrapolation)


def test_a_large_sweep_keeps_the_legend_below_and_marks_repeated_colours():
  """More variants than colours: the legend sits below the panels, inside the figure, and the
  lines carry their variant's marker so that repeated colours stay apart. A task's loss falling
  by decades gets a log axis."""
  curves = [Curve(f"run{i}", f"variant {i}", [1, 2, 3], [3.0, 0.5, 0.01 + i / 1000], [3], [0.1],
                  64) for i in range(30)]
  figure = plots.training_curves(curves, "thirty runs")
  figure.canvas.draw()
  (legend,) = figure.legends
  assert len(legend.get_texts()) == 30
  box, axes_box = legend.get_window_extent(), figure.axes[0].get_window_extent()
  assert box.y1 <= axes_box.y0 and 0 <= box.x0 and box.x1 <= figure.bbox.x1
  styles = {(line.get_color(), line.get_marker()) for line in figure.axes[0].get_lines()
            if not line.get_gid().endswith("validation")}
  assert len(styles) == 30
  ax = figure.axes[0]  # losses over two decades: a log axis, in plain numbers
  labels = [t.get_text() for t in ax.yaxis.get_ticklabels(which="both") if t.get_text()]
  assert ax.get_yscale() == "log" and {"0.01", "0.1", "1"} <= set(labels), labels
  plots.plt.close(figure)

