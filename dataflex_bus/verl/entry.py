"""verl plugin entry point (group ``verl.plugins``, name ``dataflex``).

verl imports this module on every ``import verl`` (driver, TaskRunner actor, workers) and swallows any
exception at DEBUG level, so a broken install would surface only later as ``Unknown trainer
'dataflex_sync'``. This module therefore stays tiny and never raises: it imports the adapter (which
registers the dataflex trainer modes as an import side effect, from exactly one module path) and, if
that fails, logs the cause at ERROR with its traceback and registers stand-ins whose construction
raises ``RuntimeError`` naming the real cause. The TaskRunner then fails loudly, through ``ray.get``,
with the reason instead of "Unknown trainer".

It also installs :mod:`dataflex_bus.verl.guard`, whether the adapter loaded or not: every other verl
trainer then refuses a ``dataflex`` block instead of training plain GRPO with it; and
:mod:`dataflex_bus.verl.compat`, so that verl runs beside TRL 1.x (the ``trl`` extra).
"""

from __future__ import annotations

import importlib
import logging
import traceback

from . import TRAINER_MODES

#: The exception that stopped the adapter from loading in this process (``None``: loaded fine).
LOAD_ERROR: BaseException | None = None
#: Its formatted traceback, for ``dataflex doctor``.
LOAD_TRACEBACK: str | None = None

_ADAPTER = "dataflex_bus.verl.trainer"


def _register_stand_in(cause: BaseException) -> None:
    """Register every dataflex mode as a trainer whose construction raises with the real cause."""
    try:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    except Exception:  # verl itself is broken: nothing to register into; the ERROR log says why.
        return

    message = (f"the dataflex verl plugin failed to load: {cause!r}. Run `dataflex doctor` for details; "
               "the full traceback was logged at ERROR by the 'dataflex_bus' logger in this process.")

    class DataflexSyncUnavailable(PPOTrainerSync):
        """Stand-in for the dataflex modes when the adapter could not be imported."""

        load_error = cause
        dataflex_host = True  # raise the load error, not the guard's "wrong mode" one

        def __init__(self, config):
            raise RuntimeError(message) from cause

    for mode in TRAINER_MODES:
        if mode not in TRAINER_REGISTRY:
            register_trainer(mode)(DataflexSyncUnavailable)


def _mend_trl_probe() -> None:
    try:
        from .compat import install

        install()
    except Exception:
        logging.getLogger("dataflex_bus").error(
            "dataflex: could not narrow verl's TRL probe; with TRL 1.x installed verl's model build may fail "
            "importing AutoModelForCausalLMWithValueHead.\n%s", traceback.format_exc())


def _install_guard() -> None:
    try:
        from .guard import install

        install()
    except Exception:  # never raise from a verl plugin: verl would hide it at DEBUG anyway
        logging.getLogger("dataflex_bus").error(
            "dataflex: could not install the guard refusing a dataflex block in non-dataflex verl trainers; "
            "such trainers will ignore the block.\n%s", traceback.format_exc())


try:
    # import_module, not `from ... import`: when the adapter module itself triggered `import verl`
    # (a user importing it first), it is already in sys.modules, half-initialised, and registers
    # itself when it finishes. Reading an attribute here would fail spuriously.
    importlib.import_module(_ADAPTER)
except Exception as exc:
    LOAD_ERROR = exc
    LOAD_TRACEBACK = traceback.format_exc()
    logging.getLogger("dataflex_bus").error(
        "dataflex: the verl plugin could not import %s; trainer modes %s will raise on use.\n%s",
        _ADAPTER, ", ".join(TRAINER_MODES), LOAD_TRACEBACK,
    )
    _register_stand_in(exc)

_install_guard()
_mend_trl_probe()
