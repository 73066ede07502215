"""The result files of README.md and docs/ and how each is made (experiments/results.py,
`make results`): RESULTS lists, per entry, the commands that make it (a quick preset through
experiments.run, then any head analyses) and the files it copies into docs/; `copy` puts them
there, a Markdown file with a line saying how it was made on top, and `record` keeps
docs/made.json and docs/made.md, which say for every file the command, commit, date, hardware
and minutes."""

import collections
import dataclasses
import json
import os
import shutil
import sys

from research import variants
from research.results import sweep
from research.runs import provenance

ROOT = provenance.ROOT
MADE = os.path.join("docs", "made.json")  # the record; docs/made.md is drawn from it


@dataclasses.dataclass(frozen=True)
class Result:
  """A result: `commands` (python -m module args, `{dir}` standing for the entry's directory:
  `directory` under the workdir, its name by default), `copies`, {file under the entry's
  directory: its place under docs/}, and `embeds`, {Markdown file under the entry's directory: a
  page under docs/ that shows it in its block `<!-- made:NAME/FILE -->` ... `<!-- /made:NAME/FILE
  -->`}."""
  name: str
  commands: tuple[tuple[str, ...], ...]
  copies: dict[str, str]
  directory: str = ""
  embeds: dict[str, str] = dataclasses.field(default_factory=dict)


def _sweep(config, *extra):
  return ("experiments.run", f"--config={config}", "--workdir={dir}", "--parallel=2", *extra)


# Whether retrieval, recall, an induction head or an algorithmic task is learned in a quick
# preset's budget (and how far past the training length it holds) hinges on an abrupt transition:
# those results are run over three seeds, and their tables show the spread.
SEEDS = "--seeds=3"


def _analyze(analyses, *extra):
  return ("experiments.analyze", "--workdir={dir}", f"--analysis={analyses}", *extra)


_MHA_ROPE, _MHA_ALIBI = "runs/attention=mha,position=rope", "runs/attention=mha,position=alibi"

RESULTS = (
    Result("demo", (_sweep("configs/lm_extrapolation.py:quick"),),
           {"summary.md": "demo/summary.md", "extrapolation.png": "demo/extrapolation.png",
            "rope_scaling.png": "demo/rope_scaling.png",
            "loss_by_position.png": "demo/loss_by_position.png"}),
    Result("demo_heads", (_sweep("configs/lm_extrapolation.py:quick"),
                          _analyze("attention_maps,head_importance"),
                          _analyze("explanation", "--num_sequences=8", "--num_permutations=16")),
           {f"{_MHA_ALIBI}/analysis/attention_maps/maps.png": "heads/maps_mha_alibi.png",
            f"{_MHA_ROPE}/analysis/attention_maps/maps.png": "heads/maps_mha_rope.png",
            "analysis/attention_maps/distance.png": "heads/distance.png",
            "analysis/head_importance/pruning.png": "heads/pruning.png",
            f"{_MHA_ROPE}/analysis/explanation/explanation.png":
                "heads/explanation_mha_rope.png",
            "analysis/explanation/explanation.png": "heads/explanation.png"},
           directory="demo"),  # the demo's sweep, analysed
    Result("positions", (_sweep("configs/positions_extrapolation.py:quick"),),
           {"summary.md": "positions/summary.md",
            "extrapolation.png": "positions/extrapolation.png",
            "loss_by_position.png": "positions/loss_by_position.png"}),
    Result("attention", (_sweep("configs/attention_extrapolation.py:quick"),),
           {"summary.md": "attention/summary.md",
            "extrapolation.png": "attention/extrapolation.png"}),
    Result("algorithmic", (_sweep("configs/algorithmic.py:quick", SEEDS),),
           {"summary.md": "evaluation/algorithmic_summary.md",
            "tasks.png": "evaluation/algorithmic_tasks.png"}),
    Result("state_tracking", (_sweep("configs/state_tracking.py:quick", SEEDS),),
           {"summary.md": "evaluation/state_tracking_summary.md",
            "tasks.png": "evaluation/state_tracking.png"}),
    Result("mqar", (_sweep("configs/mqar.py:quick", SEEDS),),
           {"summary.md": "evaluation/mqar_summary.md", "width.png": "evaluation/mqar_width.png",
            "accuracy_vs_state.png": "evaluation/mqar_state.png"},
           embeds={"width.md": "results.md"}),  # every cell over the seeds, seed by seed
    Result("mad", (_sweep("configs/mad.py:quick", SEEDS),),
           {"mad.md": "evaluation/mad_quick.md", "mad_state.png": "evaluation/mad_state.png"}),
    Result("needles", (_sweep("configs/long_context.py:quick", SEEDS),),
           {"summary.md": "evaluation/needles_summary.md",
            "needle_heatmap.png": "evaluation/needle_heatmap.png",
            "lost_in_the_middle.png": "evaluation/lost_in_the_middle.png"},
           embeds={"summary.md": "long_context.md"}),
    Result("passkey", (_sweep("configs/passkey_extrapolation.py:quick", SEEDS),),
           {"summary.md": "evaluation/passkey_extrapolation_summary.md",
            "needle_heatmap.png": "evaluation/passkey_extrapolation_heatmap.png"},
           embeds={"summary.md": "long_context.md"}),
    Result("induction", (_sweep("configs/induction_heads.py:quick", SEEDS),
                         _analyze("induction")),
           {"analysis/induction/induction.png": "heads/induction_task.png",
            "analysis/induction/summary.md": "heads/induction_summary.md"}),
    Result("uptraining", (_sweep("configs/gqa_uptraining.py:quick"),
                          _analyze("uptraining,head_importance")),
           {"analysis/uptraining/summary.md": "heads/uptraining.md",
            "analysis/uptraining/uptraining.csv": "heads/uptraining.csv",
            "analysis/uptraining/uptraining.png": "heads/uptraining.png"}),
    Result("jamba", (_sweep("configs/jamba.py:quick"),),
           {"summary.md": "evaluation/jamba_summary.md"}),
)
BY_NAME = {result.name: result for result in RESULTS}


def selected(only):
  """The entries named by --only (all without it); an unknown name is refused before any work."""
  if not only:
    return list(RESULTS)
  unknown = [name for name in only if name not in BY_NAME]
  if unknown:
    raise ValueError(f"--only: unknown result {', '.join(unknown)}; valid: {', '.join(BY_NAME)}")
  return [BY_NAME[name] for name in only]


def commands(result, workdir):
  """The entry's command lines, and its directory under `workdir`."""
  directory = os.path.join(workdir, result.directory or result.name)
  return [[sys.executable, "-m", *(a.replace("{dir}", directory) for a in command)]
          for command in result.commands], directory


def run_sources(directory, key):
  """{value: runs} of `key` ("commit" or "hardware") over the done runs of the sweep in
  `directory`: the code, or the machine, that trained each (sweep status.json; "not recorded"
  for runs made before status files kept it)."""
  runs = os.path.join(directory, "runs")
  names = sorted(os.listdir(runs)) if os.path.isdir(runs) else []
  states = [sweep.status(directory, name) for name in names]
  return dict(collections.Counter(s.get(key, "not recorded") for s in states
                                  if s["state"] == "done"))


def _with_runs(value, runs):
  """The entry's value, and its runs' where they differ (runs from earlier sittings)."""
  if set(runs or {}) <= {value}:
    return value
  return f"{value} (runs: " + ", ".join(f"{v} x{n}" for v, n in sorted(runs.items())) + ")"


def commit_cell(entry):
  """The entry's commit, and its runs' where they differ."""
  return _with_runs(entry["commit"], entry.get("run_commits"))


def hardware_cell(entry):
  """The entry's hardware, and its runs' where they differ."""
  return _with_runs(entry["hardware"], entry.get("run_hardware"))


def unfinished_runs(directory):
  """The runs of the sweep in `directory` that have not ended as done or skipped (failed, or
  lost without a status): an entry with any copies nothing."""
  runs = os.path.join(directory, "runs")
  names = sorted(os.listdir(runs)) if os.path.isdir(runs) else []
  return [name for name in names
          if sweep.status(directory, name)["state"] not in ("done", "skipped")]


def provenance_line(entry):
  """The first line of a copied file: the command, commit, date, machine and minutes; where runs
  were kept from an earlier sitting, the minutes do not count their training."""
  kept = "" if set(entry.get("run_commits") or {}) <= {entry["commit"]} else (
      " (runs kept from earlier sittings not counted)")
  return (f"Made by `{entry['command']}` from commit {commit_cell(entry)} on {entry['date']}, "
          f"{hardware_cell(entry)}, in {entry['minutes']:.1f} min{kept}.")


def block(result, source):
  """The name of the block of a page that shows `source` of `result` (Result.embeds)."""
  return f"{result.name}/{source}"


def _demoted(text, levels=2):
  """A Markdown file as a page's block shows it: without its title, its headings `levels`
  deeper (a page's section holds it)."""
  lines = text.splitlines()
  if lines and lines[0].startswith("# "):
    lines = lines[1:]
  return "\n".join("#" * levels + line if line.startswith("#") else line
                   for line in lines).strip("\n")


def copy(result, directory, docs, entry):
  """Copy the entry's files into `docs` (a Markdown file with the provenance line on top) and
  fill the blocks of the pages that embed its Markdown files (the same line on top); returns
  the docs/ paths written (a page as `page (block NAME)`). Every source and block is checked
  before anything is written."""
  missing = [s for s in [*result.copies, *result.embeds]
             if not os.path.isfile(os.path.join(directory, s))]
  if missing:
    raise FileNotFoundError(f"{result.name}: its commands did not write {', '.join(missing)} "
                            f"under {directory}")
  pages = {}
  for source, page in result.embeds.items():
    if page not in pages:
      with open(os.path.join(docs, page)) as f:
        pages[page] = f.read()
    if block(result, source) not in variants.blocks(pages[page], kind="made"):
      raise ValueError(f"{result.name}: docs/{page} has no block <!-- made:"
                       f"{block(result, source)} --> ... <!-- /made:{block(result, source)} --> "
                       f"to show {source} in")
  written = []
  for source, destination in result.copies.items():
    target = os.path.join(docs, destination)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if target.endswith(".md"):
      with open(os.path.join(directory, source)) as f:
        text = f.read()
      with open(target, "w") as f:
        f.write(f"{provenance_line(entry)}\n\n{text}")
    else:
      shutil.copyfile(os.path.join(directory, source), target)
    written.append(os.path.join("docs", destination))
  for source, page in result.embeds.items():
    with open(os.path.join(directory, source)) as f:
      body = f"{provenance_line(entry)}\n\n{_demoted(f.read())}"
    pages[page] = variants.embed(pages[page], {block(result, source): body}, kind="made")
    written.append(f"{os.path.join('docs', page)} (block {block(result, source)})")
  for page, text in pages.items():
    with open(os.path.join(docs, page), "w") as f:
      f.write(text)
  return written


def record(made_path, files, entry):
  """Add `entry` for each of `files` to the JSON record and redraw docs/made.md from it."""
  made = {}
  if os.path.exists(made_path):
    with open(made_path) as f:
      made = json.load(f)
  made.update({path: entry for path in files})
  with open(made_path, "w") as f:
    json.dump(made, f, indent=1, sort_keys=True)
  lines = ["# How each result file in docs/ was made", "",
           "Written by `python -m experiments.results` (`make results`); a file not listed here "
           "was made by hand or predates it. Minutes: how long the entry ran; a sweep finds the "
           "runs it already holds done and does not repeat them, so an entry remade over an "
           "earlier workdir takes less than from an empty one (the preset table of "
           "docs/training.md has those times).", "",
           "| file | command | commit | date | hardware | minutes |", "|---|---|---|---|---|---|"]
  lines += [f"| {path} | `{e['command']}` | {commit_cell(e)} | {e['date']} | {hardware_cell(e)} | "
            f"{e['minutes']:.1f} |" for path, e in sorted(made.items())]
  with open(os.path.join(os.path.dirname(made_path), "made.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
