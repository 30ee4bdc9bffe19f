"""Replay inside verl 0.9.1: the rollout-correction settings a replay method needs are checked (a contradiction
is refused naming verl's key), and under verl's ``fit`` the stored rows written into TransferQueue leave it with
the step, the buffer rides in ``dataflex_state.pt`` and a resumed run replays exactly what the uninterrupted one
does. (Which rows train with which advantages and weights is the host contract suite's: tests/hosts.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dataflex_bus.replay import ReplayRun

pytestmark = pytest.mark.verl

RC = "algorithm.rollout_correction"
DOTS = ["+dataflex.mechanism=replay", "+dataflex.scorer.name=reward_difficulty",
        "+dataflex.actuator.name=rollout_replay",
        "+dataflex.actuator.params={fresh_fraction: 0.5, capacity: 16, dedup: true, max_age_steps: 2}"]
REPO = ["+dataflex.mechanism=replay", "+dataflex.scorer.name=reward_difficulty",
        "+dataflex.actuator.name=rollout_replay",
        "+dataflex.actuator.params={unit: prompt, priority: highest, advantage: split, correction: behaviour, "
        "per_prompt: 8, min_to_replay: 4, replays: 4}"]


def issues(overrides: list[str]) -> str:
    """What validation says of a command line (empty when it passes)."""
    import verl_harness as H

    from dataflex_bus.errors import ConfigError
    from dataflex_bus.validation import validate
    from dataflex_bus.verl.host import describe
    from dataflex_bus.verl.trainer import dataflex_block

    cfg = H.compose(H.base_overrides(Path("/nonexistent/train.parquet"), Path("/tmp/ckpt")) + overrides)
    try:
        validate(dataflex_block(cfg), host=describe(cfg))
    except ConfigError as exc:
        return str(exc)
    return ""


def test_decoupled_replay_runs_on_verls_token_level_truncated_is():
    assert issues([*DOTS, f"{RC}.rollout_is=token"]) == ""
    assert "rollout_is=token" in issues(DOTS)  # verl writes no importance weights without it
    message = issues([*DOTS, f"{RC}.rollout_is=sequence"])
    assert f"{RC}.rollout_is: is 'sequence'" in message and "min(pi_old / mu, is_cap) per token" in message


@pytest.mark.parametrize("setting, key", [
    (f"{RC}.rollout_is_threshold=3.0", "rollout_is_threshold"),
    (f"{RC}.rollout_is_threshold='0.5_2.0'", "rollout_is_threshold"),       # IcePop zeroes, never truncates
    (f"{RC}.rollout_is_batch_normalize=true", "rollout_is_batch_normalize"),
    (f"{RC}.rollout_rs=token_k1", "rollout_rs"),
    (f"{RC}.bypass_mode=true", "bypass_mode"),
])
def test_rollout_correction_settings_that_contradict_the_method_are_refused_naming_the_key(setting, key):
    extra = [f"{RC}.rollout_rs_threshold=2.0"] if "rollout_rs" in setting else []
    assert f"{RC}.{key}" in issues([*DOTS, f"{RC}.rollout_is=token", setting, *extra])


def test_behaviour_replay_refuses_verls_importance_weights_on_top():
    assert issues(REPO) == ""
    message = issues([*REPO, f"{RC}.rollout_is=token"])
    assert f"{RC}.rollout_is: is 'token'" in message and "a second time" in message


def test_replay_needs_the_rollout_log_probs_the_sync_trainer_and_no_verl_dapo():
    assert "calculate_log_probs=false" in issues([*REPO, "actor_rollout_ref.rollout.calculate_log_probs=false"])
    message = issues([*REPO, "trainer.v1.trainer_mode=dataflex_colocate_async"])
    assert "host 'verl' cannot carry out: it lacks replay" in message
    assert "trainer.v1.trainer_mode=dataflex_sync" in message
    assert "algorithm.filter_groups.enable" in issues([*REPO, "algorithm.filter_groups.enable=True"])


# ---------------------------------------------------------------------------- under verl's fit
def _dots_run(H, data, ckpt: Path, steps: int, extra: tuple[str, ...] = ()):
    return H.Run(H.base_overrides(data, ckpt, batch=4, mini=4, steps=steps) + DOTS + [f"{RC}.rollout_is=token",
                                                                                      *extra]).setup()


@pytest.mark.tq
@pytest.mark.integration
def test_fit_replays_into_transfer_queue_and_resumes_exactly(H, tmp_path, clean_partition):
    tq = clean_partition
    data = H.write_dataset(tmp_path / "train.parquet", {"math": 4, "logic": 4, "code": 4})
    # verl keeps its 2 newest checkpoints; the state files (each holding the replay buffer) go with the rest
    full = _dots_run(H, data, tmp_path / "full", 3, ("trainer.max_actor_ckpt_to_keep=2",)).fit()
    kept = sorted(p.parent.name for p in (tmp_path / "full").glob("global_step_*/dataflex_state.pt"))
    assert kept == ["global_step_2", "global_step_3"]
    logged = full.logged
    assert [m["dataflex/replay/fresh_prompts"] for m in logged] == [4, 2, 2]
    assert [m["dataflex/replay/rows"] for m in logged] == [0, 8, 8]
    for m, update in zip(logged[1:], full.trainer.actor_rollout_wg.updates[1:]):
        real = [k for k, pad in zip(update["keys"], update["is_padding"]) if not pad]
        assert len(real) == 16 and sum(k.startswith("replay") for k in real) == 8  # 2 stored groups, new uids
        assert m["compute/replayed_rows"] > 0
    assert not (tq.kv_list("train") or {}).get("train")  # fit() cleared the replayed keys with the step's
    assert (tmp_path / "full" / "global_step_3" / "dataflex_state.pt").exists()

    _dots_run(H, data, tmp_path / "resumed", 2).fit()
    resumed = _dots_run(H, data, tmp_path / "resumed", 3)
    assert resumed.trainer.global_steps == 2
    resumed.fit()
    a, b = (run.trainer.dataflex_state_dict()["runtime"]["replay"]["store"] for run in (full, resumed))
    for name, column in a["columns"].items():
        assert torch.equal(column, b["columns"][name]), name
    x, y = (ReplayRun.of(run.trainer.dataflex).buffer.store.held() for run in (full, resumed))
    assert torch.equal(x.mu, y.mu) and x.objects == y.objects and a["objects"] == b["objects"]
    assert x.payload.keys() == y.payload.keys() and all(torch.equal(v, y.payload[k]) for k, v in x.payload.items())
    assert x.lengths.keys() == y.lengths.keys() and all(torch.equal(v, y.lengths[k]) for k, v in x.lengths.items())
    for key in ("dataflex/replay/rows", "dataflex/replay/age_mean", "compute/replayed_rows", "dataflex/trained/rows"):
        assert resumed.logged[-1][key] == pytest.approx(full.logged[-1][key]), key
