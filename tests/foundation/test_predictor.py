"""The predictor component kind: registered and resolved like scorers and actuators, configured by the block's
``predictor`` key, checked on what it returns, calibrated every step and saved with the run."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from dataflex_bus.batch import Batch
from dataflex_bus.components import Param
from dataflex_bus.errors import BatchFieldError, ConfigError, PluginRuntimeError
from dataflex_bus.ops import waves
from dataflex_bus.predictor import (
    BRIER,
    P_FIELD,
    SPEARMAN,
    Observation,
    Prediction,
    Predictor,
    PredictorRun,
    average_ranks,
    spearman,
)
from dataflex_bus.registry import register_predictor, unregister_local
from dataflex_bus.validation import validate

READER = {"mechanism": "select", "scorer": {"name": "predicted"}, "actuator": {"name": "top_b"}}


class Fixed(Predictor):
    """Predicts ``value`` for everyone; ``mode`` breaks it on purpose."""

    params: ClassVar = {"value": Param(float, 0.5), "mode": Param(str, "ok")}
    value: float
    mode: str

    def bind(self, prompts: int) -> None:
        self.seen = torch.zeros(prompts, dtype=torch.float64)

    def observe(self, seen: Observation) -> None:
        self.seen[seen.prompt] += 1

    def predict(self, prompt: torch.Tensor, step: int) -> Any:
        n = prompt.numel()
        if self.mode == "raise":
            raise RuntimeError("boom")
        if self.mode == "nan":
            return torch.full((n,), float("nan"))
        if self.mode == "shape":
            return torch.zeros(n + 1)
        if self.mode == "columns":
            return Prediction(torch.zeros(n), {"extra": torch.zeros(n)})
        return torch.full((n,), float(self.value), dtype=torch.float64)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"seen": self.seen}


class Learned(Predictor):
    """A small trainable model: a logit per domain bucket, trained by SGD on each group's outcomes."""

    def bind(self, prompts: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(1, 1, dtype=torch.float64)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.1)

    def features(self, prompt: torch.Tensor) -> torch.Tensor:
        return (prompt % 3).to(torch.float64)[:, None]

    def observe(self, seen: Observation) -> None:
        self.optimizer.zero_grad()
        logit = self.model(self.features(seen.prompt)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, seen.rate, weight=seen.size.to(logit.dtype))
        loss.backward()
        self.optimizer.step()

    def predict(self, prompt: torch.Tensor, step: int) -> torch.Tensor:
        with torch.no_grad():
            return torch.sigmoid(self.model(self.features(prompt)).squeeze(-1))


@pytest.fixture
def local() -> Iterator[None]:
    register_predictor("fixed")(Fixed)
    register_predictor("learned")(Learned)
    yield
    unregister_local("predictor", "fixed")
    unregister_local("predictor", "learned")


def groups(prompts: list[int], rewards: list[list[float]]) -> Batch:
    uid, rows, index = [], [], []
    for g, (p, rs) in enumerate(zip(prompts, rewards)):
        for r in rs:
            uid.append(f"g{g}")
            rows.append(r)
            index.append(p)
    n = len(rows)
    rm = torch.zeros(n, 2)
    rm[:, 1] = torch.tensor(rows)
    return Batch.from_tensors(uid=uid, rm_scores=rm, response_mask=torch.ones(n, 2, dtype=torch.long),
                              prompt_index=torch.tensor(index))


def test_the_kind_is_registered_and_listed():
    from dataflex_bus.discovery import get_plugins
    from dataflex_bus.mechanisms import component_kinds

    assert "predictor" in component_kinds()
    registry = get_plugins().registry()
    assert {"cures", "dps", "vip"} <= set(registry.names("predictor"))
    assert registry.resolve("predictor", "dps").load().kind == "predictor"


def test_an_unknown_predictor_gets_the_suggestion_list():
    with pytest.raises(ConfigError, match=r"dataflex.predictor.name: .*unknown predictor 'dsp'.*dps.*installed: "
                                          r"cures, dps, vip"):
        validate({**READER, "predictor": {"name": "dsp"}})


def test_bad_predictor_params_are_named():
    with pytest.raises(ConfigError, match=r"dataflex.predictor.params.decay"):
        validate({**READER, "predictor": {"name": "dps", "params": {"decay": 2.0}}})


def test_a_reader_without_a_predictor_and_a_predictor_without_a_reader_are_refused():
    with pytest.raises(ConfigError, match=r"dataflex.scorer.name: reads a predicted success rate, but the block "
                                          r"names no predictor"):
        validate(READER)
    with pytest.raises(ConfigError, match=r"dataflex.predictor: predictor 'cures' is named but no method"):
        validate({"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                  "actuator": {"name": "threshold_band"}, "predictor": {"name": "cures"}})


def test_the_block_round_trips_its_predictor():
    cfg = validate({**READER, "predictor": {"name": "cures", "params": {"prior_alpha": 2.0}}})
    assert cfg.predictor is not None and cfg.predictor.name == "cures"
    assert cfg.to_dict()["predictor"] == {"name": "cures", "params": {"prior_alpha": 2.0}}


@pytest.mark.parametrize(("mode", "field", "message"), [
    ("nan", P_FIELD, "NaN/inf at rows"),
    ("shape", P_FIELD, r"expected shape \(3,\)"),
    ("columns", "columns", "returned columns"),
])
def test_bad_output_is_named_with_its_field(local, mode, field, message):
    run = PredictorRun(Fixed(mode=mode), "local")
    run.bind(5)
    with pytest.raises(BatchFieldError, match=rf"predictor 'Fixed' \(plugin 'local'\).*{field}.*{message}"):
        run.predict(torch.tensor([0, 1, 2]), 0)


def test_p_outside_the_unit_interval_and_a_raise_are_named(local):
    run = PredictorRun(Fixed(value=1.5), "local")
    run.bind(5)
    with pytest.raises(BatchFieldError, match=r"predicted_p.*p must lie in \[0, 1\]"):
        run.predict(torch.tensor([0]), 0)
    broken = PredictorRun(Fixed(mode="raise"), "pack")
    broken.bind(5)
    with pytest.raises(PluginRuntimeError, match=r"plugin 'pack'.*predict.*boom"):
        broken.predict(torch.tensor([0]), 0)


def test_spearman_and_ranks_hand_vectors():
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    assert spearman(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.0, 0.5, 1.0])) == pytest.approx(1.0)
    assert spearman(torch.tensor([0.3, 0.2, 0.1]), torch.tensor([0.0, 0.5, 1.0])) == pytest.approx(-1.0)
    # ranks x = 1, 2, 3, 4; y = 1, 3, 2, 4: 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([1.0, 3, 2, 4])) == pytest.approx(0.8)
    assert math.isnan(spearman(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])))


def test_waves_split_repeats_in_order():
    assert [w.tolist() for w in waves(torch.tensor([4, 2, 4, 4, 1]))] == [[0, 1, 4], [2], [3]]


def test_calibration_is_the_steps_over_every_round(local):
    """Two rounds of one step: the metrics returned add up to the step's calibration over all its groups."""

    class Rate(Fixed):
        def predict(self, prompt, step):
            return prompt.to(torch.float64) / 4

    run = PredictorRun(Rate(), "local")
    run.bind(5)
    first = run.record(groups([0, 4], [[0, 0], [1, 1]]), 0)  # predicted 0, 1; observed 0, 1
    assert first == {BRIER: 0.0, SPEARMAN: pytest.approx(1.0)}
    second = run.record(groups([2, 1], [[1, 0], [1, 1]]), 0)  # predicted 0.5, 0.25; observed 0.5, 1
    total = {k: first[k] + second[k] for k in first}
    # pairs (0, 0), (1, 1), (0.5, 0.5), (0.25, 1): Brier 0.5625 / 4; ranks of predictions 1, 4, 3, 2 and of
    # outcomes 1, 3, 2, 3 (ties averaged: 1, 3.5, 2, 3.5)
    assert total[BRIER] == pytest.approx(0.5625 / 4)
    assert total[SPEARMAN] == pytest.approx(spearman(torch.tensor([0, 1, 0.5, 0.25]), torch.tensor([0, 1, 0.5, 1.0])))
    assert run.record(groups([3], [[0, 0]]), 1)[BRIER] == pytest.approx(0.75**2)  # a new step starts afresh


def test_a_trainable_predictor_saves_model_and_optimizer_and_resumes_exactly(local):
    def trained(steps: range, run: PredictorRun) -> list[float]:
        out = []
        for s in steps:
            out.append(run.record(groups([s % 5, (s + 1) % 5], [[1, 0], [1, 1]]), s)[BRIER])
            run.end_step(s)
        return out

    full = PredictorRun(Learned(), "local")
    full.bind(5)
    whole = trained(range(6), full)
    half = PredictorRun(Learned(), "local")
    half.bind(5)
    trained(range(3), half)
    state = half.state_dict()
    assert {"model", "optimizer"} <= set(state["state"])
    resumed = PredictorRun(Learned(), "local")
    resumed.bind(5)
    resumed.load_state_dict(state)
    assert trained(range(3, 6), resumed) == whole[3:]
    with pytest.raises(ValueError, match="over 5 prompts; this run has 'Learned' over 7"):
        other = PredictorRun(Learned(), "local")
        other.bind(7)
        other.load_state_dict(state)


def test_info_shows_a_predictor_with_its_columns_and_a_validated_block(capsys):
    from dataflex_bus.cli import main

    assert main(["info", "dps"]) == 0
    out = capsys.readouterr().out
    assert "dps (predictor)" in out and "columns:      p, partial, entropy" in out
    assert "on_prompts (predicts p for the candidates)" in out and "not checked valid" not in out
