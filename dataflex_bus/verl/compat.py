"""verl 0.9.1 and TRL 1.16 in one environment (the ``verl`` and ``trl`` extras together).

verl's FSDP model build (``verl/models/transformers/monkey_patch.py``, ``apply_monkey_patch``) patches
``AutoModelForCausalLMWithValueHead.state_dict`` whenever ``trl`` is importable, importing that class from
``trl.experimental.ppo`` or ``trl``. TRL 1.x has neither (its PPO trainer is gone), so with TRL installed every
verl run stopped at the model build with an ``ImportError``. verl asks ``verl.utils.import_utils.
is_trl_available``; :func:`install` narrows that probe, in every process that imports verl, to "TRL with its
PPO value head", the one thing verl uses TRL for. verl's value-head critic (``verl/utils/model.py``) then says
TRL is missing instead of failing on the import.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from functools import cache

#: verl's modules that bind ``is_trl_available`` at import time.
_USERS = ("verl.models.transformers.monkey_patch", "verl.utils.model")
_installed: Callable[[], bool] | None = None


def trl_has_value_head() -> bool:
    """True when the installed TRL still ships ``AutoModelForCausalLMWithValueHead`` where verl imports it."""
    for module in ("trl.experimental.ppo", "trl"):
        try:
            with warnings.catch_warnings():  # trl.experimental warns on import
                warnings.simplefilter("ignore")
                found = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(found, "AutoModelForCausalLMWithValueHead"):
            return True
    return False


def install() -> None:
    """Narrow verl's TRL probe (idempotent; TRL is imported only when verl first asks)."""
    global _installed
    from verl.utils import import_utils

    original = import_utils.is_trl_available
    if original is _installed:
        return

    @cache
    def is_trl_available() -> bool:
        return bool(original()) and trl_has_value_head()

    _installed = is_trl_available
    import_utils.is_trl_available = is_trl_available
    for name in _USERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "is_trl_available", None) is original:
            module.is_trl_available = is_trl_available  # type: ignore[attr-defined]
