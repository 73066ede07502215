"""Every entry point takes the same flags for the same things and answers a bad command line with
one line and exit status 1 (experiments/cli.py), whatever the mistake."""

import os
import re

from tests import forked_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def entry_points() -> list[str]:
  """Every module of experiments/ that runs as a command (found, not listed)."""
  names = []
  for filename in sorted(os.listdir(os.path.join(ROOT, "experiments"))):
    if not filename.endswith(".py"):  # __pycache__ and the like
      continue
    with open(os.path.join(ROOT, "experiments", filename)) as f:
      if 'if __name__ == "__main__":' in f.read():
        names.append(filename[:-3])
  return names


def _error_line(result):
  errors = result.stderr
  assert result.returncode == 1, errors[-2000:]
  assert "Traceback" not in errors, errors[-2000:]
  lines = [line for line in errors.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), errors[-2000:]
  return lines[0]


def test_every_entry_point_refuses_an_unknown_flag_and_a_misspelt_field_in_one_line(tmp_path):
  modules = entry_points()
  assert {"train", "run", "evaluate", "plot", "bench", "analyze", "generate", "variants",
          "bench_data", "accelerator_check"} <= set(modules)
  workdir = str(tmp_path / "new")
  config = os.path.join(ROOT, "tests", "tiny_config.py")
  results = forked_commands.run([
      (module, [f"--config={config}", f"--workdir={workdir}", "--no_such_flag=1",
                "--config.train.num_step=5"]) for module in modules])
  for module, result in zip(modules, results):
    line = _error_line(result)
    # Each names a mistake: the unknown flag with the flags the command takes, or the misspelt
    # field with the closest one (a config flag with a default applies the fields at import).
    assert (re.search(r"unknown flag [^;]*--no_such_flag[^;]*; this command takes .*--verbose",
                      line)) or (
        "unknown config field 'train.num_step'; did you mean 'train.num_steps'?" in line), (
            module, line)
    if "unknown flag" in line and "takes --config" in line:
      assert "did you mean 'train.num_steps'?" in line, (module, line)
  assert not os.path.exists(workdir)


def test_the_shared_flags_mean_the_same_everywhere(tmp_path):
  """plot takes its directory as --workdir or as an argument (not both), and a command without
  a config says so instead of ignoring --config.x (bench's --out is the alias of --workdir)."""
  two, bench = forked_commands.run([
      ("plot", [f"--workdir={tmp_path}/a", f"{tmp_path}/b"]),
      ("bench", ["--suite=mixers", f"--out={tmp_path}/c", "--config.model.d_model=8"])])
  assert "give one directory" in _error_line(two)
  assert "--config.model.d_model: this command takes no --config" in _error_line(bench)
  assert not os.listdir(tmp_path)
