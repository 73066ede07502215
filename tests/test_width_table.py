"""A width sweep's table (research.results.width_table): one table per width, every cell over
seeds with each seed's value, lines best first at the last setting, the state beside them."""

import pytest

from research.results import width_table

ACCURACY = {  # (mixer, width, pairs): accuracy of seeds 0, 1, 2
    ("mha", 64, 4): (1.0, 1.0, 1.0), ("mha", 64, 8): (0.978, 1.0, 0.167),
    ("gla", 64, 4): (0.5, 0.5, 0.5), ("gla", 64, 8): (0.25, 0.3, 0.35),
    ("mha", 32, 4): (1.0, 0.784, 1.0), ("mha", 32, 8): (0.164, 0.151, 0.726),
    ("gla", 32, 4): (0.4, 0.3, 0.2), ("gla", 32, 8): (0.9, 0.9, 0.9),
}


def _rows(drop=()):
  rows = []
  for (mixer, width, pairs), values in ACCURACY.items():
    for seed, value in enumerate(values):
      if (mixer, width, pairs, seed) in drop:
        continue
      length = 16 * pairs
      rows.append({"run": f"{mixer}-{width}-{pairs}-{seed}", "seed": seed,
                   "model.attention": mixer, "model.position": "none",
                   "model.d_model": width, "data.num_kv_pairs": pairs, "train.seq_len": length,
                   "train.seed": seed, "eval_mode": "nonoverlapping", "eval_length": length,
                   "rope_scaling": "none", "step": 400, "train_steps": 400,
                   "accuracy": value, "state_bytes": width * length * 8})
  return rows


def _tables(text):
  """{width: [table lines]} of width.md's text."""
  out, width = {}, None
  for line in text.splitlines():
    if line.startswith("## Width "):
      width = int(line.removeprefix("## Width "))
      out[width] = []
    elif width is not None and line.startswith("|"):
      out[width].append(line)
  return out


def test_each_width_has_a_table_with_every_seed_s_value_best_first(tmp_path):
  assert width_table.write(str(tmp_path), _rows(), "accuracy") == ["width.md"]
  text = (tmp_path / "width.md").read_text()
  tables = _tables(text)
  assert list(tables) == [64, 32]  # widest first
  header = tables[64][0]
  assert header == ("| mixer | state at num_kv_pairs=8 / seq_len=128 | num_kv_pairs=4 / "
                    "seq_len=64 | num_kv_pairs=8 / seq_len=128 |")
  # Width 64: mha is better at 8 pairs (0.715 against 0.300); width 32: gla (0.900 vs 0.347).
  assert [line.split(" | ")[0] for line in tables[64][2:]] == ["| mha / none", "| gla / none"]
  assert [line.split(" | ")[0] for line in tables[32][2:]] == ["| gla / none", "| mha / none"]
  mha_64 = tables[64][2].split(" | ")
  assert mha_64[1] == "64 KiB"  # 64 x 128 x 8 bytes
  assert mha_64[3] == "0.715 +/- 0.388 (0.978, 1.000, 0.167) |"
  assert "Seeds 0, 1, 2." in text


def test_a_cell_missing_a_seed_names_the_seeds_it_has(tmp_path):
  width_table.write(str(tmp_path), _rows(drop={("gla", 32, 4, 1)}), "accuracy")
  gla_32 = next(line for line in _tables((tmp_path / "width.md").read_text())[32]
                if line.startswith("| gla"))
  assert "0.300 +/- 0.100 (seed 0: 0.400, seed 2: 0.200)" in gla_32
  assert "0.900 +/- 0.000 (0.900, 0.900, 0.900)" in gla_32


def test_only_a_sweep_over_width_gets_the_table():
  rows = _rows()
  assert width_table.applies(rows)
  assert not width_table.applies([{k: v for k, v in row.items() if k != "model.d_model"}
                                  for row in rows])


@pytest.mark.parametrize("value, text", [(36 * 1024, "36 KiB"), (43.875 * 1024, "43.88 KiB"),
                                         (1.5 * 2 ** 20, "1.5 MiB"), (512, "512 B")])
def test_state_sizes_read_in_binary_units(value, text):
  from research.results import tables  # noqa: PLC0415
  assert tables.bytes_text(value) == text
