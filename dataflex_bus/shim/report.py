"""Plots and tables for shim runs. matplotlib is optional (``plot`` extra) and imported only here,
only when a plot is drawn; without it the run still completes and the caller is told why no PNG."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .tasks import TASKS

SMOOTH = 10


class PlottingUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlottingUnavailable("matplotlib is not installed (pip install 'dataflex-bus[plot]'); "
                                  "no PNG written") from exc
    return plt


def series(metrics: Sequence[Mapping[str, float]], key: str) -> list[float]:
    """One value per step (NaN where the step has no such metric, e.g. a domain not sampled)."""
    return [float(m.get(key, math.nan)) for m in metrics]


def smooth(values: Sequence[float], window: int = SMOOTH) -> list[float]:
    """Trailing moving average over the finite values of the last ``window`` steps."""
    out: list[float] = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def mean_over_runs(runs: Sequence[Sequence[Mapping[str, float]]], key: str) -> list[float]:
    """Per-step mean of ``key`` over several runs (NaN-aware), truncated to the shortest run."""
    n = min(len(r) for r in runs)
    cols = [series(r[:n], key) for r in runs]
    out = []
    for vals in zip(*cols):
        finite = [v for v in vals if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


def learnable(domains: Sequence[str]) -> list[str]:
    return [d for d in domains if d in TASKS and TASKS[d].learnable]


def plot_run(metrics: Sequence[Mapping[str, float]], domains: Sequence[str], path: Path, title: str, *,
             mix: bool = False) -> Path:
    """Training reward per domain (smoothed), held-out accuracy, and (``mix``) domain probabilities."""
    plt = _pyplot()
    has_eval = any(f"eval/heldout/{d}" in m for m in metrics for d in domains)
    has_mix = mix
    panels = 1 + has_eval + has_mix
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.8), squeeze=False)
    axes = axes[0]
    steps = series(metrics, "step")
    ax = axes[0]
    for d in domains:
        ax.plot(steps, smooth(series(metrics, f"reward/{d}")), label=d)
    ax.set(title=f"training reward (mean of {SMOOTH} steps)", xlabel="step", ylabel="reward", ylim=(-0.02, 1.02))
    ax.legend(fontsize=8)
    i = 1
    if has_eval:
        ax = axes[i]
        i += 1
        for d in domains:
            pts = [(m["step"], m[f"eval/heldout/{d}"]) for m in metrics if f"eval/heldout/{d}" in m]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=d)
        ax.set(title="held-out accuracy (exact, greedy)", xlabel="step", ylim=(-0.02, 1.02))
        ax.legend(fontsize=8)
    if has_mix:
        ax = axes[i]
        for d in domains:
            ax.plot(steps, series(metrics, f"data/prob/{d}"), label=d)
        ax.set(title="sampling probability per domain", xlabel="step", ylim=(0, 1))
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_compare(groups: Mapping[str, Sequence[Sequence[Mapping[str, float]]]], domains: Sequence[str],
                 path: Path) -> Path:
    """One panel for the mean reward and one per learnable domain; one line per config (seed mean)."""
    plt = _pyplot()
    keys = [("reward/mean", "all domains")] + [(f"reward/{d}", d) for d in learnable(domains)]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.8), squeeze=False)
    for ax, (key, name) in zip(axes[0], keys):
        for label, runs in groups.items():
            y = smooth(mean_over_runs(runs, key))
            ax.plot(range(len(y)), y, label=label)
        ax.set(title=f"{name}: training reward", xlabel="step", ylim=(-0.02, 1.02))
    axes[0][0].set_ylabel(f"reward (mean over seeds, {SMOOTH}-step average)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A plain Markdown table (also readable in a terminal)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "-" if not math.isfinite(v) else f"{v:.3f}"
        return str(v)

    body = [[cell(r.get(c, math.nan)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)
