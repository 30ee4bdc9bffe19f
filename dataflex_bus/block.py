"""The ``dataflex`` config block: its own keys and their types (component names and parameters are
checked against the installed plugins by :mod:`dataflex_bus.validation`).

A block is either one method, written as the seed writes it::

    dataflex:
      mechanism: select
      scorer:   {name: group_solve_rate, params: {success_threshold: 0.5}}
      actuator: {name: threshold_band, params: {low: 0.2, high: 0.8}}
      warmup_step: 0

or a stack of methods, run in list order at each event::

    dataflex:
      methods:
        - {name: filter, mechanism: select, scorer: {name: reward_difficulty}, actuator: {name: dapo}}
        - {name: ar, mechanism: reweight, scorer: {name: token_prob}, actuator: {name: advantage_reweight}}

Both parse to a :class:`DataflexConfig` holding :class:`MethodConfig` objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, ConfigIssue
from .mechanisms import mechanism_names
from .schema import Param, check_section, did_you_mean

if TYPE_CHECKING:
    from .registry import ComponentSpec

EMPTY_POLICIES = ("skip", "keep_all", "error")
NONFINITE_POLICIES = ("error", "drop")

#: The keys of one method (besides ``scorer`` and ``actuator``).
METHOD_KEYS: dict[str, Param] = {
    "name": Param((str, type(None)), None, nonempty=True,
                  doc="unique name in a stack (default <mechanism>:<actuator>); namespaces its metrics"),
    # Checked against the mechanism registry when parsed (a registered mechanism is valid at once).
    "mechanism": Param(str, doc="what the actuator does: a registered mechanism (dataflex_bus.mechanisms)"),
    "warmup_step": Param(int, 0, low=0, doc="steps before the actuator acts (mixers still gather statistics)"),
    "update_step": Param(int, 1, low=1, doc="a mixer recomputes its probabilities every update_step steps"),
    "on_empty": Param(str, "skip", choices=EMPTY_POLICIES,
                      doc="an empty selection skips this step's update (warned, counted), keeps all rows, "
                          "or raises"),
    "on_nonfinite": Param(str, "error", choices=NONFINITE_POLICIES,
                          doc="a NaN/inf score raises, or its row is dropped and counted"),
}
#: Keys of the block shared by all its methods.
BLOCK_KEYS: dict[str, Param] = {
    "domains": Param((list, type(None)), None, item=str, unique=True, nonempty=True,
                     doc="domain names a mixer samples (default: read from the dataset)"),
    "domain_key": Param(str, "data_source", nonempty=True, doc="dataset column holding the domain label"),
    "max_oversample": Param(float, 50.0, low=1.0,
                            doc="a pre-rollout selection considers at most this many candidates per prompt the "
                                "host needs; then the shortfall is filled with skipped candidates (on_empty=error "
                                "raises if none was kept)"),
    "refill": Param((dict, type(None)), None,
                    doc="dynamic sampling with refill: generate more prompts until the on_rollout selection "
                        "keeps the target number of groups (keys: see REFILL_KEYS)"),
}
EXHAUST_POLICIES = ("raise", "train_short", "pad_with_filtered")
REFILL_POLICIES = ("fixed", "credit2", "greso")
#: Keys of ``dataflex.refill`` (DAPO dynamic sampling, arXiv 2503.14476; policies in docs/methods.md).
REFILL_KEYS: dict[str, Param] = {
    "gen_batch_size": Param((int, type(None)), None, low=1,
                            doc="prompts generated in the first round (and each round under policy=fixed); "
                                "default: the step's prompt count"),
    "max_rounds": Param(int, 10, low=0, doc="generation rounds per step at most (0: unbounded)"),
    "policy": Param(str, "fixed", choices=REFILL_POLICIES,
                    doc="prompts per refill round: gen_batch_size (fixed), twice the groups dropped in the last "
                        "round (credit2, verl 0.9.1), or GRESO's estimate from the drop rate (greso)"),
    "on_exhaust": Param(str, "raise", choices=EXHAUST_POLICIES,
                        doc="when the rounds end short: raise, train on fewer groups, or pad with dropped groups"),
    "beta": Param(float, 1.25, low=1.0, doc="policy=greso: safety factor on the estimated refill"),
    "min_gen_batch": Param((int, type(None)), None, low=1,
                           doc="policy=greso: smallest refill round (default: a quarter of the step's prompts)"),
}
_REF_KEYS: dict[str, Param] = {
    "name": Param(str, nonempty=True, doc="component name, or distribution:name"),
    "params": Param((dict, type(None)), None, doc="the component's parameters"),
}
_SLOTS = ("scorer", "actuator")


@dataclass
class ComponentRef:
    """``{name: ..., params: {...}}`` as written in the config."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params)}


@dataclass(frozen=True)
class Resolved:
    """What validation found for one method: the providing specs, checked parameters and the event."""

    scorer: ComponentSpec
    actuator: ComponentSpec
    scorer_params: dict[str, Any]
    actuator_params: dict[str, Any]
    event: str


@dataclass(frozen=True)
class RefillConfig:
    """``dataflex.refill``: dynamic sampling with refill (see :class:`~dataflex_bus.decision.GroupFill`)."""

    gen_batch_size: int | None = None
    max_rounds: int = 10
    policy: str = "fixed"
    on_exhaust: str = "raise"
    beta: float = 1.25
    min_gen_batch: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MethodConfig:
    """One method: a scorer times an actuator under a mechanism, with its own schedule and policies."""

    mechanism: str
    scorer: ComponentRef
    actuator: ComponentRef
    warmup_step: int = 0
    update_step: int = 1
    on_empty: str = "skip"
    on_nonfinite: str = "error"
    name: str = ""
    #: Set by :func:`~dataflex_bus.validation.validate`: the components and parameters it resolved.
    resolved: Resolved | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.name = self.name or f"{self.mechanism}:{self.actuator.name}"

    def to_dict(self, *, with_name: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mechanism": self.mechanism,
            "scorer": self.scorer.to_dict(),
            "actuator": self.actuator.to_dict(),
            "warmup_step": self.warmup_step,
            "update_step": self.update_step,
            "on_empty": self.on_empty,
            "on_nonfinite": self.on_nonfinite,
        }
        if with_name:
            out = {"name": self.name, **out}
        return out


@dataclass
class DataflexConfig:
    """The validated ``dataflex`` block: its methods, in order, and the keys they share.

    ``stacked`` records how the block was written (a ``methods:`` list or one seed-style method); a
    seed-style block reads as its one method (``cfg.scorer``, ``cfg.mechanism``, ...).
    """

    methods: list[MethodConfig]
    domains: list[str] | None = None
    domain_key: str = "data_source"
    stacked: bool = False
    #: Set by :func:`~dataflex_bus.validation.validate`: settings that are valid but cannot act as meant.
    warnings: list[ConfigIssue] = field(default_factory=list, compare=False, repr=False)
    max_oversample: float = 50.0
    refill: RefillConfig | None = None

    # -------------------------------------------------------------- the one method of a seed-style block
    @property
    def method(self) -> MethodConfig:
        if len(self.methods) != 1:
            raise AttributeError(f"this dataflex block stacks {len(self.methods)} methods; read .methods[i]")
        return self.methods[0]

    @property
    def mechanism(self) -> str:
        return self.method.mechanism

    @property
    def scorer(self) -> ComponentRef:
        return self.method.scorer

    @property
    def actuator(self) -> ComponentRef:
        return self.method.actuator

    @property
    def warmup_step(self) -> int:
        return self.method.warmup_step

    @property
    def update_step(self) -> int:
        return self.method.update_step

    @property
    def on_empty(self) -> str:
        return self.method.on_empty

    @property
    def on_nonfinite(self) -> str:
        return self.method.on_nonfinite

    # -------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], key: str = "dataflex") -> DataflexConfig:
        """Parse and check the block's own keys; raises :class:`ConfigError` listing every problem."""
        cfg, issues = cls.parse(raw, key)
        if issues or cfg is None:
            raise ConfigError(issues)
        return cfg

    @classmethod
    def parse(cls, raw: Any, key: str = "dataflex") -> tuple[DataflexConfig | None, list[ConfigIssue]]:
        """Best-effort parse: the config (``None`` if a method is unusable) and every problem found, so
        validation can still check the components of a block with a stray key."""
        issues: list[ConfigIssue] = []
        if not isinstance(raw, Mapping):
            return None, [ConfigIssue(key, f"expected a mapping, got {type(raw).__name__}")]
        stacked = "methods" in raw
        if stacked:
            shared = check_section(raw, BLOCK_KEYS, key, issues, extra=("methods",))
            methods = _parse_methods(raw["methods"], f"{key}.methods", issues)
        else:
            shared = check_section(raw, BLOCK_KEYS, key, issues, extra=(*METHOD_KEYS, *_SLOTS))
            if "name" in raw:
                issues.append(ConfigIssue(f"{key}.name", "a single method takes no name; name methods inside "
                                          "a `methods:` list"))
            own = {k: v for k, v in raw.items() if k in _SLOTS or (k in METHOD_KEYS and k != "name")}
            one = _parse_method(own, key, issues)
            methods = None if one is None else [one]
        refill = None
        if shared["refill"] is not None:
            refill = RefillConfig(**check_section(shared["refill"], REFILL_KEYS, f"{key}.refill", issues))
        if methods is None:
            return None, issues
        cfg = cls(methods=methods, domains=shared["domains"], domain_key=shared["domain_key"], stacked=stacked,
                  max_oversample=shared["max_oversample"], refill=refill)
        return cfg, issues

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any]
        if self.stacked:
            out = {"methods": [m.to_dict() for m in self.methods]}
        else:
            out = self.method.to_dict(with_name=False)
        out["domain_key"] = self.domain_key
        if self.domains is not None:
            out["domains"] = list(self.domains)
        # Written only when set, so blocks without them read (and checkpoint) as before.
        if self.max_oversample != BLOCK_KEYS["max_oversample"].default:
            out["max_oversample"] = self.max_oversample
        if self.refill is not None:
            out["refill"] = self.refill.to_dict()
        return out


def _parse_methods(raw: Any, key: str, issues: list[ConfigIssue]) -> list[MethodConfig] | None:
    if not isinstance(raw, list) or not raw:
        issues.append(ConfigIssue(key, f"expected a non-empty list of method blocks, got {raw!r}"))
        return None
    methods = [_parse_method(item, f"{key}[{i}]", issues) for i, item in enumerate(raw)]
    if any(m is None for m in methods):
        return None
    done = [m for m in methods if m is not None]
    seen: dict[str, int] = {}
    for i, m in enumerate(done):
        if m.name in seen:
            issues.append(ConfigIssue(f"{key}[{i}].name", f"method name {m.name!r} is already used by "
                                      f"{key}[{seen[m.name]}]; give each method a unique `name`"))
        seen.setdefault(m.name, i)
    return done


def _parse_method(raw: Any, key: str, issues: list[ConfigIssue]) -> MethodConfig | None:
    if not isinstance(raw, Mapping):
        issues.append(ConfigIssue(key, f"expected a method block {{mechanism: ..., scorer: ..., actuator: ...}}, "
                                  f"got {raw!r}"))
        return None
    before = len(issues)
    values = check_section(raw, METHOD_KEYS, key, issues, extra=_SLOTS)
    names = mechanism_names()
    if isinstance(values.get("mechanism"), str) and values["mechanism"] not in names:
        issues.append(ConfigIssue(f"{key}.mechanism", f"{values['mechanism']!r} is not allowed", names,
                                  hint=did_you_mean(values["mechanism"], names)))
    refs = {slot: _parse_ref(raw.get(slot), f"{key}.{slot}", issues) for slot in _SLOTS}
    mechanism_ok = not any(i.key == f"{key}.mechanism" for i in issues[before:])
    if not mechanism_ok or refs["scorer"] is None or refs["actuator"] is None:
        return None
    return MethodConfig(scorer=refs["scorer"], actuator=refs["actuator"], **{**values, "name": values["name"] or ""})


def _parse_ref(raw: Any, key: str, issues: list[ConfigIssue]) -> ComponentRef | None:
    if raw is None:
        issues.append(ConfigIssue(key, "missing: expected {name: ..., params: {...}}"))
        return None
    if isinstance(raw, str):
        return ComponentRef(raw)
    if not isinstance(raw, Mapping):
        issues.append(ConfigIssue(key, f"expected {{name: ..., params: {{...}}}}, got {raw!r}"))
        return None
    before = len(issues)
    values = check_section(raw, _REF_KEYS, key, issues)
    if len(issues) > before:
        return None
    return ComponentRef(values["name"], dict(values["params"] or {}))


def method_keys(config: DataflexConfig, key: str = "dataflex") -> list[str]:
    """The config key of each method: the block itself, or ``dataflex.methods[i]`` in a stack."""
    if config.stacked:
        return [f"{key}.methods[{i}]" for i in range(len(config.methods))]
    return [key]
