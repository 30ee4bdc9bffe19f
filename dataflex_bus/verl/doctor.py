"""``dataflex doctor``: is the verl integration healthy in this environment?

Checks, in order: verl's version (and whether it is in the range the adapter's private hook points
were tested against), TransferQueue and Ray, the ``verl.plugins`` entry point, whether ``import verl``
registered the real dataflex trainer modes (not the stand-ins a failed import leaves), the
``VERL_USE_EXTERNAL_PLUGINS`` policy, and the dataflex plugin set as ``dataflex plugins --check`` sees it
(every component imported in a child process; names two plugins share are warnings). Given the user's ``main_ppo``
overrides (``dataflex doctor trainer.v1.trainer_mode=sync +dataflex.mechanism=select ...``) it also
composes verl's config the way ``main_ppo`` does and checks the ``dataflex`` block against the trainer
that config would run: a block the trainer would ignore, or one that does not validate, fails.
Exits 1 when anything is broken.

Where the time goes (2-core CPU box): ``import verl`` about 5 s (tensordict, torch, transformers), the
adapter's import of verl's v1 trainer about 2 s more, the plugin set and the Hydra compose well under a
second each. Doctor silences the warnings verl prints while importing (no accelerator on this machine,
optional engines not installed): they say nothing about the integration.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from ..kit import FAIL, OK, WARN, add_block, block_warnings, new_checks, plugin_checks, report, tested_version, version
from . import TESTED_VERL, TRAINER_MODES


def compose_main_ppo(overrides: Sequence[str]) -> Any:
    """verl's ``ppo_trainer`` config composed with ``overrides`` exactly as ``main_ppo`` composes it."""
    import verl.trainer.main_ppo as main_ppo
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose(config_name="ppo_trainer", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def _block_checks(overrides: Sequence[str], add: Any) -> None:
    """The ``dataflex`` block of ``overrides`` against the trainer ``main_ppo`` would build from them."""
    from ..kit import ConfigError
    from .guard import has_block, ignored_issue

    try:
        config = compose_main_ppo(overrides)
    except Exception as exc:  # Hydra's own message names the override
        add("config", FAIL, f"verl could not compose these overrides: {type(exc).__name__}: {exc}")
        return
    mode = str(config.trainer.v1.trainer_mode) if config.trainer.get("use_v1", True) else "legacy (use_v1=False)"
    add("config", OK, f"main_ppo config composed; trainer: {mode}")
    issue = ignored_issue(config)
    if issue is not None:
        add("dataflex block", FAIL, f"would be ignored: {issue}")
        return
    if not has_block(config):
        ours = mode in TRAINER_MODES
        add("dataflex block", WARN if ours else OK,
            "none: " + ("this dataflex mode trains plain GRPO (observers still see the events)" if ours else
                        "plain verl training"))
        return
    from .trainer import build_runtime

    try:
        with block_warnings() as warnings:
            runtime = build_runtime(config)
    except ConfigError as exc:
        add("dataflex block", FAIL, str(exc))
        return
    add_block(add, f"{mode} runs " + "; ".join(runtime.describe()), warnings)


def _file_block_checks(config: dict[str, Any], add: Any) -> None:
    """The ``dataflex`` block of a verl config file (``--config FILE``) against verl's description of that file,
    as ``dataflex validate FILE`` checks it (no Hydra compose: the file holds what it holds)."""
    from ..kit import ConfigError
    from .host import check_config

    try:
        with block_warnings() as warnings:
            cfg = check_config(config)
    except ConfigError as exc:
        add("dataflex block", FAIL, str(exc))
        return
    if cfg is None:
        add("dataflex block", OK, "none in the file: plain verl training")
        return
    methods = "; ".join(f"{m.mechanism} {m.scorer.name}+{m.actuator.name}" for m in cfg.methods)
    add_block(add, f"the file's block validates against verl: {methods}", [*map(str, cfg.warnings), *warnings])


def run_checks(overrides: Sequence[str] = (), config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every check as ``{"check", "status", "detail"}`` (``overrides``: see the module doc; ``config``: a verl
    config file's contents, overrides applied, whose block is checked instead of a composed one)."""
    checks, add = new_checks()
    if not tested_version(add, "verl", TESTED_VERL, 'pip install "dataflex-bus[verl]"',
                          "the adapter overrides private verl methods"):
        return checks
    for dist in ("TransferQueue", "ray"):
        found = version(dist)
        add(dist, OK if found else FAIL, f"{dist} {found}" if found else
            f"{dist} is not installed (the v1 trainer needs it): pip install \"verl[verl-core]\"")

    eps = [ep for ep in metadata.entry_points(group="verl.plugins") if ep.value == "dataflex_bus.verl.entry"]
    add("entry point", OK if eps else FAIL,
        f"verl.plugins: {eps[0].name} = {eps[0].value}" if eps else
        "no verl.plugins entry point for dataflex_bus.verl.entry (reinstall dataflex-bus)")

    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    names = {n.strip() for n in policy.split(",") if n.strip()}
    loads = policy == "auto" or (policy != "none" and "dataflex" in names)
    add("VERL_USE_EXTERNAL_PLUGINS", OK if loads else WARN,
        f"{policy!r}" + ("" if loads else ": verl will not load the dataflex plugin; unset it or include "
                         "'dataflex' (on every Ray node)"))

    try:
        import verl  # noqa: F401  (loads the entry points, as every verl process does)
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    except Exception as exc:
        add("import verl", FAIL, f"{type(exc).__name__}: {exc}")
        return checks
    # What `import verl` registered by itself is what main_ppo will find: read it before importing the
    # entry point ourselves (that import only serves to surface the adapter's own load error).
    registered = {mode: TRAINER_REGISTRY.get(mode) for mode in TRAINER_MODES}
    from . import entry

    if entry.LOAD_ERROR is not None:
        add("trainer mode", FAIL, f"{sorted(TRAINER_MODES)} are stand-ins: the adapter failed to import:\n"
            f"{entry.LOAD_TRACEBACK}")
    elif any(cls is None for cls in registered.values()):
        why = (f"VERL_USE_EXTERNAL_PLUGINS={policy!r} excludes the 'dataflex' entry point" if not loads
               else "verl did not load the dataflex entry point")
        missing = [mode for mode, cls in registered.items() if cls is None]
        add("trainer mode", FAIL, f"`import verl` did not register {missing} ({why}): main_ppo would fail "
            f"with \"Unknown trainer\" (available: {sorted(TRAINER_REGISTRY)})")
    else:
        add("trainer mode", OK, ", ".join(f"{mode!r} -> {getattr(cls, '__qualname__', cls)}"
                                          for mode, cls in registered.items()))

    plugin_checks(add)
    if config is not None:
        _file_block_checks(config, add)
    elif overrides:
        _block_checks(overrides, add)
    return checks


def _quiet_verl_import() -> None:
    """Silence what ``import verl`` prints on a machine without an accelerator or optional engines."""
    warnings.filterwarnings("ignore", message=r".* engine is not available", category=UserWarning)
    # A filter, not a level: that module sets its logger's level when it is imported.
    logging.getLogger("verl.plugin.platform.platform_manager").addFilter(lambda record: record.levelno >= logging.ERROR)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print the checks; exit status 1 if any failed (``--strict``: or warned)."""
    from ..kit import load_config

    _quiet_verl_import()
    overrides = getattr(args, "overrides", None) or ()
    path = getattr(args, "config", None)
    checks = run_checks(overrides, load_config(path, overrides) if path else None)
    return report(checks, as_json=getattr(args, "json", False), strict=getattr(args, "strict", False))
