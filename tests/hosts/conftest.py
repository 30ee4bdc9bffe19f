"""The hosts of the contract suite: one ``host`` parameter per host, its test id the host's name."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# The verl driver builds on the verl tier's harness.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "verl_tier"))

#: TRL's GRPO advantage divides by the group std + 1e-4 (hard-coded in TRL), the shim's and verl's by std + 1e-6:
#: advantages and what derives from them (weights, a mixer's statistics) agree to about 2e-4 relative.
TRL_REL = 1e-3


@dataclass
class Host:
    """A host under contract: ``run(block, world, batch=, steps=, tmp_path=)`` -> step records and
    ``description(settings)``: the host's description under its framework ``settings`` (``None``: the suite's
    own). ``configurations``: other settings of the host, each described for the refusal cases (what each lacks
    is read from its description, never listed here). ``rel``: the relative tolerance of its advantage-derived
    values against the shim's (0: the suite's absolute ones). ``behaviour_is_old``: the host samples with the
    policy that computes a step's old log-probs, so a row's behaviour log-probs are its host's own old ones
    (not the world's scripted ones) and a fresh row's off-policy weight is exactly 1."""

    name: str
    module: Any
    configurations: list[Any] = field(default_factory=list)
    rel: float = 0.0
    behaviour_is_old: bool = False

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.run(*args, **kwargs)

    def description(self, settings: Any = None) -> Any:
        return self.module.description() if settings is None else self.module.description(settings)

    def descriptions(self) -> list[Any]:
        """The suite's description of the host, then one per other configuration."""
        return [self.description(), *(self.description(c) for c in self.configurations)]


def _shim() -> Host:
    import shim_host

    return Host("shim", shim_host)


def _verl() -> Host:
    import verl_host

    return Host("verl", verl_host, [["trainer.v1.trainer_mode=dataflex_colocate_async"],
                                    ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"]])


def _trl() -> Host:
    import trl_host

    return Host("trl", trl_host, rel=TRL_REL, behaviour_is_old=True)


HOSTS = {"shim": (_shim, []), "verl": (_verl, [pytest.mark.verl, pytest.mark.tq]), "trl": (_trl, [pytest.mark.trl])}


@pytest.fixture(params=[pytest.param(name, marks=marks, id=name) for name, (_, marks) in HOSTS.items()])
def host(request) -> Host:
    name = request.param
    if name == "verl":
        if importlib.util.find_spec("verl") is None:
            pytest.skip("verl is not installed")
        request.getfixturevalue("clean_partition")
        import verl_components  # noqa: F401  (the verl tier's in-process components)
    if name == "trl" and importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed")
    return HOSTS[name][0]()
