"""Run under two CPU processes (gloo): ``torchrun --nproc_per_node 2 tests/trl_tier/trl_multiproc.py OUT.json``.

(``accelerate launch --cpu --num_processes 2`` starts a single process.) Per case: (a) DataflexGRPOTrainer
on two processes against (b) plain GRPOTrainer on two processes on a dataset of only the groups (a) trained;
the trainer itself checks that every process decided the same (it raises otherwise). Rank 0 writes the
results."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import trl_tiny as T
from accelerate import PartialState

from dataflex_bus import Selection, Selector
from dataflex_bus.discovery import reset_plugins
from dataflex_bus.errors import DataflexError
from dataflex_bus.registry import register_local
from dataflex_bus.trl import DataflexGRPOTrainer

MIXED, FLAT = T.prompts()
DAPO = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}
results: list[dict[str, Any]] = []


class Recording(DataflexGRPOTrainer):
    def _dfx_replay(self, rounds, kept):
        self.trained_prompts = [*getattr(self, "trained_prompts", []),
                                *[rounds[a].inputs[b]["prompt"] for a, b in kept.refs][::T.G]]
        return super()._dfx_replay(rounds, kept)


def case(name: str, rows: list[dict[str, Any]], gen: int, *, block: dict[str, Any] = DAPO,
         plain_rows: list[dict[str, Any]] | None = None, plain_gen: int | None = None,
         plain_spg: int | None = None, exact: bool = True, **kw: Any) -> None:
    if os.environ.get("CASE") and os.environ["CASE"] not in name:
        return
    a = T.train(Recording, rows=rows, rows_per_gen=gen, processes=2, trainer_kwargs={"dataflex": block}, **kw)
    metrics = a["trainer"].dataflex_metrics
    out: dict[str, Any] = {"name": name, "trained_rows": [m["dataflex/trained/rows"] for m in metrics],
                           "generated": metrics[-1]["compute/generated_rollouts"]}
    if plain_rows is not None or block is DAPO or "refill" in block:
        if plain_rows is None:  # the groups (a) trained, in training order
            by_prompt = {r["prompt"]: r for r in rows}
            plain_rows = [by_prompt[p] for p in a["trainer"].trained_prompts]
        b_kw = {**kw, "spg": plain_spg or kw.get("spg", 1), "ga": plain_spg or kw.get("ga", 1)}
        b = T.train(rows=plain_rows, rows_per_gen=plain_gen or gen, processes=2, **b_kw)
        worst = T.compare(a, b)
        out.update(max_abs_diff=worst, ok=worst == 0.0 if exact else worst < 1e-6)
    else:
        out["weight_std"] = max((v for k, v in metrics[-1].items() if k.endswith("weight_std")), default=None)
        out["ok"] = True
    results.append(out)


# 3 groups per generation batch over 2 processes of 6 rows: the middle group spans both.
spanning = [MIXED[0], FLAT[0], MIXED[1], MIXED[2], FLAT[1], MIXED[3]]
case("a group spanning the processes (grpo)", spanning, 12, plain_rows=MIXED[:4], plain_gen=8, loss_type="grpo")
# 4 groups per generation batch, 2 micro-batches, the old-log-prob pass on the kept rows (ga=1).
interleaved = T.interleave(MIXED[:4], FLAT[:4], 2, 2)
case("steps_per_generation=2, ga=1 (dr_grpo)", interleaved, 16, plain_rows=MIXED[:4], plain_gen=8, spg=2,
     loss_type="dr_grpo", steps=4)
case("refill, rounds drawn the same on both (bnpo)", [r for p in zip(FLAT[:8], MIXED[:8]) for r in p], 16,
     block={**DAPO, "refill": {"policy": "fixed", "max_rounds": 10}}, spg=2, loss_type="bnpo", steps=4)
# 3 of 4 groups kept, 4 micro-batches: 12 rows laid out 8 + 4 and padded; dapo to rounding.
uneven = [FLAT[0], MIXED[0], MIXED[1], MIXED[2], FLAT[1], MIXED[3], MIXED[4], MIXED[5]]
case("uneven kept rows, padded (dapo)", uneven, 16, plain_rows=MIXED[:6], plain_gen=12, spg=4, ga=4,
     plain_spg=3, loss_type="dapo", exact=False)
case("a reweight stack with old log-probs", interleaved, 16, block={"methods": [
    {"name": "filter", **DAPO},
    {"name": "ar", "mechanism": "reweight", "scorer": {"name": "token_prob"},
     "actuator": {"name": "advantage_reweight"}}]},
    loss_type="dapo")
case("rows dropped at on_advantage, laid out again", MIXED[:8], 16, block={
    "mechanism": "select", "scorer": {"name": "advantage_magnitude"},
    "actuator": {"name": "topk_fraction", "params": {"fraction": 0.5}}}, loss_type="bnpo")


if not os.environ.get("CASE") or "allocation" in os.environ["CASE"]:
    from trl_methods import ByPosition
    from trl_methods import PromptPosition as Position

    register_local("scorer", "test_position", Position)
    register_local("allocator", "test_by_position", ByPosition)
    reset_plugins()

    def allocate(counts: list[int], **params: Any) -> dict[str, Any]:
        return {"mechanism": "allocate", "scorer": {"name": "test_position"},
                "actuator": {"name": "test_by_position", "params": {"counts": counts, "max_n": 16, **params}}}

    # Counts [8, 8, 0, 0]: plain TRL with num_generations=8 on the kept prompts, on two processes.
    draws = [row for i in (0, 2) for row in MIXED[i:i + 2] + FLAT[i:i + 2]]
    a = T.train(DataflexGRPOTrainer, rows=draws, rows_per_gen=16, processes=2, spg=2, ga=2, loss_type="grpo",
                trainer_kwargs={"dataflex": allocate([8, 8, 0, 0])})
    b = T.train(rows=MIXED[:4], rows_per_gen=16, processes=2, spg=2, ga=2, loss_type="grpo", num_generations=8)
    worst = T.compare(a, b)
    results.append({"name": "an allocation of 8 to half the candidates", "max_abs_diff": worst, "ok": worst == 0.0})
    # Counts [3, 4, 0, 2]: 9 rollouts a step over two processes, one filler row, every rollout trained once.
    a = T.train(DataflexGRPOTrainer, rows=MIXED[:8], rows_per_gen=16, processes=2, loss_type="dapo",
                trainer_kwargs={"dataflex": allocate([3, 4, 0, 2], exact_budget=False)})
    m = a["trainer"].dataflex_metrics
    got = {"generated": [x["compute/generated_rollouts"] for x in m],
           "trained": [x["dataflex/trained/rows"] for x in m],
           "fillers": [x["dataflex/compute/filler_rollouts"] for x in m]}
    results.append({"name": "an odd allocation, filler rows", **got,
                    "ok": got == {"generated": [9.0, 18.0], "trained": [9.0, 9.0], "fillers": [1.0, 1.0]}})

if not os.environ.get("CASE") or "replay" in os.environ["CASE"]:
    from test_trl_replay import NEVER, REPO, ROWS

    # A store that never replays: plain TRL on two processes, bit for bit.
    a = T.train(DataflexGRPOTrainer, rows=ROWS, rows_per_gen=16, processes=2, steps=3,
                trainer_kwargs={"dataflex": NEVER})
    worst = T.compare(a, T.train(rows=ROWS, rows_per_gen=16, processes=2, steps=3))
    results.append({"name": "a replay store that never replays", "max_abs_diff": worst, "ok": worst == 0.0})
    # RePO: the stored rows (every process's, gathered) replayed over both processes; the parameters go to the
    # test, which compares them with one process's.
    a = T.train(DataflexGRPOTrainer, rows=ROWS, rows_per_gen=16, processes=2, steps=3,
                trainer_kwargs={"dataflex": REPO})
    m = a["trainer"].dataflex_metrics
    if PartialState().is_main_process:
        torch.save(a["params"], sys.argv[1] + ".repo.pt")
    results.append({"name": "replay, stored rows laid out over both processes", "ok": True,
                    "replayed": [x["dataflex/replay/rows"] for x in m],
                    "trained": [x["dataflex/trained/rows"] for x in m],
                    "params": sys.argv[1] + ".repo.pt"})


class ByRank(Selector):
    """Keeps the groups of an index with the parity of its process's rank: decides differently per process."""

    @classmethod
    def keeps_whole_groups(cls, granularity: str) -> bool:
        return True

    def select(self, batch, score, step):
        return Selection(keep=batch.group_index % 2 == torch.distributed.get_rank())


if not os.environ.get("CASE") or "rank" in os.environ["CASE"]:
    register_local("selector", "test_by_rank", ByRank)
    reset_plugins()
    try:
        T.train(DataflexGRPOTrainer, rows=MIXED[:8], rows_per_gen=16, processes=2, trainer_kwargs={"dataflex": {
            "mechanism": "select", "scorer": {"name": "group_solve_rate"}, "actuator": {"name": "test_by_rank"}}})
        refused = ""
    except DataflexError as exc:
        refused = str(exc)
    results.append({"name": "a selection by process rank is refused", "ok": "decided differently" in refused,
                    "error": refused})

state = PartialState()
if state.is_main_process:
    with open(sys.argv[1], "w") as f:
        json.dump({"world_size": torch.distributed.get_world_size(), "cases": results}, f, indent=1)
