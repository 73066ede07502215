"""How the corpora's text becomes token ids: data.tokenizer.

  "bytes"   the default: tokens 0..255 are the UTF-8 bytes, END_OF_DOCUMENT = 256 separates
            documents and PAD = 257 fills evaluation windows past the end (research.data.vocab)
  DIR       a Hugging Face tokenizer: DIR/tokenizer.json read with the `tokenizers` library
            (experiments.import_hf copies it into RUN/tokenizer); documents are separated by the
            tokenizer's end-of-sequence token (tokenizer_config.json's eos_token) and windows are
            padded with it (padding is never scored)

Where DIR lies: on a command line, a relative DIR is taken from the current directory, as any
path. In a run's config.json, a DIR inside the run is stored relative to the run (`for_run`:
"tokenizer" is RUN/tokenizer, what experiments.import_hf writes), so that a copied or moved run
still finds it, and any other DIR absolute (experiments.train and import_hf both save so:
research.runs.config_fields.as_saved); reading the run (config_fields.load_saved) turns it back
into a path from here (`from_run`). A relative DIR that the run does not hold (runs saved before
as_saved kept the command line's value) is read from the current directory.

Used for the language-modeling corpora (training and evaluation streams), the needle tasks (their
text rendered, then tokenized: research.data.needles) and generation; the synthetic tasks build
their own symbol ids and refuse a tokenizer.
"""

import functools
import hashlib
import json
import os

import numpy as np

from research.data import vocab

BYTES = "bytes"


class ByteTokenizer:
  name = BYTES
  vocab_size = vocab.BYTE_VOCAB_SIZE
  eod = vocab.EOD
  pad = vocab.PAD
  dtype = np.dtype("<u2")
  digest = ""  # the byte streams keep the paths they always had

  @staticmethod
  def encode(text) -> np.ndarray:
    text = text.encode() if isinstance(text, str) else text
    return np.frombuffer(text, np.uint8).astype(np.int64)

  @staticmethod
  def label(token) -> str:
    """A one-character label of the token for figures."""
    return chr(token) if 32 <= token < 127 else "·"

  def decode(self, tokens) -> str:
    tokens = list(tokens)
    end = tokens.index(self.eod) if self.eod in tokens else len(tokens)
    return bytes(t for t in tokens[:end] if t < 256).decode("utf-8", errors="replace")


class FileTokenizer:
  """A Hugging Face tokenizer.json (and tokenizer_config.json's eos_token) in `directory`."""

  dtype = np.dtype("<u4")

  def __init__(self, directory):
    import tokenizers  # noqa: PLC0415 (only for a run with a tokenizer)
    path = os.path.join(directory, "tokenizer.json")
    self.name = os.path.abspath(directory)
    self.tokenizer = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
    eos = _eos_token(directory)
    self.eod = self.tokenizer.token_to_id(eos)
    if self.eod is None:
      raise ValueError(f"the end-of-sequence token {eos!r} of {directory} is not in its "
                       "tokenizer.json")
    self.pad = self.eod
    with open(path, "rb") as f:
      self.digest = hashlib.sha256(f.read()).hexdigest()[:12] + f"_{self.eod}"

  def encode(self, text) -> np.ndarray:
    text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int64)

  def label(self, token) -> str:
    return self.tokenizer.id_to_token(int(token)) or "·"

  def decode(self, tokens) -> str:
    tokens = list(tokens)
    end = tokens.index(self.eod) if self.eod in tokens else len(tokens)
    return self.tokenizer.decode(tokens[:end], skip_special_tokens=False)


def _eos_token(directory) -> str:
  path = os.path.join(directory, "tokenizer_config.json")
  eos = None
  if os.path.exists(path):
    with open(path) as f:
      eos = json.load(f).get("eos_token")
  eos = eos.get("content") if isinstance(eos, dict) else eos
  if not eos:
    raise ValueError(f"{directory} names no end-of-sequence token: add "
                     '{"eos_token": "<its text>"} to its tokenizer_config.json')
  return eos


def check(name: str):
  """ValueError if data.tokenizer is neither "bytes" nor a directory with a tokenizer.json."""
  if name != BYTES and not os.path.exists(os.path.join(name, "tokenizer.json")):
    raise ValueError(f"data.tokenizer={name!r} is neither 'bytes' nor a directory holding a "
                     "Hugging Face tokenizer.json")


def for_run(name: str, run_dir: str) -> str:
  """data.tokenizer as `run_dir`'s config.json keeps it: "bytes" as it is, a directory inside the
  run relative to the run, any other directory absolute (see the module's docstring)."""
  if name == BYTES:
    return name
  path, run = os.path.abspath(name), os.path.abspath(run_dir)
  return os.path.relpath(path, run) if path.startswith(run + os.sep) else path


def from_run(name: str, run_dir: str) -> str:
  """The data.tokenizer of `run_dir`'s config.json as a path from the current directory: a
  relative one names the run's own directory where the run holds it (see the module's
  docstring); "bytes" and absolute paths as they are."""
  if name == BYTES or os.path.isabs(name):
    return name
  inside = os.path.abspath(os.path.join(run_dir, name))
  return inside if os.path.isdir(inside) else name


@functools.lru_cache(maxsize=4)
def load(name):
  """The tokenizer named by a data.tokenizer value, loaded once per process."""
  check(name)
  return ByteTokenizer() if name == BYTES else FileTokenizer(name)


def get(config):
  """The tokenizer of `config` (data.tokenizer)."""
  return load(config.data.get("tokenizer", BYTES))
