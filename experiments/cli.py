"""What the command-line entry points share: the same flags for the same things, and a user error
as one line, not a traceback.

  cli.run(main)    absl's app.run, except that a user error (a bad or unknown flag, config field
                   or value, a busy or unwritable workdir, a failed write, an unreadable
                   checkpoint, a diverged run) prints `error: <what is wrong; what is valid>` on
                   one line and exits with status 1. --verbose prints the traceback too. Any
                   other exception is a bug and keeps its traceback. A run stopped by SIGTERM or
                   SIGINT (research.training.preemption.Stopped) prints `stopped at step N; ...`
                   on one line and exits with status 0 (SIGTERM) or 130 (SIGINT).
  cli.workdir_flag(help)   --workdir, the one name of every entry point's run, sweep or output
                   directory (defined once per process, whichever entry point asks first).

A misspelt config field (--config.train.num_step=5) is named with the closest valid field; an
unknown flag with the flags the command takes. Finding those hints cannot itself fail: if it
does, the original error is printed.
"""

import re
import sys

from absl import app
from absl import flags

from research.runs import checkpoints
from research.runs import config_fields
from research.training import loop as train
from research.training import preemption
from research.runs import lock as workdir_lock

_VERBOSE = flags.DEFINE_bool("verbose", False, "On an error, print its traceback too.")

USER_ERRORS = (ValueError, OSError, flags.Error, app.UsageError, workdir_lock.WorkdirBusyError,
               checkpoints.CheckpointError, train.NonFiniteLossError)


def workdir_flag(help_text: str) -> flags.FlagHolder:
  """The --workdir flag (defined on first use; later entry points imported into the same process,
  e.g. by the tests, share it)."""
  if "workdir" not in flags.FLAGS:
    return flags.DEFINE_string("workdir", None, help_text)
  return flags.FlagHolder(flags.FLAGS, flags.FLAGS["workdir"])


def config_flag(define, default, help_text: str, **kwargs) -> flags.FlagHolder:
  """--config, defined by `define` (config_flags.DEFINE_config_file or DEFINE_config_dict) with
  this default. ml_collections applies the command line's --config.<field> overrides as soon as a
  flag with a default is defined, at import: a misspelt field is one line from here too."""
  try:
    return define("config", default, help_text, **kwargs)
  except Exception as e:  # noqa: BLE001 (ml_collections raises several types here)
    if "--verbose" in sys.argv:
      raise
    # The command's other flags are not defined yet: only the config fields can be explained.
    _exit_with(_explain(sys.argv, e, default, check_flags=False))


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


def _command_flags() -> list[str]:
  """The flags this command takes: those its own module and experiments/ define."""
  by_module = flags.FLAGS.flags_by_module_dict()  # a -m module's flags are under its file path
  names = {flag.name for module, module_flags in by_module.items()
           if module in ("__main__", sys.argv[0]) or module.startswith("experiments")
           for flag in module_flags}
  return sorted(names)


def _config_field_problems(argv, config=None) -> list[str]:
  """'unknown config field ...; did you mean ...?' for each --config.<field> of argv that the
  config (`config`, else the --config flag's) has no field for, or that a command without
  --config was given."""
  given = [arg for arg in argv if re.match(r"^--(?:no)?config\.", arg)]
  if not given:
    return []
  if config is None and "config" not in flags.FLAGS:
    return [f"{arg.split('=', 1)[0]}: this command takes no --config"
            for arg in given]
  files = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
  try:
    if config is None:
      config = _config_of_flag(flags.FLAGS["config"], files)
    names = config_fields.flatten(config)
  except Exception:  # noqa: BLE001 (the config itself is broken: report the original error)
    return []
  problems = []
  for arg in given:
    name = re.match(r"^--(?:no)?config\.([^=]+)", arg).group(1)
    if name in names:
      continue
    closest = config_fields.closest_field(name, config)
    siblings = (sorted(n for n in names if n.startswith(name.rsplit(".", 1)[0] + "."))
                or sorted({n.split(".")[0] for n in names}))
    hint = f"did you mean {closest!r}?" if closest else f"valid: {', '.join(siblings)}"
    problems.append(f"unknown config field {name!r}; {hint}")
  return problems


def _config_of_flag(config_flag, files):
  """The config the --config flag holds for these --config=FILE values (its default when there
  are none, or when it takes no file: a config_dict flag)."""
  if files:
    try:
      return config_flag.parser.parse(files[-1])
    except Exception:  # noqa: BLE001 (not a file flag, or a broken file)
      pass
  return config_flag.default


def _unknown_flag_problems(argv) -> list[str]:
  """'unknown flag --x; this command takes ...' for each flag of argv that nobody defined."""
  unknown = []
  for arg in argv[1:]:
    if arg == "--":
      break
    name = arg.lstrip("-").split("=", 1)[0]
    if not arg.startswith("-") or name.startswith(("config.", "noconfig.")):
      continue
    if name not in flags.FLAGS and not (name.startswith("no") and name[2:] in flags.FLAGS):
      unknown.append(arg.split("=", 1)[0])
  if not unknown:
    return []
  takes = ", ".join(f"--{name}" for name in _command_flags())
  return [f"unknown flag {', '.join(unknown)}; this command takes {takes}"]


def _explain(argv, error: Exception, config=None, check_flags=True) -> str:
  """The one-line message for a flag-parsing error; the original message if explaining fails."""
  try:
    problems = ((_unknown_flag_problems(argv) if check_flags else [])
                + _config_field_problems(argv, config))
    return "; ".join(problems) or str(error)
  except Exception:  # noqa: BLE001 (the error path itself must not fail)
    return str(error)


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 (absl and ml_collections raise several types here)
    if "--verbose" in argv:
      raise
    _exit_with(_explain(argv, e))


def run(main):
  """app.run(main) with user errors as one line (see the module docstring)."""

  def main_with_user_errors(argv):
    try:
      return main(argv)
    except USER_ERRORS as e:
      if _VERBOSE.value:
        raise
      _exit_with(str(e))
    except preemption.Stopped as stopped:
      print(stopped, file=sys.stderr, flush=True)
      sys.exit(stopped.exit_status)

  app.run(main_with_user_errors, flags_parser=_parse_flags)
