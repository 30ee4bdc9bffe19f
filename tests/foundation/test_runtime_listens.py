"""What a host may ask the runtime about an event before preparing a batch for it."""

from __future__ import annotations

from dataflex_bus import hookimpl
from dataflex_bus.runtime import Runtime

SEED = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
        "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}}
TOPK = {"mechanism": "select", "scorer": {"name": "advantage_magnitude"},
        "actuator": {"name": "topk_fraction", "params": {"fraction": 0.5}}}
REWEIGHT = {"mechanism": "reweight", "scorer": {"name": "token_prob"},
            "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.5}}}


class StepEndWatcher:
    @hookimpl
    def on_step_end(self, batch, step):
        return None


def test_listens_follows_the_methods_and_the_observers():
    runtime = Runtime(SEED)
    assert [runtime.listens(e) for e in ("on_rollout", "on_advantage", "on_step_end")] == [True, False, False]
    runtime.bus.add_observer(StepEndWatcher(), "watcher")
    assert runtime.listens("on_step_end") and not runtime.listens("on_advantage")
    assert not any(Runtime(None).listens(e) for e in ("on_rollout", "on_advantage", "on_step_end"))


def test_the_plan_names_the_methods_that_may_drop_rows_at_on_rollout():
    """What the hosts read to decide whether TRL's generation runs again on the kept rows."""
    assert Runtime(SEED).plan.drops_at_rollout == ("dataflex.mechanism",)
    assert Runtime(TOPK).plan.drops_at_rollout == ()  # drops at on_advantage, after generation
    assert Runtime({**REWEIGHT, "on_nonfinite": "drop"}).plan.drops_at_rollout == ()
    assert Runtime(None).plan.drops_at_rollout == ()
