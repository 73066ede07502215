"""Datasets and input pipeline: TFDS builders (synthetic tasks, byte-level text) read with
tfds.data_source into deterministic numpy batches.

  validate(config)           ValueError naming what is wrong and what would be valid
  prepare(config)            build the configured dataset once per data dir (process-safe)
  train_batch(config, step, process_index=0, process_count=1)
                             this process's rows of the global batch of `step`
  eval_batches(config, length, mode, split="validation", depth=None)
                             evaluation batches at `length` inputs (of one needle depth)
  eval_depths(config)        needle depths evaluated per length; (None,) for other datasets
  vocab_size(config)         token ids the dataset uses (model.vocab_size must be >= this)
  is_language_modeling(config)  True for the corpora (loss, perplexity), False for tasks
  is_text(config)            True for the corpora and the needle tasks (text, then tokens)

Batches are dicts of numpy arrays `inputs`, `targets` (int32) and `loss_mask` (float32), and with
data.packing = "documents" (language modeling) `segments` and `positions` (int32) too.
"""

from research.data.catalog import NAMES
from research.data.catalog import NEEDLE_NAMES
from research.data.catalog import eval_depths
from research.data.catalog import is_language_modeling
from research.data.catalog import is_text
from research.data.catalog import vocab_size
from research.data.packing import PACKINGS
from research.data.pipeline import eval_batches
from research.data.pipeline import prepare
from research.data.pipeline import train_batch
from research.data.validation import EVAL_MODES
from research.data.validation import validate
from research.data.vocab import BYTE_VOCAB_SIZE
from research.data.vocab import EOD
from research.data.vocab import PAD
