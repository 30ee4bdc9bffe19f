"""Config files and Hydra-style overrides, read into plain dicts.

The ``dataflex`` block's own schema lives in :mod:`dataflex_bus.block` (re-exported here), its check
against the installed plugins in :mod:`dataflex_bus.validation`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .block import ComponentRef, DataflexConfig, MethodConfig
from .errors import ConfigError, ConfigIssue

__all__ = ["ComponentRef", "DataflexConfig", "MethodConfig", "apply_overrides", "load_config", "load_yaml",
           "parse_override_value"]

# ---------------------------------------------------------------------------- files and overrides
def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict (an empty file is an empty config)."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(ConfigIssue(str(p), f"cannot read config file: {exc.strerror or exc}")) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(ConfigIssue(str(p), f"not valid YAML: {exc}")) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(ConfigIssue(str(p), f"expected a mapping at the top level, got {type(data).__name__}"))
    return data


def parse_override_value(text: str) -> Any:
    """Parse an override value the way Hydra users expect: YAML scalars, lists and mappings."""
    import yaml

    if text == "":
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(config: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply Hydra-style dotted overrides: ``a.b=1``, ``+a.b=1`` (add), ``++a.b=1`` (force), ``~a.b``.

    The leading ``+`` that verl users type for keys absent from verl's schema is accepted; the result
    is the same as without it. Returns a new dict; the input is not modified.
    """
    import copy

    out = copy.deepcopy(dict(config))
    for item in overrides:
        text = item.strip()
        delete = text.startswith("~")
        text = text.lstrip("+~")
        path, sep, value_text = text.partition("=")
        if not path or (not sep and not delete) or any(not part for part in path.split(".")):
            raise ConfigError(ConfigIssue(item, "malformed override: expected key.path=value, +key=value or ~key"))
        parts = path.split(".")
        node: dict[str, Any] = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                if delete:
                    break
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(ConfigIssue(".".join(parts[: i + 1]),
                                              f"cannot set {path!r}: {part!r} holds {nxt!r}, not a mapping"))
            node = nxt
        else:
            if delete:
                node.pop(parts[-1], None)
            else:
                node[parts[-1]] = parse_override_value(value_text)
    return out


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """YAML file (optional) plus overrides, as a plain dict."""
    base = load_yaml(path) if path is not None else {}
    return apply_overrides(base, overrides)
