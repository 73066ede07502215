"""Prepared datasets on disk, and the cached handles that read them.

prepare() builds a dataset at most once per data dir: holding an exclusive fcntl lock on
<data_dir>/locks/<tfds name>.lock it asks TFDS again whether the dataset is there, and otherwise
runs download_and_prepare, which writes an `incomplete.*` directory and renames it into place.
So concurrent processes build a dataset once and a partial dataset is never read as complete.
A corpus split is read once into a packed token stream, its documents' bytes each followed by
END_OF_DOCUMENT, stored as little-endian uint16 in <data_dir>/streams/ (written to a temporary
file, then renamed) and memory-mapped. A task's train split is likewise read once into two
arrays in <data_dir>/examples/, each example's tokens (inputs then the last target, uint16) and
its loss mask (uint8), so that a training batch is a memory-mapped gather rather than a TFDS
decode per example; a split whose targets are not its inputs shifted by one (MAD's selective
copying, memorization, compression: research.data.mad) also gets an array of its inputs. Data
sources, streams and example arrays are cached per (dataset, data dir, split) for the life of
the process.
"""

import fcntl
import os
import tempfile

import numpy as np
import tensorflow_datasets as tfds

from research.data import catalog
from research.data import tokenizer

tfds.disable_progress_bar()  # preparation is quick and logs one line; bars flood job logs

_PREPARED = set()
_SOURCES = {}
_STREAMS = {}
_EXAMPLES = {}
_READ_CHUNK = 1024  # examples decoded at once while writing the example arrays


def data_dir(config):
  """config.data.dir, or $RESEARCH_DATA_DIR, or ~/.cache/research_data, as an absolute path."""
  path = config.data.dir or os.environ.get("RESEARCH_DATA_DIR") or "~/.cache/research_data"
  return os.path.abspath(os.path.expanduser(path))


def check_available(dataset, data_dir):
  """Raises ValueError if a named corpus is neither prepared in data_dir nor downloadable."""
  if dataset.download is None or dataset.make_builder(data_dir).is_prepared():
    return
  host, port = dataset.download.host
  if not catalog.reachable(host, port):
    raise ValueError(
        f"data.name={dataset.name!r} is not prepared in {data_dir} and cannot be downloaded: "
        f"{host}:{port} is unreachable (offline). Use a local builder instead: "
        f"{' or '.join(catalog.LOCAL_CORPORA)} (byte-level text from this machine; text_dir reads "
        f"data.corpus_path), or a synthetic task ({', '.join(catalog.TASK_NAMES)}); or prepare "
        f"{dataset.name} into data.dir on a machine with network (TFDS's {dataset.name} builder "
        "needs TensorFlow to prepare).")


def prepare(dataset, data_dir):
  """Makes sure `dataset` is prepared in data_dir (idempotent, safe across processes)."""
  key = (dataset.tfds_name, data_dir)
  if key in _PREPARED:
    return
  check_available(dataset, data_dir)
  if not dataset.make_builder(data_dir).is_prepared():
    lock_path = os.path.join(data_dir, "locks", f"{dataset.tfds_name}.lock")
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    with open(lock_path, "a") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      builder = dataset.make_builder(data_dir)  # sees what another process finished meanwhile
      if not builder.is_prepared():
        builder.download_and_prepare()
  _PREPARED.add(key)


def source(dataset, data_dir, tfds_split):
  """The random-access tfds.data_source of one split."""
  key = (dataset.tfds_name, data_dir, tfds_split)
  if key not in _SOURCES:
    prepare(dataset, data_dir)
    _SOURCES[key] = tfds.data_source(
        dataset.tfds_name, split=tfds_split, data_dir=data_dir, download=False)
  return _SOURCES[key]


def _temporary_path(path):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".incomplete-")
  os.close(fd)
  return tmp


def _inputs_path(tokens_path):
  return tokens_path.replace(".tokens.npy", ".inputs.npy")


def _write_example_arrays(examples, tokens_path, mask_path, dtype):
  """Writes every example's tokens and mask, and its inputs if some example's targets are not
  its inputs shifted by one; the mask file, renamed last, marks completion."""
  first = examples[0]
  shape = (len(examples), first["inputs"].size)
  tmp_tokens, tmp_mask = _temporary_path(tokens_path), _temporary_path(mask_path)
  tmp_inputs = _temporary_path(_inputs_path(tokens_path))
  tokens = np.lib.format.open_memmap(tmp_tokens, "w+", dtype, (shape[0], shape[1] + 1))
  mask = np.lib.format.open_memmap(tmp_mask, "w+", np.uint8, shape)
  inputs = np.lib.format.open_memmap(tmp_inputs, "w+", dtype, shape)
  shifted = True
  for start in range(0, shape[0], _READ_CHUNK):
    chunk = examples.__getitems__(range(start, min(start + _READ_CHUNK, shape[0])))
    rows = slice(start, start + len(chunk))
    inputs[rows] = np.stack([example["inputs"] for example in chunk])
    tokens[rows, 0] = inputs[rows, 0]
    tokens[rows, 1:] = np.stack([example["targets"] for example in chunk])
    shifted = shifted and np.array_equal(inputs[rows, 1:], tokens[rows, 1:-1])
    mask[rows] = np.stack([example["loss_mask"] for example in chunk])
  written = [(tokens, tmp_tokens, tokens_path), (mask, tmp_mask, mask_path)]
  if shifted:
    del inputs
    os.remove(tmp_inputs)
  else:
    written.insert(0, (inputs, tmp_inputs, _inputs_path(tokens_path)))
  for array, tmp, path in written:
    array.flush()
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the prepared data is shared
    os.replace(tmp, path)


def example_arrays(dataset, data_dir, split):
  """(tokens [N, L + 1] uint16 (uint32 with a tokenizer), loss_mask [N, L] uint8) of a task
  split whose N examples all have L inputs (inputs = tokens[:, :-1], targets = tokens[:, 1:],
  unless example_inputs gives the inputs), read-only memory maps."""
  key = (dataset.tfds_name, data_dir, split)
  if key not in _EXAMPLES:
    directory = os.path.join(data_dir, "examples", dataset.tfds_name, dataset.version)
    tokens_path = os.path.join(directory, f"{split}.tokens.npy")
    mask_path = os.path.join(directory, f"{split}.loss_mask.npy")
    if not (os.path.exists(tokens_path) and os.path.exists(mask_path)):
      _write_example_arrays(source(dataset, data_dir, split), tokens_path, mask_path,
                            dataset.token_dtype)
    _EXAMPLES[key] = (np.load(tokens_path, mmap_mode="r"), np.load(mask_path, mmap_mode="r"))
  return _EXAMPLES[key]


def example_inputs(dataset, data_dir, split):
  """The inputs [N, L] (uint16, memory-mapped) of a task split whose targets are not its inputs
  shifted by one; None for the others (inputs = tokens[:, :-1] of example_arrays)."""
  tokens, _ = example_arrays(dataset, data_dir, split)
  path = _inputs_path(tokens.filename)
  key = (dataset.tfds_name, data_dir, split, "inputs")
  if key not in _EXAMPLES:
    _EXAMPLES[key] = np.load(path, mmap_mode="r") if os.path.exists(path) else None
  return _EXAMPLES[key]


def _write_stream(documents, text_feature, path, tokens):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".incomplete-")
  eod = np.array([tokens.eod], tokens.dtype).tobytes()
  with os.fdopen(fd, "wb") as f:
    for i in range(len(documents)):
      f.write(tokens.encode(documents[i][text_feature]).astype(tokens.dtype).tobytes() + eod)
  os.chmod(tmp, 0o644)  # mkstemp makes it private; the prepared data is shared
  os.replace(tmp, path)


def token_stream(dataset, data_dir, split, tokens=tokenizer.ByteTokenizer()):
  """The packed token stream of a corpus split as `tokens` (research.data.tokenizer) encodes it,
  a read-only array (uint16 for bytes, uint32 for a tokenizer), written once per tokenizer."""
  tfds_split = dataset.splits[split]
  key = (dataset.tfds_name, data_dir, tfds_split, tokens.digest)
  if key not in _STREAMS:
    streams = os.path.join(data_dir, "streams", *([f"tokenizer_{tokens.digest}"]
                                                   if tokens.digest else []))
    path = os.path.join(streams, dataset.tfds_name, dataset.version,
                        f"{tfds_split}.{'uint16' if tokens.dtype.itemsize == 2 else 'uint32'}")
    if not os.path.exists(path):
      _write_stream(source(dataset, data_dir, tfds_split), dataset.text_feature, path, tokens)
    if os.path.getsize(path) == 0:
      raise ValueError(f"the {split} split of data.name={dataset.name!r} has no documents")
    _STREAMS[key] = np.memmap(path, dtype=tokens.dtype, mode="r")
  return _STREAMS[key]
