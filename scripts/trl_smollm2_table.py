"""The paired SmolLM2-135M table: plain TRL against a selection with refill and an allocation, 3 seeds.

    python scripts/trl_smollm2_table.py                  # the runs (about 100 min on 2 cores), then the table
    python scripts/trl_smollm2_table.py --table-only     # the table from finished runs

Each (method, seed) is one ``examples/trl/arithmetic.py`` run of SmolLM2-135M-Instruct in TRL's GRPOTrainer on
few-shot two-digit addition (300 training and 100 held-out problems, split by the seed; the held-out ones
scored greedily every ``EVAL_EVERY`` steps), in a process of its own with one torch thread, ``--jobs`` at a
time. The analysis is ``dataflex compare``'s (:func:`dataflex_bus.shim.analysis.analyse`): the held-out
accuracy at the last step, paired against plain TRL on the same seeds with Student t intervals, and the same
at equal generated rollouts (each pair read where both have generated the smaller final count, linear
between eval points). Writes ``docs/results/trl_smollm2_table.json`` (every run's eval points and summary,
the settings and the command) and ``.png``, and the table between the markers of ``trl_smollm2_table.md``.
A run whose ``summary.json`` exists is not run again (``--force`` reruns it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dataflex_bus.shim import report  # noqa: E402
from dataflex_bus.shim.analysis import Reading, RunCurve, analyse  # noqa: E402

#: label -> the dataflex block's file (None: plain TRL). The blocks are the examples', unchanged.
METHODS: dict[str, str | None] = {
    "plain TRL": None,
    "dynamic sampling + refill": "examples/trl/dynamic_sampling.yaml",
    "SPEED (allocate)": "examples/speed.yaml",
}
BASELINE = "plain TRL"
METRIC = "eval/heldout/accuracy"
#: Fixed before any run (docs/results/trl_smollm2_table.md says how they were sized).
SETTINGS = {"task": "two_digit", "train": 300, "heldout": 100, "steps": 48, "prompts": 2, "generations": 8,
            "max_new_tokens": 6, "lr": 1e-5, "eval_every": 6, "threads": 1}
RESULTS = ROOT / "docs" / "results"
START, END = "<!-- trl-table:start -->", "<!-- trl-table:end -->"


def run_dir(out: Path, label: str, seed: int) -> Path:
    return out / label.split(" ")[0].lower() / f"seed{seed}"


def command(label: str, seed: int, folder: Path) -> list[str]:
    cmd = [sys.executable, str(ROOT / "examples" / "trl" / "arithmetic.py"), "--seed", str(seed), "--out", str(folder)]
    for key, value in SETTINGS.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    block = METHODS[label]
    return cmd + ([] if block is None else ["--method", str(ROOT / block)])


def train(label: str, seed: int, folder: Path) -> float:
    """One run in its own process (its output in ``folder/stdout.log``); its wall seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(SETTINGS["threads"]), "MKL_NUM_THREADS": str(SETTINGS["threads"])}
    started = time.perf_counter()
    with open(folder / "stdout.log", "w") as log:
        done = subprocess.run(command(label, seed, folder), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{label} seed {seed} failed (exit {done.returncode}): see {folder / 'stdout.log'}")
    seconds = time.perf_counter() - started
    print(f"{label}, seed {seed}: {seconds:.0f} s", flush=True)
    return seconds


def curve(folder: Path, seed: int) -> tuple[RunCurve, dict[str, Any]]:
    """A run's eval points as ``dataflex compare`` reads them: step 0 (the pretrained model, nothing spent)
    and every logged step holding the held-out accuracy, with the cumulative counters of that step."""
    summary = json.loads((folder / "summary.json").read_text())
    lines = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    points = [Reading(summary["heldout_before"], 0.0,
                      {"generated_rollouts": 0.0, "trained_tokens": 0.0, "wall_s": 0.0})]
    wall = 0.0
    metrics = [{"step": 0.0, METRIC: summary["heldout_before"], "compute/generated_rollouts": 0.0}]
    for line in lines:
        wall += float(line["step_time"])  # TRL's own time of the step: held-out scoring is not in it
        entry = {k: float(v) for k, v in line.items() if isinstance(v, (int, float))}
        metrics.append(entry)
        if METRIC in line:
            points.append(Reading(float(line[METRIC]), float(line["step"]),
                                  {"generated_rollouts": float(line["compute/generated_rollouts"]),
                                   "trained_tokens": float(line["compute/trained_tokens"]), "wall_s": wall}))
    return RunCurve(folder, seed, (), tuple(points), tuple(metrics)), summary


def table(out: Path, seeds: list[int], argv: list[str]) -> dict[str, Any]:
    curves: dict[str, list[RunCurve]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    for label in METHODS:
        for seed in seeds:
            c, summary = curve(run_dir(out, label, seed), seed)
            curves.setdefault(label, []).append(c)
            runs.setdefault(label, []).append({
                "seed": seed, "summary": summary,
                "points": [{"step": p.step, "accuracy": p.value, **p.budget} for p in c.points]})
    summary = analyse(curves, baseline=BASELINE, metric=METRIC)
    summary.pop("runs")
    summary.update({"settings": SETTINGS, "methods_blocks": METHODS, "command": shlex.join(["python", *argv]),
                    "per_run": runs})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "trl_smollm2_table.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    text = report.compare_table(summary)
    print(text)
    md = RESULTS / "trl_smollm2_table.md"
    doc = md.read_text()
    if START in doc and END in doc:
        head, rest = doc.split(START, 1)
        md.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END, 1)[1]}")
    groups = {label: [list(c.metrics) for c in runs_] for label, runs_ in curves.items()}
    try:
        print("plot:", report.plot_compare(groups, metric=METRIC, domains=[], path=RESULTS / "trl_smollm2_table.png",
                                           baseline=BASELINE))
    except report.PlottingUnavailable as exc:
        print(exc)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "trl_smollm2_table",
                        help="run folders: OUT/<method>/seed<k> (default: runs/trl_smollm2_table)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (default: 2)")
    parser.add_argument("--force", action="store_true", help="rerun finished runs")
    parser.add_argument("--table-only", action="store_true", help="no runs: the table from finished ones")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1 (got {args.jobs})")
    todo = [(label, seed) for label in METHODS for seed in args.seeds
            if args.force or not (run_dir(args.out, label, seed) / "summary.json").is_file()]
    if todo and not args.table_only:
        # The allocation's runs are the longest: started first, so the last job standing is a short one.
        todo.sort(key=lambda item: list(METHODS).index(item[0]), reverse=True)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda item: train(item[0], item[1], run_dir(args.out, *item)), todo))
        print(f"{len(todo)} runs in {time.perf_counter() - started:.0f} s ({args.jobs} at a time)", flush=True)
    table(args.out, args.seeds, [os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
