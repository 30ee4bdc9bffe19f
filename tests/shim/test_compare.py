"""`dataflex compare`: paired statistics, the equal-rollouts reading, outputs and refusals.

Most tests write small synthetic run directories in the trainer's format (``metrics.jsonl`` lines and
``run.json`` through the trainer's own writers) with known curves, so every number compare reports can
be computed by hand. One test drives the real trainer through the CLI.
"""

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dataflex_bus.cli import build_parser, main
from dataflex_bus.shim import analysis
from dataflex_bus.shim.analysis import (
    COUNTERS,
    METRIC,
    STEP_TIME,
    RunCurve,
    analyse,
    load_curve,
    read_at_rollouts,
)
from dataflex_bus.shim.files import METRICS, RECORD, checkpoint_step, write_json, write_metrics
from dataflex_bus.shim.report import compare_table

from .conftest import tiny

DOMAINS = ["sort", "reverse", "random"]
T975_4 = 2.7764451051977934  # scipy.stats.t.ppf(0.975, 4)


def write_run(run_dir: Path, seed: int, curve, *, steps: int = 10, eval_every: int = 2, rollouts: float = 100.0,
              drop: tuple[str, ...] = (), extra=None) -> Path:
    """A finished run whose held-out metric at step s is ``curve(s)``; ``rollouts`` generated per step."""
    lines = []
    for step in range(steps):
        m = {
            "step": float(step),
            COUNTERS["generated_rollouts"]: rollouts * (step + 1),
            "compute/generated_tokens": 2.5 * rollouts * (step + 1),
            "compute/trained_rows": 0.5 * rollouts * (step + 1),
            COUNTERS["trained_tokens"]: 1.25 * rollouts * (step + 1),
            COUNTERS["modelled_cost"]: 0.01 * rollouts * (step + 1),
            STEP_TIME: 0.5,
            "dataflex/kept_fraction": 0.5,
            "dataflex/skipped_update": float(step == 3),
            **{f"dataflex/sample_prob/{d}": 1 / 3 for d in DOMAINS},
        }
        if extra is not None:
            m.update(extra(step))
        if step == 0 or (step + 1) % eval_every == 0:
            m[METRIC] = curve(step)
            m["eval/heldout/sort"] = curve(step) + 0.1
            m["eval/heldout/reverse"] = curve(step) - 0.1
            m["eval/heldout/random"] = 0.01
        for key in drop:
            m.pop(key, None)
        lines.append(m)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_metrics(run_dir / METRICS, lines)
    write_json(run_dir / RECORD, {"config": {}, "seed": seed, "steps": steps, "domains": DOMAINS,
                                   "status": "complete", "wall_s": 0.5 * steps, "summary": {}})
    return run_dir


def method_dir(root: Path, label: str, finals, **kw) -> Path:
    """``root/label/seed<k>`` for k = 0.. with final metric ``finals[k]`` (a line through 0.3 at step 0)."""
    for seed, final in enumerate(finals):
        steps = kw.get("steps", 10)
        write_run(root / label / f"seed{seed}", seed, lambda s, f=final, n=steps: 0.3 + (f - 0.3) * s / (n - 1), **kw)
    return root / label


def strict_json(path: Path):
    def no_constant(name):
        raise AssertionError(f"{path} holds {name}")

    return json.loads(path.read_text(), parse_constant=no_constant)


def compare_cli(*args: str) -> int:
    return main(["compare", *map(str, args), "--no-progress"])


BASE = [0.50, 0.52, 0.48, 0.55, 0.51]
METHOD = [0.56, 0.55, 0.52, 0.60, 0.57]


# ---------------------------------------------------------------------------- the required hand check
@pytest.mark.integration
def test_paired_statistics_equal_a_hand_computed_t_interval(tmp_path, capsys):
    base = method_dir(tmp_path / "runs", "grpo", BASE)
    meth = method_dir(tmp_path / "runs", "filter", METHOD)
    out = tmp_path / "cmp"
    assert compare_cli(base, meth, "--out", out) == 0
    doc = strict_json(out / "compare.json")
    assert doc["baseline"] == "grpo" and doc["metric"] == METRIC and doc["seeds"] == [0, 1, 2, 3, 4]

    # by hand: differences 0.06 0.03 0.04 0.05 0.06, mean 0.048, squared deviations (1e-6) 144 324 64 4 144
    sd = math.sqrt(680e-6 / 4)
    half = T975_4 * sd / math.sqrt(5)
    delta = doc["methods"]["filter"]["delta"]
    assert delta["mean"] == pytest.approx(0.048, abs=1e-12)
    assert delta["std"] == pytest.approx(sd, rel=1e-9)
    assert delta["ci95"] == pytest.approx([0.048 - half, 0.048 + half], rel=1e-9)
    assert delta["p_value"] == pytest.approx(0.0011873593006288465, rel=1e-8)  # scipy.stats.ttest_rel

    m = doc["methods"]["filter"]
    sd_m = math.sqrt(0.0034 / 4)  # deviations from 0.56: 0, .01, .04, .04, .01
    assert (m["n"], m["mean"], m["std"]) == (5, pytest.approx(0.56), pytest.approx(sd_m, rel=1e-9))
    assert m["ci95"] == pytest.approx([0.56 - T975_4 * sd_m / math.sqrt(5), 0.56 + T975_4 * sd_m / math.sqrt(5)])
    assert m["values"] == pytest.approx(METHOD) and m["at_step"] == [9.0] * 5
    b = doc["methods"]["grpo"]
    assert b["delta"] is None and b["mean"] == pytest.approx(sum(BASE) / 5)
    # budget at the last eval point (step 9): 1000 rollouts, 1250 trained tokens, cost 10, 10 steps x 0.5 s
    assert m["budget"] == pytest.approx({"generated_rollouts": 1000, "trained_tokens": 1250, "modelled_cost": 10,
                                         "wall_s": 5.0})

    # same rollouts per step: the equal-rollouts reading is the final reading
    eq = doc["equal_rollouts"]
    assert eq["reading"] == "linear" and eq["unavailable"] == {}
    assert eq["methods"]["filter"]["delta"]["ci95"] == pytest.approx(delta["ci95"])
    assert eq["methods"]["filter"]["delta"]["baseline_mean"] == pytest.approx(b["mean"])
    assert eq["methods"]["grpo"] == b

    text = capsys.readouterr().out
    table = (out / "table.md").read_text()
    assert table.strip() in text
    row = next(line for line in table.splitlines() if line.startswith("| filter"))
    assert "0.560 ± 0.029" in row and f"+0.048 [+{0.048 - half:.3f}, +{0.048 + half:.3f}]" in row
    assert "0.001 **" in row
    assert "| grpo (baseline)" in table and "paired t-test" in table
    assert (out / "compare.png").stat().st_size > 0


# ---------------------------------------------------------------------------- reading at a rollout budget
def curve_of(tmp_path, rollouts, name="r", **kw) -> RunCurve:
    # eval points at steps 0, 1, 3, 5, 7, 9 with value = step / 10
    return load_curve(write_run(tmp_path / name, 0, lambda s: s / 10, rollouts=rollouts, **kw), METRIC)


def test_read_at_rollouts_linear_and_floor(tmp_path):
    c = curve_of(tmp_path, 150.0)  # eval points at 150, 300, 600, 900, 1200, 1500 rollouts
    assert [p.rollouts for p in c.points] == [150, 300, 600, 900, 1200, 1500]
    # 1000 lies a third of the way from 900 (step 5) to 1200 (step 7)
    lin = read_at_rollouts(c, 1000.0, "linear")
    assert lin.value == pytest.approx(0.5 + (0.7 - 0.5) / 3) and lin.step == pytest.approx(5 + 2 / 3)
    assert lin.rollouts == 1000.0
    assert lin.budget["trained_tokens"] == pytest.approx(1.25 * 1000)
    assert lin.budget["wall_s"] == pytest.approx(3.0 + (4.0 - 3.0) / 3)  # 6 then 8 steps of 0.5 s
    flo = read_at_rollouts(c, 1000.0, "floor")
    assert (flo.value, flo.step, flo.rollouts) == (pytest.approx(0.5), 5.0, 900.0)
    # exactly on an eval point both readings agree; past the last point the last is read
    assert read_at_rollouts(c, 600.0, "linear") == read_at_rollouts(c, 600.0, "floor") == c.points[2]
    assert read_at_rollouts(c, 5000.0, "linear") == c.final
    # before the first eval point there is nothing to read
    assert read_at_rollouts(c, 149.0, "linear") is None and read_at_rollouts(c, 149.0, "floor") is None


def test_equal_counts_read_the_most_trained_point(tmp_path):
    # no rollouts generated between steps 3 and 5 (a method that only reused data): both evals sit at 400
    c = curve_of(tmp_path, 100.0, extra=lambda s: {COUNTERS["generated_rollouts"]: 100.0 * (s + 1) if s < 4 else
                                                   400.0 if s < 6 else 100.0 * (s - 1)})
    at = [(p.step, p.rollouts) for p in c.points]
    assert at[2:4] == [(3.0, 400.0), (5.0, 400.0)]
    assert read_at_rollouts(c, 400.0, "linear").step == 5.0 and read_at_rollouts(c, 400.0, "floor").step == 5.0


def test_equal_rollouts_reads_both_sides_at_the_smaller_final_count(tmp_path):
    seeds = range(3)
    # the baseline generates 100 rollouts per step, "refill" 150, "lean" 80; value = step / 10 + seed / 100
    base = [load_curve(write_run(tmp_path / f"b{s}", s, lambda t, s=s: t / 10 + s / 100), METRIC) for s in seeds]
    refill = [load_curve(write_run(tmp_path / f"r{s}", s, lambda t, s=s: t / 10 + s / 100 + 0.05, rollouts=150.0),
                         METRIC) for s in seeds]
    lean = [load_curve(write_run(tmp_path / f"l{s}", s, lambda t, s=s: t / 20 + s / 100, rollouts=80.0), METRIC)
            for s in seeds]
    doc = analyse({"base": base, "refill": refill, "lean": lean}, baseline="base")
    # finals (step 9): base 0.9 + s/100 at 1000 rollouts, refill 0.95 + s/100 at 1500, lean 0.45 + s/100 at 800
    assert doc["methods"]["refill"]["delta"]["mean"] == pytest.approx(0.05)
    assert doc["methods"]["refill"]["budget"]["generated_rollouts"] == 1500
    eq = doc["equal_rollouts"]["methods"]
    # refill read at the baseline's 1000: a third of the way from step 5 (900) to step 7 (1200)
    refill_at = 0.5 + 0.2 / 3 + 0.05
    assert eq["refill"]["values"] == pytest.approx([refill_at + s / 100 for s in seeds])
    assert eq["refill"]["delta"]["mean"] == pytest.approx(refill_at - 0.9)
    assert eq["refill"]["delta"]["baseline_mean"] == pytest.approx(0.91)
    assert eq["refill"]["budget"]["generated_rollouts"] == pytest.approx(1000)
    assert eq["refill"]["at_step"] == pytest.approx([5 + 2 / 3] * 3)
    # lean generated fewer: the baseline is read at lean's 800, between step 7 (800) exactly
    assert eq["lean"]["values"] == pytest.approx([0.45 + s / 100 for s in seeds])
    assert eq["lean"]["delta"]["baseline_mean"] == pytest.approx(0.7 + 0.01)
    assert eq["lean"]["delta"]["mean"] == pytest.approx(0.45 - 0.7)
    # a constant difference over seeds: zero spread, the interval collapses, p = 0
    assert eq["lean"]["delta"]["std"] == pytest.approx(0.0, abs=1e-12)
    floor = analyse({"base": base, "refill": refill}, baseline="base", reading="floor")
    assert floor["equal_rollouts"]["reading"] == "floor"
    assert floor["equal_rollouts"]["methods"]["refill"]["values"] == pytest.approx([0.55 + s / 100 for s in seeds])


def test_equal_rollouts_unavailable_is_explained(tmp_path):
    # the method's first eval point (step 0) already holds more rollouts than the baseline ever generated
    base = [load_curve(write_run(tmp_path / "b", 0, lambda t: 0.5, steps=2, rollouts=10.0), METRIC)]
    big = [load_curve(write_run(tmp_path / "g", 0, lambda t: 0.6, steps=2, rollouts=100.0), METRIC)]
    doc = analyse({"base": base, "big": big}, baseline="base")
    assert doc["equal_rollouts"]["methods"]["big"] is None
    assert "20 generated rollouts" in doc["equal_rollouts"]["unavailable"]["big"]
    assert "no equal-rollouts reading for big" in compare_table(doc)


# ---------------------------------------------------------------------------- one seed, errors, refusals
@pytest.mark.integration
def test_one_seed_writes_nulls_and_says_so(tmp_path):
    base = method_dir(tmp_path / "runs", "a", [0.5])
    meth = method_dir(tmp_path / "runs", "b", [0.6])
    out = tmp_path / "cmp"
    assert compare_cli(base, meth, "--out", out) == 0
    doc = strict_json(out / "compare.json")
    b = doc["methods"]["b"]
    assert (b["n"], b["std"], b["ci95"]) == (1, None, None)
    assert b["delta"] == {"mean": pytest.approx(0.1), "std": None, "ci95": None, "p_value": None}
    table = (out / "table.md").read_text()
    assert "n=1: no std" in table and "n=1: none" in table and "(n=1: no CI)" in table


@pytest.mark.parametrize(("drop", "culprit"), [
    ((METRIC,), f"no '{METRIC}' on any step"),
    ((COUNTERS["generated_rollouts"],), f"no '{COUNTERS['generated_rollouts']}' at step 0"),
    ((COUNTERS["modelled_cost"],), f"no '{COUNTERS['modelled_cost']}' at step 0"),
    ((STEP_TIME,), f"no '{STEP_TIME}' at step 0"),
])
def test_missing_metric_or_counter_names_run_and_key(tmp_path, capsys, drop, culprit):
    good = method_dir(tmp_path / "runs", "good", [0.5])
    bad = write_run(tmp_path / "runs" / "bad", 0, lambda s: 0.5, drop=drop)
    assert compare_cli(good, bad, "--out", tmp_path / "cmp") == 2
    err = capsys.readouterr().err
    assert err.startswith("dataflex compare: error: ") and str(bad) in err and culprit in err
    assert "Traceback" not in err and not (tmp_path / "cmp").exists()


def test_non_finite_metric_is_refused(tmp_path, capsys):
    good = method_dir(tmp_path / "runs", "good", [0.5])
    bad = write_run(tmp_path / "runs" / "bad", 0, lambda s: math.nan if s == 9 else 0.5)
    assert compare_cli(good, bad, "--out", tmp_path / "cmp") == 2
    assert f"'{METRIC}' at step 9 is nan, not a finite number" in capsys.readouterr().err


@pytest.mark.integration
def test_metric_option_and_missing_metric_suggests_keys(tmp_path, capsys):
    a = method_dir(tmp_path / "runs", "a", [0.5, 0.6])
    b = method_dir(tmp_path / "runs", "b", [0.4, 0.7])
    out = tmp_path / "cmp"
    assert compare_cli(a, b, "--out", out, "--metric", "eval/heldout/sort") == 0
    doc = strict_json(out / "compare.json")
    assert doc["metric"] == "eval/heldout/sort" and doc["methods"]["a"]["mean"] == pytest.approx(0.65)
    assert compare_cli(a, b, "--out", tmp_path / "c2", "--metric", "eval/heldout/nope") == 2
    err = capsys.readouterr().err
    assert "no 'eval/heldout/nope' on any step" in err and "eval/heldout/sort" in err and "--metric" in err


@pytest.mark.integration
def test_baseline_option(tmp_path, capsys):
    a = method_dir(tmp_path / "runs", "a", BASE)
    b = method_dir(tmp_path / "runs", "b", METHOD)
    out = tmp_path / "cmp"
    assert compare_cli(a, b, "--out", out, "--baseline", "b") == 0
    doc = strict_json(out / "compare.json")
    assert doc["baseline"] == "b" and doc["methods"]["b"]["delta"] is None
    assert doc["methods"]["a"]["delta"]["mean"] == pytest.approx(-0.048)
    assert list(doc["methods"]) == ["a", "b"]  # input order is kept
    assert compare_cli(a, b, "--out", tmp_path / "c2", "--baseline", "c") == 2
    assert "--baseline: 'c' is none of the compared inputs (allowed: a, b)" in capsys.readouterr().err


@pytest.mark.integration
def test_earlier_comparison_needs_force(tmp_path, capsys, monkeypatch):
    a = method_dir(tmp_path / "runs", "a", BASE)
    b = method_dir(tmp_path / "runs", "b", METHOD)
    out = tmp_path / "cmp"
    assert compare_cli(a, b, "--out", out) == 0
    before = (out / "compare.json").read_text()
    assert compare_cli(b, a, "--out", out) == 2
    err = capsys.readouterr().err
    assert f"{out} already holds a comparison (compare.json, table.md, compare.png)" in err and "--force" in err
    assert (out / "compare.json").read_text() == before
    # --force replaces it; without matplotlib the old PNG goes too (it would show the other comparison)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert compare_cli(b, a, "--out", out, "--force") == 0
    assert strict_json(out / "compare.json")["baseline"] == "b"
    assert not (out / "compare.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


@pytest.mark.integration
def test_directory_inputs_and_seeds(tmp_path, capsys):
    a = method_dir(tmp_path / "runs", "a", BASE)
    b = method_dir(tmp_path / "runs", "b", METHOD)
    out = tmp_path / "cmp"
    assert compare_cli(a, b, "--out", out, "--seeds", "1", "3") == 0
    doc = strict_json(out / "compare.json")
    assert doc["seeds"] == [1, 3] and doc["methods"]["b"]["values"] == pytest.approx([0.55, 0.60])
    # a single run directory is one seed; against a five-seed input it is refused
    assert compare_cli(a / "seed2", b, "--out", tmp_path / "c2") == 2
    assert "not on the same seeds (a: [2], b: [0, 1, 2, 3, 4])" in capsys.readouterr().err
    assert compare_cli(a, b, "--out", tmp_path / "c3", "--seeds", "7") == 2
    assert f"{a} holds no run for seed(s) [7]" in capsys.readouterr().err
    # a seed<k> run directory is labelled after its method's directory; --baseline takes the label or the path
    assert compare_cli(a / "seed2", b / "seed2", "--out", tmp_path / "c4", "--baseline", str(b / "seed2")) == 0
    doc = strict_json(tmp_path / "c4" / "compare.json")
    assert doc["baseline"] == "b" and doc["seeds"] == [2] and doc["methods"]["a"]["values"] == pytest.approx([0.48])
    (tmp_path / "empty").mkdir()
    assert compare_cli(a, tmp_path / "empty", "--out", tmp_path / "c5") == 2
    assert "neither a run directory nor a directory of run directories" in capsys.readouterr().err


def test_cli_defaults_match_the_module():
    args = build_parser().parse_args(["compare", "a.yaml"])
    assert args.metric == analysis.METRIC and args.budget_reading == "linear" and args.baseline is None


# ---------------------------------------------------------------------------- through the real trainer
def write_config(path: Path, config) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.integration
def test_compare_runs_configs_and_reuses_finished_runs(tmp_path, capsys):
    a = write_config(tmp_path / "a.yaml", tiny(trainer={"eval_every": 1}))
    b = write_config(tmp_path / "b.yaml", tiny(trainer={"eval_every": 1, "lr": 0.01}))
    out = tmp_path / "cmp"
    args = [a, b, "--steps", "2", "--seeds", "0", "1", "--out", out, "--metric", "eval/heldout/learnable"]
    rc = compare_cli(*args)
    lines = [json.loads(x) for x in (out / "a" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    # compare needs the trainer's counters and step times on every line
    assert not [k for k in [*COUNTERS.values(), STEP_TIME] if k not in lines[0]]
    assert rc == 0, capsys.readouterr().err
    doc = strict_json(out / "compare.json")
    assert list(doc["methods"]) == ["a", "b"] and doc["seeds"] == [0, 1]
    values = [json.loads(x)["eval/heldout/learnable"]
              for s in (0, 1) for x in (out / "b" / f"seed{s}" / "metrics.jsonl").read_text().splitlines()[-1:]]
    assert doc["methods"]["b"]["values"] == pytest.approx(values)
    assert (out / "table.md").exists() and (out / "compare.png").exists()
    assert len(lines) == 2 and (out / "b" / "seed1" / RECORD).exists()
    stamp = (out / "a" / "seed0" / METRICS).stat().st_mtime_ns
    assert compare_cli(*args, "--force") == rc  # finished runs are read, not re-run
    assert (out / "a" / "seed0" / METRICS).stat().st_mtime_ns == stamp


def test_compare_refuses_configs_on_different_seeds(tmp_path, capsys):
    a = write_config(tmp_path / "a.yaml", tiny())
    b = write_config(tmp_path / "b.yaml", tiny(trainer={"seed": 3}))
    out = tmp_path / "cmp"
    assert compare_cli(a, b, "--steps", "1", "--out", out) == 2
    assert "a: [0], b: [3]" in capsys.readouterr().err and not out.exists()


def test_a_bad_run_directory_fails_before_any_training(tmp_path, capsys):
    a = write_config(tmp_path / "a.yaml", tiny())
    bad = write_run(tmp_path / "bad", 0, lambda s: 0.5, drop=(STEP_TIME,))
    out = tmp_path / "cmp"
    assert compare_cli(a, bad, "--steps", "1", "--out", out, "--seeds", "0") == 2
    assert f"{bad}: metrics.jsonl has no '{STEP_TIME}'" in capsys.readouterr().err
    assert not (out / "a").exists()


@pytest.mark.integration
def test_runs_are_paired_by_seed_not_by_directory_order(tmp_path):
    def final(f):
        return lambda s: 0.3 + (f - 0.3) * s / 9

    # directory-name order gives seeds (10, 2) for the baseline and (2, 10) for the method
    write_run(tmp_path / "base" / "x1", 10, final(0.6))
    write_run(tmp_path / "base" / "x2", 2, final(0.5))
    write_run(tmp_path / "meth" / "a", 2, final(0.55))
    write_run(tmp_path / "meth" / "b", 10, final(0.65))
    out = tmp_path / "cmp"
    assert compare_cli(tmp_path / "base", tmp_path / "meth", "--out", out) == 0
    doc = strict_json(out / "compare.json")
    assert doc["seeds"] == [2, 10] and doc["methods"]["meth"]["values"] == pytest.approx([0.55, 0.65])
    delta = doc["methods"]["meth"]["delta"]
    assert delta["mean"] == pytest.approx(0.05) and delta["std"] == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------------------- interrupted and resumed
def _comparable(doc):
    """compare.json without what no two runs share: wall times and the run directories' paths."""
    doc = json.loads(json.dumps(doc))
    doc.pop("runs")
    for block in (doc["methods"], doc["equal_rollouts"]["methods"], doc["equal_tokens"]["methods"]):
        for entry in block.values():
            if entry is not None:
                entry["budget"].pop("wall_s")
    return doc


@pytest.mark.integration
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_compare_killed_mid_run_and_resumed_equals_an_uninterrupted_one(tmp_path, capsys, signum):
    from . import faults

    small = {"trainer": {"eval_every": 10, "save_every": 5}, "data": {"heldout": 60}}
    a = write_config(tmp_path / "a.yaml", tiny(**small))
    b = write_config(tmp_path / "b.yaml", tiny(**small, model={"hidden": 16, "pretrain_steps": 5, "seed": 1}))
    common = [str(a), str(b), "--steps", "40", "--seeds", "0", "1"]
    assert compare_cli(*common, "--out", tmp_path / "whole") == 0, capsys.readouterr().err
    whole = strict_json(tmp_path / "whole" / "compare.json")

    out = tmp_path / "cut"
    exe = str(Path(sys.executable).with_name("dataflex"))
    command = [exe, "compare", *common, "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(command, env=faults.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = out / "b" / "seed0"
    while not (victim / "run.json").exists():  # a, both seeds, are done; b seed0 has begun
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    at = faults.wait_for_checkpoint(victim, proc, at_least=10)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, err
    # every run is named as it starts, --no-progress or not
    assert [line for line in err.splitlines() if " seed " in line and line.endswith(":")] == [
        "a seed 0:", "a seed 1:", "b seed 0:"]
    held = checkpoint_step(victim)
    assert held >= at
    name = "SIGTERM" if signum == signal.SIGTERM else "SIGINT"
    assert re.fullmatch(
        rf"dataflex compare: interrupted \({name}\) at step \d+ in b seed 0; its checkpoint "
        rf"\({re.escape(str(victim))}\) holds step {held}; rerun the same command with --resume to continue: "
        "finished runs are reused, unfinished ones resume from their checkpoints", err.splitlines()[-1]), err
    assert json.loads((victim / RECORD).read_text())["status"] == "interrupted"
    assert not (out / "compare.json").exists()

    # the same command again: refused, saying what would continue it (nothing is touched)
    again = subprocess.run(command, env=faults.env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    done = json.loads((victim / RECORD).read_text())["counters"]["steps_done"]
    assert (f"{victim} holds an interrupted run at step {done}, its checkpoint at step {held}; rerun with --resume to "
            "continue it from its checkpoint, or --force to start it over") in again.stderr, again.stderr

    resumed = subprocess.run([*command, "--resume"], env=faults.env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"b seed 0: resuming from its checkpoint at step {held}" in resumed.stderr
    assert "a seed 0:" not in resumed.stderr  # finished runs are read, not re-run
    assert _comparable(strict_json(out / "compare.json")) == _comparable(whole)
    record = json.loads((victim / RECORD).read_text())
    assert [s["status"] for s in record["sessions"]] == ["interrupted", "complete"]


@pytest.mark.integration
def test_resume_refuses_a_run_of_another_config_and_force_reruns_it(tmp_path, capsys):
    a = write_config(tmp_path / "a.yaml", tiny(trainer={"eval_every": 1}))
    out = tmp_path / "cmp"
    seed0 = out / "a" / "seed0"
    assert main(["run", str(a), "--steps", "2", "--out", str(seed0), "--no-progress", "trainer.lr=0.01"]) == 0
    capsys.readouterr()
    assert compare_cli(a, "--steps", "2", "--seeds", "0", "--out", out, "--resume") == 2
    err = capsys.readouterr().err
    assert (f"{seed0} holds a complete run, its checkpoint at step 2, written with another config (trainer.lr: "
            "there 0.01, config 0.0005); use --force to re-run it") in err, err
    assert compare_cli(a, "--steps", "2", "--seeds", "0", "--out", out, "--resume", "--force") == 0
    assert "a seed 0: starting over" in capsys.readouterr().err
    assert json.loads((seed0 / RECORD).read_text())["config"]["trainer"]["lr"] == 0.0005


def test_the_comparison_names_the_cpus_its_runs_ran_on(tmp_path):
    base = method_dir(tmp_path / "runs", "grpo", BASE[:2])
    meth = method_dir(tmp_path / "runs", "filter", METHOD[:2])
    for run, cpu in zip([*base.iterdir(), *meth.iterdir()], ["CPU A", "CPU A", "CPU A", "CPU B"]):
        record = json.loads((run / RECORD).read_text())
        write_json(run / RECORD, {**record, "machine": {"cpu": cpu}})
    curves = {label: [load_curve(d / f"seed{s}", METRIC) for s in (0, 1)] for label, d in (("grpo", base),
                                                                                          ("filter", meth))}
    doc = analyse(curves, baseline="grpo")
    assert doc["cpus"] == ["CPU A", "CPU B"]
    assert compare_table(doc).endswith("- computed on CPU A and CPU B: runs are bit-identical on one CPU; another "
                                       "CPU gives other digits, within the intervals.")
    doc["cpus"] = []  # runs from before run.json named the CPU: no note
    assert "computed on" not in compare_table(doc)
