"""The ``dataflex=`` argument of :class:`~dataflex_bus.trl.DataflexGRPOTrainer`, read into a block.

It takes a block (a mapping), the path of a YAML file holding one, or ``None``. A string that is no file
(a bare name such as ``"dynamic_sampling"``) is refused saying what is expected, with the example
configs of that name and, for a component's name, where its example block is. Import-light (no TRL).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..kit import ConfigError, ConfigIssue

#: What ``dataflex=`` takes, said in every refusal of it.
EXPECTED = ("a block (a mapping such as {'mechanism': 'select', 'scorer': {'name': ...}, 'actuator': {'name': "
            "...}}), the path of a YAML file holding one (under a top-level 'dataflex:' key), or None (plain TRL)")

#: How to ask for plain TRL, said where an empty block is refused.
PLAIN = "pass dataflex=None to train plain TRL"


def load_block(dataflex: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The ``dataflex`` block given to the trainer: a mapping, a YAML file holding one (under a top-level
    ``dataflex:`` key, as the examples write it, or as the whole file), or ``None``."""
    if dataflex is None:
        return None
    if isinstance(dataflex, Mapping):
        if not dataflex:  # (a block computed as {} would otherwise train plain TRL without a word)
            raise ConfigError(ConfigIssue("dataflex", "an empty block: it configures no method", hint=PLAIN))
        return dict(dataflex)
    if not isinstance(dataflex, (str, os.PathLike)):
        raise ConfigError(ConfigIssue("dataflex", f"got {type(dataflex).__name__} {dataflex!r}; expected {EXPECTED}"))
    path = Path(dataflex)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "is no file"
        raise ConfigError(ConfigIssue("dataflex", f"{str(dataflex)!r} {what}; dataflex= takes {EXPECTED}",
                                      hint=_hint(path)))
    from ..kit import load_config

    config = load_config(path)
    if "dataflex" in config:
        block = config["dataflex"]
        if not block:
            raise ConfigError(_empty(path, config))
        if not isinstance(block, Mapping):
            raise ConfigError(ConfigIssue("dataflex", f"{path}: its 'dataflex:' key holds {type(block).__name__} "
                                          f"{block!r}; expected a block (a mapping)"))
        return dict(block)
    if "mechanism" in config or "methods" in config:
        return config
    raise ConfigError(ConfigIssue("dataflex", f"{dataflex} holds no dataflex block (no top-level 'dataflex:' key "
                                  "and no mechanism or methods)"))


def _empty(path: Path, config: Mapping[str, Any]) -> ConfigIssue:
    """The refusal of a file whose ``dataflex:`` block is empty: a bare ``dataflex:``, ``dataflex: {}``, or a
    block whose keys were not indented under it (then they sit at the top level, named)."""
    from ..kit import BLOCK_KEYS, METHOD_KEYS

    keys = {*METHOD_KEYS, *BLOCK_KEYS, "scorer", "actuator", "methods"}
    stray = [str(k) for k in config if k in keys]
    why = (f"; the keys {', '.join(map(repr, stray))} sit at the top level: indent them under 'dataflex:'"
           if stray else "")
    return ConfigIssue("dataflex", f"{path}: its 'dataflex:' block is empty{why}", hint=PLAIN)


def _hint(path: Path) -> str:
    """The example configs of that name; for a component's name, where its example block is."""
    from ..kit import missing_file_hint

    hints = [missing_file_hint(path)]
    name = str(path)
    if os.sep not in name and "/" not in name:
        from ..kit import installed_registry

        if installed_registry().find(name):
            hints.append(f"{name!r} is a component: `dataflex info {name}` prints a block using it")
    return "; ".join(h for h in hints if h)


__all__ = ["EXPECTED", "load_block"]
