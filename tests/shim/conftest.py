import copy

import pytest

from . import comps

#: A run small enough for unit tests (well under a second per step).
TINY = {
    "trainer": {"steps": 3, "prompts_per_step": 4, "group_size": 4, "eval_every": 0, "save_every": 1},
    "model": {"hidden": 16, "pretrain_steps": 5},
}


def without_times(metrics):
    """Per-step metrics without the wall times (``time/*``), which no two runs share."""
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]


def tiny(dataflex=None, **sections):
    cfg = copy.deepcopy(TINY)
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    if dataflex is not None:
        cfg["dataflex"] = dataflex
    return cfg


@pytest.fixture
def shim_components():
    comps.register()
    yield
    comps.unregister()


@pytest.fixture
def recorder(monkeypatch):
    """Every Runtime the shim builds gets a recording observer on its bus."""
    from dataflex_bus.runtime import Runtime
    from dataflex_bus.shim import run

    rec = comps.Recorder()

    class Recording(Runtime):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.bus.add_observer(rec, "recorder")

    monkeypatch.setattr(run, "Runtime", Recording)
    return rec


@pytest.fixture
def observers(monkeypatch):
    """``name -> observer`` added to the bus of every Runtime the shim builds in this test."""
    from dataflex_bus.runtime import Runtime
    from dataflex_bus.shim import run

    added: dict[str, object] = {}

    class Observed(Runtime):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for name, observer in added.items():
                self.bus.add_observer(observer, name)

    monkeypatch.setattr(run, "Runtime", Observed)
    return added


