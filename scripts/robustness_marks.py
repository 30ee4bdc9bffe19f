"""Score the pre-registered hypotheses of ``docs/results/robustness.md`` (#46) from the committed per-run
curves and write their marks, with the Holm correction over the document's own family, into that file.

The curves are ``docs/results/robustness_curves.json``: for each experiment (``independent``, ``learnable``)
its regime, baseline, seeds and, per method label, one entry per seed with its eval points
``[step, generated_rollouts, generated_tokens, trained_tokens, modelled_cost, value]`` (what compare reads).
Every reading is recomputed from them with ``dataflex compare``'s own functions
(:func:`~dataflex_bus.shim.analysis.analyse`, :func:`~dataflex_bus.shim.analysis.to_target`), so a reader
can recompute each mark from committed numbers:

    python scripts/robustness_marks.py docs/results/robustness.md docs/results/robustness_curves.json

``scripts/regenerate_results.py --robustness`` runs the experiments, writes the curves with :func:`curves_of`
and calls :func:`fill`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from preregistration import read_hypotheses  # noqa: E402  (scripts/ is no package)

from dataflex_bus.shim.analysis import Reading, RunCurve, analyse, load_curve, to_target  # noqa: E402
from dataflex_bus.shim.stats import holm, one_sided_p  # noqa: E402

READINGS = ("delta_equal_rollouts", "delta_equal_tokens", "delta_equal_steps", "rollouts_to_target_symmetric")
#: The columns of one eval point in the curves file.
POINT = ("step", "generated_rollouts", "generated_tokens", "trained_tokens", "modelled_cost", "value")
ALPHA = 0.05
RESULTS = ("<!-- robustness-results:start -->", "<!-- robustness-results:end -->")


def hypotheses(doc: str) -> list[dict[str, Any]]:
    """The pre-registered hypotheses of the document, checked."""
    return read_hypotheses(doc, group="experiment", readings=READINGS, ops=(">",))


# ---------------------------------------------------------------------------- the committed curves
def curves_of(compare_json: Path) -> dict[str, Any]:
    """One experiment's compact curves, from a ``dataflex compare`` output (its compare.json and runs)."""
    report = json.loads(compare_json.read_text())
    out: dict[str, Any] = {"regime": (report.get("regime") or {}).get("name", "default"),
                           "baseline": report["baseline"], "seeds": report["seeds"],
                           "independent": bool(report.get("independent")), "metric": report["metric"], "runs": {}}
    for label, dirs in report["runs"].items():
        runs = []
        for run_dir in dirs:
            c = load_curve(Path(run_dir), report["metric"])
            runs.append({"seed": c.seed, "points": [
                [p.step, *(p.budget.get(k) for k in POINT[1:-1]), p.value] for p in c.points]})
        out["runs"][label] = runs
    return out


def rebuild(experiment: Mapping[str, Any]) -> dict[str, list[RunCurve]]:
    """The RunCurves of an experiment's compact curves (what compare read from the run directories)."""
    curves: dict[str, list[RunCurve]] = {}
    for label, runs in experiment["runs"].items():
        curves[label] = []
        for run in runs:
            points = []
            for row in run["points"]:
                p = dict(zip(POINT, row))
                budget = {k: float(p[k]) for k in POINT[1:-1] if p[k] is not None}
                budget["wall_s"] = 0.0
                points.append(Reading(float(p["value"]), float(p["step"]), budget))
            curves[label].append(RunCurve(Path(label) / f"seed{run['seed']}", run["seed"], (), tuple(points), ()))
    return curves


# ---------------------------------------------------------------------------- readings and marks
def reading(h: Mapping[str, Any], experiments: Mapping[str, Any]) -> dict[str, Any]:
    """The hypothesis's reading: mean, 95% interval, one-sided p against its bound, n and a note."""
    exp = experiments.get(h["experiment"])
    if exp is None or h["method"] not in exp["runs"] or h["against"] not in exp["runs"]:
        return {"missing": "not run"}
    curves = rebuild(exp)
    pair = {h["against"]: curves[h["against"]], h["method"]: curves[h["method"]]}
    bound = float(h["predict"]["value"])
    n = len(exp["seeds"])
    if h["reading"] == "rollouts_to_target_symmetric":
        t = to_target(pair, h["against"])["methods"][h["method"]]
        note = (f"{h['against']}'s rollouts / {h['method']}'s at the first crossing of {h['against']}'s smoothed "
                f"final level, {t['reached']}/{t['n']} seeds reach it")
        if t["mean"] is None:
            return {"missing": f"0/{t['n']} seeds reach the target", "censored": t["censored"], "n": n}
        return {"mean": t["mean"], "ci": t["ci95"], "p": one_sided_p(t["mean"], t["std"], t["reached"], bound),
                "n": t["reached"], "seeds": n, "censored": t["censored"], "note": note, "unit": "x"}
    doc = analyse(pair, baseline=h["against"])
    if h["reading"] == "delta_equal_steps":
        entry, note = doc["methods"][h["method"]], "Δ at equal steps"
    else:
        block = doc["equal_rollouts" if h["reading"] == "delta_equal_rollouts" else "equal_tokens"]
        entry = block["methods"].get(h["method"])
        if entry is None:
            return {"missing": block["unavailable"].get(h["method"], "no entry")}
        note = "Δ at equal generated " + ("rollouts" if h["reading"] == "delta_equal_rollouts" else "tokens")
    d = entry["delta"]
    return {"mean": d["mean"], "ci": d["ci95"], "p": one_sided_p(d["mean"], d["std"], entry["n"], bound),
            "n": entry["n"], "seeds": n, "censored": [], "note": note, "unit": "Δ"}


def verdict(value: float, lo: float, hi: float, p_holm: float | None, censored: int, n: int) -> str:
    """The document's scoring rule (its "Scoring" section)."""
    if 2 * censored >= n or hi <= value:
        return "refuted"
    if censored == 0 and p_holm is not None and p_holm < ALPHA and lo > value:
        return "confirmed"
    return "inconclusive"


def _shown(x: float, unit: str) -> str:
    return f"{x:.2f}x" if unit == "x" else f"{x:+.3f}"


def marks(doc: str, experiments: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every hypothesis's reading, Holm-adjusted one-sided p (over those with a p) and mark."""
    hs = hypotheses(doc)
    out = {h["id"]: reading(h, experiments) for h in hs}
    tested = [hid for hid, r in out.items() if r.get("p") is not None]
    for hid, adjusted in zip(tested, holm([out[hid]["p"] for hid in tested])):
        out[hid]["p_holm"] = adjusted
    for h in hs:
        r = out[h["id"]]
        if "missing" in r:
            seeds = r.get("n")
            r["mark"] = (f"**refuted** ({r['missing']}; censored seeds {r['censored']})" if seeds and
                         len(r.get("censored", [])) * 2 >= seeds else
                         "not run" if r["missing"] == "not run" else f"inconclusive ({r['missing']})")
            continue
        lo, hi = r["ci"]
        word = verdict(float(h["predict"]["value"]), lo, hi, r.get("p_holm"), len(r["censored"]), r["seeds"])
        censored = f"; censored seeds {r['censored']}" if r["censored"] else ""
        r["mark"] = (f"**{word}**: {_shown(r['mean'], r['unit'])} [{_shown(lo, r['unit'])}, {_shown(hi, r['unit'])}] "
                     f"({r['note']}, {r['seeds']} seeds{censored}; one-sided p {r['p']:.2g}, Holm {r['p_holm']:.2g})")
    return out


# ---------------------------------------------------------------------------- the descriptive table
def describe(experiments: Mapping[str, Any]) -> str:
    """Every method against its experiment's baseline (and RePO against the extra-update control): Δ at equal
    steps, rollouts and tokens with 95% intervals, and the budgets' ratios at the end."""
    rows = ["| experiment | method vs | Δ equal steps | Δ equal rollouts | Δ equal tokens | rollouts to target "
            "(symmetric) | generated tokens ratio | trained tokens ratio | modelled cost ratio |",
            "|---|---|---|---|---|---|---|---|---|"]

    def cell(d: Mapping[str, Any] | None) -> str:
        if d is None or d.get("ci95") is None:
            return "-"
        return f"{d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"

    for name, exp in experiments.items():
        curves = rebuild(exp)
        pairs = [(label, exp["baseline"]) for label in curves if label != exp["baseline"]]
        if "repo_replay" in curves and "grpo_ppo_epochs2" in curves:
            pairs.append(("repo_replay", "grpo_ppo_epochs2"))
        for method, against in pairs:
            pair = {against: curves[against], method: curves[method]}
            doc = analyse(pair, baseline=against)
            t = to_target(pair, against)["methods"][method]
            target = "-" if t["mean"] is None else (
                f"{t['mean']:.2f}x" + (f" [{t['ci95'][0]:.2f}, {t['ci95'][1]:.2f}]" if t["ci95"] else "")
                + f" ({t['reached']}/{t['n']})")
            eq_t = doc["equal_tokens"]["methods"].get(method)
            ratios = []
            for key in ("generated_tokens", "trained_tokens", "modelled_cost"):
                mine = doc["methods"][method]["budget"].get(key)
                theirs = doc["methods"][against]["budget"].get(key)
                ratios.append("-" if not mine or not theirs else f"{mine / theirs:.2f}x")
            rows.append(f"| {name} ({exp['regime']}, {len(exp['seeds'])} seeds) | {method} vs {against} | "
                        f"{cell(doc['methods'][method]['delta'])} | "
                        f"{cell(doc['equal_rollouts']['methods'][method]['delta'])} | "
                        f"{cell(eq_t['delta'] if eq_t else None)} | {target} | {' | '.join(ratios)} |")
    return "\n".join(rows)


def fill(doc_path: Path, curves_path: Path) -> dict[str, dict[str, Any]]:
    """Write every hypothesis's mark and the descriptive table into the document; returns the marks."""
    doc = doc_path.read_text()
    experiments = json.loads(curves_path.read_text())
    found = marks(doc, experiments)
    for hid, r in found.items():
        pattern = re.compile(rf"(<!-- result:{re.escape(hid)} -->)(.*?)(<!-- /result:{re.escape(hid)} -->)", re.S)
        if not pattern.search(doc):
            raise SystemExit(f"{doc_path}: no result mark for {hid}")
        shown = r["mark"].replace("|", "/")
        doc = pattern.sub(lambda m, shown=shown: m.group(1) + shown + m.group(3), doc)
    start, end = RESULTS
    if start in doc and end in doc:
        head, _, rest = doc.partition(start)
        _, _, tail = rest.partition(end)
        doc = f"{head}{start}\n{describe(experiments)}\n{end}{tail}"
    doc_path.write_text(doc)
    return found


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        raise SystemExit(__doc__)
    for hid, r in fill(Path(args[0]), Path(args[1])).items():
        print(f"{hid}: {r['mark']}")


if __name__ == "__main__":
    main()
