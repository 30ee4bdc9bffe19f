"""The configured methods, in order, as one participant on the bus.

:func:`build_pipeline` turns a validated ``dataflex`` block into a :class:`Pipeline`. At each event the
pipeline runs the methods that act there, in list order, each seeing the batch as the previous ones left
it: rows an earlier method dropped are padding to the later ones (in no group, count or statistic), and
advantages an earlier subset selector recomputed are the ones a later method reads. Keep masks AND,
weights multiply, and the one mixer publishes the domain probabilities.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .block import DataflexConfig
from .confdiff import resume_refusal
from .decision import Decision
from .errors import ConfigError, ConfigIssue
from .hookspecs import EVENTS, hookimpl
from .method import Method
from .validation import installed_registry, validate

if TYPE_CHECKING:
    from .batch import Batch
    from .components import Actuator, Component, Scorer
    from .host import HostDescription
    from .registry import ComponentSpec, Registry


def build_component(slot: str, name: str, params: Mapping[str, Any] | None = None,
                    registry: Registry | None = None) -> Component:
    """Build one installed component by name (``scorer`` or ``actuator`` slot) with checked params."""
    registry = registry if registry is not None else installed_registry()
    return _instantiate(registry.resolve(slot, name), params or {})


def _instantiate(spec: ComponentSpec, params: Mapping[str, Any]) -> Any:
    """An instance of ``spec``'s class with ``params``, named as registered."""
    instance = spec.load()(**dict(params))
    instance.name = spec.name
    return instance


def build_pipeline(config: DataflexConfig | Mapping[str, Any], registry: Registry | None = None, *,
                   host: HostDescription | None = None) -> Pipeline:
    """Build the pipeline of a ``dataflex`` block, validating it first (against ``host``) unless
    :func:`validate` already returned it (then nothing is resolved or checked twice)."""
    if not (isinstance(config, DataflexConfig) and all(m.resolved is not None for m in config.methods)):
        config = validate(config, registry, host=host)
    stacked = len(config.methods) > 1
    methods = []
    for m in config.methods:
        found = m.resolved
        assert found is not None
        scorer: Scorer = _instantiate(found.scorer, found.scorer_params)
        actuator: Actuator = _instantiate(found.actuator, found.actuator_params)
        methods.append(Method(m, scorer, actuator, event=found.event, domains=config.domains,
                              provenance={"scorer": found.scorer.qualified_name,
                                          "actuator": found.actuator.qualified_name},
                              prefix=f"dataflex/{m.name}/" if stacked else "dataflex/",
                              refill=config.refill is not None))
    return Pipeline(config, methods)


class Pipeline:
    """Built methods, run in list order at the events they act at. Register it on an
    :class:`~dataflex_bus.EventBus` as the participant, or call :meth:`apply` directly."""

    def __init__(self, config: DataflexConfig, methods: Sequence[Method]) -> None:
        self.config = config
        self.methods = list(methods)
        self._at = {event: [m for m in self.methods if m.event == event] for event in EVENTS}
        mixers = [m for m in self.methods if m.mechanism.samples_domains]
        self.mixer: Method | None = mixers[0] if mixers else None

    # -------------------------------------------------------------- a one-method pipeline reads as its method
    @property
    def method(self) -> Method:
        if len(self.methods) != 1:
            raise AttributeError(f"this pipeline stacks {len(self.methods)} methods; read .methods[i]")
        return self.methods[0]

    @property
    def event(self) -> str:
        return self.method.event

    @property
    def scorer(self) -> Component:
        return self.method.scorer

    @property
    def actuator(self) -> Component:
        return self.method.actuator

    @property
    def provenance(self) -> dict[str, str]:
        return self.method.provenance

    @property
    def counters(self) -> dict[str, int]:
        return self.method.counters

    # -------------------------------------------------------------- running
    def at(self, event: str) -> list[Method]:
        """The methods acting at ``event``, in list order."""
        return self._at[event]

    def apply(self, batch: Batch, step: int, decision: Decision | None = None, *,
              event: str | None = None) -> Decision:
        """Run the methods acting at ``event`` (every method, in list order, when ``None``) on ``batch``
        and fill ``decision`` (a new one if not given)."""
        decision = decision if decision is not None else Decision()
        methods = self.methods if event is None else self._at[event]
        view = batch
        for i, method in enumerate(methods):
            if i:
                view = _as_left(view, decision)
            method.apply(view, step, decision)
        return decision

    @hookimpl
    def on_prompts(self, batch: Batch, step: int, decision: Decision) -> None:
        self.apply(batch, step, decision, event="on_prompts")

    @hookimpl
    def on_rollout(self, batch: Batch, step: int, decision: Decision) -> None:
        self.apply(batch, step, decision, event="on_rollout")

    @hookimpl
    def on_advantage(self, batch: Batch, step: int, decision: Decision) -> None:
        self.apply(batch, step, decision, event="on_advantage")

    @hookimpl
    def on_step_end(self, batch: Batch, step: int, decision: Decision) -> None:
        self.apply(batch, step, decision, event="on_step_end")

    # -------------------------------------------------------------- mix
    def set_domains(self, domains: Sequence[str]) -> None:
        """Tell the mixer (if any) the dataset's domain names, in the sampler's order."""
        if self.mixer is not None:
            self.mixer.set_domains(domains)

    def domain_probabilities(self) -> dict[str, float] | None:
        """The mixer's current sampling probabilities per domain (``None`` without a mixer)."""
        if self.mixer is None or self.mixer.domain_probs is None:
            return None
        return dict(self.mixer.domain_probs)

    # -------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "methods": {m.name: m.state_dict() for m in self.methods}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("config")
        refusal = resume_refusal(saved, self.config.to_dict()) if saved is not None else None
        if refusal is not None:
            raise ConfigError(ConfigIssue("dataflex", refusal))
        states = state.get("methods") or {}
        missing = [m.name for m in self.methods if m.name not in states]
        if missing:
            raise ConfigError(ConfigIssue("dataflex", f"checkpoint holds no state for method(s) {missing} "
                                          f"(it has {sorted(states)})"))
        for m in self.methods:
            m.load_state_dict(states[m.name])


def _as_left(batch: Batch, decision: Decision) -> Batch:
    """``batch`` as the methods so far left it: dropped rows become padding, recomputed advantages
    replace the old ones."""
    if decision.keep is not None:
        batch = batch.derive(is_padding=batch.is_padding | ~decision.keep)
    if decision.advantages is not None:
        batch = batch.with_fields(advantages=decision.advantages)
    return batch
