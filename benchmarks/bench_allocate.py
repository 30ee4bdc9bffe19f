"""Cost of a Knapsack RL allocation per step, as a ratio of one group selection (a script, not a test).

Shape: 1,024 candidate prompts, a budget of 16,384 rollouts (plain GRPO's 1,024 x 16), drawn from a dataset
of 100,000 prompts whose history is populated (every prompt visited with success rates spread over [0, 1],
so most candidates have a valid estimate and are effective). The allocation's per-step work is the host
kit's ``Step.prompts``: look the candidates up, read their history, emit ``on_prompts``
(``knapsack_rate`` x ``knapsack``: the estimate, the floors, the fallback and the value objective over up to
1,024 x 126 marginal gains), check the counts and carry them out.

The reference is one ``Pipeline.apply`` of a group selector (``dapo``) on the resulting rollout batch
(16,384 rows in the allocated ragged groups x 2,048 response tokens, verl dtypes), fresh, so it computes
the rewards from ``rm_scores``. Goal: ratio <= 1x. ``--dp`` also times the official DP (``solver: dp``),
which is ``O(candidates x budget x max_n)``.

Run: ``python benchmarks/bench_allocate.py [--prompts 1024 --group 16 --tokens 2048 --dataset 100000 --dp]``.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_methods import fresh_batch, timeit_pair

from dataflex_bus.batch import Batch
from dataflex_bus.history import PromptTable
from dataflex_bus.host import ANY_HOST
from dataflex_bus.pipeline import build_pipeline
from dataflex_bus.runtime import Runtime
from dataflex_bus.steps import Candidates, StepKit

DAPO = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}


def knapsack(solver: str) -> dict:
    return {"mechanism": "allocate", "scorer": {"name": "knapsack_rate"},
            "actuator": {"name": "knapsack", "params": {"solver": solver}}}


def populated(solver: str, group: int, dataset: int, domains: int) -> tuple[Runtime, list[str], int]:
    names = [f"d{i}" for i in range(domains)]
    per = -(-dataset // domains)
    runtime = Runtime(knapsack(solver), host=ANY_HOST.replace(name="bench", group_size=group))
    runtime.set_prompts(PromptTable.full(names, [per] * domains, column="row"))
    history = runtime.history
    assert history is not None
    n = per * domains
    g = torch.Generator().manual_seed(0)
    p = torch.rand(n, generator=g) ** 2  # more hard prompts than easy ones
    p[torch.randperm(n, generator=g)[: n // 10]] = 0.0  # a tenth never solved
    for step in range(2):  # two visits of 8 rollouts each: 16 rewards, every estimate valid
        r = (torch.rand(n * 8, generator=g) < p.repeat_interleave(8)).float()
        visit = Batch.from_tensors(uid=torch.arange(n).repeat_interleave(8), rm_scores=r[:, None],
                                   response_mask=torch.ones(n * 8, 1, dtype=torch.long),
                                   prompt_index=torch.arange(n).repeat_interleave(8))
        history.record(visit, step)
        history.end_step(step)
    return runtime, names, per


def rollouts(counts: torch.Tensor, tokens: int, names: list[str], seed: int = 1) -> dict[str, torch.Tensor]:
    """The rollout batch of an allocation: one group per candidate, ``counts[i]`` rows."""
    g = torch.Generator().manual_seed(seed)
    rows = int(counts.sum())
    lengths = torch.randint(tokens // 4, tokens + 1, (rows,), generator=g)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.long)
    rm = torch.zeros(rows, tokens)
    rm[torch.arange(rows), lengths - 1] = (torch.rand(rows, generator=g) < 0.4).float()
    uid = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return {"uid": uid, "rm_scores": rm, "response_mask": mask, "domains": uid % len(names)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dataset", type=int, default=100_000)
    parser.add_argument("--domains", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dp", action="store_true", help="also time the official DP (solver: dp), once")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one intra-op thread on a shared machine, both sides alike
    runtime, names, per = populated("greedy", args.group, args.dataset, args.domains)
    cand = torch.randperm(per * args.domains, generator=torch.Generator().manual_seed(7))[: args.prompts]
    domain_ids, rows = torch.div(cand, per, rounding_mode="floor"), cand % per
    kit = StepKit(runtime)

    def draw(n: int) -> Candidates[torch.Tensor]:
        return Candidates(cand[:n], domain_ids[:n], rows[:n])

    def allocation() -> torch.Tensor:
        chosen = kit.begin(10).prompts(args.prompts, draw)
        assert chosen.counts is not None
        out = torch.zeros(args.prompts, dtype=torch.long)
        out[chosen.index] = chosen.counts
        return out

    counts = allocation()
    data = rollouts(counts[counts > 0], args.tokens, names)
    reference = build_pipeline(DAPO)

    def selection() -> None:
        reference.apply(fresh_batch(data, names), 10)

    given = counts[counts > 0]
    print(f"allocation: {args.prompts} candidates, budget {int(counts.sum())} rollouts (group size {args.group}); "
          f"counts min {int(given.min())} max {int(given.max())}, "
          f"{int((counts == args.group).sum())} at the group size; rollout batch {int(counts.sum())} rows x "
          f"{args.tokens} tokens; 1 intra-op thread; median of {args.repeats}")
    t_alloc, t_sel = timeit_pair(allocation, selection, args.repeats)
    print(f"knapsack allocation (Step.prompts) {t_alloc * 1e3:8.2f} ms | dapo Pipeline.apply on the rollouts "
          f"{t_sel * 1e3:8.2f} ms | ratio {t_alloc / t_sel:6.3f}x (goal <= 1x)")
    if args.dp:
        dp_runtime, _, _ = populated("dp", args.group, args.dataset, args.domains)
        dp_kit = StepKit(dp_runtime)
        start = time.perf_counter()
        chosen = dp_kit.begin(10).prompts(args.prompts, draw)
        took = time.perf_counter() - start
        assert chosen.counts is not None
        same = bool((chosen.counts == counts[chosen.index]).all())
        print(f"official DP (solver: dp)           {took * 1e3:8.0f} ms | ratio {took / t_sel:8.1f}x; "
              f"the same counts as the greedy: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
