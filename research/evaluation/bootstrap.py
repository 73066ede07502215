"""Percentile bootstrap intervals of statistics over evaluation rows (windows or examples).

A statistic is a function of column sums, e.g. loss = sum(nll) / sum(tokens). Its interval at
level 1 - alpha resamples the N rows with replacement `samples` times (a seeded generator, so the
interval is reproducible), computes the statistic on each resample's sums, and takes the alpha/2
and 1 - alpha/2 quantiles (Efron and Tibshirani, An Introduction to the Bootstrap, ch. 13).
Rows are the unit because tokens of one window or example are not independent.
"""

from typing import Callable

import numpy as np

Statistic = Callable[[dict[str, np.ndarray]], np.ndarray]
_CHUNK = 1 << 22  # resampled row values held at once


def intervals(rows: dict[str, np.ndarray], statistics: dict[str, Statistic], samples: int,
              seed: int, level: float = 0.95) -> dict[str, tuple[float, float]]:
  """{name: (low, high)}: the percentile interval of every statistic over resampled rows.

  `rows` maps column names to arrays of one value (or one vector: class counts) per row, all of
  the same length N >= 1.
  """
  num_rows = len(next(iter(rows.values())))
  if num_rows < 1 or samples < 1:
    raise ValueError(f"bootstrap needs >= 1 row and >= 1 sample, got {num_rows} and {samples}")
  rng = np.random.default_rng(seed)
  columns = {name: np.asarray(values, np.float64) for name, values in rows.items()}
  values = {name: [] for name in statistics}
  width = max(int(np.prod(column.shape[1:])) for column in columns.values())
  per_chunk = max(1, _CHUNK // (num_rows * width))
  for first in range(0, samples, per_chunk):
    index = rng.integers(0, num_rows, (min(per_chunk, samples - first), num_rows))
    sums = {name: column[index].sum(axis=1) for name, column in columns.items()}
    for name, statistic in statistics.items():
      values[name].append(statistic(sums))
  alpha = 1 - level
  return {name: tuple(float(q) for q in np.quantile(np.concatenate(v), [alpha / 2, 1 - alpha / 2]))
          for name, v in values.items()}
