"""Local text corpora: which files, in which order, in which split.

stdlib_bytes reads the running interpreter's standard-library .py sources
(sysconfig.get_paths()["stdlib"]) outside site-packages, test directories and caches; text_dir
reads config.data.corpus_path, a directory (every non-hidden file under it) or a glob. Files are
ordered by relative path, and a file's split is a stable hash of that path:
sha256(path) mod 100 < 90 is train, < 95 validation, else test, so adding a file moves no other.
"""

import dataclasses
import glob
import hashlib
import os
import sysconfig

SPLITS = ("train", "validation", "test")
_STDLIB_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class CorpusFile:
  split: str
  relpath: str
  path: str
  size: int
  mtime_ns: int


def split_of(relpath):
  """The split of a file, from a stable hash of its relative path (~90/5/5)."""
  bucket = int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100
  return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def _describe(root, paths):
  files = []
  for path in paths:
    relpath = os.path.relpath(path, root)
    stat = os.stat(path)
    files.append(CorpusFile(split_of(relpath), relpath, path, stat.st_size, stat.st_mtime_ns))
  return sorted(files, key=lambda f: f.relpath)


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
  """The files of a directory or glob, in relative-path order; ValueError if there are none."""
  if not corpus_path:
    raise ValueError("data.corpus_path is empty: text_dir needs a directory or a glob of text files"
                     " (e.g. --config.data.corpus_path='/data/books/*.txt')")
  if glob.has_magic(corpus_path):
    root = corpus_path
    while glob.has_magic(root):
      root = os.path.dirname(root)
    root = root or "."
    paths = [p for p in glob.glob(corpus_path, recursive=True) if os.path.isfile(p)]
  elif os.path.isdir(corpus_path):
    root = corpus_path
    hidden = lambda name: name.startswith(".")
    paths = list(_walk(root, lambda d: not hidden(d), lambda f: not hidden(f)))
  else:
    raise ValueError(f"data.corpus_path={corpus_path!r} is neither a directory nor a glob that"
                     " matches files: text_dir needs a readable directory or glob of text files")
  if not paths:
    raise ValueError(f"data.corpus_path={corpus_path!r} contains no files: text_dir needs at least"
                     " one readable text file (a directory, or a glob such as '/data/*.txt')")
  unreadable = [p for p in paths if not os.access(p, os.R_OK)]
  if unreadable:
    raise ValueError(f"data.corpus_path={corpus_path!r}: {len(unreadable)} files are unreadable,"
                     f" e.g. {unreadable[0]!r}; text_dir needs every matched file to be readable")
  return _describe(root, paths)


def split_sizes(files):
  """Tokens per split once packed: the bytes of its files plus one END_OF_DOCUMENT each."""
  sizes = dict.fromkeys(SPLITS, 0)
  for f in files:
    sizes[f.split] += f.size + 1
  return sizes
