"""Replay in TRL's GRPOTrainer (mechanism ``replay``): stored rows join a later generation batch, trained with
TRL's own old/reference passes and the kit's advantages over their groups; the buffer rides in TRL's
checkpoints. What each row trains on, against the shim and verl, is tests/hosts' contract suite."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl")

import torch
import trl_tiny as T
from trl_methods import DOTS, REPO, dots_weights, replayer

from dataflex_bus.replay import ReplayRun
from dataflex_bus.trl import DataflexGRPOTrainer

pytestmark = pytest.mark.trl

MIXED, _ = T.prompts()
ROWS = MIXED[:4]  # 4 prompts of 4 rollouts per generation batch: every prompt comes back at every step


#: RePO and DOTS: trl_methods.py (the vllm tier trains them too).
#: Stores every row and never replays one (no prompt reaches min_to_replay).
NEVER = replayer(unit="prompt", correction="behaviour", min_to_replay=1000, per_prompt=0, capacity=256)


@pytest.mark.parametrize("spg,ga", [(1, 1), (2, 1)], ids=["one-pass", "trl-old-pass"])
def test_a_replay_block_that_never_replays_trains_plain_trl_bit_for_bit(spg, ga):
    """The whole path (rounds stopped at their rewards, TRL's method on the kept rows, the old log-probs
    computed and stored as behaviour log-probs) with no stored row ever replayed."""
    kw = dict(rows=ROWS, rows_per_gen=16, spg=spg, ga=ga, steps=3 * spg // ga)
    a = T.train(DataflexGRPOTrainer, trainer_kwargs={"dataflex": NEVER}, **kw)
    b = T.train(**kw)
    metrics = a["trainer"].dataflex_metrics
    assert [m["dataflex/replay/rows"] for m in metrics] == [0.0] * 3
    assert [m["dataflex/replay/stored_rows"] for m in metrics] == [16.0, 32.0, 48.0]
    assert T.compare(a, b) == 0.0 and a["losses"] == b["losses"]


class Recording(DataflexGRPOTrainer):
    """Keeps every micro-batch the loss trains: old and behaviour log-probs, advantages, weights."""

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        self.__dict__.setdefault("seen", []).append(
            (self.dataflex_batch.generations - 1, {k: v.detach().clone() for k, v in inputs.items()
                                         if isinstance(v, torch.Tensor)}))
        return super()._compute_loss(model, inputs)


def test_repo_trains_each_prompt_s_best_stored_rows_again_against_their_behaviour_log_probs():
    a = T.train(Recording, rows=ROWS, rows_per_gen=16, steps=3, trainer_kwargs={"dataflex": REPO})
    trainer = a["trainer"]
    first, *later = trainer.dataflex_metrics
    assert first["dataflex/replay/rows"] == 0 and first["dataflex/trained/rows"] == 16
    for m in later:  # 4 prompts x 2 replayed rows, beside the 16 fresh ones
        assert m["dataflex/replay/rows"] == 8 and m["dataflex/trained/rows"] == 24
    last = trainer.dataflex_metrics[-1]
    assert last["compute/generated_rollouts"] == 48 and last["compute/replayed_rows"] == 16
    step, inputs = trainer.seen[-1]
    assert step == 2 and inputs["completion_ids"].size(0) == 24
    from dataflex_bus.trl.rows import BEHAVIOUR

    old, mu, mask = inputs["old_per_token_logps"], inputs[BEHAVIOUR], inputs["completion_mask"].bool()
    # correction=behaviour: every row's ratio is taken against its behaviour log-probs (a fresh row's are its
    # old ones: without vLLM the sampling policy computes them)
    assert torch.equal(old[mask], mu[mask])
    assert len(ReplayRun.of(trainer.dataflex).buffer.store) == 32  # per_prompt=8: each prompt's newest 8 rows
    plain = T.train(rows=ROWS, rows_per_gen=16, steps=3)
    assert T.compare(a, plain) > 0


def test_dots_fills_half_of_each_step_from_the_store_weighted_by_the_truncated_ratio():
    a = T.train(Recording, rows=ROWS, rows_per_gen=16, steps=3, trainer_kwargs={"dataflex": DOTS})
    trainer = a["trainer"]
    first, *later = trainer.dataflex_metrics
    assert first["dataflex/replay/empty"] == 1 and first["dataflex/trained/rows"] == 16
    for m in later:
        assert m["dataflex/replay/fresh_prompts"] == 2 and m["dataflex/replay/rows"] == 8
        assert m["dataflex/trained/rows"] == 16
    from dataflex_bus.trl.rows import BEHAVIOUR, WEIGHTS

    _, inputs = trainer.seen[-1]
    old, mu, w = inputs["old_per_token_logps"], inputs[BEHAVIOUR], inputs[WEIGHTS]
    mask = inputs["completion_mask"].bool()
    expected = dots_weights(old, mu)
    assert torch.allclose(w[mask], expected[mask], atol=1e-6)
    moved = ((old - mu).abs() * mask).amax(dim=1) > 0  # the replayed rows: their policy has moved since
    assert int(moved.sum()) == 8 and bool((w[~moved][mask[~moved]] == 1).all())


@pytest.mark.parametrize("block", [REPO, DOTS], ids=["repo", "dots"])
def test_k_steps_then_resume_then_k_steps_is_2k_steps_with_the_buffer(tmp_path, block):
    """The store (rows, priorities, behaviour log-probs and what TRL needs to train a row again) rides in
    checkpoint-N/dataflex_state.pt."""
    kw = dict(rows=ROWS, rows_per_gen=16, steps=4, save_strategy="steps", save_steps=2,
              trainer_kwargs={"dataflex": block})
    whole = T.train(DataflexGRPOTrainer, out=str(tmp_path / "whole"), **kw)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    resumed = T.train(DataflexGRPOTrainer, out=str(tmp_path / "resumed"), resume=str(checkpoint), **kw)
    assert sum(m["dataflex/replay/rows"] for m in resumed["trainer"].dataflex_metrics) > 0
    strip = [{k: v for k, v in h.items() if "time" not in k and "per_second" not in k} for h in whole["logs"]]
    again = [{k: v for k, v in h.items() if "time" not in k and "per_second" not in k} for h in resumed["logs"]]
    assert again == strip
    assert all(torch.equal(whole["params"][n], p) for n, p in resumed["params"].items())


def test_a_replayer_planning_the_whole_step_from_its_store_is_refused_naming_replay_groups(register):
    from dataflex_plugins.methods.replay import RolloutReplay

    from dataflex_bus.errors import DataflexError

    class Everything(RolloutReplay):
        def replay_groups(self, target: int, available: int, step: int) -> int:
            return min(target, available)

    register("replayer", "test_everything", Everything)
    block = {**DOTS, "actuator": {**DOTS["actuator"], "name": "test_everything"}}
    with pytest.raises(DataflexError, match=r"step 1 generates no prompt.*replay_groups"):
        T.train(DataflexGRPOTrainer, rows=ROWS, rows_per_gen=16, steps=3, trainer_kwargs={"dataflex": block})
