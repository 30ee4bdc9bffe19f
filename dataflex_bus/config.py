"""The ``dataflex`` config block: YAML loading, Hydra-style overrides and the schema of the block.

Component names and parameters are checked against the installed plugins by
:func:`dataflex_bus.pipeline.validate`; this module checks the block's own keys and types.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .components import MECHANISM_KIND
from .errors import ConfigError, ConfigIssue

EMPTY_POLICIES = ("skip", "keep_all", "error")
NONFINITE_POLICIES = ("error", "drop")


@dataclass
class ComponentRef:
    """``{name: ..., params: {...}}`` as written in the config."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params)}


@dataclass
class DataflexConfig:
    """The validated ``dataflex`` block.

    ``warmup_step``: steps before the actuator acts (mixers still gather statistics).
    ``update_step``: a mixer recomputes its probabilities every ``update_step`` steps.
    ``domains``: the domain names (mix); read from the dataset when omitted.
    ``domain_key``: the dataset column holding the domain label.
    ``on_empty``: what an empty selection does: ``skip`` this step's update (default, warns and counts
    it), ``keep_all`` rows, or raise an ``error``.
    ``on_nonfinite``: a NaN/inf score raises an ``error`` (default) or the row is dropped and counted
    (``drop``).
    """

    mechanism: str
    scorer: ComponentRef
    actuator: ComponentRef
    warmup_step: int = 0
    update_step: int = 1
    domains: list[str] | None = None
    domain_key: str = "data_source"
    on_empty: str = "skip"
    on_nonfinite: str = "error"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], key: str = "dataflex") -> DataflexConfig:
        """Parse and check the block's own keys; raises :class:`ConfigError` listing every problem."""
        cfg, issues = cls.parse(raw, key)
        if issues or cfg is None:
            raise ConfigError(issues)
        return cfg

    @classmethod
    def parse(cls, raw: Mapping[str, Any], key: str = "dataflex") -> tuple[DataflexConfig | None, list[ConfigIssue]]:
        """Best-effort parse: the config (``None`` if the mechanism or a component is unusable) and every
        problem found, so validation can also check the components of a block with a stray key."""
        issues: list[ConfigIssue] = []
        if not isinstance(raw, Mapping):
            return None, [ConfigIssue(key, f"expected a mapping, got {type(raw).__name__}")]
        allowed = [f.name for f in cls.__dataclass_fields__.values()]
        for k in raw:
            if k not in allowed:
                issues.append(ConfigIssue(f"{key}.{k}", "unknown key", allowed))
        mechanism = raw.get("mechanism")
        if mechanism not in MECHANISM_KIND:
            issues.append(ConfigIssue(f"{key}.mechanism",
                                      "missing" if mechanism is None else f"unknown mechanism {mechanism!r}",
                                      list(MECHANISM_KIND)))
        refs = {}
        for slot in ("scorer", "actuator"):
            ref, slot_issues = _parse_ref(raw.get(slot), f"{key}.{slot}")
            issues.extend(slot_issues)
            refs[slot] = ref
        values: dict[str, Any] = {}
        for name, lo in (("warmup_step", 0), ("update_step", 1)):
            value = raw.get(name, cls.__dataclass_fields__[name].default)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                issues.append(ConfigIssue(f"{key}.{name}", f"expected an integer >= {lo}, got {value!r}"))
            values[name] = value
        for name, choices in (("on_empty", EMPTY_POLICIES), ("on_nonfinite", NONFINITE_POLICIES)):
            value = raw.get(name, cls.__dataclass_fields__[name].default)
            if value not in choices:
                issues.append(ConfigIssue(f"{key}.{name}", f"unknown policy {value!r}", choices))
            values[name] = value
        domain_key = raw.get("domain_key", "data_source")
        if not isinstance(domain_key, str) or not domain_key:
            issues.append(ConfigIssue(f"{key}.domain_key", f"expected a column name, got {domain_key!r}"))
        domains = raw.get("domains")
        if domains is not None:
            if (not isinstance(domains, Sequence) or isinstance(domains, str)
                    or not all(isinstance(d, str) for d in domains)):
                issues.append(ConfigIssue(f"{key}.domains", f"expected a list of domain names, got {domains!r}"))
            elif len(set(domains)) != len(domains) or not domains:
                issues.append(ConfigIssue(f"{key}.domains", f"expected distinct, non-empty names, got {domains!r}"))
        if mechanism not in MECHANISM_KIND or refs["scorer"] is None or refs["actuator"] is None:
            return None, issues
        defaults = {f.name: f.default for f in cls.__dataclass_fields__.values()}
        safe = {k: (v if not any(i.key == f"{key}.{k}" for i in issues) else defaults[k]) for k, v in values.items()}
        ok_domains = domains is not None and not any(i.key == f"{key}.domains" for i in issues)
        cfg = cls(mechanism=mechanism, scorer=refs["scorer"], actuator=refs["actuator"],
                  domains=list(domains) if ok_domains else None,
                  domain_key=domain_key if isinstance(domain_key, str) and domain_key else "data_source", **safe)
        return cfg, issues

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mechanism": self.mechanism,
            "scorer": self.scorer.to_dict(),
            "actuator": self.actuator.to_dict(),
            "warmup_step": self.warmup_step,
            "update_step": self.update_step,
            "domain_key": self.domain_key,
            "on_empty": self.on_empty,
            "on_nonfinite": self.on_nonfinite,
        }
        if self.domains is not None:
            out["domains"] = list(self.domains)
        return out


def _parse_ref(raw: Any, key: str) -> tuple[ComponentRef | None, list[ConfigIssue]]:
    if raw is None:
        return None, [ConfigIssue(key, "missing: expected {name: ..., params: {...}}")]
    if isinstance(raw, str):
        return ComponentRef(raw), []
    if not isinstance(raw, Mapping):
        return None, [ConfigIssue(key, f"expected {{name: ..., params: {{...}}}}, got {raw!r}")]
    issues = [ConfigIssue(f"{key}.{k}", "unknown key", ["name", "params"]) for k in raw if k not in ("name", "params")]
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        issues.append(ConfigIssue(f"{key}.name", f"expected a component name, got {name!r}"))
    params = raw.get("params") or {}
    if not isinstance(params, Mapping):
        issues.append(ConfigIssue(f"{key}.params", f"expected a mapping, got {params!r}"))
        params = {}
    return (ComponentRef(name, dict(params)) if not issues else None), issues


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


def _parse_yaml(text: str, name: str) -> Any:
    """Parse ``text``; syntax errors name ``name`` (the file) instead of ``<unicode string>``."""
    loader = _loader()(text)
    loader.name = name  # what PyYAML's marks (line/column of an error) report as the source
    try:
        return loader.get_single_data()
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


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict (an empty file is an empty config)."""
    import yaml

    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(ConfigIssue(str(p), f"cannot read config file: {exc.strerror or exc}")) from exc
    try:
        text = raw.decode("utf-8-sig")  # a UTF-8 byte-order mark (some Windows editors) is accepted
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(ConfigIssue(str(p), f"not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}, offset "
                                      f"{exc.start}): save the config file as UTF-8")) from None
    try:
        data = _parse_yaml(text, str(p))
    except yaml.YAMLError as exc:
        raise ConfigError(ConfigIssue(str(p), f"not valid YAML: {_yaml_problem(exc)}")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(ConfigIssue(str(p), f"expected a mapping at the top level, got {type(data).__name__}"))
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
