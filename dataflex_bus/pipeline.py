"""A configured method: one scorer times one actuator under one mechanism, wired to one bus event.

:func:`validate` checks a ``dataflex`` block against the installed plugins without training;
:func:`build_pipeline` builds the components by name. :meth:`Pipeline.apply` runs the method on a
:class:`~dataflex_bus.Batch` and returns a :class:`Decision` (keep mask, recomputed advantages,
per-token weights, domain probabilities, metrics) for the host loop to carry out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .components import MECHANISM_KIND, TIMINGS, Component, Mixer, Reweighter, Score, Scorer, Selector, as_score
from .config import DataflexConfig
from .errors import (
    BatchFieldError,
    CollisionError,
    ConfigError,
    ConfigIssue,
    DataflexError,
    PluginLoadError,
    PluginRuntimeError,
    UnknownComponentError,
)
from .hookspecs import EVENTS, hookimpl

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .registry import ComponentSpec, Registry

log = logging.getLogger("dataflex_bus")

#: Fields the host can provide at each event (verl's names). ``uid``/``data_source`` are row labels.
EVENT_FIELDS: dict[str, frozenset[str]] = {
    "on_rollout": frozenset({"prompts", "responses", "response_mask", "loss_mask", "attention_mask",
                             "input_ids", "rm_scores", "rollout_log_probs", "uid", "data_source"}),
}
EVENT_FIELDS["on_advantage"] = EVENT_FIELDS["on_rollout"] | {
    "old_log_probs", "ref_log_prob", "advantages", "returns", "rollout_is_weights", "entropy", "values",
    "token_level_rewards"}
EVENT_FIELDS["on_step_end"] = EVENT_FIELDS["on_advantage"]

#: verl advantage estimators that use one rollout per prompt (no groups).
NON_GROUP_ESTIMATORS = frozenset({"gae", "reinforce_plus_plus", "remax"})

_TIMING_ORDER = list(TIMINGS)


class Decision:
    """What the participants decided at one event; the host loop carries it out.

    ``keep``: bool ``[B]`` rows to keep (``None``: all). ``advantages``: recomputed ``[B, T]`` (subset
    selectors). ``weights``: ``[B, T]`` multiplied into ``rollout_is_weights`` (1 on tokens that do not
    count). ``domain_probs``: sampling probabilities for the next prompts (mix). ``skip_update``: the
    empty-selection policy asked to skip this step's policy update. ``metrics``: ``dataflex/...``.
    """

    __slots__ = ("advantages", "domain_probs", "keep", "metrics", "skip_update", "weights")

    def __init__(self) -> None:
        self.keep: Tensor | None = None
        self.advantages: Tensor | None = None
        self.weights: Tensor | None = None
        self.domain_probs: dict[str, float] | None = None
        self.skip_update = False
        self.metrics: dict[str, float] = {}

    @property
    def acted(self) -> bool:
        return (self.keep is not None or self.advantages is not None or self.weights is not None
                or self.domain_probs is not None or self.skip_update)

    def __repr__(self) -> str:
        keep = None if self.keep is None else f"{int(self.keep.sum())}/{self.keep.numel()}"
        return (f"Decision(keep={keep}, advantages={self.advantages is not None}, "
                f"weights={self.weights is not None}, domain_probs={self.domain_probs}, "
                f"skip_update={self.skip_update})")


# ---------------------------------------------------------------------------- validation
def _event_of(timing: str) -> str:
    return TIMINGS[timing]


def pipeline_event(mechanism: str, scorer_cls: type[Scorer], actuator_cls: type[Component]) -> str:
    """The bus event a pipeline subscribes to, from the mechanism and the components' timings."""
    if mechanism == "mix":
        return "on_step_end"
    if mechanism == "reweight":
        return "on_advantage"
    latest = max(_TIMING_ORDER.index(scorer_cls.timing), _TIMING_ORDER.index(actuator_cls.min_timing))
    event = _event_of(_TIMING_ORDER[latest])
    if event == "on_rollout" and not (issubclass(actuator_cls, Selector)
                                      and actuator_cls.keeps_whole_groups(scorer_cls.granularity)):
        # Row-level drops before the advantage would shift the GRPO baseline of the rows left.
        event = "on_advantage"
    return event


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


def validate(
    config: DataflexConfig | Mapping[str, Any],
    registry: Registry | None = None,
    *,
    context: Mapping[str, Any] | None = None,
    key: str = "dataflex",
) -> DataflexConfig:
    """Check a ``dataflex`` block against the installed components; raises :class:`ConfigError`.

    ``context`` describes the host when known: ``adv_estimator`` (verl's ``algorithm.adv_estimator``),
    ``rollout_n`` (responses per prompt) and ``available_fields`` ({event: fields}) to override
    :data:`EVENT_FIELDS`.
    """
    if isinstance(config, DataflexConfig):
        cfg, issues = config, []
    else:
        parsed, issues = DataflexConfig.parse(config, key=key)
        if parsed is None:
            raise ConfigError(issues)
        cfg = parsed
    registry = registry if registry is not None else _default_registry()
    context = dict(context or {})
    _, s_cls = _resolve(registry, "scorer", cfg.scorer.name, f"{key}.scorer.name", issues)
    a_spec, a_cls = _resolve(registry, "actuator", cfg.actuator.name, f"{key}.actuator.name", issues)
    wanted_kind = MECHANISM_KIND[cfg.mechanism]
    if a_spec is not None and a_spec.kind != wanted_kind:
        fitting = registry.names("actuator", [wanted_kind])
        issues.append(ConfigIssue(
            f"{key}.actuator.name",
            f"{cfg.actuator.name!r} is a {a_spec.kind}, but mechanism {cfg.mechanism!r} needs a {wanted_kind}",
            fitting))
        a_cls = None
    from .components import resolve_params

    if s_cls is not None:
        issues.extend(resolve_params(s_cls, cfg.scorer.params, key=f"{key}.scorer.params")[1])
    if a_cls is not None:
        issues.extend(resolve_params(a_cls, cfg.actuator.params, key=f"{key}.actuator.params")[1])
    if s_cls is not None and a_cls is not None:
        issues.extend(_check_fit(cfg, s_cls, a_cls, context, key))
    if not issues and cfg.mechanism == "mix" and cfg.domains:
        # Rules that join parameters and domains (a floor times K, proportions naming every domain)
        # are checked by the mixer's own set_domains, here rather than at the first training step.
        try:
            a_cls(**cfg.actuator.params).set_domains(list(cfg.domains))
        except ConfigError as exc:
            issues.extend(exc.issues)
    if issues:
        raise ConfigError(issues)
    return cfg


def _check_fit(cfg: DataflexConfig, s_cls: type[Scorer], a_cls: type[Component],
               context: Mapping[str, Any], key: str) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    sname, aname = cfg.scorer.name, cfg.actuator.name
    if s_cls.granularity not in a_cls.accepts:
        issues.append(ConfigIssue(
            f"{key}.scorer.name",
            f"scorer {sname!r} gives {s_cls.granularity}-level scores but {a_cls.kind} {aname!r} acts on "
            f"{' or '.join(a_cls.accepts)}-level scores", a_cls.accepts))
    if cfg.mechanism in ("select",) and _TIMING_ORDER.index(s_cls.timing) > _TIMING_ORDER.index("post_advantage"):
        issues.append(ConfigIssue(f"{key}.scorer.name",
                                  f"scorer {sname!r} runs {s_cls.timing}, after the update it would select for"))
    if cfg.mechanism == "reweight" and s_cls.timing == "post_update":
        issues.append(ConfigIssue(f"{key}.scorer.name",
                                  f"scorer {sname!r} runs post_update, after the loss it would reweight"))
    fields_at = dict(EVENT_FIELDS)
    fields_at.update(context.get("available_fields") or {})
    for who, cls in (("scorer", s_cls), ("actuator", a_cls)):
        timing = cls.timing if who == "scorer" else None
        event = _event_of(timing) if timing else pipeline_event(cfg.mechanism, s_cls, a_cls)
        missing = [f for f in cls.requires if f not in fields_at[event]]
        if missing:
            issues.append(ConfigIssue(
                f"{key}.{who}.name",
                f"{cls.kind} {getattr(cfg, who).name!r} requires {missing}, not available at {event} "
                f"(timing {timing or cls.min_timing})", sorted(fields_at[event])))
    estimator = context.get("adv_estimator")
    for who, cls in (("scorer", s_cls), ("actuator", a_cls)):
        if not cls.needs_groups:
            continue
        if estimator is not None and str(estimator) in NON_GROUP_ESTIMATORS:
            issues.append(ConfigIssue(
                f"{key}.{who}.name",
                f"{getattr(cfg, who).name!r} needs groups of rollouts per prompt, but the advantage "
                f"estimator {estimator!r} is not group-based",
                ["grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline", "opo"]))
        n = context.get("rollout_n")
        if n is not None and int(n) < 2:
            issues.append(ConfigIssue(f"{key}.{who}.name",
                                      f"{getattr(cfg, who).name!r} needs groups, but rollout n={n} (< 2)"))
    return issues


def _default_registry() -> Registry:
    from .discovery import get_plugins

    return get_plugins().registry()


# ---------------------------------------------------------------------------- building
def build_component(slot: str, name: str, params: Mapping[str, Any] | None = None,
                    registry: Registry | None = None) -> Component:
    """Build one installed component by name (``scorer`` or ``actuator`` slot) with checked params."""
    registry = registry if registry is not None else _default_registry()
    spec = registry.resolve(slot, name)
    cls = spec.load()
    instance = cls(**dict(params or {}))
    instance.name = spec.name
    return instance


def build_pipeline(config: DataflexConfig | Mapping[str, Any], registry: Registry | None = None, *,
                   context: Mapping[str, Any] | None = None) -> Pipeline:
    """Validate a ``dataflex`` block and build its pipeline."""
    registry = registry if registry is not None else _default_registry()
    cfg = validate(config, registry, context=context)
    s_spec = registry.resolve("scorer", cfg.scorer.name)
    a_spec = registry.resolve("actuator", cfg.actuator.name)
    scorer = s_spec.load()(**cfg.scorer.params)
    scorer.name = s_spec.name
    actuator = a_spec.load()(**cfg.actuator.params)
    actuator.name = a_spec.name
    return Pipeline(cfg, scorer, actuator, provenance={"scorer": s_spec.qualified_name,
                                                      "actuator": a_spec.qualified_name})


class Pipeline:
    """A built method. Register it on an :class:`~dataflex_bus.EventBus` as the participant, or call
    :meth:`apply` directly."""

    def __init__(self, config: DataflexConfig, scorer: Scorer, actuator: Component,
                 provenance: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.scorer = scorer
        self.actuator = actuator
        self.provenance = dict(provenance or {})
        self.event = pipeline_event(config.mechanism, type(scorer), type(actuator))
        self.domain_probs: dict[str, float] | None = None
        self.counters = {"empty_selections": 0, "nonfinite_rows": 0}
        if isinstance(actuator, Mixer) and config.domains:
            self.set_domains(config.domains)

    @property
    def label(self) -> str:
        return f"{self.config.mechanism}:{self.scorer.name}+{self.actuator.name}"

    # -------------------------------------------------------------- mix support
    def set_domains(self, domains: Sequence[str]) -> None:
        """Tell a mixer the dataset's domain names (in the sampler's order); starts uniform."""
        if not isinstance(self.actuator, Mixer):
            return
        if self.config.domains and list(domains) != list(self.config.domains):
            missing = sorted(set(self.config.domains) - set(domains))
            if missing:
                raise ConfigError(ConfigIssue("dataflex.domains", f"domains {missing} are not in the dataset",
                                              list(domains)))
            domains = self.config.domains
        self.actuator.set_domains(list(domains))
        self.domain_probs = {d: 1.0 / len(domains) for d in domains}

    def domain_probabilities(self) -> dict[str, float] | None:
        """Current sampling probabilities per domain (``None`` unless mechanism is mix)."""
        return None if self.domain_probs is None else dict(self.domain_probs)

    # -------------------------------------------------------------- the method
    def apply(self, batch: Batch, step: int, decision: Decision | None = None) -> Decision:
        """Run scorer and actuator on ``batch`` and fill ``decision`` (a new one if not given)."""
        decision = decision if decision is not None else Decision()
        mech = self.config.mechanism
        warm = step < self.config.warmup_step
        metrics = decision.metrics
        metrics["dataflex/warmup"] = float(warm)
        if mech == "mix":
            self._apply_mix(batch, step, decision, warm)
            return decision
        if warm:
            return decision
        batch, score = self._score(batch, step, metrics)
        if mech == "select":
            self._apply_select(batch, score, step, decision)
        else:
            self._apply_reweight(batch, score, step, decision)
        return decision

    def _call(self, who: str, fn: Any, *args: Any) -> Any:
        """Call a component method; any failure names the component's plugin and the event."""
        try:
            if who == "scorer":
                return as_score(fn(*args, event=self.event), self.scorer, args[0])
            return fn(*args)
        except PluginRuntimeError:
            raise
        except Exception as exc:
            component = self.scorer if who == "scorer" else self.actuator
            raise PluginRuntimeError(self.provenance.get(who, component.name), self.event, exc) from exc

    def _score(self, batch: Batch, step: int, metrics: dict[str, float]) -> tuple[Batch, Score]:
        import torch

        name = f"scorer {self.scorer.name!r}"
        batch.require(name, self.scorer.requires)
        batch.require(f"actuator {self.actuator.name!r}", self.actuator.requires)
        score = self._call("scorer", self.scorer.score, batch, step)
        values = score.values
        bad = batch.nonfinite_rows(values) if values.dim() >= 1 and values.shape[0] == len(batch) else None
        if bad is not None:
            if self.config.on_nonfinite == "error":
                rows = torch.nonzero(bad).flatten()[:5].tolist()
                raise BatchFieldError(name, "score", f"non-finite score (NaN/inf) on rows {rows}; "
                                      "fix the input or set dataflex.on_nonfinite=drop")
            count = int(bad.sum())
            self.counters["nonfinite_rows"] += count
            metrics["dataflex/nonfinite_rows"] = float(count)
            # Dropped rows become padding, so no statistic, group or normalisation counts them.
            batch = batch.derive(is_padding=batch.is_padding | bad)
            score = self._call("scorer", self.scorer.score, batch, step)
        for k, v in score.metrics.items():
            metrics[f"dataflex/{k}"] = float(v)
        return batch, score

    def _apply_select(self, batch: Batch, score: Score, step: int, decision: Decision) -> None:
        import torch

        assert isinstance(self.actuator, Selector)
        sel = self._call("actuator", self.actuator.select, batch, score, step)
        keep = sel.keep.to(torch.bool) & batch.valid_rows
        if keep.shape != (len(batch),):
            raise BatchFieldError(f"selector {self.actuator.name!r}", "keep",
                                  f"expected shape ({len(batch)},), got {tuple(keep.shape)}")
        metrics = decision.metrics
        real = int(batch.valid_rows.sum())
        kept = int(keep.sum())
        tokens = batch.lengths
        metrics["dataflex/kept_fraction"] = kept / real if real else 0.0
        metrics["dataflex/kept_rows"] = float(kept)
        metrics["dataflex/kept_tokens"] = float(tokens[keep].sum()) if "response_mask" in batch.fields else 0.0
        metrics["dataflex/kept_groups"] = float(torch.unique(batch.group_index[keep]).numel())
        for k, v in sel.metrics.items():
            metrics[f"dataflex/{k}"] = float(v)
        if kept == 0 and real > 0:
            self.counters["empty_selections"] += 1
            metrics["dataflex/empty_selection"] = 1.0
            policy = self.config.on_empty
            if policy == "error":
                raise DataflexError(f"selector {self.actuator.name!r} kept no row at step {step} "
                                    "(dataflex.on_empty=error)")
            n = self.counters["empty_selections"]
            # Warn on the 1st, 2nd, 4th, 8th ... empty step: visible, counted, but no log flood.
            if n & (n - 1) == 0:
                action = "keeping all rows" if policy == "keep_all" else "skipping this step's update"
                log.warning("dataflex: %s kept no row at step %d; %s (on_empty=%s; %d empty step(s) so far, "
                            "counted in dataflex/empty_selection)", self.actuator.name, step, action, policy, n)
            if policy == "keep_all":
                return
            decision.skip_update = True
        else:
            metrics["dataflex/empty_selection"] = 0.0
        if self.event == "on_rollout":
            self._check_whole_groups(batch, keep)
        decision.keep = keep if decision.keep is None else decision.keep & keep
        if sel.advantages is not None:
            batch.check_finite(f"selector {self.actuator.name!r}", "advantages", sel.advantages)
            decision.advantages = sel.advantages

    def _check_whole_groups(self, batch: Batch, keep: Tensor) -> None:
        """At ``on_rollout`` a selector must keep or drop whole groups (it promised to)."""
        import torch

        from .ops import segment_max, segment_min

        k = keep.to(torch.float32)
        gi, n = batch.group_index, batch.num_groups
        split = segment_max(k, gi, n) != segment_min(k, gi, n)
        if bool(split.any()):
            raise BatchFieldError(f"selector {self.actuator.name!r}", "keep",
                                  f"split {int(split.sum())} group(s) at on_rollout although it declares "
                                  "keeps_whole_groups; dropping part of a group before the advantage would "
                                  "change the GRPO baseline of the rest")

    def _apply_reweight(self, batch: Batch, score: Score, step: int, decision: Decision) -> None:
        assert isinstance(self.actuator, Reweighter)
        out = self._call("actuator", self.actuator.reweight, batch, score, step)
        w, stats = _neutral_weights(out.weights, batch, f"reweighter {self.actuator.name!r}")
        decision.weights = w if decision.weights is None else decision.weights * w
        metrics = decision.metrics
        if stats is not None:
            n_real, total, sq, hi, lo = stats
            mean = total / n_real
            var = max(sq - n_real * mean * mean, 0.0) / (n_real - 1) if n_real > 1 else 0.0
            metrics["dataflex/weight_mean"] = mean
            metrics["dataflex/weight_std"] = var ** 0.5
            metrics["dataflex/weight_max"] = hi
            metrics["dataflex/weight_min"] = lo
        for k, v in out.metrics.items():
            metrics[f"dataflex/{k}"] = float(v)

    def _apply_mix(self, batch: Batch, step: int, decision: Decision, warm: bool) -> None:
        assert isinstance(self.actuator, Mixer)
        if self.domain_probs is None:
            self.set_domains(self.config.domains or batch.domain_names)
        batch = batch.with_domain_names(self.actuator.domains)
        metrics = decision.metrics
        if (step + 1) % self.config.update_step == 0:
            batch, score = self._score(batch, step, metrics)
            for k, v in self._call("actuator", self.actuator.update, batch, score, step).items():
                metrics[f"dataflex/{k}"] = float(v)
            if step + 1 >= self.config.warmup_step:
                probs = self._call("actuator", self.actuator.probabilities)
                self.domain_probs = {d: float(p) for d, p in zip(self.actuator.domains, probs.tolist())}
        decision.domain_probs = dict(self.domain_probs or {})
        for d, p in decision.domain_probs.items():
            metrics[f"dataflex/domain_prob/{d}"] = p

    # -------------------------------------------------------------- bus participation
    @hookimpl
    def on_rollout(self, batch: Batch, step: int, decision: Decision) -> None:
        if self.event == "on_rollout":
            self.apply(batch, step, decision)

    @hookimpl
    def on_advantage(self, batch: Batch, step: int, decision: Decision) -> None:
        if self.event == "on_advantage":
            self.apply(batch, step, decision)

    @hookimpl
    def on_step_end(self, batch: Batch, step: int, decision: Decision) -> None:
        if self.event == "on_step_end":
            self.apply(batch, step, decision)

    # -------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "scorer": self.scorer.state_dict(),
            "actuator": self.actuator.state_dict(),
            "domain_probs": self.domain_probs,
            "domains": getattr(self.actuator, "domains", None),
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("config")
        if saved is not None and saved != self.config.to_dict():
            raise ConfigError(ConfigIssue("dataflex", "checkpoint was written with a different dataflex config: "
                                          f"saved {saved}, now {self.config.to_dict()}"))
        if state.get("domains") is not None and isinstance(self.actuator, Mixer):
            self.actuator.set_domains(state["domains"])
        self.scorer.load_state_dict(state.get("scorer") or {})
        self.actuator.load_state_dict(state.get("actuator") or {})
        self.domain_probs = state.get("domain_probs")
        self.counters.update(state.get("counters") or {})



_BAD_WEIGHTS = "weights must be finite and non-negative on real tokens"


def _neutral_weights(w: Tensor, batch: Batch, who: str) -> tuple[Tensor, tuple[int, float, float, float, float] | None]:
    """Check a reweighter's ``[B]`` or ``[B, T]`` weights on real tokens and expand them to ``[B, T]`` float32
    with 1 on every other token. Returns the weights and ``(n_real, sum, sum of squares, max, min)`` over
    real tokens (``None`` without real tokens), computed without boolean-indexed ``[B, T]`` copies: this
    runs on every step of a reweight method, on the largest tensors of the batch."""
    import torch

    tm = batch.token_mask
    if tuple(w.shape) not in ((len(batch),), tuple(tm.shape)):
        raise BatchFieldError(who, "weights",
                              f"expected shape {tuple(tm.shape)} or ({len(batch)},), got {tuple(w.shape)}")
    lengths = batch.lengths
    n_real = int(lengths.sum())
    if w.dim() == 1:
        # Row weights: check and summarise on [B] (each row counted once per real token), expand once.
        has_tokens = lengths > 0
        wr, lr = w[has_tokens].double(), lengths[has_tokens].double()
        if wr.numel() and (not bool(torch.isfinite(wr).all()) or bool((wr < 0).any())):
            raise BatchFieldError(who, "weights", _BAD_WEIGHTS)
        stats = None
        if n_real:
            stats = (n_real, float((wr * lr).sum()), float((wr * wr * lr).sum()), float(wr.max()), float(wr.min()))
        return torch.where(tm, w.to(torch.float32)[:, None], 1.0), stats
    w = w.to(torch.float32)
    if not n_real:
        return torch.ones_like(w), None
    # Token weights: fill non-real tokens with one real token's own weight, so whole-tensor reductions
    # give the real tokens' min/max exactly; the sums are corrected for the fill.
    row = int(torch.nonzero(lengths > 0)[0])
    fill = w[row][tm[row]][0]
    wf = torch.where(tm, w, fill)
    lo, hi = torch.aminmax(wf)
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))) or float(lo) < 0:
        raise BatchFieldError(who, "weights", _BAD_WEIGHTS)
    n_fill, f = wf.numel() - n_real, float(fill)
    # Row-wise float32 reductions, combined in float64 (a float64 whole-tensor sum would copy).
    total = float(wf.sum(-1).double().sum()) - f * n_fill
    sq = float(torch.linalg.vector_norm(wf, dim=-1).double().square().sum()) - f * f * n_fill
    # In place on our own copy (no [B, T] ~mask temporary): non-real tokens -> 1.
    return torch.where(tm, wf, torch.ones((), dtype=wf.dtype), out=wf), (n_real, total, sq, float(hi), float(lo))

assert set(EVENTS) == set(EVENT_FIELDS)
