"""Local text corpora: which files, in which order, in which split.

stdlib_bytes reads the running interpreter's standard-library .py sources
(sysconfig.get_paths()["stdlib"]) outside site-packages, test directories and caches; text_dir
reads config.data.corpus_path (`~` expanded), a directory (every non-hidden file under it) or a
glob, of text files or gzip-compressed text files (read decompressed, whatever their name); other
binary files (NUL bytes in their first 8 KiB) are refused, naming them. Files are ordered by
relative path, and a file's split is a stable hash of that path: sha256(path) mod 100 < 90 is
train, < 95 validation, else test, so adding a file moves no other. When that leaves a split
without files (a corpus of one or a few files), every file is split by byte ranges instead: its
first 90% of bytes train, the next 5% validation, the last 5% test.
"""

import dataclasses
import glob
import gzip
import hashlib
import os
import sysconfig

SPLITS = ("train", "validation", "test")
_STDLIB_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
BYTE_RANGE_SPLITS = (("train", 0.0, 0.9), ("validation", 0.9, 0.95), ("test", 0.95, 1.0))
GZIP_MAGIC = b"\x1f\x8b"
_SNIFF_BYTES = 8192


@dataclasses.dataclass(frozen=True)
class CorpusFile:
  """Bytes [start, end) of a file's text (decompressed if gzip), assigned to one split."""

  split: str
  relpath: str
  path: str
  start: int
  end: int
  mtime_ns: int
  gzipped: bool = False

  @property
  def size(self):
    return self.end - self.start


def split_of(relpath):
  """The split of a file, from a stable hash of its relative path (~90/5/5)."""
  bucket = int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100
  return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def is_gzipped(path: str) -> bool:
  with open(path, "rb") as f:
    return f.read(len(GZIP_MAGIC)) == GZIP_MAGIC


def _open(path, gzipped):
  return gzip.open(path, "rb") if gzipped else open(path, "rb")


def read(corpus_file: CorpusFile) -> bytes:
  """The bytes of a CorpusFile."""
  with _open(corpus_file.path, corpus_file.gzipped) as f:
    f.seek(corpus_file.start)
    return f.read(corpus_file.size)


def _text_size(path, gzipped):
  if not gzipped:
    return os.path.getsize(path)
  with gzip.open(path, "rb") as f:
    return f.seek(0, os.SEEK_END)


def _describe(root, paths, gzipped=lambda path: False):
  """The corpus files of `paths`: whole files split by hash, or by byte ranges when hashing
  leaves a split without files."""
  texts = []  # (relpath, path, size, mtime_ns, gzipped)
  for path in paths:
    compressed = gzipped(path)
    texts.append((os.path.relpath(path, root), path, _text_size(path, compressed),
                  os.stat(path).st_mtime_ns, compressed))
  texts.sort()
  if {split_of(relpath) for relpath, *_ in texts} == set(SPLITS):
    return [CorpusFile(split_of(relpath), relpath, path, 0, size, mtime, compressed)
            for relpath, path, size, mtime, compressed in texts]
  return [CorpusFile(split, relpath, path, int(size * low), int(size * high), mtime, compressed)
          for relpath, path, size, mtime, compressed in texts
          for split, low, high in BYTE_RANGE_SPLITS]


def _walk(root, keep_dir, keep_file):
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if keep_dir(d)]
    yield from (os.path.join(dirpath, f) for f in filenames if keep_file(f))


def stdlib_files():
  """The standard-library .py files of the running interpreter, in relative-path order."""
  root = sysconfig.get_paths()["stdlib"]
  paths = _walk(root, lambda d: d not in _STDLIB_SKIPPED_DIRS, lambda f: f.endswith(".py"))
  return _describe(root, paths)


def text_files(corpus_path):
  """The files of a directory or glob, in relative-path order; ValueError if there are none or
  some are not text."""
  if not corpus_path:
    raise ValueError("data.corpus_path is empty: text_dir needs a directory or a glob of text files"
                     " (e.g. --config.data.corpus_path='/data/books/*.txt')")
  expanded = os.path.expanduser(corpus_path)
  if glob.has_magic(expanded):
    root = expanded
    while glob.has_magic(root):
      root = os.path.dirname(root)
    root = root or "."
    paths = [p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p)]
  elif os.path.isfile(expanded):
    root, paths = os.path.dirname(expanded), [expanded]
  elif os.path.isdir(expanded):
    root = expanded
    hidden = lambda name: name.startswith(".")
    paths = list(_walk(root, lambda d: not hidden(d), lambda f: not hidden(f)))
  else:
    raise ValueError(f"data.corpus_path={corpus_path!r} is neither a file, a directory nor a glob"
                     " that matches files: text_dir needs a readable file, directory or glob of "
                     "text files")
  if not paths:
    raise ValueError(f"data.corpus_path={corpus_path!r} contains no files: text_dir needs at least"
                     " one readable text file (a directory, or a glob such as '/data/*.txt')")
  unreadable = [p for p in paths if not os.access(p, os.R_OK)]
  if unreadable:
    raise ValueError(f"data.corpus_path={corpus_path!r}: {len(unreadable)} files are unreadable,"
                     f" e.g. {unreadable[0]!r}; text_dir needs every matched file to be readable")
  binary = sorted(p for p in paths if _is_binary(p))
  if binary:
    raise ValueError(f"data.corpus_path={corpus_path!r}: {len(binary)} files are binary, not "
                     f"text: {', '.join(map(repr, binary[:3]))}{', ...' if len(binary) > 3 else ''}"
                     "; text_dir reads text files and gzip-compressed text (.gz): remove them or "
                     "narrow the path to the text files")
  return _describe(root, paths, gzipped=is_gzipped)


def _is_binary(path):
  """NUL bytes in the first 8 KiB of the (decompressed) file, or gzip data that does not
  decompress."""
  try:
    with _open(path, is_gzipped(path)) as f:
      return b"\0" in f.read(_SNIFF_BYTES)
  except (OSError, EOFError):  # gzip.BadGzipFile is an OSError; EOFError: truncated gzip data
    return True


def split_sizes(files):
  """Tokens per split once packed: the bytes of its files plus one END_OF_DOCUMENT each."""
  sizes = dict.fromkeys(SPLITS, 0)
  for f in files:
    sizes[f.split] += f.size + 1
  return sizes
