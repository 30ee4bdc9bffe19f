"""Config files and Hydra-style overrides, read into plain dicts.

Reading files and parsing the block are two jobs: the ``dataflex`` block's own schema lives in
:mod:`dataflex_bus.block`, its check against the installed plugins in :mod:`dataflex_bus.validation`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError, ConfigFileError, ConfigIssue

__all__ = ["apply_overrides", "load_config", "load_yaml", "parse_override_value"]

# ---------------------------------------------------------------------------- files and overrides
#: YAML 1.1 floats need a dot (``1.0e-3``), so PyYAML reads ``1e-3`` as a string; ML configs write
#: learning rates and thresholds exactly that way. This adds the YAML 1.2 forms: a mantissa without a
#: dot (``1e-3``, ``3E5``) and an exponent without a sign (``1.0e5``).
_FLOAT_12 = re.compile(r"""^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$""")


@functools.cache
def _loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        """``yaml.SafeLoader`` that also reads ``1e-3`` / ``1E5`` as floats."""

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
    return Loader


class DuplicateKey(Exception):
    """A mapping that names one key twice: ``path`` (dotted, as config keys are written) on ``lines``."""

    def __init__(self, path: str, lines: tuple[int, int]) -> None:
        super().__init__(f"duplicate key {path!r} on lines {lines[0]} and {lines[1]}")
        self.path, self.lines = path, lines


def _check_duplicates(node: Any, path: str = "") -> None:
    """Refuse a key given twice in one mapping, at any depth: YAML keeps the last silently, so a second
    ``trainer:`` section would reset the first's settings to defaults and of two ``dataflex:`` blocks only one
    would run. Merge keys (``<<: *base``) are YAML's way to override on purpose and stay allowed."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":
                continue
            name = key.value if isinstance(key, yaml.ScalarNode) else repr(key)
            child = f"{path}.{name}" if path else str(name)
            line = key.start_mark.line + 1
            if name in seen:
                raise DuplicateKey(child, (seen[name], line))
            seen[name] = line
            _check_duplicates(value, child)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(item, f"{path}[{i}]")


def _parse_yaml(text: str, name: str) -> Any:
    """Parse ``text``; syntax errors name ``name`` (the file) instead of ``<unicode string>``; a key given
    twice in one mapping raises :class:`DuplicateKey`."""
    loader = _loader()(text)
    loader.name = name  # what PyYAML's marks (line/column of an error) report as the source
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicates(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_problem(exc: Exception) -> str:
    """A YAML error as one line: where (line, column), what, and in what context."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return problem
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context:
        text += f" ({context}" + (f" started at line {cmark.line + 1}" if cmark is not None else "") + ")"
    return text


def example_configs(name: str) -> list[Path]:
    """The example configs called ``name`` (``examples/**/NAME.yaml``, ``.yaml`` optional in ``name``) in the
    current directory's ``examples/`` and in that of the source checkout dataflex-bus runs from."""
    stem = Path(name).name.removesuffix(".yaml").removesuffix(".yml")
    if not stem or stem in (".", ".."):
        return []
    roots = {Path.cwd() / "examples", Path(__file__).resolve().parents[1] / "examples"}
    found = {f.resolve() for root in roots if root.is_dir() for f in root.rglob(f"{stem}.y*ml")}
    return sorted(found)


def missing_file_hint(path: Path) -> str:
    """What to write instead of a config path that is no file: the example configs of that name, as paths
    from the current directory where they lie below it."""
    found = example_configs(str(path))
    if not found:
        return ""
    cwd = Path.cwd().resolve()
    shown = [str(f.relative_to(cwd)) if f.is_relative_to(cwd) else str(f) for f in found]
    return "did you mean " + " or ".join(repr(x) for x in shown) + "?"


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict (an empty file is an empty config)."""
    import yaml

    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigFileError(ConfigIssue(str(p), "no such config file", hint=missing_file_hint(p))) from None
    except OSError as exc:
        raise ConfigFileError(ConfigIssue(str(p), f"cannot read config file: {exc.strerror or exc}")) from exc
    try:
        text = raw.decode("utf-8-sig")  # a UTF-8 byte-order mark (some Windows editors) is accepted
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigFileError(ConfigIssue(str(p), f"not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}, offset "
                                      f"{exc.start}): save the config file as UTF-8")) from None
    try:
        data = _parse_yaml(text, str(p))
    except yaml.YAMLError as exc:
        raise ConfigFileError(ConfigIssue(str(p), f"not valid YAML: {_yaml_problem(exc)}")) from None
    except DuplicateKey as exc:
        raise ConfigFileError(ConfigIssue(str(p), f"{exc}: YAML would keep only the last one silently; keep one "
                                                  "(merge the two)")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(ConfigIssue(str(p), f"expected a mapping at the top level, got {type(data).__name__}"))
    return data


def parse_override_value(text: str) -> Any:
    """Parse an override value the way Hydra users expect: YAML scalars, lists and mappings
    (``1e-3`` is a float, as in config files)."""
    import yaml

    if text == "":
        return ""
    try:
        return _parse_yaml(text, "<override>")
    except yaml.YAMLError:
        return text
    except DuplicateKey as exc:
        raise ConfigError(ConfigIssue(text, f"override value names key {exc.path!r} twice: keep one")) from None


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
