"""The hosts of the contract suite: one ``host`` parameter per host, its test id the host's name."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The verl driver builds on the verl tier's harness.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "verl"))

#: TRL's GRPO advantage divides by the group std + 1e-4 (hard-coded in TRL), the shim's and verl's by std + 1e-6:
#: advantages and what derives from them (weights, a mixer's statistics) agree to about 2e-4 relative.
TRL_REL = 1e-3


@dataclass
class Host:
    """A host under contract: ``run(block, world, batch=, steps=, tmp_path=)`` -> step records,
    ``description()``, and ``lacking()``: ``(capability, description)`` of configurations lacking one; ``rel``:
    the relative tolerance of its advantage-derived values against the shim's (0: the suite's absolute ones)."""

    name: str
    module: Any
    lacks: Any
    rel: float = 0.0

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.run(*args, **kwargs)

    def description(self) -> Any:
        return self.module.description()

    def lacking(self) -> list[tuple[str, Any]]:
        found = self.lacks()
        if not found:
            pytest.skip(f"host {self.name!r} has every capability")
        return found


def _shim() -> Host:
    import shim_host

    return Host("shim", shim_host, lambda: [])


def _verl() -> Host:
    import verl_host

    return Host("verl", verl_host, lambda: [
        ("refill", verl_host.description(["trainer.v1.trainer_mode=dataflex_colocate_async"])),
        ("loss_weights", verl_host.description(["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"])),
        ("replay", verl_host.description(["trainer.v1.trainer_mode=dataflex_colocate_async"])),
        ("ragged_groups", verl_host.description(["trainer.v1.trainer_mode=dataflex_colocate_async"])),
    ])


def _trl() -> Host:
    import trl_host

    return Host("trl", trl_host, lambda: [("replay", trl_host.description()),
                                           ("ragged_groups", trl_host.description())], rel=TRL_REL)


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
