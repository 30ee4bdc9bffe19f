"""Compare runs of ``examples/trl/arithmetic.py``: a markdown table and a figure of the rollouts' reward per
step and per generated rollout.

    python examples/trl/curve.py runs/trl_plain runs/trl_ds --out runs/trl_curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def read(run: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    logs = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((run / "summary.json").read_text()), logs


def table(runs: list[Path]) -> str:
    lines = ["| run | held-out before | held-out after | rollout reward, first 5 / last 5 steps | rollouts generated "
             "| rows trained | wall time |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        summary, logs = read(run)
        reward = [h["dataflex/rollout/reward_mean"] for h in logs]
        head, tail = sum(reward[:5]) / len(reward[:5]), sum(reward[-5:]) / len(reward[-5:])
        lines.append(f"| {summary['method']} | {summary['heldout_before']:.2f} | {summary['heldout_after']:.2f} | "
                     f"{head:.3f} / {tail:.3f} | {summary['generated_rollouts']:.0f} | {summary['trained_rows']:.0f} | "
                     f"{summary['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def figure(runs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for run in runs:
        summary, logs = read(run)
        reward = [h["dataflex/rollout/reward_mean"] for h in logs]
        label = Path(str(summary["method"])).stem
        axes[0].plot([h["step"] for h in logs], reward, marker=".", label=label)
        axes[1].plot([h["compute/generated_rollouts"] for h in logs], reward, marker=".", label=label)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("rollouts generated")
    for ax in axes:
        ax.set_ylabel("mean reward of the step's rollouts")
        ax.set_ylim(0, 1.05)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, 1-digit addition, TRL GRPOTrainer on 2 CPU cores")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="--out folders of examples/trl/arithmetic.py")
    parser.add_argument("--out", type=Path, help="the figure (PNG)")
    args = parser.parse_args()
    print(table(args.runs))
    if args.out:
        figure(args.runs, args.out)


if __name__ == "__main__":
    main()
