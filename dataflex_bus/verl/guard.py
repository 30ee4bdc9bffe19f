"""Refuse a ``dataflex`` block that the verl trainer being built would silently ignore.

Only the dataflex trainer modes read the block. Every other verl trainer (``sync``, ``colocate_async``,
``separate_async``, a mode someone else registered, the legacy ``trainer.use_v1=False`` trainer and the
experimental fully-async / one-step-off-policy / separation trainers) would train plain GRPO with the
block in its config and say nothing. :func:`install`, run by the ``verl.plugins`` entry point in every
process that imports verl, makes the construction of such a trainer raise a :class:`ConfigError` that
names the mode to use instead.

Two base classes cover all of them: ``PPOTrainer`` (the v1 modes) and ``RayPPOTrainer`` (the legacy and
experimental trainers). Their ``__init__`` is wrapped, and so is the ``__init__`` of every subclass that
defines its own, now and when it is defined later: the experimental ``FullyAsyncTrainer`` and
``FullyAsyncRollouter`` never call their base ``__init__``, and ``PPOTrainerSeparateAsync`` asserts on
its own config before it does. :func:`ignored_issue` is the same judgement for a config alone, before
anything is built (``dataflex doctor``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..kit import ConfigError, ConfigIssue
from . import TRAINER_MODES
from .host import select

log = logging.getLogger("dataflex_bus")

#: verl's own v1 modes and the dataflex mode that runs the same trainer with the events wired in.
DATAFLEX_MODE_FOR = {verl_mode: ours for ours, verl_mode in TRAINER_MODES.items()}
#: Set on a wrapped ``__init__`` so that installing twice never wraps twice.
_MARK = "__dataflex_guarded__"


def has_block(config: Any) -> bool:
    """True when ``config`` (a verl config: DictConfig or mapping) holds a non-empty ``dataflex`` block."""
    if config is None or not hasattr(config, "get"):
        return False
    try:
        block = config.get("dataflex", None)
    except Exception:  # a config object without the key in struct mode: no block
        return False
    return bool(block)


def _mode_issue(mode: str) -> ConfigIssue:
    ours = sorted(TRAINER_MODES)
    if mode in DATAFLEX_MODE_FOR:
        return ConfigIssue("trainer.v1.trainer_mode",
                           f"verl's {mode!r} trainer ignores the dataflex block and would train plain GRPO", ours,
                           hint=f"use trainer.v1.trainer_mode={DATAFLEX_MODE_FOR[mode]}")
    return ConfigIssue("trainer.v1.trainer_mode",
                       f"trainer mode {mode!r} is not a dataflex mode: it ignores the dataflex block and would "
                       "train plain GRPO", ours, hint="use trainer.v1.trainer_mode=dataflex_sync")


def ignored_issue(config: Any) -> ConfigIssue | None:
    """Why the trainer ``python -m verl.trainer.main_ppo`` builds from ``config`` would ignore its
    ``dataflex`` block; ``None`` when there is no block or a dataflex mode runs it."""
    if not has_block(config):
        return None
    if not bool(select(config, "trainer.use_v1", True)):
        return ConfigIssue("trainer.use_v1", "False runs verl's legacy trainer (main_ppo_v0), which ignores the "
                           "dataflex block and would train plain GRPO",
                           hint="set trainer.use_v1=True trainer.v1.trainer_mode=dataflex_sync")
    mode = str(select(config, "trainer.v1.trainer_mode", "sync"))
    return None if mode in TRAINER_MODES else _mode_issue(mode)


def _experimental_issue(cls: type) -> ConfigIssue:
    return ConfigIssue("dataflex", f"verl's {cls.__module__}.{cls.__qualname__} trainer ignores the dataflex "
                       "block and would train plain GRPO",
                       hint="run python -m verl.trainer.main_ppo with trainer.v1.trainer_mode=dataflex_sync, "
                            "or dataflex_colocate_async / dataflex_separate_async for asynchronous training")


def _config_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    return args[0] if args else kwargs.get("config")


def _guard(init: Callable[..., None], judge: Callable[[Any, Any], ConfigIssue | None]) -> Callable[..., None]:
    if getattr(init, _MARK, False):
        return init

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not getattr(type(self), "dataflex_host", False):
            config = _config_of(args, kwargs)
            if has_block(config):
                issue = judge(self, config)
                if issue is not None:
                    raise ConfigError(issue)
        init(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    return __init__


def _judge_v1(trainer: Any, config: Any) -> ConfigIssue | None:
    return _mode_issue(str(select(config, "trainer.v1.trainer_mode", "sync")))


def _judge_legacy(trainer: Any, config: Any) -> ConfigIssue | None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    if type(trainer) is RayPPOTrainer:
        return ignored_issue(config) or ConfigIssue(
            "trainer.use_v1", "verl's legacy trainer (RayPPOTrainer) ignores the dataflex block",
            hint="set trainer.use_v1=True trainer.v1.trainer_mode=dataflex_sync")
    return _experimental_issue(type(trainer))


def _guard_tree(base: type[Any], judge: Callable[[Any, Any], ConfigIssue | None]) -> None:
    """Wrap ``base.__init__`` and that of every subclass defining one, now and later."""
    stack = [base]
    while stack:
        cls = stack.pop()
        if "__init__" in cls.__dict__:
            cls.__init__ = _guard(cls.__dict__["__init__"], judge)
        stack.extend(cls.__subclasses__())
    if getattr(base.__dict__.get("__init_subclass__"), _MARK, False):
        return

    def guard_subclass(cls: type[Any], **kwargs: Any) -> None:
        super(base, cls).__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _guard(cls.__dict__["__init__"], judge)

    setattr(guard_subclass, _MARK, True)
    base.__init_subclass__ = classmethod(guard_subclass)  # type: ignore[assignment]


def install() -> None:
    """Make every verl trainer that is not a dataflex mode refuse a non-empty ``dataflex`` block."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    _guard_tree(PPOTrainer, _judge_v1)
    _guard_tree(RayPPOTrainer, _judge_legacy)
