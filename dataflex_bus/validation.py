"""Check a ``dataflex`` block against the installed components and the host that will run it, before
anything trains.

:func:`validate` resolves every method's scorer and actuator by name, checks their parameters, the
mechanism's rules (:mod:`dataflex_bus.mechanisms`), the fields they need at the event they will run at
and what the host can carry out (:class:`~dataflex_bus.host.HostDescription`: a field or capability the
host lacks is refused naming the host), and the rules of a method stack; it reports every problem at once,
each keyed by its config key. What it resolved (component specs, checked parameters, the event) travels
with the returned config, so building the pipeline neither resolves nor validates again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .block import DataflexConfig, MethodConfig, Resolved, method_keys
from .components import TIMINGS, Actuator, Scorer, as_score, resolve_params
from .errors import CollisionError, ConfigError, ConfigIssue, PluginLoadError, UnknownComponentError
from .host import ANY_HOST, GROUP_ESTIMATORS, NON_GROUP_ESTIMATORS, HostDescription
from .mechanisms import mechanism, mechanisms
from .mechanisms.allocate import Allocator
from .mechanisms.base import Need, Needed
from .mechanisms.select import Selector
from .plan import Plan
from .visits import VisitClasses

if TYPE_CHECKING:
    from .registry import ComponentSpec, Registry

_Classes = tuple[type[Scorer], type[Actuator]]
_TIMING_ORDER = list(TIMINGS)


class _Built:
    """The block's components as validation builds them: each at most once, for the checks that need an
    instance (visit classes, domains, the selection probe). The pipeline builds its own: the probe may have
    changed an instance's state."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, str], Any] = {}

    def get(self, method: MethodConfig, slot: str, cls: type, params: Mapping[str, Any]) -> Any:
        key = (id(method), slot)
        if key not in self._made:
            self._made[key] = cls(**params)
        return self._made[key]

    def made(self, method: MethodConfig, slot: str) -> Any:
        """The component built for ``method``'s ``slot``, ``None`` when none was."""
        return self._made.get((id(method), slot))


#: What ``dataflex.refill`` needs of a host.
REFILL_NEEDS = {"refill": Need("dynamic sampling with refill generates more prompts within a step",
                               instead="remove dataflex.refill")}


def method_needs(method: MethodConfig, scorer: type[Scorer], actuator: type[Actuator], key: str) -> list[Needed]:
    """The capabilities one method needs (its mechanism's :meth:`~dataflex_bus.mechanisms.Mechanism.needs`)."""
    return [Needed(f"{key}.{need.at}", capability, need)
            for capability, need in mechanism(method.mechanism).needs(method, scorer, actuator).items()]


def refill_needs(key: str = "dataflex") -> list[Needed]:
    """The capabilities ``dataflex.refill`` needs."""
    return [Needed(f"{key}.refill", capability, need) for capability, need in REFILL_NEEDS.items()]


def block_needs(config: DataflexConfig, key: str = "dataflex") -> list[Needed]:
    """Every capability a validated block (:func:`validate`'s result) needs of its host: its plan's
    (:meth:`~dataflex_bus.plan.Plan.needed`), its methods' and ``dataflex.refill``'s."""
    needed = refill_needs(key) if config.refill is not None else []
    needed.extend(Plan.of(config, key).needed())
    for method, mkey in zip(config.methods, method_keys(config, key)):
        if method.resolved is None:
            raise ValueError(f"{mkey} is not resolved: pass the config validate() returned")
        scorer, actuator = method.resolved.scorer.load(), method.resolved.actuator.load()
        assert issubclass(scorer, Scorer) and issubclass(actuator, Actuator)
        needed.extend(method_needs(method, scorer, actuator, mkey))
    return needed


def refuse_lacking(host: HostDescription, needed: Iterable[Needed]) -> list[ConfigIssue]:
    """The refusal of each capability in ``needed`` that ``host`` lacks, naming the host, the capability and the
    host's reason (:meth:`HostDescription.why_not`)."""
    return [ConfigIssue(n.key, f"{n.need.why}, which host {host.name!r} cannot carry out: it lacks {n.capability}"
                        f"{host.why_not(n.capability)}" + (f"; {n.need.instead}" if n.need.instead else ""))
            for n in needed if not host.can(n.capability)]


def method_event(mechanism_name: str, scorer_cls: type[Scorer], actuator_cls: type[Actuator]) -> str:
    """The bus event a method acts at, from its mechanism and its components' timings."""
    return mechanism(mechanism_name).event(scorer_cls, actuator_cls)


def validate(
    config: DataflexConfig | Mapping[str, Any],
    registry: Registry | None = None,
    *,
    host: HostDescription | None = None,
    key: str = "dataflex",
) -> DataflexConfig:
    """Check a ``dataflex`` block against the installed components and ``host`` (default
    :data:`~dataflex_bus.host.ANY_HOST`: every field, every capability); raises :class:`ConfigError` with
    every problem. Returns the config with each method's resolution attached (``method.resolved``)."""
    issues: list[ConfigIssue]
    if isinstance(config, DataflexConfig):
        cfg, issues = config, []
    else:
        parsed, issues = DataflexConfig.parse(config, key=key)
        if parsed is None:
            raise ConfigError(issues)
        cfg = parsed
    registry = registry if registry is not None else installed_registry()
    host = host if host is not None else ANY_HOST
    classes: list[_Classes | None] = []
    built = _Built()
    for method, mkey in zip(cfg.methods, method_keys(cfg, key)):
        found = _validate_method(method, cfg, registry, host, mkey, issues, built)
        classes.append(found)
    issues.extend(_check_stack(cfg, classes, key))
    issues.extend(_check_block(cfg, classes, key))
    issues.extend(_check_history(cfg, classes, key, built))
    issues.extend(_check_refill(cfg, host, key))
    if not issues:  # (the plan reads the resolved methods)
        issues.extend(refuse_lacking(host, Plan.of(cfg, key).needed()))
    if not issues and host.check is not None:
        issues.extend(host.check(cfg, key))
    if issues:
        raise ConfigError(issues)
    cfg.warnings = (_stack_warnings(cfg, classes, key) + _selection_warnings(cfg, key, host.group_size or 8, built)
                    + [ConfigIssue(f"{mkey}.actuator.params.{param}", message)
                       for method, mkey in zip(cfg.methods, method_keys(cfg, key))
                       if (actuator := built.made(method, "actuator")) is not None
                       for param, message in actuator.host_warnings(host)])
    return cfg


def _validate_method(method: MethodConfig, cfg: DataflexConfig, registry: Registry, host: HostDescription,
                     key: str, issues: list[ConfigIssue], built: _Built) -> _Classes | None:
    before = len(issues)
    mech = mechanism(method.mechanism)
    s_spec, s_cls = _resolve(registry, "scorer", method.scorer.name, f"{key}.scorer.name", issues)
    a_spec, a_cls = _resolve(registry, "actuator", method.actuator.name, f"{key}.actuator.name", issues)
    if a_spec is not None and a_spec.kind != mech.kind:
        issues.append(ConfigIssue(
            f"{key}.actuator.name",
            f"{method.actuator.name!r} is {_article(a_spec.kind)} {a_spec.kind}, but mechanism "
            f"{method.mechanism!r} needs {_article(mech.kind)} {mech.kind}", registry.names("actuator", [mech.kind])))
        a_cls = None
    s_params = a_params = None
    if s_cls is not None:
        s_params, found = resolve_params(s_cls, method.scorer.params, key=f"{key}.scorer.params")
        issues.extend(found)
    if a_cls is not None:
        a_params, found = resolve_params(a_cls, method.actuator.params, key=f"{key}.actuator.params")
        issues.extend(found)
    if s_cls is None or a_cls is None:
        return None
    issues.extend(_check_fit(method, s_cls, a_cls, host, key, s_params or {}, a_params or {}))
    if len(issues) > before:
        return None
    if cfg.domains:
        found_issues = mech.check_domains(built.get(method, "actuator", a_cls, a_params or {}), cfg.domains)
        if found_issues:
            issues.extend(found_issues)
            return None
    host_issues = [ConfigIssue(f"{key}.actuator.params.{param}", message)
                   for param, message in built.get(method, "actuator", a_cls, a_params or {}).check_host(host)]
    if host_issues:
        issues.extend(host_issues)
        return None
    assert s_spec is not None and a_spec is not None and s_params is not None and a_params is not None
    method.resolved = Resolved(s_spec, a_spec, s_params, a_params, mech.event(s_cls, a_cls))
    return s_cls, a_cls


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _resolve(registry: Registry, slot: str, name: str, key: str,
             issues: list[ConfigIssue]) -> tuple[ComponentSpec | None, type | None]:
    try:
        spec = registry.resolve(slot, name, key=key)
        return spec, spec.load()
    except (UnknownComponentError, CollisionError, PluginLoadError) as exc:
        message = str(exc)
        if message.startswith(f"{key}: "):
            message = message[len(key) + 2:]
        issues.append(ConfigIssue(key, message))
        return None, None


def _later_timing(cls: type[Scorer] | type[Actuator], who: str, host: HostDescription) -> str:
    """The fix for requirements an event lacks: the earliest later timing whose event on ``host`` has them all."""
    attr = "timing" if who == "scorer" else "min_timing"
    timing = getattr(cls, attr)
    later = [t for t in _TIMING_ORDER[_TIMING_ORDER.index(timing) + 1:]
             if all(host.provides(TIMINGS[t], f) for f in cls.requires)]
    if not later:
        return ""
    return f'set {attr} = "{later[0]}" in {cls.__name__} (the earliest timing that has them)'


def _check_fit(method: MethodConfig, s_cls: type[Scorer], a_cls: type[Actuator], host: HostDescription,
               key: str, s_params: Mapping[str, Any], a_params: Mapping[str, Any]) -> list[ConfigIssue]:
    """What every method must satisfy, then its mechanism's own rules (``*_params``: the checked parameters,
    which may add fields a component reads)."""
    issues: list[ConfigIssue] = []
    mech = mechanism(method.mechanism)
    sname, aname = method.scorer.name, method.actuator.name
    if s_cls.granularity not in a_cls.accepts:
        issues.append(ConfigIssue(
            f"{key}.scorer.name",
            f"scorer {sname!r} gives {s_cls.granularity}-level scores but {a_cls.kind} {aname!r} acts on "
            f"{' or '.join(a_cls.accepts)}-level scores", a_cls.accepts))
    if s_cls.timing == "pre_rollout" and not mech.before_generation:
        issues.append(ConfigIssue(f"{key}.scorer.name", f"scorer {sname!r} runs pre_rollout (before generation); "
                                  f"mechanism {method.mechanism!r} cannot act there (only "
                                  f"{', '.join(m.name for m in mechanisms() if m.before_generation)} can)"))
    issues.extend(refuse_lacking(host, method_needs(method, s_cls, a_cls, key)))
    issues.extend(mech.check(method, s_cls, a_cls, host, key))
    event = mech.event(s_cls, a_cls)
    needs: list[tuple[str, type[Scorer] | type[Actuator], str]] = [
        ("scorer", s_cls, TIMINGS[s_cls.timing]), ("actuator", a_cls, event)]
    params = {"scorer": s_params, "actuator": a_params}
    for who, cls, at in needs:
        missing = [f for f in cls.requires_for(params[who]) if not host.provides(at, f)]
        if missing:
            reasons = "".join(host.why_not(f) for f in missing)
            where = f"timing {cls.timing}" if who == "scorer" else "where the method acts"  # type: ignore[union-attr]
            issues.append(ConfigIssue(
                f"{key}.{who}.name",
                f"{cls.kind} {getattr(method, who).name!r} requires {missing}, not available at {at} on host "
                f"{host.name!r} ({where}){reasons}", sorted(host.fields[at]), hint=_later_timing(cls, who, host)))
    estimator = host.adv_estimator
    for who, cls, _ in needs:
        if not cls.needs_groups:
            continue
        if estimator is not None and str(estimator) in NON_GROUP_ESTIMATORS:
            issues.append(ConfigIssue(
                f"{key}.{who}.name",
                f"{getattr(method, who).name!r} needs groups of rollouts per prompt, but the advantage "
                f"estimator {estimator!r} is not group-based", GROUP_ESTIMATORS))
        n = host.group_size
        if n is not None and int(n) < 2:
            issues.append(ConfigIssue(f"{key}.{who}.name", f"{getattr(method, who).name!r} needs groups, but "
                                      f"{host.group_size_name}={n} (< 2) on host {host.name!r}"))
    return issues


def _check_history(cfg: DataflexConfig, classes: list[_Classes | None], key: str, built: _Built) -> list[ConfigIssue]:
    """The block keeps one per-prompt history: every component that classifies visits must agree."""
    seen: list[tuple[str, VisitClasses]] = []
    for method, mkey, found in zip(cfg.methods, method_keys(cfg, key), classes):
        if found is None or method.resolved is None:
            continue
        for slot, cls, params in (("scorer", found[0], method.resolved.scorer_params),
                                  ("actuator", found[1], method.resolved.actuator_params)):
            if not cls.uses_history:
                continue
            try:
                wanted = built.get(method, slot, cls, params).visit_classes()
            except ConfigError as exc:
                return [ConfigIssue(f"{mkey}.{slot}.params.{i.key}", i.message, i.allowed) for i in exc.issues]
            if wanted is not None:
                seen.append((f"{mkey}.{slot}.params", wanted))
    issues = []
    for where, wanted in seen[1:]:
        if wanted != seen[0][1]:
            issues.append(ConfigIssue(where, f"classifies prompt visits as {wanted.to_dict()}, but {seen[0][0]} "
                                      f"classifies them as {seen[0][1].to_dict()}; the block keeps one prompt "
                                      "history, so they must agree"))
    return issues


def _check_refill(cfg: DataflexConfig, host: HostDescription, key: str) -> list[ConfigIssue]:
    """Refill tops up what an ``on_rollout`` selection drops: without one it would never stop early; the host
    must be able to generate within a step, with the configured policies."""
    refill = cfg.refill
    if refill is None:
        return []
    refused = refuse_lacking(host, refill_needs(key))
    if refused:
        return refused
    issues = []
    for method, mkey in zip(cfg.methods, method_keys(cfg, key)):
        if not mechanism(method.mechanism).refill_compatible:
            issues.append(ConfigIssue(f"{key}.refill", f"{mkey} (mechanism {method.mechanism!r}) decides how many "
                                      "prompts a step generates, and so does dynamic sampling with refill: use one "
                                      "of the two"))
    for name, value, allowed in (("policy", refill.policy, host.refill_policies),
                                 ("on_exhaust", refill.on_exhaust, host.exhaust_policies)):
        if allowed is not None and value not in allowed:
            issues.append(ConfigIssue(f"{key}.refill.{name}", f"{value!r} cannot be carried out by host {host.name!r}"
                                      f"{host.why_not(f'refill.{name}')}", sorted(allowed)))
    if any(m.resolved is None for m in cfg.methods):
        return issues  # the unresolved method was reported already
    if not any(m.resolved is not None and m.resolved.event == "on_rollout" and mechanism(m.mechanism).drops_rows
               for m in cfg.methods):
        issues.append(ConfigIssue(f"{key}.refill", "dynamic sampling refills the groups an on_rollout selection drops, "
                                  "but no method of this block selects at on_rollout (a select method whose selector "
                                  "keeps or drops whole groups, such as dapo or threshold_band on group_solve_rate)"))
    return issues


def _check_stack(cfg: DataflexConfig, classes: list[_Classes | None], key: str) -> list[ConfigIssue]:
    """Rules between the methods of a stack (one method passes trivially): each mechanism's ``per_block`` and
    its own stack rules."""
    issues: list[ConfigIssue] = []
    keys = method_keys(cfg, key)
    for mech in mechanisms():
        mine = [(k, m, found) for k, m, found in zip(keys, cfg.methods, classes) if m.mechanism == mech.name]
        if mech.per_block is not None and len(mine) > mech.per_block:
            issues.append(ConfigIssue(mine[mech.per_block][0], f"a stack may hold {mech.per_block_reason}; "
                                      f"{mine[0][0]} already uses mechanism {mech.name!r}"))
        issues.extend(mech.check_stack([(k, found[1]) for k, _, found in mine if found is not None]))
    return issues


def _check_block(cfg: DataflexConfig, classes: list[_Classes | None], key: str) -> list[ConfigIssue]:
    """Each actuator's rules between its method and the others of the block (:meth:`Actuator.check_block`),
    over the methods that validated."""
    block = [(k, m) for k, m in zip(method_keys(cfg, key), cfg.methods) if m.resolved is not None]
    issues: list[ConfigIssue] = []
    for (k, method), found in zip(zip(method_keys(cfg, key), cfg.methods), classes):
        if found is not None and method.resolved is not None:
            issues.extend(found[1].check_block(k, method, block))
    return issues


def _stack_warnings(cfg: DataflexConfig, classes: list[tuple[type[Scorer], type[Actuator]] | None],
                    key: str) -> list[ConfigIssue]:
    """A scorer other than the statistic the actuator is defined on; a method reading advantages that a
    later method at the same event recomputes."""
    warnings: list[ConfigIssue] = []
    keys = method_keys(cfg, key)
    for method, found, mkey in zip(cfg.methods, classes, keys):
        intended = getattr(found[1], "intended_scorers", ()) if found is not None else ()
        if intended and method.resolved is not None and method.resolved.scorer.name not in intended:
            warnings.append(ConfigIssue(
                f"{mkey}.scorer.name", f"{method.actuator.name!r} is defined on the statistic of "
                f"{' or '.join(repr(n) for n in intended)}; with {method.scorer.name!r} it acts on another "
                "quantity than its paper's (valid, but read its documentation)"))
    mixers = [k for k, m in zip(keys, cfg.methods) if mechanism(m.mechanism).samples_domains]
    selections = [k for k, m in zip(keys, cfg.methods) if mechanism(m.mechanism).drops_rows]
    if mixers and selections:
        warnings.append(ConfigIssue(mixers[0], f"the mixer sees only the rows {', '.join(selections)} keep(s): "
                                    "a domain whose groups are always dropped gives it no statistics"))
    for i, (method, found) in enumerate(zip(cfg.methods, classes)):
        if found is None or method.resolved is None:
            continue
        reads_advantages = "advantages" in (*found[0].requires, *getattr(found[1], "requires", ()))
        for j in range(i + 1, len(cfg.methods)):
            later, later_found = cfg.methods[j], classes[j]
            if (reads_advantages and later_found is not None and later.resolved is not None
                    and later.resolved.event == method.resolved.event
                    and getattr(later_found[1], "rewrites_advantages", False)):
                warnings.append(ConfigIssue(keys[i], f"reads advantages that {keys[j]} (later, same event) "
                                            "recomputes; list it after that method to read the new ones"))
    return warnings


def _selection_warnings(cfg: DataflexConfig, key: str, n: int, built: _Built) -> list[ConfigIssue]:
    """Run the block's selections, in order, on a probe batch holding one group per number of right
    rollouts (0..g of g, binary rewards; :mod:`.probe`, bounded whatever ``n`` is): a selection that keeps
    nothing of what reaches it would skip every update, one that keeps everything does nothing. Advisory: a
    component that cannot run on the probe (fields it lacks, state it expects) ends the probe without a
    warning."""
    # Token selections keep rows (only their tokens vary): the probe's row outcomes say nothing of them.
    selects = [i for i, m in enumerate(cfg.methods)
               if m.resolved is not None and issubclass(cls := m.resolved.actuator.load(), Selector)
               and not cls.selects_tokens]
    # An allocator's continuation rounds grow the groups after on_rollout (Reinforce-Ada): a later selection
    # sees those pools, not the probe's groups of one round.
    if any(m.resolved is not None and m.resolved.event == "on_rollout"
           and issubclass(a := m.resolved.actuator.load(), Allocator) and a.rounds > 1 for m in cfg.methods):
        selects = [i for i in selects if (r := cfg.methods[i].resolved) is not None
                   and r.event in ("on_prompts", "on_rollout")]
    if not selects or n < 2:
        return []
    import torch

    from .decision import Decision
    from .probe import outcome_probe, probe_group_size

    keys = method_keys(cfg, key)
    batch = outcome_probe(n)
    g = probe_group_size(n)
    outcomes = f"0..{g} of {g} rollouts right, rewards 0/1" + (f"; groups of {g} standing in for n={n}"
                                                             if g < n else "")
    decision = Decision()
    view, warnings = batch, list[ConfigIssue]()
    for i in selects:
        found = cfg.methods[i].resolved
        assert found is not None
        try:
            method = cfg.methods[i]
            scorer = built.get(method, "scorer", found.scorer.load(), found.scorer_params)
            selector = built.get(method, "actuator", found.actuator.load(), found.actuator_params)
            assert isinstance(scorer, Scorer) and isinstance(selector, Selector)
            scorer.name, selector.name = found.scorer.name, found.actuator.name  # as warnings name them
            score = as_score(scorer.score(view, 0), scorer, view)
            keep = selector.select(view, score, 0).keep.to(torch.bool) & view.valid_rows
        except (Exception, SystemExit):  # sys.exit in a plugin must not end `validate` or `run` with 0
            return warnings
        if not bool(keep.any()):
            before = " of what the methods before it leave" if decision.keep is not None else ""
            warnings.append(ConfigIssue(keys[i], f"keeps no row{before} in a probe batch holding every outcome "
                                        f"of a group ({outcomes}): every update "
                                        "would be skipped; check the parameters"))
            return warnings
        if bool(keep[view.valid_rows].all()):
            warnings.append(ConfigIssue(keys[i], f"keeps every row of a probe batch holding every outcome of a "
                                        f"group ({outcomes}): it would select "
                                        "nothing away; check the parameters"))
        decision.restrict(keep)
        view = batch.derive(is_padding=batch.is_padding | ~keep)
    return warnings


def installed_registry() -> Registry:
    """The components of every installed, enabled plugin plus in-process registrations."""
    from .discovery import get_plugins

    return get_plugins().registry()
