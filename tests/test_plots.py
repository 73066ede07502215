"""The figures, drawn from results rows: readable log ticks, the legend below the panels, one
colour per variant across its RoPE scalings, and titles that say what they show."""

import re
import warnings

import numpy as np
import pytest
from matplotlib.collections import PathCollection

from research.results import plots

LENGTHS = (32, 64, 128, 256)


def _rows():
  """Perplexities of two runs (rope with two scalings, alibi) between 5 and 25: under a decade."""
  rows = []
  for run, position, scalings in (("a", "rope", ("none", "ntk", "yarn")),
                                  ("b", "alibi", ("none",))):
    for k, scaling in enumerate(scalings):
      for i, length in enumerate(LENGTHS):
        rows.append({"run": run, "model.position": position, "eval_mode": "nonoverlapping",
                     "eval_length": length, "rope_scaling": scaling, "step": 8, "train_steps": 8,
                     "perplexity": 5.0 + 5 * i / (k + 1) + (position == "alibi"),
                     "tokens": 16 * length, "loss_by_position": [1.0] * length})
  return rows


@pytest.fixture(scope="module")
def extrapolation_figure():
  figure = plots.extrapolation(_rows(), "perplexity", train_length=32)
  figure.canvas.draw()
  yield figure
  plots.plt.close(figure)


def test_log_axis_ticks_are_plain_numbers(extrapolation_figure):
  ax = extrapolation_figure.axes[0]
  labels = [t.get_text() for t in ax.yaxis.get_ticklabels(which="both") if t.get_text()]
  assert len(labels) >= 3 and all(re.fullmatch(r"\d+(\.\d+)?", label) for label in labels), labels


def test_the_legend_sits_below_the_panels_inside_the_figure(extrapolation_figure):
  (legend,) = extrapolation_figure.legends
  box, axes_box = legend.get_window_extent(), extrapolation_figure.axes[0].get_window_extent()
  assert box.y1 <= axes_box.y0 and 0 <= box.x0 and box.x1 <= extrapolation_figure.bbox.x1


def test_the_scalings_of_a_variant_share_its_colour_in_distinct_line_styles(extrapolation_figure):
  lines = {line.get_label(): line for line in extrapolation_figure.axes[0].get_lines()
           if not line.get_label().startswith("_")}
  assert set(lines) == {"rope", "rope +ntk", "rope +yarn", "alibi"}
  rope = [lines[label] for label in ("rope", "rope +ntk", "rope +yarn")]
  assert len({line.get_color() for line in rope}) == 1
  assert len({line.get_linestyle() for line in rope}) == 3
  assert lines["alibi"].get_color() != rope[0].get_color()


def test_the_loss_by_position_title_names_the_length_and_mode():
  figure = plots.loss_by_position(_rows(), train_length=32)
  assert "non-overlapping windows of 256 tokens" in figure.axes[0].get_title()
  plots.plt.close(figure)


def test_loss_by_position_skips_unscored_positions_without_warnings():
  """Task runs (MQAR) score a few positions: bins where no example is scored stay empty."""
  rows = [dict(row, loss_by_position=[None] * (row["eval_length"] // 2)
               + [2.0] * (row["eval_length"] // 2)) for row in _rows()]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    figure = plots.loss_by_position(rows, train_length=32, bins=4)
  curve = figure.axes[0].get_lines()[0].get_ydata()
  assert np.isnan(curve[:2]).all() and list(curve[2:]) == [2.0, 2.0]
  plots.plt.close(figure)


def test_the_extrapolation_band_spans_the_bootstrap_interval():
  rows = [dict(row, perplexity_ci_low=row["perplexity"] - 1.0,
               perplexity_ci_high=row["perplexity"] + 2.0)
          for row in _rows() if row["model.position"] == "alibi"]
  figure = plots.extrapolation(rows, "perplexity", train_length=32)
  (band,) = figure.axes[0].collections
  ys = band.get_paths()[0].vertices[:, 1]
  want = [row["perplexity"] for row in rows]
  assert min(ys) == pytest.approx(min(want) - 1.0) and max(ys) == pytest.approx(max(want) + 2.0)
  plots.plt.close(figure)


def test_the_width_figure_keeps_each_mixer_one_line_and_lists_every_panel_s_lines():
  """Mixers that read a setting the others do not (model.num_kv_heads: nsa) stay lines beside
  the others, not a panel of their own; the one legend lists every panel's lines, and once the
  colours repeat (24 mixers) the markers tell them apart."""
  mixers = [f"m{i:02d}" for i in range(24)]
  rows = []
  for mixer in mixers:
    for width in (32, 64):
      for pairs in (4, 8):
        row = {"run": f"{mixer}-{width}-{pairs}", "model.attention": mixer,
               "model.position": "none", "model.d_model": width, "data.num_kv_pairs": pairs,
               "eval_mode": "nonoverlapping", "eval_length": 64, "rope_scaling": "none",
               "accuracy": 0.5}
        if mixer == "m00":
          row["model.num_kv_heads"] = 1
        rows.append(row)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no collapsed layout
    figure = plots.width(rows, "accuracy")
    figure.canvas.draw()
  assert [ax.get_title() for ax in figure.axes] == ["num_kv_pairs=4", "num_kv_pairs=8"]
  (legend,) = figure.legends
  labels = [text.get_text() for text in legend.get_texts()]
  assert sorted(labels) == sorted(["m00 / none / num_kv_heads=1"]
                                  + [f"{m} / none" for m in mixers[1:]])
  styles = {(bar.lines[0].get_color(), bar.lines[0].get_marker())
            for bar in figure.axes[0].containers}
  assert len(styles) == len(mixers)
  plots.plt.close(figure)


def test_points_over_several_seeds_show_each_seed_s_value():
  """A recall result hinges on which seeds crossed a transition: beside the mean, each seed's
  value is drawn (hollow markers of the line's colour); one seed draws the mean alone."""
  rows = [{"run": f"mha-{width}-{seed}", "model.attention": "mha", "model.position": "none",
           "model.d_model": width, "data.num_kv_pairs": 4, "eval_mode": "nonoverlapping",
           "eval_length": 64, "rope_scaling": "none", "accuracy": value}
          for width, values in ((32, (0.2, 0.3, 1.0)), (64, (1.0, 1.0, 0.1)))
          for seed, value in enumerate(values)]
  figure = plots.width(rows, "accuracy")
  (ax,) = figure.axes
  (bar,) = ax.containers
  np.testing.assert_allclose(bar.lines[0].get_ydata(), [0.5, 0.7])  # the means
  scattered = lambda axes: [c for c in axes.collections if isinstance(c, PathCollection)]
  (seeds,) = scattered(ax)
  assert sorted(map(tuple, seeds.get_offsets().tolist())) == sorted(
      [(32, 0.2), (32, 0.3), (32, 1.0), (64, 1.0), (64, 1.0), (64, 0.1)])
  plots.plt.close(figure)
  one_seed = plots.width([row for row in rows if row["run"].endswith("-0")], "accuracy")
  assert scattered(one_seed.axes[0]) == []
  plots.plt.close(one_seed)
