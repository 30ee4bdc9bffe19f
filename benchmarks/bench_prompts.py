"""Cost of pre-rollout selection per step, as a ratio of one group selection (a script, not a test).

Shape: a step of 1,024 prompts x 16 rollouts (16,384 rows) x 2,048 response tokens on CPU (verl dtypes),
drawn from a dataset of 100,000 prompts whose history is already populated (every prompt visited several
times). GRESO's per-step work is:

* ``on_prompts``: look the 1,024 candidates up in the prompt table, read their history, emit
  ``on_prompts`` (``zero_variance_streak`` x ``greso``: the skip rule and its random draws) and carry the
  decision out;
* the history update: one visit per rolled-out group (group statistics from the rewards, then one
  scatter into the per-prompt tensors).

The reference is one ``Pipeline.apply`` of a group selector (``dapo``: keep groups whose rewards are not
all equal) on the same rollout batch. Both sides start from a fresh batch, so each computes the rewards
from ``rm_scores`` (one pass over the token tensor); that is the ``fresh`` ratio (goal <= 1x). Inside a
host the history update and ``on_rollout`` read the same batch, whose rewards are computed once, so what
GRESO adds to a step is ``marginal``: ours on a batch whose rewards exist, against one fresh group
selection. ``cached`` times both sides on such a batch: the per-group work alone, for information (there a
group selector is a few segment reductions).

Run: ``python benchmarks/bench_prompts.py [--prompts 1024 --group 16 --tokens 2048 --dataset 100000]``.
"""

from __future__ import annotations

import argparse

import torch
from bench_methods import fresh_batch, timeit_pair

from dataflex_bus.batch import Batch
from dataflex_bus.carry import carry_out_prompts
from dataflex_bus.history import PromptTable
from dataflex_bus.pipeline import build_pipeline
from dataflex_bus.runtime import Runtime

GRESO = {"name": "greso", "mechanism": "select", "scorer": {"name": "zero_variance_streak"},
         "actuator": {"name": "greso", "params": {"adapt_from_epoch": 0}}}
DAPO = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}


def rollout_data(prompts: int, group: int, tokens: int, domains: int, dataset: int,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = prompts * group
    lengths = torch.randint(tokens // 4, tokens + 1, (rows,), generator=g)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.long)
    # a third of the groups all right, a third all wrong, a third mixed
    kind = torch.randint(0, 3, (prompts,), generator=g).repeat_interleave(group)
    coin = (torch.rand(rows, generator=g) < 0.5).to(torch.float32)
    reward = torch.where(kind == 0, 1.0, torch.where(kind == 1, 0.0, coin))
    rm = torch.zeros(rows, tokens)
    rm[torch.arange(rows), lengths - 1] = reward
    prompt = torch.randperm(dataset, generator=g)[:prompts]
    return {"uid": torch.arange(prompts).repeat_interleave(group), "rm_scores": rm, "response_mask": mask,
            "domains": (prompt % domains).repeat_interleave(group),
            "prompt_index": prompt.repeat_interleave(group)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dataset", type=int, default=100_000)
    parser.add_argument("--domains", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)  # [prompts]-sized work: one intra-op thread on a shared machine, both sides alike
    names = [f"d{i}" for i in range(args.domains)]
    per = -(-args.dataset // args.domains)
    table = PromptTable.full(names, [per] * args.domains, column="row")
    runtime = Runtime({"methods": [GRESO, DAPO]})
    runtime.set_prompts(table)
    history = runtime.history
    assert history is not None
    data = rollout_data(args.prompts, args.group, args.tokens, args.domains, len(table))
    # populate: every prompt of the dataset visited four times, over four steps
    for step in range(4):
        visits = torch.randperm(len(table), generator=torch.Generator().manual_seed(step))
        n = len(table)
        rm = torch.zeros(2 * n, 1)
        rm[:, 0] = (torch.arange(2 * n) % 3 == 0).float()
        warm = Batch.from_tensors(uid=torch.arange(2 * n) // 2, rm_scores=rm,
                                  response_mask=torch.ones(2 * n, 1, dtype=torch.long),
                                  prompt_index=visits.repeat_interleave(2))
        history.record(warm, step)
        history.end_step(step)
    history.consider(len(table) * 4)
    candidates = data["prompt_index"][:: args.group]
    cand_domains = torch.div(candidates, per, rounding_mode="floor")
    cand_rows = candidates - cand_domains * per
    reference = build_pipeline(DAPO)
    step = 10

    def on_prompts() -> None:
        batch = runtime.prompt_candidates(cand_domains, cand_rows, names)
        carry_out_prompts(batch, runtime.emit("on_prompts", batch, step))

    def ours_fresh() -> None:
        on_prompts()
        runtime.record_rollouts(fresh_batch(data, names), step)

    def ref_fresh() -> None:
        reference.apply(fresh_batch(data, names), step)

    shared = fresh_batch(data, names)
    _ = shared.rewards, shared.group_index  # computed once per step by the host's on_rollout batch

    def ours_shared() -> None:
        on_prompts()
        runtime.record_rollouts(shared, step)

    def ref_shared() -> None:
        reference.apply(shared, step)

    rows = args.prompts * args.group
    print(f"step: {args.prompts} prompts x {args.group} rollouts = {rows} rows x {args.tokens} tokens; "
          f"dataset {len(table)} prompts; 1 intra-op thread; median of {args.repeats}")
    t_ours, t_ref = timeit_pair(ours_fresh, ref_fresh, args.repeats)
    print(f"fresh   : on_prompts + history update {t_ours * 1e3:8.2f} ms | dapo Pipeline.apply {t_ref * 1e3:8.2f} ms"
          f" | ratio {t_ours / t_ref:6.3f}x (goal <= 1x)")
    t_marg, t_ref3 = timeit_pair(ours_shared, ref_fresh, args.repeats)
    print(f"marginal: on_prompts + history update {t_marg * 1e3:8.2f} ms | dapo Pipeline.apply {t_ref3 * 1e3:8.2f} ms"
          f" | ratio {t_marg / t_ref3:6.3f}x (ours on the on_rollout batch, rewards already computed)")
    t_shared, t_ref2 = timeit_pair(ours_shared, ref_shared, args.repeats)
    print(f"cached  : on_prompts + history update {t_shared * 1e3:8.2f} ms | dapo Pipeline.apply {t_ref2 * 1e3:8.2f} ms"
          f" | ratio {t_shared / t_ref2:6.3f}x (both on a batch whose rewards and groups exist)")
    t_p, _ = timeit_pair(on_prompts, on_prompts, args.repeats)
    print(f"          of which on_prompts alone {t_p * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
