"""The hosts of the contract suite: one ``host`` parameter per registered host (:mod:`dataflex_bus.hosts`) with a
contract driver, its test id the host's name. What each host needs (its driver, importable modules, marks,
fixtures) is its registration's and its driver's; nothing here names a host."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import pytest

from dataflex_bus import hosts


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


def host_params(entries: tuple[hosts.HostEntry, ...] | None = None) -> list[Any]:
    """One ``host`` parameter per registered host with a contract driver, marked as its registration says."""
    return [pytest.param(e.name, marks=[getattr(pytest.mark, m) for m in e.contract.marks], id=e.name)
            for e in (hosts.registered() if entries is None else entries) if e.contract]


def contract_host(name: str, request: pytest.FixtureRequest) -> Host:
    """Registered host ``name`` under contract: skipped when a module it requires is not installed, its driver's
    ``before_case(request)`` run (the fixtures it needs), the driver's settings read."""
    contract = hosts.get(name).contract
    assert contract is not None, f"host {name!r} has no contract driver"
    for module in contract.requires:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    driver = importlib.import_module(contract.driver)
    before_case = getattr(driver, "before_case", None)
    if before_case is not None:
        before_case(request)
    return Host(name, driver, list(getattr(driver, "CONFIGURATIONS", [])), getattr(driver, "REL", 0.0),
                getattr(driver, "BEHAVIOUR_IS_OLD", False))


@pytest.fixture(params=host_params())
def host(request) -> Host:
    return contract_host(request.param, request)


@pytest.fixture
def host_under_contract() -> Any:
    """:func:`contract_host`, for a test module whose ``host`` is a host it registers itself."""
    return contract_host
