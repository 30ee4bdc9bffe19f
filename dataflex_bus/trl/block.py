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

from ..errors import ConfigError, ConfigIssue

#: What ``dataflex=`` takes, said in every refusal of it.
EXPECTED = ("a block (a mapping such as {'mechanism': 'select', 'scorer': {'name': ...}, 'actuator': {'name': "
            "...}}), the path of a YAML file holding one (under a top-level 'dataflex:' key), or None (plain TRL)")


def load_block(dataflex: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The ``dataflex`` block given to the trainer: a mapping, a YAML file holding one (under a top-level
    ``dataflex:`` key, as the examples write it, or as the whole file), or ``None``."""
    if dataflex is None or isinstance(dataflex, Mapping):
        return None if dataflex is None else dict(dataflex)
    if not isinstance(dataflex, (str, os.PathLike)):
        raise ConfigError(ConfigIssue("dataflex", f"got {type(dataflex).__name__} {dataflex!r}; expected {EXPECTED}"))
    path = Path(dataflex)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "is no file"
        raise ConfigError(ConfigIssue("dataflex", f"{str(dataflex)!r} {what}; dataflex= takes {EXPECTED}",
                                      hint=_hint(path)))
    from ..config import load_config

    config = load_config(path)
    if "dataflex" in config:
        block = config["dataflex"]
        return None if block is None else dict(block)
    if "mechanism" in config or "methods" in config:
        return config
    raise ConfigError(ConfigIssue("dataflex", f"{dataflex} holds no dataflex block (no top-level 'dataflex:' key "
                                  "and no mechanism or methods)"))


def _hint(path: Path) -> str:
    """The example configs of that name; for a component's name, where its example block is."""
    from ..config import missing_file_hint

    hints = [missing_file_hint(path)]
    name = str(path)
    if os.sep not in name and "/" not in name:
        from ..validation import installed_registry

        if installed_registry().find(name):
            hints.append(f"{name!r} is a component: `dataflex info {name}` prints a block using it")
    return "; ".join(h for h in hints if h)


__all__ = ["EXPECTED", "load_block"]
