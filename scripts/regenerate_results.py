"""Regenerate every comparison the docs show, on this machine: the README's main job and docs/results.

    python scripts/regenerate_results.py               # everything (about 15 minutes on 2 cores)
    python scripts/regenerate_results.py --only main   # the README's main job (2 to 4 minutes)
    python scripts/regenerate_results.py --regimes     # every example, 5 seeds, in every training regime

Each command is read from the document that shows it and run as written, from the repository root, with
``--force`` added where it is missing (an earlier comparison is replaced; finished identical runs are
still reused):

* ``main``: the README's first command (its ``dataflex compare`` part); its ``table.md`` replaces the
  README's main-job table (between ``<!-- main-job-table:start -->`` and ``<!-- main-job-table:end -->``)
  and its ``compare.json`` is kept as ``docs/results/main_job.json`` (``tests/foundation/test_readme_ci.py``
  checks that the README's table is that document's table, as the command prints it);
* ``examples``: the command in ``docs/results/examples_5seeds.md``; its ``compare.json`` and ``compare.png``
  become ``examples_5seeds.json`` / ``.png``, its table replaces the one in that file, and
  ``benchmarks/greso_report.py`` writes ``generation_cost.txt``; then the command in
  ``greso_vs_dynamic_sampling.md`` (the same runs, dynamic sampling as the baseline) gives that file's
  table and ``greso_vs_dynamic_sampling.json``.

* ``--regimes`` (alone: it runs nothing else): one ``dataflex compare`` of every example (``grpo_baseline``
  the baseline, then every other ``examples/*.yaml``, pilot_commit and reinforce_ada included where they
  exist) on seeds 0-4 in each regime (``default``: no overlay, then each ``examples/regimes/*.yaml`` via
  ``--regime``), into ``runs/regimes/<regime>``; each regime's table goes to
  ``docs/results/regime_<regime>.md`` (with the command) and its ``compare.json`` to ``regime_<regime>.json``,
  and ``scripts/regime_marks.py`` writes the pre-registered hypotheses' marks into
  ``docs/results/regimes.md`` from those files. ``--regime``, ``--examples``, ``--seeds``, ``--steps``,
  ``--runs``, ``--results`` and ``--doc`` narrow it (a small trial: two examples, one seed, one regime, a
  few steps, written outside docs/). About 4 x 18 x 5 runs of 10-40 s each: hours on 2 cores.

* ``--robustness`` (alone): the pre-registered experiments of ``docs/results/robustness.md`` (#46), read
  from its ``bash`` blocks and run as written (two ``dataflex compare`` runs at once, each on one core);
  each one's table goes to ``docs/results/robustness_<name>.md``, its ``compare.json`` to
  ``robustness_<name>.json`` and its figure to ``robustness_<name>.png``, the compact per-run curves of all of
  them to ``robustness_curves.json``, and ``scripts/robustness_marks.py`` writes the marks from those curves.

Every table names the CPU its runs ran on: runs are bit-identical on one machine, and another CPU gives
other digits, within the intervals. The README's prose quotes a few of these numbers; read it again after
a regeneration (the README test names any quoted interval no table holds).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"
EXAMPLES = RESULTS / "examples_5seeds.md"
VERSUS = RESULTS / "greso_vs_dynamic_sampling.md"
MAIN_JSON = RESULTS / "main_job.json"
MAIN_MARKERS = ("<!-- main-job-table:start -->", "<!-- main-job-table:end -->")
TABLE_MARKERS = ("<!-- table:start -->", "<!-- table:end -->")


def bash_blocks(path: Path) -> list[str]:
    """The ``bash`` code blocks of a Markdown file, continuation lines joined."""
    return [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.+?)\n```", path.read_text(), re.S)]


def compare_command(block: str) -> list[str]:
    """The ``dataflex compare ...`` command of a block (after any ``pip install ... &&``), with ``--force``."""
    text = block.split("&&")[-1].strip()
    words = shlex.split(text)
    if words[:2] != ["dataflex", "compare"]:
        raise SystemExit(f"expected a dataflex compare command, found: {text}")
    return words if "--force" in words else [*words, "--force"]


def option(words: list[str], name: str, default: str) -> str:
    return words[words.index(name) + 1] if name in words else default


def run(words: list[str]) -> None:
    exe = Path(sys.executable).with_name(words[0])
    command = [str(exe) if exe.exists() else words[0], *words[1:]]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def replace_between(path: Path, markers: tuple[str, str], text: str) -> None:
    start, end = markers
    content = path.read_text()
    if start not in content or end not in content:
        raise SystemExit(f"{path}: no {start} ... {end} block to replace")
    head, _, rest = content.partition(start)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{start}\n{text.strip()}\n{end}{tail}")


def main_job() -> None:
    words = compare_command(bash_blocks(README)[0])
    run(words)
    out = ROOT / option(words, "--out", "runs/compare")
    replace_between(README, MAIN_MARKERS, (out / "table.md").read_text())
    shutil.copyfile(out / "compare.json", MAIN_JSON)


def examples() -> None:
    words = compare_command(bash_blocks(EXAMPLES)[0])
    run(words)
    out = ROOT / option(words, "--out", "runs/compare")
    shutil.copyfile(out / "compare.json", RESULTS / "examples_5seeds.json")
    shutil.copyfile(out / "compare.png", RESULTS / "examples_5seeds.png")
    replace_between(EXAMPLES, TABLE_MARKERS, (out / "table.md").read_text())
    # the relative path, so the report names the runs as the docs' commands do, not this checkout's location
    report = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "greso_report.py"),
                             option(words, "--out", "runs/compare"), "--versus",
                             "dynamic_sampling", "--baseline", "grpo_baseline"], cwd=ROOT, check=True,
                            capture_output=True, text=True)
    (RESULTS / "generation_cost.txt").write_text(report.stdout)
    versus = compare_command(bash_blocks(VERSUS)[0])
    run(versus)
    out = ROOT / option(versus, "--out", "runs/compare")
    replace_between(VERSUS, TABLE_MARKERS, (out / "table.md").read_text())
    shutil.copyfile(out / "compare.json", RESULTS / "greso_vs_dynamic_sampling.json")


REGIMES_DIR = ROOT / "examples" / "regimes"
REGIME_DOC = RESULTS / "regimes.md"
REGIME_RESULTS = ("<!-- regimes-results:start -->", "<!-- regimes-results:end -->")


def regime_names() -> list[str]:
    """``default`` (no overlay), then every shipped regime overlay."""
    return ["default", *sorted(p.stem for p in REGIMES_DIR.glob("*.yaml"))]


def example_names() -> list[str]:
    """The baseline first, then every other example config (new ones such as pilot_commit included)."""
    others = sorted(p.stem for p in (ROOT / "examples").glob("*.yaml") if p.stem != "grpo_baseline")
    return ["grpo_baseline", *others]


def regime_command(regime: str, examples: list[str], seeds: list[int], steps: int | None, out: Path) -> list[str]:
    words = ["dataflex", "compare", *(f"examples/{e}.yaml" for e in examples), "--seeds", *map(str, seeds),
             "--out", str(out), "--no-progress", "--force"]
    if regime != "default":
        words += ["--regime", f"examples/regimes/{regime}.yaml"]
    return words if steps is None else [*words, "--steps", str(steps)]


def regimes(args: argparse.Namespace) -> None:
    names = args.regime or regime_names()
    unknown = [r for r in names if r not in regime_names()]
    if unknown:
        raise SystemExit(f"unknown regime(s) {unknown}; known: {regime_names()}")
    examples_ = args.examples or example_names()
    missing = [e for e in examples_ if not (ROOT / "examples" / f"{e}.yaml").exists()]
    if missing:
        raise SystemExit(f"no examples/<name>.yaml for {missing}")
    results, runs = Path(args.results), Path(args.runs)
    results.mkdir(parents=True, exist_ok=True)
    dirs: dict[str, Path] = {}
    lines = []
    for regime in names:
        out = runs / regime
        words = regime_command(regime, examples_, args.seeds, args.steps, out)
        run(words)
        dirs[regime] = out if out.is_absolute() else ROOT / out
        table = (dirs[regime] / "table.md").read_text().strip()
        shutil.copyfile(dirs[regime] / "compare.json", results / f"regime_{regime}.json")
        doc = results / f"regime_{regime}.md"
        doc.write_text(f"# Every example in the {regime} regime\n\n```bash\n{shlex.join(words)}\n```\n\n"
                       f"{TABLE_MARKERS[0]}\n{table}\n{TABLE_MARKERS[1]}\n")
        lines.append(f"- `{regime}`: [{doc.name}]({doc.name}) ({len(examples_)} examples, seeds {args.seeds})")
    doc_path = Path(args.doc)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from regime_marks import fill

    marks = fill(doc_path, dirs)
    replace_between(doc_path, REGIME_RESULTS, "\n".join(lines))
    for hid, text in marks.items():
        print(f"{hid}: {text}")


ROBUSTNESS_DOC = RESULTS / "robustness.md"


def robustness() -> None:
    """Run the experiments of robustness.md (its ``bash`` blocks, each ``--out runs/robustness/<name>``), in
    parallel, then write their tables, JSON, figures and curves, and the marks."""
    commands = [compare_command(block) for block in bash_blocks(ROBUSTNESS_DOC)]
    print("\n".join("+ " + shlex.join(words) for words in commands), flush=True)
    procs = []
    for words in commands:
        exe = Path(sys.executable).with_name(words[0])
        procs.append(subprocess.Popen([str(exe) if exe.exists() else words[0], *words[1:]], cwd=ROOT))
    failed = [shlex.join(w) for w, p in zip(commands, procs) if p.wait() != 0]
    if failed:
        raise SystemExit(f"failed: {failed}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import json

    from robustness_marks import curves_of, fill

    curves = {}
    for words in commands:
        out = ROOT / option(words, "--out", "runs/compare")
        name = out.name
        curves[name] = curves_of(out / "compare.json")
        shutil.copyfile(out / "compare.json", RESULTS / f"robustness_{name}.json")
        shutil.copyfile(out / "compare.png", RESULTS / f"robustness_{name}.png")
        table = (out / "table.md").read_text().strip()
        (RESULTS / f"robustness_{name}.md").write_text(
            f"# #46 robustness: {name}\n\n```bash\n{shlex.join(words)}\n```\n\n"
            f"{TABLE_MARKERS[0]}\n{table}\n{TABLE_MARKERS[1]}\n")
    path = RESULTS / "robustness_curves.json"
    path.write_text(json.dumps(curves, separators=(",", ":")) + "\n")
    for hid, r in fill(ROBUSTNESS_DOC, path).items():
        print(f"{hid}: {r['mark']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["main", "examples"], help="one of the two (default: both)")
    parser.add_argument("--regimes", action="store_true", help="the regime runs instead (see the module doc)")
    parser.add_argument("--regime", action="append", help="--regimes: only this regime (repeatable)")
    parser.add_argument("--examples", nargs="+", help="--regimes: only these example names")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="--regimes: seeds")
    parser.add_argument("--steps", type=int, help="--regimes: override every run's steps (a trial)")
    parser.add_argument("--runs", default="runs/regimes", help="--regimes: where the runs go")
    parser.add_argument("--results", default=str(RESULTS), help="--regimes: where the tables go")
    parser.add_argument("--doc", default=str(REGIME_DOC), help="--regimes: the pre-registration to mark")
    parser.add_argument("--robustness", action="store_true",
                        help="the pre-registered experiments of docs/results/robustness.md (see the module doc)")
    args = parser.parse_args()
    if args.robustness:
        robustness()
        return
    if args.regimes:
        regimes(args)
        return
    if args.only in (None, "main"):
        main_job()
    if args.only in (None, "examples"):
        examples()


if __name__ == "__main__":
    main()
