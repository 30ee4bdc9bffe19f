"""The base policy's success rate ``p`` per (domain, level), as a distribution over training prompts (a
script, not a test): the measurement behind ``data.level_weights`` and the hard-tail regime
(examples/regimes/hard_tail.yaml, docs/shim.md).

It warm-starts the base policy of a config (cached, as a run does), draws ``--prompts`` training prompts of
every cell uniformly, samples ``--samples`` rollouts of each at the run's temperature and prints, per cell,
the quantiles of ``p`` and the share of prompts with ``p`` in [0.01, 0.1] (the hard tail), in 0 (never
solved in ``--samples``) and above 0.9. Takes about a minute on one CPU core at the defaults.

Run: ``python benchmarks/level_success.py [--config examples/grpo_baseline.yaml] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json

import torch

from dataflex_bus.config import load_config
from dataflex_bus.runtime import Runtime
from dataflex_bus.shim.config import prepare
from dataflex_bus.shim.host import describe
from dataflex_bus.shim.policy import generate
from dataflex_bus.shim.split import digits_of
from dataflex_bus.shim.tasks import TASKS, build_prompts, exact_match
from dataflex_bus.shim.trainer import ShimTrainer

TAIL = (0.01, 0.1)


def cell_rates(trainer: ShimTrainer, domain: int, level: int, prompts: int, samples: int,
               gen: torch.Generator) -> torch.Tensor:
    """``p`` of ``prompts`` uniform training prompts of one cell, from ``samples`` rollouts each."""
    split = trainer.split
    cell = int(split.first_cell[domain]) + level
    size = int(split.train_sizes[cell])
    rank = torch.randperm(size, generator=gen)[:prompts]
    cells = torch.full_like(rank, cell)
    index = split.train_index(cells, rank)
    domains = torch.full_like(rank, domain)
    drawn = build_prompts(domains, torch.full_like(rank, level), digits_of(index, split.lengths[cells]),
                          split.names, gen)
    rows = drawn.repeat(samples)
    with torch.no_grad():
        responses, mask, _ = generate(trainer.policy, rows.tokens, trainer.t["temperature"], gen)
    return exact_match(responses, mask, rows.targets).view(-1, samples).double().mean(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/grpo_baseline.yaml")
    parser.add_argument("--prompts", type=int, default=400, help="prompts per cell")
    parser.add_argument("--samples", type=int, default=64, help="rollouts per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the table as JSON here")
    args = parser.parse_args()
    config = prepare(load_config(args.config))
    trainer = ShimTrainer(config.resolved, Runtime(None, host=describe(config.resolved)))
    trainer.policy.eval()
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    print(f"base policy p per cell ({args.prompts} prompts x {args.samples} rollouts, T="
          f"{trainer.t['temperature']:g})")
    print("domain   level len  mean    q10    q50    q90   p=0  p in [0.01,0.1]  p>0.9")
    for d, name in enumerate(trainer.domains):
        if not TASKS[name].learnable:
            continue
        for level, n in enumerate(TASKS[name].lengths):
            p = cell_rates(trainer, d, level, args.prompts, args.samples, gen)
            q = torch.quantile(p, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
            tail = float(((p >= TAIL[0]) & (p <= TAIL[1])).double().mean())
            row = {"domain": name, "level": level, "length": n, "mean": float(p.mean()), "q10": q[0],
                   "q50": q[1], "q90": q[2], "zero": float((p == 0).double().mean()), "tail": tail,
                   "high": float((p > 0.9).double().mean())}
            rows.append(row)
            print(f"{name:8s} {level:5d} {n:3d}  {row['mean']:.3f}  {q[0]:.3f}  {q[1]:.3f}  {q[2]:.3f}  "
                  f"{row['zero']:.2f}  {tail:15.2f}  {row['high']:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"prompts": args.prompts, "samples": args.samples, "cells": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
