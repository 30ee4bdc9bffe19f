"""Check a ``dataflex`` block against the installed components, before anything trains.

:func:`validate` resolves every method's scorer and actuator by name, checks their parameters, the
mechanism, the fields they need at the event they will run at and the host they will run in, and the
rules of a method stack; it reports every problem at once, each keyed by its config key. What it
resolved (component specs, checked parameters, the event) travels with the returned config, so building
the pipeline neither resolves nor validates again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .block import DataflexConfig, MethodConfig
from .components import MECHANISM_KIND, TIMINGS, Actuator, Mixer, Scorer, Selector, as_score, resolve_params
from .errors import CollisionError, ConfigError, ConfigIssue, PluginLoadError, UnknownComponentError
from .history import FIELDS as HISTORY_FIELDS
from .history import VisitClasses

if TYPE_CHECKING:
    from .registry import ComponentSpec, Registry

#: Fields the host can provide at each event (verl's names). ``uid``/``data_source`` are row labels. At
#: ``on_prompts`` a row is a candidate prompt: its id and history, nothing about responses.
EVENT_FIELDS: dict[str, frozenset[str]] = {
    "on_prompts": HISTORY_FIELDS | {"uid", "data_source"},
    "on_rollout": frozenset({"prompts", "responses", "response_mask", "loss_mask", "attention_mask",
                             "input_ids", "rm_scores", "rollout_log_probs", "uid", "data_source"}),
}
EVENT_FIELDS["on_advantage"] = EVENT_FIELDS["on_rollout"] | {
    "old_log_probs", "ref_log_prob", "advantages", "returns", "rollout_is_weights", "entropy", "values",
    "token_level_rewards"}
EVENT_FIELDS["on_step_end"] = EVENT_FIELDS["on_advantage"]

#: verl advantage estimators that use one rollout per prompt (no groups).
NON_GROUP_ESTIMATORS = frozenset({"gae", "reinforce_plus_plus", "remax"})
GROUP_ESTIMATORS = ("grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline", "opo")

_TIMING_ORDER = list(TIMINGS)


@dataclass(frozen=True)
class Resolved:
    """What validation found for one method: the providing specs, checked parameters and the event."""

    scorer: ComponentSpec
    actuator: ComponentSpec
    scorer_params: dict[str, Any]
    actuator_params: dict[str, Any]
    event: str


def method_event(mechanism: str, scorer_cls: type[Scorer], actuator_cls: type[Actuator]) -> str:
    """The bus event a method acts at, from its mechanism and its components' timings."""
    if mechanism == "mix":
        return "on_step_end"
    if mechanism == "reweight":
        return "on_advantage"
    latest = max(_TIMING_ORDER.index(scorer_cls.timing), _TIMING_ORDER.index(actuator_cls.min_timing))
    event = TIMINGS[_TIMING_ORDER[latest]]
    if event == "on_rollout" and not (issubclass(actuator_cls, Selector)
                                      and actuator_cls.keeps_whole_groups(scorer_cls.granularity)):
        # Row-level drops before the advantage would shift the GRPO baseline of the rows left.
        event = "on_advantage"
    return event


def method_keys(config: DataflexConfig, key: str = "dataflex") -> list[str]:
    """The config key of each method: the block itself, or ``dataflex.methods[i]`` in a stack."""
    if config.stacked:
        return [f"{key}.methods[{i}]" for i in range(len(config.methods))]
    return [key]


def validate(
    config: DataflexConfig | Mapping[str, Any],
    registry: Registry | None = None,
    *,
    context: Mapping[str, Any] | None = None,
    key: str = "dataflex",
) -> DataflexConfig:
    """Check a ``dataflex`` block against the installed components; raises :class:`ConfigError` with
    every problem. Returns the config with each method's resolution attached (``method.resolved``).

    ``context`` describes the host when known: ``adv_estimator`` (verl's ``algorithm.adv_estimator``),
    ``rollout_n`` (responses per prompt) and ``available_fields`` ({event: fields}) to override
    :data:`EVENT_FIELDS`.
    """
    issues: list[ConfigIssue]
    if isinstance(config, DataflexConfig):
        cfg, issues = config, []
    else:
        parsed, issues = DataflexConfig.parse(config, key=key)
        if parsed is None:
            raise ConfigError(issues)
        cfg = parsed
    registry = registry if registry is not None else installed_registry()
    context = dict(context or {})
    classes: list[tuple[type[Scorer], type[Actuator]] | None] = []
    for method, mkey in zip(cfg.methods, method_keys(cfg, key)):
        found = _validate_method(method, cfg, registry, context, mkey, issues)
        classes.append(found)
    issues.extend(_check_stack(cfg, classes, key))
    issues.extend(_check_history(cfg, classes, key))
    issues.extend(_check_refill(cfg, key))
    if issues:
        raise ConfigError(issues)
    cfg.warnings = _stack_warnings(cfg, classes, key) + _selection_warnings(cfg, key,
                                                                           int(context.get("rollout_n") or 8))
    return cfg


def _validate_method(method: MethodConfig, cfg: DataflexConfig, registry: Registry, context: Mapping[str, Any],
                     key: str, issues: list[ConfigIssue]) -> tuple[type[Scorer], type[Actuator]] | None:
    before = len(issues)
    s_spec, s_cls = _resolve(registry, "scorer", method.scorer.name, f"{key}.scorer.name", issues)
    a_spec, a_cls = _resolve(registry, "actuator", method.actuator.name, f"{key}.actuator.name", issues)
    wanted_kind = MECHANISM_KIND[method.mechanism]
    if a_spec is not None and a_spec.kind != wanted_kind:
        issues.append(ConfigIssue(
            f"{key}.actuator.name",
            f"{method.actuator.name!r} is a {a_spec.kind}, but mechanism {method.mechanism!r} needs a {wanted_kind}",
            registry.names("actuator", [wanted_kind])))
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
    issues.extend(_check_fit(method, s_cls, a_cls, context, key))
    if len(issues) > before:
        return None
    if method.mechanism == "mix" and cfg.domains:
        # Rules that join parameters and domains (a floor times K, proportions naming every domain)
        # are checked by the mixer's own set_domains, here rather than at the first training step.
        mixer = a_cls(**(a_params or {}))
        assert isinstance(mixer, Mixer)
        try:
            mixer.set_domains(list(cfg.domains))
        except ConfigError as exc:
            issues.extend(exc.issues)
            return None
    assert s_spec is not None and a_spec is not None and s_params is not None and a_params is not None
    method.resolved = Resolved(s_spec, a_spec, s_params, a_params, method_event(method.mechanism, s_cls, a_cls))
    return s_cls, a_cls


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


def _check_fit(method: MethodConfig, s_cls: type[Scorer], a_cls: type[Actuator],
               context: Mapping[str, Any], key: str) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    sname, aname = method.scorer.name, method.actuator.name
    if s_cls.granularity not in a_cls.accepts:
        issues.append(ConfigIssue(
            f"{key}.scorer.name",
            f"scorer {sname!r} gives {s_cls.granularity}-level scores but {a_cls.kind} {aname!r} acts on "
            f"{' or '.join(a_cls.accepts)}-level scores", a_cls.accepts))
    if s_cls.timing == "pre_rollout":
        issues.extend(_check_pre_rollout(method, s_cls, a_cls, key))
    elif a_cls.uses_history and any(f.startswith("history_") for f in getattr(a_cls, "requires", ())):
        issues.append(ConfigIssue(f"{key}.scorer.name", f"{a_cls.kind} {aname!r} selects prompts before generation "
                                  f"from their history; scorer {sname!r} runs {s_cls.timing}: pair it with a "
                                  "pre_rollout scorer (such as zero_variance_streak)"))
    if method.mechanism == "select" and _TIMING_ORDER.index(s_cls.timing) > _TIMING_ORDER.index("post_advantage"):
        issues.append(ConfigIssue(f"{key}.scorer.name",
                                  f"scorer {sname!r} runs {s_cls.timing}, after the update it would select for"))
    if method.mechanism == "reweight" and s_cls.timing == "post_update":
        issues.append(ConfigIssue(f"{key}.scorer.name",
                                  f"scorer {sname!r} runs post_update, after the loss it would reweight"))
    fields_at = dict(EVENT_FIELDS)
    fields_at.update(context.get("available_fields") or {})
    needs: list[tuple[str, type[Scorer] | type[Actuator], str]] = [
        ("scorer", s_cls, s_cls.timing), ("actuator", a_cls, a_cls.min_timing)]
    for who, cls, timing in needs:
        event = TIMINGS[timing] if who == "scorer" else method_event(method.mechanism, s_cls, a_cls)
        missing = [f for f in cls.requires if f not in fields_at[event]]
        if missing:
            issues.append(ConfigIssue(
                f"{key}.{who}.name",
                f"{cls.kind} {getattr(method, who).name!r} requires {missing}, not available at {event} "
                f"(timing {timing})", sorted(fields_at[event])))
    estimator = context.get("adv_estimator")
    for who, cls, _ in needs:
        if not cls.needs_groups:
            continue
        if estimator is not None and str(estimator) in NON_GROUP_ESTIMATORS:
            issues.append(ConfigIssue(
                f"{key}.{who}.name",
                f"{getattr(method, who).name!r} needs groups of rollouts per prompt, but the advantage "
                f"estimator {estimator!r} is not group-based", GROUP_ESTIMATORS))
        n = context.get("rollout_n")
        if n is not None and int(n) < 2:
            issues.append(ConfigIssue(f"{key}.{who}.name",
                                      f"{getattr(method, who).name!r} needs groups, but rollout n={n} (< 2)"))
    return issues


def _check_pre_rollout(method: MethodConfig, s_cls: type[Scorer], a_cls: type[Actuator],
                       key: str) -> list[ConfigIssue]:
    """A ``pre_rollout`` scorer runs before anything is generated: it can only feed a selection made
    there, by a selector able to act on a score alone."""
    sname = method.scorer.name
    if method.mechanism != "select":
        return [ConfigIssue(f"{key}.scorer.name", f"scorer {sname!r} runs pre_rollout (before generation); only a "
                            f"select method can act there, not mechanism {method.mechanism!r}")]
    issues = []
    if s_cls.needs_groups:
        issues.append(ConfigIssue(f"{key}.scorer.name", f"scorer {sname!r} runs pre_rollout but needs groups of "
                                  "rollouts, which do not exist before generation"))
    event = method_event(method.mechanism, s_cls, a_cls)
    if event != "on_prompts":
        earliest = getattr(a_cls, "min_timing", "post_reward")
        issues.append(ConfigIssue(
            f"{key}.actuator.name",
            f"scorer {sname!r} runs pre_rollout, but {a_cls.kind} {method.actuator.name!r} can act no earlier than "
            f"{earliest} ({event}); pair a pre_rollout scorer with a selector that acts on its score alone"))
    return issues


def _check_history(cfg: DataflexConfig, classes: list[tuple[type[Scorer], type[Actuator]] | None],
                   key: str) -> list[ConfigIssue]:
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
                wanted = cls(**params).visit_classes()
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


def _check_refill(cfg: DataflexConfig, key: str) -> list[ConfigIssue]:
    """Refill tops up what an ``on_rollout`` selection keeps: without one it would never stop early."""
    if cfg.refill is None:
        return []
    if any(m.resolved is not None and m.resolved.event == "on_rollout" and m.mechanism == "select"
           for m in cfg.methods):
        return []
    if any(m.resolved is None for m in cfg.methods):
        return []  # the unresolved method was reported already
    return [ConfigIssue(f"{key}.refill", "dynamic sampling refills the groups an on_rollout selection drops, but no "
                        "method of this block selects at on_rollout (a select method whose selector keeps or "
                        "drops whole groups, such as dapo or threshold_band on group_solve_rate)")]


def _check_stack(cfg: DataflexConfig, classes: list[tuple[type[Scorer], type[Actuator]] | None],
                 key: str) -> list[ConfigIssue]:
    """Rules between the methods of a stack (one method passes trivially)."""
    issues: list[ConfigIssue] = []
    keys = method_keys(cfg, key)
    mixers = [k for k, m in zip(keys, cfg.methods) if m.mechanism == "mix"]
    if len(mixers) > 1:
        issues.append(ConfigIssue(mixers[1], f"a stack may hold one mixer (the sampler draws the next prompts from "
                                  f"one set of domain probabilities); {mixers[0]} already mixes"))
    rewriters = [k for k, found in zip(keys, classes)
                 if found is not None and getattr(found[1], "rewrites_advantages", False)]
    if len(rewriters) > 1:
        issues.append(ConfigIssue(rewriters[1], f"{rewriters[0]} already recomputes advantages over the rows it "
                                  "keeps; two subset selectors would overwrite each other's advantages"))
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
    mixers = [k for k, m in zip(keys, cfg.methods) if m.mechanism == "mix"]
    selections = [k for k, m in zip(keys, cfg.methods) if m.mechanism == "select"]
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


def _selection_warnings(cfg: DataflexConfig, key: str, n: int) -> list[ConfigIssue]:
    """Run the block's selections, in order, on a probe batch holding one group per number of right
    rollouts (0..n of n, binary rewards): a selection that keeps nothing of what reaches it would skip
    every update, one that keeps everything does nothing. Advisory: a component that cannot run on the
    probe (fields it lacks, state it expects) ends the probe without a warning."""
    selects = [i for i, m in enumerate(cfg.methods) if m.mechanism == "select" and m.resolved is not None]
    if not selects or n < 2:
        return []
    import torch

    from .decision import Decision
    from .testing.factories import make_batch

    keys = method_keys(cfg, key)
    rewards = [float(i < k) for k in range(n + 1) for i in range(n)]
    batch = make_batch(groups=n + 1, group_size=n, rewards=rewards, max_len=4, min_len=4, domains=1)
    decision = Decision()
    view, warnings = batch, list[ConfigIssue]()
    for i in selects:
        found = cfg.methods[i].resolved
        assert found is not None
        try:
            scorer = found.scorer.load()(**found.scorer_params)
            selector = found.actuator.load()(**found.actuator_params)
            assert isinstance(scorer, Scorer) and isinstance(selector, Selector)
            score = as_score(scorer.score(view, 0), scorer, view)
            keep = selector.select(view, score, 0).keep.to(torch.bool) & view.valid_rows
        except (Exception, SystemExit):  # sys.exit in a plugin must not end `validate` or `run` with 0
            return warnings
        if not bool(keep.any()):
            before = " of what the methods before it leave" if decision.keep is not None else ""
            warnings.append(ConfigIssue(keys[i], f"keeps no row{before} in a probe batch holding every outcome "
                                        f"of a group (0..{n} of {n} rollouts right, rewards 0/1): every update "
                                        "would be skipped; check the parameters"))
            return warnings
        if bool(keep[view.valid_rows].all()):
            warnings.append(ConfigIssue(keys[i], f"keeps every row of a probe batch holding every outcome of a "
                                        f"group (0..{n} of {n} rollouts right, rewards 0/1): it would select "
                                        "nothing away; check the parameters"))
        decision.restrict(keep)
        view = batch.derive(is_padding=batch.is_padding | ~keep)
    return warnings


def installed_registry() -> Registry:
    """The components of every installed, enabled plugin plus in-process registrations."""
    from .discovery import get_plugins

    return get_plugins().registry()
