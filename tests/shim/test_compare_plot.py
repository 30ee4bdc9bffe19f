"""The comparison figure's axes stay readable: the generated-rollouts axis (hundreds of thousands) once had
tick labels written in full ("150000 200000 ...") that ran into each other."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("matplotlib")

from dataflex_bus.shim.report import compare_figure

DOMAINS = ["copy", "sort", "reverse", "random"]


def _run(seed: int, per_step: int, steps: int = 200, every: int = 20) -> list[dict[str, float]]:
    out = []
    for step in range(steps + 1):
        m = {"step": float(step), "compute/generated_rollouts": float(per_step * step),
             "dataflex/kept_fraction": 0.5, "dataflex/skipped_update": 0.0}
        if step % every == 0:
            m["eval/heldout/learnable"] = 0.4 + 0.001 * step + 0.01 * seed
            for d in DOMAINS:
                m[f"eval/heldout/{d}"] = 0.3 + 0.001 * step
        out.append(m)
    return out


def _overlaps(fig) -> list[tuple[str, str]]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        boxes = sorted(((t.get_window_extent(renderer), t.get_text()) for t in labels), key=lambda b: b[0].x0)
        found += [(a[1], b[1]) for a, b in itertools.pairwise(boxes) if a[0].x1 > b[0].x0]
    return found


def test_no_tick_labels_overlap_on_the_rollouts_axis():
    import matplotlib.pyplot as plt

    groups = {"grpo_baseline": [_run(s, 512) for s in range(3)],
              "dynamic_sampling": [_run(s, 1536) for s in range(3)]}
    fig = compare_figure(groups, metric="eval/heldout/learnable", domains=DOMAINS, baseline="grpo_baseline")
    try:
        rollouts = [ax for ax in fig.axes if ax.get_xlabel() == "generated rollouts"]
        assert rollouts and all(ax.get_xticklabels() for ax in rollouts)
        assert _overlaps(fig) == []
        texts = [t.get_text() for t in rollouts[0].get_xticklabels() if t.get_text()]
        assert any(t.endswith("k") for t in texts), texts  # 300000 reads 300k
    finally:
        plt.close(fig)


@pytest.mark.parametrize(("value", "label"), [(0, "0"), (950, "950"), (12_000, "12k"), (350_000, "350k"),
                                              (1_500_000, "1.5M"), (2.5e9, "2.5G")])
def test_count_labels_are_short(value, label):
    from dataflex_bus.shim.report import count_label

    assert count_label(value) == label


def test_a_predictors_calibration_gets_its_panel():
    import matplotlib.pyplot as plt

    predicted = [_run(s, 512) for s in range(2)]
    for run in predicted:
        for m in run:
            m["dataflex/predictor/brier"], m["dataflex/predictor/spearman"] = 0.1, 0.4
    groups = {"grpo_baseline": [_run(s, 512) for s in range(2)], "dps": predicted}
    fig = compare_figure(groups, metric="eval/heldout/learnable", domains=DOMAINS, baseline="grpo_baseline")
    try:
        panel = [ax for ax in fig.axes if ax.get_visible() and ax.get_title().startswith("predictor calibration")]
        assert len(panel) == 1 and len(panel[0].lines) == 2  # the predicting method's two curves only
    finally:
        plt.close(fig)
    fig = compare_figure({"grpo_baseline": groups["grpo_baseline"]}, metric="eval/heldout/learnable", domains=DOMAINS)
    try:
        assert not any(ax.get_title().startswith("predictor calibration") for ax in fig.axes)
    finally:
        plt.close(fig)
