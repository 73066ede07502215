"""Run several `python -m experiments.X ARGS` commands that stop at their argument checks, each
in a process of its own, forked from one process that has imported what every command imports.

A command's process would spend ~3 s of CPU importing JAX, Flax, TFDS and the library before it
reads its first flag; the tests of flags and of one-line user errors start about twenty of them.
Here one server process imports those modules once (no JAX backend is started by an import, and
no thread: forking is safe), then forks a child per command, which runs the module as
`python -m` does (runpy, as __main__, with sys.argv set) with its stdout and stderr in files of
its own. The children run at once; each gives its exit status and output as a subprocess would.
Only for commands that start no JAX backend in the parent's stead: the children share the
server's environment, which is the test session's.

  results = forked_commands.run([("train", ["--config=...", "--no_such_flag=1"]), ...])
  results[0].returncode, results[0].stdout, results[0].stderr
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the entry points import before they parse a flag (the rest each imports in its child).
PRELOADED = ("experiments.cli", "research.training.loop", "research.results.sweep",
             "research.evaluation.extrapolation", "research.analysis.analyze")


def run(commands, timeout=300):
  """[(module under experiments/, [arguments])] -> [subprocess.CompletedProcess], in order."""
  server = subprocess.run([sys.executable, "-m", "tests.forked_commands"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), input=json.dumps(commands),
                          capture_output=True, text=True, timeout=timeout, check=False)
  assert server.returncode == 0, server.stderr[-3000:]
  return [subprocess.CompletedProcess([sys.executable, "-m", f"experiments.{module}", *args],
                                      returncode, stdout, stderr)
          for (module, args), (returncode, stdout, stderr)
          in zip(commands, json.loads(server.stdout), strict=True)]


def _child(module, args, out_path, err_path):
  """Runs in the forked child; never returns."""
  import runpy  # noqa: PLC0415
  import traceback  # noqa: PLC0415
  for fd, path in ((1, out_path), (2, err_path)):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
  sys.argv = [os.path.join(ROOT, "experiments", f"{module}.py"), *args]
  status = 0
  try:
    runpy.run_module(f"experiments.{module}", run_name="__main__", alter_sys=True)
  except SystemExit as stop:
    status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    if stop.code is not None and not isinstance(stop.code, int):
      print(stop.code, file=sys.stderr)
  except BaseException:  # noqa: BLE001 (reported as Python reports an uncaught exception)
    traceback.print_exc()
    status = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def _serve():
  import importlib  # noqa: PLC0415
  commands = json.load(sys.stdin)
  for name in PRELOADED:
    importlib.import_module(name)
  with tempfile.TemporaryDirectory() as scratch:
    children = []
    for index, (module, args) in enumerate(commands):
      paths = [os.path.join(scratch, f"{index}.{stream}") for stream in ("out", "err")]
      pid = os.fork()
      if pid == 0:
        _child(module, args, *paths)
      children.append((pid, paths))
    results = []
    for pid, paths in children:
      _, status = os.waitpid(pid, 0)
      outputs = []
      for path in paths:
        with open(path) as f:
          outputs.append(f.read())
      results.append((os.waitstatus_to_exitcode(status), *outputs))
  json.dump(results, sys.stdout)


if __name__ == "__main__":
  _serve()
