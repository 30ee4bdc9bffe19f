"""The lean host's description and contract driver: the shim's real step (``shim_host``) under the name
"lean", lacking domain sampling and refill, so the contract suite skips the cases that need either and checks
they are refused naming the host."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import shim_host

from . import NAME

#: What the lean host cannot carry out, and why (said in the refusal).
LACKS = {"domain_sampling": "the lean host draws prompts from one pool",
         "refill": "the lean host generates each step's rollouts once"}


def description(settings: Any = None) -> Any:
    """The shim's description of the suite's world, renamed and lacking :data:`LACKS`."""
    shim = shim_host.description()
    return shim.replace(name=NAME, capabilities=shim.capabilities - set(LACKS), missing={**shim.missing, **LACKS})


def run(block: dict[str, Any] | None, *args: Any, **kwargs: Any) -> Any:
    """A case on the shim's step, once the lean description accepts its block (the suite skips what it lacks)."""
    from dataflex_bus.kit import validate

    if block:
        validate(block, host=description())
    return shim_host.run(block, *args, **kwargs)


def claims(config: Mapping[str, Any]) -> str | None:
    """A config file with a ``lean:`` section is the lean host's."""
    return "it has a `lean:` section" if "lean" in config else None
