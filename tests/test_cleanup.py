"""A test session keeps its temporary data in one directory and removes it when it ends."""

import os
import subprocess
import sys

import pytest

from tests.conftest import can_mount_in_a_namespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not can_mount_in_a_namespace(), reason="needs unshare -rm (user namespaces)")
def test_a_test_session_leaves_nothing_in_the_temp_dir():
  # A session of its own, with a fresh tmpfs as /tmp, of tests that prepare a dataset and make
  # TFDS build (and leave) scratch directories for datasets that are not prepared.
  session = (f"mount -t tmpfs tmpfs /tmp && {sys.executable} -m pytest -q tests/test_data.py "
             "-k 'named_corpora_offline or one_file' && echo left: $(ls -A /tmp)")
  env = {k: v for k, v in os.environ.items()
         if k not in ("RESEARCH_TESTS_TMP", "TMPDIR", "RESEARCH_DATA_DIR")}
  result = subprocess.run(["unshare", "-rm", "bash", "-c", session], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "3 passed" in result.stdout
  assert result.stdout.splitlines()[-1] == "left:"
