"""What the command-line entry points share: a user error is one line, not a traceback.

  cli.run(main)    absl's app.run, except that a user error (a bad flag, config field or value,
                   a busy or unwritable workdir, a failed write, an unreadable checkpoint, a
                   diverged run) prints `error: <what is wrong; what is valid>` on one line and
                   exits with status 1. --verbose prints the traceback too. Any other exception
                   is a bug and keeps its traceback.

A misspelt config field (--config.train.num_step=5) is named with the closest valid field.
"""

import re
import sys

from absl import app
from absl import flags

from research.runs import checkpoints
from research.runs import config_fields
from research.training import loop as train
from research.runs import lock as workdir_lock

_VERBOSE = flags.DEFINE_bool("verbose", False, "On an error, print its traceback too.")

USER_ERRORS = (ValueError, OSError, flags.Error, app.UsageError, workdir_lock.WorkdirBusyError,
               checkpoints.CheckpointError, train.NonFiniteLossError)


def _one_line(message: str) -> str:
  """The message on one line; for a message that embeds a traceback (a config file that failed
  to load), the error at its end without the exception's type."""
  if "Traceback (most recent call last)" in message:
    last = [line for line in message.splitlines() if line.strip()][-1].strip()
    message = re.sub(r"^[\w.]+(Error|Exception): ", "", last)
  return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _exit_with(message: str):
  print(f"error: {_one_line(message)}", file=sys.stderr, flush=True)
  sys.exit(1)


def _unknown_config_fields(argv) -> str | None:
  """'unknown config field ...; did you mean ...?' for the --config.<field> flags of argv that
  the config has no field for; None if there are none (or the config does not load)."""
  config_flag = flags.FLAGS["config"]
  given = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
  try:
    config = config_flag.parser.parse(given[-1]) if given else config_flag.default
    names = config_fields.flatten(config)
  except Exception:  # noqa: BLE001 (the config itself is broken: report the original error)
    return None
  problems = []
  for arg in argv:
    match = re.match(r"^--(?:no)?config\.([^=]+)", arg)
    if not match or match.group(1) in names:
      continue
    name = match.group(1)
    closest = config_fields.closest_field(name, config)
    siblings = (sorted(n for n in names if n.startswith(name.rsplit(".", 1)[0] + "."))
                or sorted({n.split(".")[0] for n in names}))
    hint = f"did you mean {closest!r}?" if closest else f"valid: {', '.join(siblings)}"
    problems.append(f"unknown config field {name!r}; {hint}")
  return "; ".join(problems) or None


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 (absl and ml_collections raise several types here)
    if "--verbose" in argv:
      raise
    _exit_with(_unknown_config_fields(argv) or str(e))


def run(main):
  """app.run(main) with user errors as one line (see the module docstring)."""

  def main_with_user_errors(argv):
    try:
      return main(argv)
    except USER_ERRORS as e:
      if _VERBOSE.value:
        raise
      _exit_with(str(e))

  app.run(main_with_user_errors, flags_parser=_parse_flags)
