"""Testing kit for plugin authors: realistic batches, in-process registration, quick shim runs.

Shipped with dataflex-bus and activated in every pytest session through the ``pytest11`` entry point
(:mod:`dataflex_bus.testing.pytest_plugin`), so a method pack's tests get the fixtures without any
``conftest.py``. This module stays import-light (pytest imports it in every session of every project
that has dataflex-bus installed): the helpers below import torch only when called.

Helpers (importable from here):

* :func:`make_batch` - a GRPO-shaped :class:`~dataflex_bus.Batch`: variable response lengths, binary
  rewards on the last valid token, verl's GRPO advantages, negative old log-probs, optional domains,
  mixed group sizes and padding rows.
* :func:`make_prompt_batch` - an ``on_prompts`` batch (candidate prompts with their history) for a
  ``pre_rollout`` scorer.
* :func:`run_short_training` - a few steps of the CPU shim with a given config; returns the metrics.
* :func:`apply_method` - build a ``dataflex`` block from the installed (or in-process) components and
  apply it to one batch, returning the :class:`~dataflex_bus.Decision`.
* :func:`check_scorer`, :func:`check_selector`, :func:`check_reweighter`, :func:`check_mixer` - the
  contract every component of that kind must meet (shapes, padding rows, finiteness, determinism).
* :func:`assert_state_roundtrip` - a component's ``state_dict`` restores an identical twin.

Fixtures (see :mod:`dataflex_bus.testing.pytest_plugin`): ``dataflex_register_plugin``,
``dataflex_plugin_env``, ``dataflex_isolated_plugins``, ``dataflex_fresh_plugins``, ``dataflex_batch``,
``dataflex_run_training``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataflex_bus._lazy import lazy_exports

_EXPORTS = {
    "make_batch": "factories",
    "make_prompt_batch": "factories",
    "DEFAULT_DOMAINS": "factories",
    "run_short_training": "training",
    "apply_method": "contracts",
    "check_scorer": "contracts",
    "check_selector": "contracts",
    "check_reweighter": "contracts",
    "check_mixer": "contracts",
    "assert_state_roundtrip": "contracts",
}

__all__ = [
    "DEFAULT_DOMAINS",
    "apply_method",
    "assert_state_roundtrip",
    "check_mixer",
    "check_reweighter",
    "check_scorer",
    "check_selector",
    "make_batch",
    "make_prompt_batch",
    "run_short_training",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from .contracts import (
        apply_method,
        assert_state_roundtrip,
        check_mixer,
        check_reweighter,
        check_scorer,
        check_selector,
    )
    from .factories import DEFAULT_DOMAINS, make_batch, make_prompt_batch
    from .training import run_short_training
