"""The final numbers of a run, written to ``run.json`` and printed at the end of ``dataflex run``."""

from __future__ import annotations

import math


def summarize(metrics: list[dict[str, float]], domains: list[str], tail: int | None = None) -> dict[str, float]:
    """Mean over the last ``tail`` steps (10%, at least 1) of the reward metrics, the last eval
    accuracies, the last domain probabilities, and over the whole run: the kept fraction (rows that
    entered an update / rows generated, from the compute counters; rows a replay trained again are not
    counted, being trained but not generated, and are reported beside) and the skipped updates."""
    if not metrics:
        return {}
    tail = tail or max(1, len(metrics) // 10)
    last = metrics[-tail:]
    out: dict[str, float] = {}
    keys = ["dataflex/rollout/reward_mean", "reward/learnable"] + [f"dataflex/rollout/reward_mean/{d}" for d in domains]
    for key in keys:
        vals = [m[key] for m in last if key in m and math.isfinite(m[key])]
        if vals:
            out[key] = sum(vals) / len(vals)
    for m in reversed(metrics):
        evals = {k: v for k, v in m.items() if k.startswith("eval/")}
        if evals:
            out.update(evals)
            break
    final = metrics[-1]
    generated = final.get("compute/generated_rollouts", 0.0)
    if generated:
        # Rows a replay trained again were not generated: the kept fraction is of the generated rows.
        fresh = final.get("compute/trained_rows", 0.0) - final.get("compute/replayed_rows", 0.0)
        out["dataflex/kept_fraction"] = fresh / generated
        if final.get("compute/replayed_rows"):
            out["compute/replayed_rows"] = final["compute/replayed_rows"]
    if "dataflex/skipped_updates" in final:
        out["dataflex/skipped_updates"] = final["dataflex/skipped_updates"]
    for d in domains:
        key = f"dataflex/sample_prob/{d}"
        if key in metrics[-1]:
            out[key] = metrics[-1][key]
    return out
