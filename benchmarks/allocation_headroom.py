"""How much a rollout allocation could gain on the shim's testbed, and how much of it a history-based one
can reach (a script, not a test): the analysis behind the allocation results in docs/results.

For a policy (the warm-started base one, and the final policy of a plain GRPO run given by its run
directory) it draws training prompts as the shim's sampler does (a uniform domain, a uniform level, a
uniform prompt), estimates each prompt's success rate ``p`` from ``--samples`` rollouts, and reads the
step's plain-GRPO budget (``prompts_per_step x group_size``) three ways, in expectation under those ``p``:

* ``uniform``: every prompt the group size (plain GRPO);
* ``oracle``: Knapsack RL's allocation (the built-in ``knapsack``, official defaults) fed the true ``p``;
* ``as run``: the same allocation fed ``p`` only for the share of candidates with a valid estimate that
  the knapsack runs of a comparison actually had (``dataflex/knapsack/valid``), the rest new.

For each: the expected share of groups with a non-zero GRPO gradient (``1 - p^n - (1 - p)^n``, Knapsack
RL's "effective gradient") and ``sum Value(n, p)``. It also reads the compare's runs for how often a
prompt comes back: the share of candidates whose history held a valid estimate.

Run: ``python benchmarks/allocation_headroom.py runs/compare [--config examples/knapsack.yaml --steps 16]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dataflex_bus.batch import Batch
from dataflex_bus.components import Budget, Score
from dataflex_bus.config import load_config
from dataflex_bus.runtime import Runtime
from dataflex_bus.shim.config import prepare
from dataflex_bus.shim.files import load_checkpoint
from dataflex_bus.shim.host import describe
from dataflex_bus.shim.policy import generate
from dataflex_bus.shim.tasks import exact_match
from dataflex_bus.shim.trainer import ShimTrainer


def success_rates(trainer: ShimTrainer, prompts: int, samples: int, seed: int) -> torch.Tensor:
    """``p`` of ``prompts`` training prompts drawn like the sampler draws, from ``samples`` rollouts each."""
    gen = torch.Generator().manual_seed(seed)
    domains = torch.randint(len(trainer.domains), (prompts,), generator=gen)
    drawn = trainer.split.draw(domains, gen)
    rows = drawn.repeat(samples)
    trainer.policy.eval()
    with torch.no_grad():
        responses, mask, _ = generate(trainer.policy, rows.tokens, trainer.t["temperature"], gen)
    reward = exact_match(responses, mask, rows.targets)
    return reward.view(prompts, samples).double().mean(1)


def read(p: torch.Tensor, counts: torch.Tensor) -> tuple[float, float, float]:
    """Expected share of groups with a non-zero gradient, of rollouts in such groups, and the mean Value(n, p)."""
    n = counts.double()
    nonzero = torch.where(n > 0, 1 - p ** n - (1 - p) ** n, 0.0)
    value = nonzero * p * (1 - p) ** 2
    return (float(nonzero.sum() / (n > 0).sum()), float((nonzero * n).sum() / n.sum()),
            float(value.sum()) / p.numel())


def allocation(p: torch.Tensor, valid: torch.Tensor, group: int) -> torch.Tensor:
    from dataflex_plugins.methods.allocate import Knapsack

    batch = Batch.from_tensors(uid=torch.arange(p.numel()), prompt_index=torch.arange(p.numel()))
    rates = torch.where(valid, p, -1.0)
    out = Knapsack().allocate(batch, Score(rates, "prompt"), 0, Budget(p.numel() * group, p.numel(), group))
    return out.counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compare_dir", type=Path, help="a dataflex compare output (plain GRPO and knapsack runs)")
    parser.add_argument("--config", type=Path, default=Path("examples/knapsack.yaml"))
    parser.add_argument("--baseline", default="grpo_baseline")
    parser.add_argument("--knapsack", default="knapsack")
    parser.add_argument("--steps", type=int, default=16, help="steps of candidates read (64 prompts each)")
    parser.add_argument("--samples", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = prepare(load_config(args.config))
    t = config.resolved["trainer"]
    b, g = t["prompts_per_step"], t["group_size"]
    valid_share = []
    for run in sorted((args.compare_dir / args.knapsack).glob("seed*")):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        valid_share.append(statistics.mean(r["dataflex/knapsack/valid"] for r in rows))
    share = statistics.mean(valid_share) if valid_share else 0.0
    print(f"{args.compare_dir / args.knapsack}: candidates with a valid estimate {share:.3f} of each step "
          f"(mean over steps and {len(valid_share)} seeds; the rest are new to the history)")
    trainer = ShimTrainer(config.resolved, Runtime(None, host=describe(config.resolved)))
    policies = {"base policy (step 0)": None}
    final = args.compare_dir / args.baseline / "seed0" / "checkpoint.pt"
    if final.exists():
        policies[f"{args.baseline} seed 0, step 200"] = final
    for name, path in policies.items():
        if path is not None:
            trainer.policy.load_state_dict(load_checkpoint(path)["policy"])
        p = success_rates(trainer, b * args.steps, args.samples, seed=1)
        zero = float(((p == 0) | (p == 1)).double().mean())
        print(f"\n{name}: {b * args.steps} training prompts, p from {args.samples} rollouts each; "
              f"mean p {float(p.mean()):.3f}, p = 0 or 1 for {zero:.3f}")
        gen = torch.Generator().manual_seed(2)
        results: dict[str, list[tuple[float, float, float]]] = {"uniform": [], "oracle": [], "as run": []}
        for s in range(args.steps):
            step_p = p[s * b:(s + 1) * b]
            results["uniform"].append(read(step_p, torch.full((b,), g)))
            results["oracle"].append(read(step_p, allocation(step_p, torch.ones(b, dtype=torch.bool), g)))
            seen = torch.rand(b, generator=gen) < share
            results["as run"].append(read(step_p, allocation(step_p, seen, g)))
        base = [statistics.mean(x[i] for x in results["uniform"]) for i in range(3)]
        for label, vals in results.items():
            nz, kept, v = (statistics.mean(x[i] for x in vals) for i in range(3))
            print(f"  {label:8s}: groups with a non-zero gradient {nz:.3f} ({nz / base[0]:.2f}x uniform), "
                  f"rollouts in them {kept:.3f} ({kept / base[1]:.2f}x); mean Value per prompt {v:.4f} "
                  f"({v / base[2]:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
