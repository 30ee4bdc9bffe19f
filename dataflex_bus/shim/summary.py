"""The final numbers of a run, written to ``run.json`` and printed at the end of ``dataflex run``."""

from __future__ import annotations

import math


def summarize(metrics: list[dict[str, float]], domains: list[str], tail: int | None = None) -> dict[str, float]:
    """Mean over the last ``tail`` steps (10%, at least 1) of the reward metrics and the kept fraction,
    the last eval accuracies, the kept fraction over the whole run and the last domain probabilities."""
    if not metrics:
        return {}
    tail = tail or max(1, len(metrics) // 10)
    last = metrics[-tail:]
    out: dict[str, float] = {}
    keys = ["reward/mean", "reward/learnable", "train/kept_fraction"] + [f"reward/{d}" for d in domains]
    for key in keys:
        vals = [m[key] for m in last if key in m and math.isfinite(m[key])]
        if vals:
            out[key] = sum(vals) / len(vals)
    for m in reversed(metrics):
        evals = {k: v for k, v in m.items() if k.startswith("eval/")}
        if evals:
            out.update(evals)
            break
    kept = [m["train/kept_fraction"] for m in metrics if "train/kept_fraction" in m]
    if kept:
        out["train/kept_fraction_all"] = sum(kept) / len(kept)
    for d in domains:
        key = f"data/prob/{d}"
        if key in metrics[-1]:
            out[key] = metrics[-1][key]
    return out
