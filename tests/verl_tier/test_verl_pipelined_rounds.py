"""Pipelined generation rounds on verl decide what whole rounds decided where the method's rule is per group.

The real ``dataflex_sync`` trainer runs SPEED, Pilot-Commit and Reinforce-Ada twice on the same data: once with
every round waited for whole (``dispatch_per_group = False``, the dispatch before issue 44) and once with each
group screened as it arrives and its continuation dispatched at once. The harness's agent loop finishes prompts
after seeded delays, so groups come back out of dispatch order. The kept groups, the rows trained, their
advantages and losses, and every metric but timing must be the same; the pipelined run must have dispatched
continuations while prompts of their round were still being generated, and the whole-rounds run never.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("verl")

pytestmark = [pytest.mark.verl]

SPEED = ["+dataflex.mechanism=allocate", "+dataflex.scorer.name=group_solve_rate",
         "+dataflex.actuator={name: speed, params: {n_continue: 4}}"]
PILOT_COMMIT = ["+dataflex.mechanism=allocate", "+dataflex.scorer.name=group_solve_rate",
                "+dataflex.actuator={name: pilot_commit, params: {n_commit: 2, diversity_threshold_lower: 0.2, "
                "diversity_threshold_upper: 0.3}}"]
REINFORCE_ADA = ["+dataflex.mechanism=allocate",
                 "+dataflex.scorer={name: group_solve_rate, params: {success_threshold: 0.7}}",
                 "+dataflex.actuator={name: reinforce_ada, params: {final_keep: 2, max_rounds: 3}}"]
#: Refill rounds as large as the groups still needed (SPEED's cap cannot bind) and twice that (it does: a group
#: is released only once the groups before it cannot take its place).
REFILL = ["+dataflex.refill={gen_batch_size: 4, policy: fixed, max_rounds: 4, on_exhaust: train_short}"]
REFILL_LARGE = ["+dataflex.refill={gen_batch_size: 8, policy: fixed, max_rounds: 4, on_exhaust: train_short}"]

CASES = {"speed": SPEED, "speed-refill": SPEED + REFILL, "speed-refill-capped": SPEED + REFILL_LARGE,
         "pilot-commit-refill": PILOT_COMMIT + REFILL, "reinforce-ada": REINFORCE_ADA}
#: The dataset's domains in row order (prompts are drawn in order): Reinforce-Ada continues only the groups with
#: no right answer (code), so its steps start with them.
#: Enough rows that no step draws a prompt a second time (a continuation is a prompt dispatched again).
DOMAINS = {"reinforce-ada": {"code": 20, "math": 20, "logic": 20}}
#: Metrics of wall time, the only ones allowed to differ.
TIMING = ("timing_s/", "timing_per_token_ms/", "perf/")


def train(H, tq, tmp_path: Path, case: str, *, per_group: bool, delays: int = 3):
    for partition, items in (tq.kv_list() or {}).items():  # the other run's groups left nothing behind
        assert not items, f"partition {partition!r} holds {len(items)} keys before a run"
    block = CASES[case]
    data = H.write_dataset(tmp_path / "train.parquet", DOMAINS.get(case, {"math": 20, "logic": 20, "code": 20}))
    overrides = H.base_overrides(data, tmp_path / f"ckpt-{per_group}", steps=3, batch=4, mini=4)
    run = H.Run([*overrides, "data.shuffle=False", "trainer.balance_batch=False", "trainer.save_freq=-1",
                 *block]).setup()
    run.trainer.dispatch_per_group = per_group
    return run.fit(delays=delays)


def trained(run) -> list[dict]:
    """What each update trained on, by content (uids are fresh uuids in every run)."""
    out = []
    for update in run.trainer.actor_rollout_wg.updates:
        out.append({"rows": list(zip(update["data_source"], update["index"], update["session_id"])),
                    "padding": update["is_padding"], "advantages": update["advantages"].tolist(),
                    "losses": update["losses"], "mini_batch_sizes": update["mini_batch_sizes"]})
    return out


def untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(TIMING)}


def early_continuations(agent_loop) -> int:
    """Continuations (a prompt dispatched again under a fresh uid) dispatched while a prompt dispatched before them
    as a new prompt was still being generated: their group's round was not waited for whole."""
    prompt_of = agent_loop.prompts  # uid -> (data_source, index), every generated prompt
    seen: set[tuple[str, int]] = set()
    outstanding: set[str] = set()
    count = 0
    for what, uid in agent_loop.log:
        if what == "finish":
            outstanding.discard(uid)
            continue
        if prompt_of[uid] in seen:
            count += bool(outstanding)
        else:
            seen.add(prompt_of[uid])
            outstanding.add(uid)
    return count


def dispatch_order_kept(log: list[tuple[str, str]]) -> bool:
    dispatched = [u for what, u in log if what == "dispatch"]
    finished = [u for what, u in log if what == "finish"]
    return finished == dispatched


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_rounds_train_what_whole_rounds_trained(H, clean_partition, tmp_path, case):
    whole = train(H, clean_partition, tmp_path, case, per_group=False)
    piped = train(H, clean_partition, tmp_path, case, per_group=True)
    # the agent loop really finished prompts out of dispatch order, in both runs
    assert not dispatch_order_kept(whole.agent_loop.log) and not dispatch_order_kept(piped.agent_loop.log)
    assert early_continuations(whole.agent_loop) == 0
    assert early_continuations(piped.agent_loop) > 0
    assert trained(piped) == trained(whole) and len(trained(whole)) == 3
    assert len(piped.logged) == len(whole.logged) == 3
    for a, b in zip(whole.logged, piped.logged):
        a, b = untimed(a), untimed(b)
        assert a.keys() == b.keys()
        differ = {k: (a[k], b[k]) for k in a if not (a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k])
                                                                    and math.isnan(b[k])))}
        assert not differ
    # the same prompts were generated, the same number of times
    assert sorted(piped.agent_loop.prompts.values()) == sorted(whole.agent_loop.prompts.values())
