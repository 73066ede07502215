"""A test session keeps its temporary data in one directory and removes it when it ends."""

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_test_session_leaves_nothing_in_the_temp_dir():
  # A session of its own, with an empty directory as its system temp dir (TMPDIR), of tests that
  # prepare a dataset and make TFDS build (and leave) scratch directories for datasets that are
  # not prepared. (A tmpfs mounted over /tmp would also hide a checkout that lives there.)
  temp_dir = tempfile.mkdtemp(prefix="empty_tmp_")
  env = {k: v for k, v in os.environ.items()
         if k not in ("RESEARCH_TESTS_TMP", "RESEARCH_DATA_DIR", "PYTEST_XDIST_WORKER")}
  env["TMPDIR"] = temp_dir
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "tests/test_data.py",
       "-k", "named_corpora_offline or one_file"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "3 passed" in result.stdout
  assert os.listdir(temp_dir) == []
