"""#46's controls on the real shim: ``compare --independent``, ``compute/generated_tokens`` (prompt + response
tokens of every generated rollout, replayed rows not counted again) and the equal-tokens reading,
``trainer.ppo_epochs`` as an extra-update control, the symmetric rollouts-to-target factor (hand-made curves,
a censored seed included) and the ``multi_epoch_learnable`` regime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dataflex_bus.cache import cache_root
from dataflex_bus.cli import main
from dataflex_bus.errors import ConfigError
from dataflex_bus.shim import run_training
from dataflex_bus.shim.analysis import Reading, RunCurve, analyse, first_crossing, target_level, to_target
from dataflex_bus.shim.config import prepare
from dataflex_bus.shim.regime import load_regime
from dataflex_bus.shim.report import compare_table
from dataflex_bus.shim.tasks import PAD
from dataflex_bus.shim.trainer import ShimTrainer

from .conftest import tiny
from .test_replay_runs import DOTS, SMALL


def compare_cli(*args: object) -> int:
    return main(["compare", *map(str, args), "--no-progress"])


def write_config(path: Path, config) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


# ---------------------------------------------------------------------------- --independent
@pytest.mark.integration
def test_independent_seeds_set_model_and_data_seed_and_are_recorded(tmp_path, capsys):
    cfg = write_config(tmp_path / "a.yaml", tiny(trainer={"eval_every": 1}, data={"heldout": 300}))
    out = tmp_path / "cmp"
    cached = cache_root() / "warmstart"
    before = set(cached.glob("*.pt")) if cached.exists() else set()
    assert compare_cli(cfg, "--steps", "1", "--seeds", "3", "5", "--out", out, "--independent", "--tokens") == 0
    doc = json.loads((out / "compare.json").read_text())
    assert doc["independent"] is True and doc["seeds"] == [3, 5]
    for seed in (3, 5):
        record = json.loads((out / "a" / f"seed{seed}" / "run.json").read_text())
        config = record["config"]
        assert (config["trainer"]["seed"], config["model"]["seed"], config["data"]["seed"]) == (seed, seed, seed)
    # one base policy per seed: two warm starts, two cache entries
    assert len(set(cached.glob("*.pt")) - before) == 2
    table = (out / "table.md").read_text()
    assert "independent seeds (--independent)" in table and "generated tokens" in table
    # the same compare without --independent keeps model.seed and data.seed at the config's
    plain = tmp_path / "plain"
    assert compare_cli(cfg, "--steps", "1", "--seeds", "3", "--out", plain) == 0
    config = json.loads((plain / "a" / "seed3" / "run.json").read_text())["config"]
    assert (config["model"]["seed"], config["data"]["seed"]) == (0, 0)
    assert "independent" not in json.loads((plain / "compare.json").read_text())
    assert "generated tokens" not in (plain / "table.md").read_text()  # today's table unless --tokens


def test_independent_needs_seeds_and_refuses_runs_of_one_base_policy(tmp_path, capsys):
    cfg = write_config(tmp_path / "a.yaml", tiny())
    assert compare_cli(cfg, "--out", tmp_path / "x", "--independent") == 2
    assert "--independent" in capsys.readouterr().err
    run_dir = tmp_path / "runs" / "seed1"
    run_training(tiny(), steps=1, seed=1, out=run_dir)  # model.seed and data.seed stay 0
    assert compare_cli(run_dir, "--seeds", "1", "--out", tmp_path / "y", "--independent") == 2
    err = capsys.readouterr().err
    assert "--independent" in err and "model.seed 0" in err and str(run_dir) in err


# ---------------------------------------------------------------------------- generated tokens
def _spy_rollouts(monkeypatch) -> list[int]:
    """The prompt + response tokens of every batch the shim generates (the real ``_rollout``, recorded)."""
    seen: list[int] = []
    real = ShimTrainer._rollout

    def recording(self, *args, **kwargs):
        batch = real(self, *args, **kwargs)
        seen.append(int(batch["prompts"].ne(PAD).sum()) + int(batch["response_mask"].sum()))
        return batch

    monkeypatch.setattr(ShimTrainer, "_rollout", recording)
    return seen


def test_generated_tokens_count_prompt_and_response_of_generated_rows_only(monkeypatch):
    seen = _spy_rollouts(monkeypatch)
    m = run_training(tiny(DOTS, **SMALL), steps=4).metrics
    # DOTS generates half the prompts and replays stored rows in place of the rest (16 rows per step here)
    assert sum(x["dataflex/replay/rows"] for x in m) > 0 and m[-1]["compute/replayed_rows"] > 0
    assert len(seen) == 4
    assert m[-1]["compute/generated_tokens"] == sum(seen)
    prompt_part = m[-1]["compute/generated_tokens"] - m[-1]["compute/generated_response_tokens"]
    rows = m[-1]["compute/generated_rollouts"]
    assert 2 * rows <= prompt_part <= 6 * rows  # a domain token and 1-5 digits per prompt, once per rollout
    for x, upto in zip(m, [sum(seen[: i + 1]) for i in range(4)]):
        assert x["compute/generated_tokens"] == upto


def test_modelled_cost_still_reads_response_tokens():
    m = run_training(tiny(), steps=2).metrics[-1]
    assert m["compute/modelled_cost"] == 4.0 * m["compute/generated_response_tokens"] + m["compute/trained_tokens"]
    assert m["compute/generated_tokens"] > m["compute/generated_response_tokens"]


def test_a_checkpoint_without_response_tokens_reads_its_old_count_as_them():
    from dataflex_bus.step_metrics import Counters

    old = Counters()
    state = old.state_dict()
    del state["generated_response_tokens"]
    state["generated_tokens"] = 123
    new = Counters()
    new.load_state_dict(state)
    assert new["generated_response_tokens"] == 123 and new["generated_tokens"] == 123


# ---------------------------------------------------------------------------- ppo_epochs
def test_ppo_epochs_trains_each_fresh_batch_k_times():
    one = run_training(tiny(trainer={"mini_batches": 2}), steps=2).metrics
    two = run_training(tiny(trainer={"mini_batches": 2, "ppo_epochs": 2}), steps=2).metrics
    assert [x["train/optimizer_steps"] for x in one] == [2, 2]
    assert [x["train/optimizer_steps"] for x in two] == [4, 4]
    # the same first batch generated (same seed, same base policy), trained twice as often
    assert one[0]["compute/generated_tokens"] == two[0]["compute/generated_tokens"]
    assert one[0]["compute/trained_tokens"] == two[0]["compute/trained_tokens"]
    gen = 4.0 * two[0]["compute/generated_response_tokens"]
    assert two[0]["compute/modelled_cost"] == gen + 2 * two[0]["compute/trained_tokens"]
    # one generated batch per step either way
    assert one[1]["compute/generated_rollouts"] == two[1]["compute/generated_rollouts"] == 2 * 16


@pytest.mark.parametrize("value", [0, "two", 1.5])
def test_a_bad_ppo_epochs_names_the_key(value):
    with pytest.raises(ConfigError, match=r"trainer\.ppo_epochs"):
        prepare(tiny(trainer={"ppo_epochs": value}))


def test_the_control_config_is_plain_grpo_trained_twice():
    control = yaml.safe_load(Path("examples/controls/grpo_ppo_epochs2.yaml").read_text())
    base = yaml.safe_load(Path("examples/grpo_baseline.yaml").read_text())
    assert control["trainer"].pop("ppo_epochs") == 2
    assert control == base


# ---------------------------------------------------------------------------- equal tokens
def curve(seed: int, values, *, rollouts: float = 100.0, tokens: float | None = 1000.0, label: str = "r"):
    """A hand-made run: eval point i at ``(i + 1) * rollouts`` rollouts and ``(i + 1) * tokens`` tokens."""
    points = []
    for i, v in enumerate(values):
        budget = {"generated_rollouts": (i + 1) * rollouts, "trained_tokens": 0.0, "modelled_cost": 0.0,
                  "wall_s": 0.0}
        if tokens is not None:
            budget["generated_tokens"] = (i + 1) * tokens
        points.append(Reading(v, float(i), budget))
    return RunCurve(Path(f"{label}{seed}"), seed, (), tuple(points), ())


def test_equal_tokens_reads_both_at_the_smaller_token_count():
    base = [curve(s, [0.1, 0.2, 0.3, 0.4]) for s in (0, 1)]
    # the method spends twice the tokens per rollout: at equal tokens it is read at its point 2 of 4
    meth = [curve(s, [0.2, 0.5, 0.6, 0.7], tokens=2000.0, label="m") for s in (0, 1)]
    doc = analyse({"b": base, "m": meth}, baseline="b")
    assert set(doc["equal_tokens"]) == set(doc["equal_rollouts"]) == {"reading", "methods", "unavailable"}
    eq = doc["equal_tokens"]["methods"]["m"]
    assert eq["values"] == pytest.approx([0.5, 0.5]) and eq["delta"]["baseline_mean"] == pytest.approx(0.4)
    assert eq["delta"]["mean"] == pytest.approx(0.1)
    assert doc["equal_rollouts"]["methods"]["m"]["delta"]["mean"] == pytest.approx(0.3)
    lacking = [curve(s, [0.2, 0.5, 0.6, 0.7], tokens=None, label="old") for s in (0, 1)]
    doc = analyse({"b": base, "old": lacking}, baseline="b")
    assert doc["equal_tokens"]["methods"]["old"] is None
    assert "generated_response_tokens" in doc["equal_tokens"]["unavailable"]["old"]
    doc["columns"] = ["tokens"]
    assert "no equal-tokens reading for old" in compare_table(doc)


# ---------------------------------------------------------------------------- the symmetric factor
def test_first_crossing_interpolates_and_censors():
    c = curve(0, [0.2, 0.4, 0.8, 0.6])
    assert first_crossing(c, 0.6) == pytest.approx(250.0)  # between 200 (0.4) and 300 (0.8)
    assert first_crossing(c, 0.1) == 100.0
    assert first_crossing(c, 0.9) is None
    assert target_level(c) == pytest.approx((0.4 + 0.8 + 0.6) / 3)


def test_symmetric_factor_on_hand_made_curves_with_a_censored_seed():
    # the baseline's last three points average 0.6; it first crosses 0.6 at 250 rollouts (0.4 -> 0.8)
    base = [curve(s, [0.2, 0.4, 0.8, 0.5, 0.5]) for s in (0, 1, 2)]
    meth = [curve(0, [0.2, 0.6, 0.7, 0.7, 0.7], label="m"),    # reaches 0.6 at 200: 250 / 200 = 1.25
            curve(1, [0.3, 0.5, 0.7, 0.7, 0.7], label="m"),    # reaches it at 250: 1.0
            curve(2, [0.2, 0.3, 0.4, 0.5, 0.55], label="m")]   # never: censored
    doc = to_target({"b": base, "m": meth}, "b")
    m = doc["methods"]["m"]
    assert doc["budget"] == "generated_rollouts" and doc["last_points"] == 3
    assert m["target"] == pytest.approx([0.6, 0.6, 0.6])
    assert m["baseline_at"] == pytest.approx([250.0] * 3)
    assert m["method_at"][:2] == pytest.approx([200.0, 250.0]) and m["method_at"][2] is None
    assert m["per_seed"][:2] == pytest.approx([1.25, 1.0]) and m["per_seed"][2] is None
    assert m["censored"] == [2] and (m["reached"], m["n"]) == (2, 3)
    assert m["mean"] == pytest.approx(1.125)
    t = 12.706204736174698  # scipy.stats.t.ppf(0.975, 1)
    half = t * (0.125 * 2 ** 0.5) / 2 ** 0.5
    assert m["ci95"] == pytest.approx([1.125 - half, 1.125 + half])
    summary = analyse({"b": base, "m": meth}, baseline="b")
    summary["to_target"], summary["columns"] = doc, ["to_target"]
    assert "(2/3)" in compare_table(summary)


def test_a_method_identical_to_the_baseline_gets_exactly_one():
    # the asymmetric reading (first crossing against the baseline's final count) gives this 500 / 250 = 2x
    base = [curve(s, [0.2, 0.4, 0.8, 0.5, 0.5]) for s in (0, 1)]
    doc = to_target({"b": base, "m": [curve(s, [0.2, 0.4, 0.8, 0.5, 0.5], label="m") for s in (0, 1)]}, "b")
    assert doc["methods"]["m"]["per_seed"] == [1.0, 1.0]


# ---------------------------------------------------------------------------- the regime
def test_multi_epoch_learnable_is_multi_epoch_without_random():
    regime = load_regime("examples/regimes/multi_epoch_learnable.yaml")
    other = load_regime("examples/regimes/multi_epoch.yaml")
    base = yaml.safe_load(Path("examples/grpo_baseline.yaml").read_text())
    mine, theirs = prepare(regime.apply(base)).resolved, prepare(other.apply(base)).resolved
    assert mine["data"]["domains"] == [d for d in theirs["data"]["domains"] if d != "random"]
    assert mine["data"]["train_pool"] == theirs["data"]["train_pool"] == 500
    passes = lambda r: r["trainer"]["steps"] * r["trainer"]["prompts_per_step"] / (  # noqa: E731
        r["data"]["train_pool"] * len(r["data"]["domains"]))
    assert passes(mine) == pytest.approx(passes(theirs), abs=0.01)
