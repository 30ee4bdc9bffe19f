"""Plots and tables for shim runs. matplotlib is optional (``plot`` extra) and imported only here,
only when a plot is drawn; without it the run still completes and the caller is told why no PNG."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .stats import significance_mark
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
        ax.plot(steps, smooth(series(metrics, f"dataflex/rollout/reward_mean/{d}")), label=d)
    ax.set(title=f"training reward (mean of {SMOOTH} steps)", xlabel="step", ylabel="reward", ylim=(-0.02, 1.02))
    i = 1
    if has_eval:
        ax = axes[i]
        i += 1
        for d in domains:
            pts = [(m["step"], m[f"eval/heldout/{d}"]) for m in metrics if f"eval/heldout/{d}" in m]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=d)
        ax.set(title="held-out accuracy (exact, greedy)", xlabel="step", ylabel="accuracy", ylim=(-0.02, 1.02))
    if has_mix:
        ax = axes[i]
        for d in domains:
            ax.plot(steps, series(metrics, f"dataflex/sample_prob/{d}"), label=d)
        ax.set(title="sampling probability per domain", xlabel="step", ylabel="probability", ylim=(0, 1))
    # One legend for every panel (same colour per domain), below them, where it covers no line.
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


Runs = Sequence[Sequence[Mapping[str, float]]]


def eval_band(runs: Runs, key: str, x_key: str | None = None) -> tuple[list[float], list[float], list[float]]:
    """``(x, mean, std)`` over seeds of ``key`` at the steps where every seed has it.

    ``x`` is the step, or the seed mean of ``x_key`` on those lines (e.g. generated rollouts, which a
    method that refills batches spends at a seed-dependent rate). The std is the sample std (0 for one seed).
    """
    per_seed = [{int(m["step"]): m for m in run if key in m} for run in runs]
    common = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
    xs, means, stds = [], [], []
    for step in common:
        ys = [float(p[step][key]) for p in per_seed]
        mean = sum(ys) / len(ys)
        var = sum((y - mean) ** 2 for y in ys) / (len(ys) - 1) if len(ys) > 1 else 0.0
        x = float(step) if x_key is None else sum(float(p[step].get(x_key, math.nan)) for p in per_seed) / len(ys)
        xs.append(x)
        means.append(mean)
        stds.append(math.sqrt(var))
    return xs, means, stds


def _varies(values: Sequence[float], reference: float) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and (max(finite) - min(finite) > 1e-9 or abs(finite[0] - reference) > 1e-9)


def plot_compare(groups: Mapping[str, Runs], *, metric: str, domains: Sequence[str], path: Path,
                 baseline: str | None = None, rollouts_key: str = "compute/generated_rollouts") -> Path:
    """:func:`compare_figure`, saved to ``path`` (PNG)."""
    plt = _pyplot()
    fig = compare_figure(groups, metric=metric, domains=domains, baseline=baseline, rollouts_key=rollouts_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare_figure(groups: Mapping[str, Runs], *, metric: str, domains: Sequence[str], baseline: str | None = None,
                   rollouts_key: str = "compute/generated_rollouts") -> Any:
    """The comparison figure (a matplotlib ``Figure``): outcomes on top, what each method did below.

    Top: ``metric`` against steps and against generated rollouts (seed mean, band = +-1 std; a dotted
    line marks the baseline's final rollout count, where the equal-budget reading happens), then the
    same held-out family per learnable domain. Bottom (seed mean, ``SMOOTH``-step average): kept
    fraction, cumulative skipped updates, domain probabilities of methods that move them, reweight
    methods' weight mean/std and predictors' calibration (``dataflex/predictor/spearman``, ``.../brier``);
    panels nobody has anything to show in are left out.
    """
    plt = _pyplot()
    labels = list(groups)
    palette = plt.get_cmap("tab10").colors
    others = iter(palette)
    colour = {label: "black" if label == baseline else next(others, "grey") for label in labels}
    width = {label: 2.2 if label == baseline else 1.5 for label in labels}
    prefix = metric.rsplit("/", 1)[0] if "/" in metric else metric
    shown = [d for d in (learnable(domains) or domains)
             if any(f"{prefix}/{d}" in m for runs in groups.values() for r in runs for m in r)]
    spread = "mean ± std over seeds" if max(len(r) for r in groups.values()) > 1 else "one seed, no band"
    top: list[tuple[str, str, str | None]] = [(metric, f"{metric}: {spread}", None),
                                             (metric, "same, against generated rollouts", rollouts_key)]
    top += [(f"{prefix}/{d}", f"{prefix}/{d}", None) for d in shown]

    def steps_of(runs: Runs) -> list[float]:
        return series(runs[0][: min(len(r) for r in runs)], "step")

    def per_step(runs: Runs, key: str) -> list[float]:
        return smooth(mean_over_runs(runs, key))

    skipped = {label: _cumsum(mean_over_runs(runs, "dataflex/skipped_update")) for label, runs in groups.items()}
    any_skip = any(v and max((x for x in v if math.isfinite(x)), default=0.0) > 0 for v in skipped.values())
    probs = {label: [d for d in domains
                     if _varies(mean_over_runs(runs, f"dataflex/sample_prob/{d}"), 1.0 / max(1, len(domains)))]
             for label, runs in groups.items()}
    weighted = [label for label, runs in groups.items()
                if any("dataflex/weight_mean" in m for r in runs for m in r)]
    predicting = [label for label, runs in groups.items()
                  if any("dataflex/predictor/brier" in m for r in runs for m in r)]
    bottom = ["kept"] + (["skipped"] if any_skip else []) + (["probs"] if any(probs.values()) else []) \
        + (["weights"] if weighted else []) + (["calibration"] if predicting else [])

    cols = max(len(top), len(bottom))
    fig, axes = plt.subplots(2, cols, figsize=(4.4 * cols, 8.0), squeeze=False)
    for ax, (key, title, x_key) in zip(axes[0], top):
        for label, runs in groups.items():
            x, mean, std = eval_band(runs, key, x_key)
            if not x:
                continue
            ax.plot(x, mean, color=colour[label], lw=width[label], marker="o", ms=2.5)
            if len(runs) > 1:
                ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                color=colour[label], alpha=0.13, lw=0)
        if x_key is not None and baseline is not None and baseline in groups:
            final = eval_band(groups[baseline], metric, x_key)[0]
            if final:
                ax.axvline(final[-1], color="black", ls=":", lw=1)
                title += "\n(dotted: baseline's final count)"
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("generated rollouts" if x_key else "step")
        if x_key:
            _count_axis(ax)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    styles, style_names = ["-", "--", ":", "-."], ["solid", "dashed", "dotted", "dash-dot"]
    moved = [d for d in domains if any(d in v for v in probs.values())]
    for ax, panel in zip(axes[1], bottom):
        for label, runs in groups.items():
            x = steps_of(runs)
            c, w = colour[label], width[label]
            if panel == "kept":
                ax.plot(x, per_step(runs, "dataflex/kept_fraction"), color=c, lw=w)
            elif panel == "skipped":
                ax.plot(x, skipped[label], color=c, lw=w)
            elif panel == "probs":
                for d in probs[label]:
                    ax.plot(x, per_step(runs, f"dataflex/sample_prob/{d}"), color=c, lw=w,
                            ls=styles[domains.index(d) % len(styles)])
            elif panel == "calibration":
                if label in predicting:
                    ax.plot(x, per_step(runs, "dataflex/predictor/spearman"), color=c, lw=w)
                    ax.plot(x, per_step(runs, "dataflex/predictor/brier"), color=c, lw=w, ls="--")
            elif label in weighted:
                ax.plot(x, per_step(runs, "dataflex/weight_mean"), color=c, lw=w)
                ax.plot(x, per_step(runs, "dataflex/weight_std"), color=c, lw=w, ls="--")
        titles = {
            "kept": "kept fraction (rows trained / rolled out)" + ("" if any_skip else "\nno method skipped an update"),
            "skipped": "skipped updates (cumulative)",
            "probs": "sampling probability per domain\n" + ", ".join(
                f"{d} {style_names[domains.index(d) % len(styles)]}" for d in moved),
            "weights": "loss weights: mean (solid), std (dashed)",
            "calibration": "predictor calibration: Spearman (solid),\nBrier (dashed)",
        }
        ax.set_title(titles[panel], fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[1][0].set_ylabel(f"seed mean, {SMOOTH}-step average")
    for ax in [*axes[0][len(top):], *axes[1][len(bottom):]]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=colour[label], lw=width[label]) for label in labels]
    names = [f"{label} (n={len(groups[label])}{', baseline' if label == baseline else ''})" for label in labels]
    fig.legend(handles, names, loc="lower center", ncol=min(len(labels), 5), fontsize=9, frameon=False)
    rows = -(-len(labels) // 5)
    fig.tight_layout(rect=(0, 0.035 * rows + 0.01, 1, 1))
    return fig


def count_label(value: float, _position: Any = None) -> str:
    """A count as a short tick label: 950, 12k, 1.5M (a label written in full, 350000, runs into its
    neighbours on a panel a few inches wide)."""
    size = abs(value)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if size >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _count_axis(ax: Any) -> None:
    """Short labels and at most 5 ticks on an axis of counts (generated rollouts)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(count_label))


def _cumsum(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v if math.isfinite(v) else 0.0
        out.append(total)
    return out


# ---------------------------------------------------------------------------- the comparison table
def _num(v: float | None, digits: int = 3, sign: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    text = "<0.001" if p < 0.001 else f"{p:.3f}"
    mark = significance_mark(p)
    return f"{text} {mark}" if mark else text


def _delta(delta: Mapping[str, Any] | None) -> str:
    if delta is None:
        return "-"
    ci = delta["ci95"]
    if ci is None:
        return f"{_num(delta['mean'], sign=True)} (n=1: no CI)"
    return f"{_num(delta['mean'], sign=True)} [{_num(ci[0], sign=True)}, {_num(ci[1], sign=True)}]"


def _count(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _tokens(budget: Mapping[str, float]) -> str:
    return _count(budget["generated_tokens"]) if "generated_tokens" in budget else "-"


def _equal_cell(equal: Mapping[str, Any] | None, label: str, base: str) -> str:
    if label == base:
        return "-"
    entry = None if equal is None else equal["methods"].get(label)
    return "n/a" if entry is None else _delta(entry["delta"])


def _target_cell(target: Mapping[str, Any] | None, label: str, base: str) -> str:
    if label == base or not target:
        return "-"
    t = target["methods"][label]
    reached = f"{t['reached']}/{t['n']}"
    if t["mean"] is None:
        return f"never ({reached})"
    ci = t["ci95"]
    shown = f"{t['mean']:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci is not None else "")
    return f"{shown} ({reached})"


def compare_table(summary: Mapping[str, Any]) -> str:
    """The ``compare.json`` document as a Markdown table (also printed to the terminal), with its notes."""
    base, metric = summary["baseline"], summary["metric"]
    equal = summary["equal_rollouts"]
    shown = summary.get("columns") or []
    rows = []
    for label, m in summary["methods"].items():
        eq = equal["methods"].get(label)
        ci = m["ci95"]
        rows.append({
            "method": f"{label} (baseline)" if label == base else label,
            "n": str(m["n"]),
            metric: _num(m["mean"]) + (f" ± {_num(m['std'])}" if m["std"] is not None else " (n=1: no std)"),
            "95% CI": f"[{_num(ci[0])}, {_num(ci[1])}]" if ci is not None else "n=1: none",
            f"Δ vs {base} [95% CI]": _delta(m["delta"]),
            "p": _p(m["delta"]["p_value"]) if m["delta"] else "-",
            "Δ at equal rollouts [95% CI]": "n/a" if eq is None and label != base else _delta(eq and eq["delta"]),
            "p (equal)": _p(eq["delta"]["p_value"]) if eq and eq["delta"] else "-",
            "rollouts": _count(m["budget"]["generated_rollouts"]),
            "generated tokens": _tokens(m["budget"]) if "tokens" in shown else None,
            "Δ at equal tokens [95% CI]": _equal_cell(summary.get("equal_tokens"), label, base)
            if "tokens" in shown else None,
            "rollouts to target [95% CI]": _target_cell(summary.get("to_target"), label, base)
            if "to_target" in shown else None,
            "trained tokens": _count(m["budget"]["trained_tokens"]),
            "cost": f"{m['budget']['modelled_cost']:.4g}" if "modelled_cost" in m["budget"] else None,
            "wall s": f"{m['budget']['wall_s']:.1f}",
        })
        if rows[-1]["cost"] is None:  # a host without the shim's cost model (TRL's runs)
            del rows[-1]["cost"]
        for optional in ("generated tokens", "Δ at equal tokens [95% CI]", "rollouts to target [95% CI]"):
            if rows[-1][optional] is None:  # a column not asked for (--tokens, --to-target)
                del rows[-1][optional]
    columns = list(rows[0]) if rows else []
    seeds = ", ".join(str(s) for s in summary["seeds"])
    reading = {"linear": "linear interpolation between eval points",
               "floor": "the last eval point at or below the budget"}[equal["reading"]]
    notes = [
        f"{metric} at each run's last eval point; mean ± sample std over the seeds ({seeds}); 95% CI: Student t "
        "interval of the mean (n-1 df).",
        f"Δ: paired difference to {base} on the same seeds with its 95% t interval; p: two-sided paired t-test; "
        "* p<0.05, ** p<0.01, *** p<0.001. One seed: no std, interval or p.",
        f"equal rollouts: each seed's pair read where both have generated min(their final rollout counts), "
        f"{reading}.",
        f"rollouts, trained tokens, {'cost, ' if 'cost' in columns else ''}wall s: seed mean at the last eval point "
        "(wall s: summed time/step_s).",
    ]
    notes += [f"no equal-rollouts reading for {label}: {why}" for label, why in equal.get("unavailable", {}).items()]
    if "tokens" in shown:
        notes.append("generated tokens: prompt + response tokens of every generated rollout (replayed rows not "
                     "counted again), seed mean; equal tokens: each seed's pair read where both have generated "
                     f"min(their final token counts), {reading}.")
        notes += [f"no equal-tokens reading for {label}: {why}"
                  for label, why in (summary.get("equal_tokens") or {}).get("unavailable", {}).items()]
    target = summary.get("to_target")
    if "to_target" in shown and target:
        notes.append(f"rollouts to target: per seed, {base}'s rollouts over the method's at their first crossing of "
                     f"the target, the {target['target']} (linear between eval points, the same for both); mean "
                     "and 95% t interval over the seeds that reach it (k/n reached; a seed that never does is "
                     "censored, listed in compare.json).")
    if summary.get("independent"):
        notes.append("independent seeds (--independent): seed i sets trainer.seed, model.seed and data.seed to i, "
                     "so the base policy and the pool vary with the seed.")
    cpus = summary.get("cpus") or []
    if cpus:
        notes.append(f"computed on {' and '.join(cpus)}: runs are bit-identical on one CPU; another CPU gives other "
                     "digits, within the intervals.")
    return format_table(rows, columns) + "\n\n" + "\n".join(f"- {n}" for n in notes)


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
