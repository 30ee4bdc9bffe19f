"""What a host loop talks to for one run: the plugin set, the configured pipeline and the event bus.

Every host builds a :class:`Runtime` from the ``dataflex`` config block and its
:class:`~dataflex_bus.host.HostDescription` (the block is validated against that host), then drives its
steps through the host kit (:mod:`dataflex_bus.steps`), which emits the events, carries out the decisions
and keeps the counters. A host asks the runtime which fields to provide at each event and which domain
probabilities to sample the next prompts from, and saves its state with their checkpoints. So the same
plugin code runs in every host.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from .block import DataflexConfig
from .bus import EventBus
from .components import reads
from .confdiff import resume_refusal
from .decision import Decision
from .discovery import PluginSet, get_plugins
from .errors import ConfigError, ConfigIssue
from .hookspecs import EVENTS
from .host import ANY_HOST, HostDescription
from .mechanisms.select import Selector
from .pipeline import Pipeline, build_pipeline
from .plan import Plan
from .step_parts import RunPart, StepPart, parts_of, run_part_classes

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .block import RefillConfig
    from .history import PromptHistory, PromptTable
    from .predictor import PredictorRun
    from .visits import VisitClasses, Visits

log = logging.getLogger("dataflex_bus")


def warning_text(issue: ConfigIssue) -> str:
    """A block's warning as logged after ``dataflex: ``: its key unless that is the block itself (which would
    read ``dataflex: dataflex: ...``)."""
    text = str(issue)
    return text[len(issue.key) + 2:] if issue.key == "dataflex" else text


class Runtime:
    """Plugins + pipeline + bus for one run on ``host``. ``dataflex`` is the block (a mapping, or the config
    :func:`validate` returned, which is then not validated again) or ``None`` for plain GRPO: events still
    reach observers."""

    def __init__(self, dataflex: DataflexConfig | Mapping[str, Any] | None, *,
                 host: HostDescription | None = None, plugins: PluginSet | None = None,
                 check_writes: bool | None = None) -> None:
        self.host = host if host is not None else ANY_HOST
        self.plugins = plugins if plugins is not None else get_plugins()
        self.pipeline: Pipeline | None = (
            build_pipeline(dataflex, self.plugins.registry(), host=self.host) if dataflex else None
        )
        # check_writes: compare the batch around every bus hook (None: in debug mode, DATAFLEX_DEBUG); see bus.py.
        self.bus = EventBus(self.plugins, check_writes=check_writes)
        #: The block's predictor (``dataflex.predictor``), bound to the prompt table by :meth:`set_prompts`.
        self.predictor: PredictorRun | None = None
        if self.pipeline is not None and self.pipeline.config.predictor is not None:
            from .predictor import build_predictor

            self.predictor = build_predictor(self.pipeline.config.predictor, self.plugins.registry())
        if self.pipeline is not None:
            self.bus.add_participant(self.pipeline, self.name)
        #: What the block asks of the host's modes (draws prompts by row, runs generation again, ...), decided once.
        self.plan = Plan.of(self.pipeline.config if self.pipeline is not None else None)
        self._fields = {event: self._wanted_fields(event) for event in EVENTS}
        for warning in self.pipeline.config.warnings if self.pipeline is not None else ():
            log.warning("dataflex: %s", warning_text(warning))
        self.prompt_table: PromptTable | None = None
        self.history: PromptHistory | None = None
        #: The data-flow mechanisms' parts (:mod:`dataflex_bus.step_parts`): each step's, and the run's by key.
        self.step_parts: tuple[type[StepPart], ...]
        step_parts, run_parts = parts_of(self.pipeline)
        self.step_parts = step_parts
        self.parts: dict[str, RunPart] = {cls.key: cls(self, method) for cls, method in run_parts}
        from .logs import get_logger

        # One short line; the full provenance goes to the host's run record (record()).
        get_logger().info("dataflex.runtime", methods=self.describe(), plugins=self.plugins.pins())

    # -------------------------------------------------------------- what the run is
    @property
    def name(self) -> str:
        """The pipeline's name on the bus: ``scorer+actuator`` provenance per method, ``none`` without."""
        if self.pipeline is None:
            return "none"
        return ",".join(f"{m.provenance.get('scorer', m.scorer.name)}+{m.provenance.get('actuator', m.actuator.name)}"
                        for m in self.pipeline.methods)

    @property
    def mechanisms(self) -> frozenset[str]:
        """The mechanisms of the configured methods (empty for plain GRPO)."""
        if self.pipeline is None:
            return frozenset()
        return frozenset(m.config.mechanism for m in self.pipeline.methods)

    @property
    def domain_key(self) -> str:
        return self.pipeline.config.domain_key if self.pipeline is not None else "data_source"

    @property
    def configured_domains(self) -> list[str] | None:
        return self.pipeline.config.domains if self.pipeline is not None else None

    def describe(self) -> list[str]:
        """One line per method: ``name: scorer+actuator @ event``."""
        if self.pipeline is None:
            return []
        return [f"{m.name}: {m.scorer.name}+{m.actuator.name} @ {m.event}" for m in self.pipeline.methods]

    @property
    def candidates_per_prompt(self) -> float:
        """Candidates a pre-rollout selection wants to see per prompt it keeps, in one draw (a top-B selector's
        pool ratio; 1 otherwise), at most ``dataflex.max_oversample``."""
        if self.pipeline is None:
            return 1.0
        wanted = [m.actuator.candidates_per_prompt() for m in self.pipeline.at("on_prompts")
                  if isinstance(m.actuator, Selector)]
        return min(max(wanted, default=1.0), self.max_oversample)


    @property
    def max_oversample(self) -> float:
        """Candidates considered per prompt needed, at most, when selecting prompts (``dataflex.max_oversample``)."""
        return self.pipeline.config.max_oversample if self.pipeline is not None else 1.0

    @property
    def refill(self) -> RefillConfig | None:
        """``dataflex.refill``: generate more prompts until the on_rollout selection keeps a full batch."""
        return self.pipeline.config.refill if self.pipeline is not None else None

    @property
    def prompt_policy(self) -> str:
        """What a prompt selection short of candidates does (``on_empty`` of the methods at ``on_prompts``;
        ``error`` if any says so)."""
        policies = {m.config.on_empty for m in self.pipeline.at("on_prompts")} if self.pipeline else set()
        return "error" if "error" in policies else "skip"

    def filters_zero_variance(self) -> bool:
        """True when a selector drops zero-variance groups (what verl's ``algorithm.filter_groups`` does)."""
        return self.pipeline is not None and any(
            getattr(m.actuator, "filters_zero_variance", False) for m in self.pipeline.methods)

    # -------------------------------------------------------------- events
    def fields(self, event: str) -> frozenset[str]:
        """Batch fields the methods acting at ``event`` require and observers asked for (row labels and
        fields the host cannot provide at that event left out)."""
        return self._fields[event]

    def _wanted_fields(self, event: str) -> frozenset[str]:
        wanted: set[str] = set()
        if self.pipeline is not None:
            for m in self.pipeline.at(event):
                wanted |= {*reads(m.scorer), *reads(m.actuator)}
        hook = self.plugins.pm.hook.dataflex_fields
        for impl in hook.get_hookimpls():
            try:
                named = cast(Iterable[str], impl.function(event=event) or ())
                wanted |= {str(f) for f in named}
            except Exception:
                log.exception("dataflex: plugin %r failed in dataflex_fields(%r); its fields are not fetched",
                              impl.plugin_name, event)
        return frozenset(wanted & self.host.fields[event]) - {"uid", "data_source"}

    def listens(self, event: str) -> bool:
        """True when a method acts at ``event`` or an observer implements it: a host may skip preparing a
        batch for an event nobody hears."""
        if self.pipeline is not None and self.pipeline.at(event):
            return True
        return self.bus.observed(event)

    def emit(self, event: str, batch: Batch, step: int, *, observed: bool = True) -> Decision:
        """Emit one event on the bus; returns what the methods decided. ``on_step_end`` also closes the
        step's counts in the prompt history (:meth:`end_step` does that for a host that emits nothing).
        ``observed=False``: the observers do not hear it (:meth:`Bus.emit <dataflex_bus.bus.Bus.emit>`)."""
        decision = self.bus.emit(event, batch, step, observed=observed)
        if event == "on_step_end":
            self.end_step(step)
        return decision

    def end_step(self, step: int) -> None:
        """The step is done and nobody hears ``on_step_end``: close the step's counts in the prompt history."""
        if self.history is not None:
            self.history.end_step(step)
        if self.predictor is not None:
            self.predictor.end_step(step)

    # -------------------------------------------------------------- prompts and their history
    def set_prompts(self, table: PromptTable) -> None:
        """Tell the runtime the dataset's prompts (stable ids); starts the history when one is kept."""
        from .history import PromptHistory

        self.prompt_table = table
        if self.plan.reads_history:
            self.history = PromptHistory(table, self._visit_classes())
            self._own_prompt_states(self.history)
        if self.predictor is not None:
            self.predictor.bind(len(table))
        for part in self.parts.values():
            part.set_prompts(table)

    def _own_prompt_states(self, history: PromptHistory) -> None:
        """Give every component that owns per-prompt state its place in the history; its updates run under
        the guard that names its plugin."""
        from .bus import guarded_call

        assert self.pipeline is not None
        for m in self.pipeline.methods:
            for slot, component in (("scorer", m.scorer), ("actuator", m.actuator)):
                spec = component.prompt_state() if component.uses_history else None
                if spec is None:
                    continue
                plugin = m.provenance.get(slot, component.name)

                def update(state: Tensor, visits: Visits, fn: Any = component.update_prompt_state,
                           plugin: str = plugin) -> Tensor:
                    return guarded_call(fn, (state, visits), plugin, "on_rollout", None)

                history.own(spec, update)

    def _visit_classes(self) -> VisitClasses | None:
        assert self.pipeline is not None
        for m in self.pipeline.methods:
            for component in (m.scorer, m.actuator):
                wanted = component.visit_classes() if component.uses_history else None
                if wanted is not None:
                    return wanted
        return None

    def prompt_index(self, domains: Tensor | Sequence[Any], rows: Tensor) -> Tensor:
        """Dense prompt indices of the prompts ``(domains, rows)``: ``domains`` as ids into the prompt table's
        domains or as labels; an id not in the table raises naming the id column."""
        import torch

        from .errors import BatchFieldError

        if self.prompt_table is None:
            raise BatchFieldError("dataflex prompt ids", "prompt_index", "the host never gave the runtime its "
                                  "prompt table (Runtime.set_prompts)")
        if isinstance(domains, torch.Tensor):
            return self.prompt_table.lookup(domains, rows)
        return self.prompt_table.lookup_labels(domains, rows)

    def prompt_candidates(self, domain_ids: Tensor, rows: Tensor) -> Batch:
        """The ``on_prompts`` batch for candidates ``(domain_ids, rows)`` (ids into the prompt table's
        domains): one row and group per candidate, ``prompt_index`` and the history."""
        import torch

        from .batch import Batch

        if self.prompt_table is None:
            raise ConfigError(ConfigIssue("dataflex", "the host selects prompts but never gave the runtime its "
                                          "prompt table (Runtime.set_prompts)"))
        index = self.prompt_index(domain_ids, rows)
        fields = {"prompt_index": index}
        if self.history is not None:
            fields.update(self.history.fields(index))  # the epoch before this draw
            self.history.consider(len(index))
        if self.predictor is not None:
            fields.update(self.predictor.predict(index, self.predictor.next_step))
        n = len(index)
        return Batch.from_tensors(uid=torch.arange(n), domains=domain_ids, domain_names=self.prompt_table.domains,
                                  is_padding=torch.zeros(n, dtype=torch.bool), **fields)

    def record_rollouts(self, batch: Batch, step: int) -> dict[str, float]:
        """Add every rolled-out group of ``batch`` (with ``prompt_index`` per row) to the prompt history,
        before any selection; returns ``dataflex/history/...`` metrics. No-op without a history."""
        out = {} if self.history is None else self.history.record(batch, step)
        if self.predictor is not None:
            out.update(self.predictor.record(batch, step))
        return {f"dataflex/{k}": v for k, v in out.items()}

    @property
    def observer_failures(self) -> list[dict[str, Any]]:
        """Observers that raised (isolated, the run went on): one entry per observer and hook with the
        count, first and last step and last error; for the host's run record."""
        return self.bus.observer_failures

    # -------------------------------------------------------------- mix
    def set_domains(self, domains: Sequence[str]) -> None:
        """Tell the mixer the domains the host samples from, in the sampler's order."""
        if self.pipeline is not None:
            self.pipeline.set_domains(domains)

    @property
    def domain_probs(self) -> dict[str, float] | None:
        """The domain probabilities last published (uniform after :meth:`set_domains`); ``None``
        without a mixer."""
        return self.pipeline.domain_probabilities() if self.pipeline is not None else None

    # -------------------------------------------------------------- provenance and state
    def provenance(self) -> dict[str, Any]:
        """What a run record keeps of the runtime: the host, active plugins (``name==version``), failed ones
        and the resolved block with each method's components and versions."""
        pipeline = self.pipeline
        return {
            "host": self.host.to_dict(),
            "plugins": self.plugins.pins(),
            "failed_plugins": [{"name": r.name, "distribution": r.distribution, "error": r.error}
                               for r in self.plugins.failed],
            "dataflex": pipeline.config.to_dict() if pipeline else None,
            "methods": [{"name": m.name, "mechanism": m.config.mechanism, "event": m.event,
                         "components": dict(m.provenance), "versions": self._versions(m.provenance)}
                        for m in pipeline.methods] if pipeline else [],
        }

    def _versions(self, provenance: Mapping[str, str]) -> dict[str, str]:
        """``slot -> dist==version`` of the plugin providing each component."""
        pins = {}
        for record in self.plugins.active:
            for spec in record.components:
                pins[spec.qualified_name] = record.pin
        return {slot: pins.get(name, "local") for slot, name in provenance.items()}

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pipeline": self.pipeline.state_dict() if self.pipeline else None}
        if self.history is not None:
            out["history"] = self.history.state_dict()
        for key, part in self.parts.items():
            if (saved := part.state_dict()) is not None:
                out[key] = saved
        if self.predictor is not None:
            out["predictor"] = self.predictor.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("pipeline")
        if (saved is None) != (self.pipeline is None):
            # One side has a block: say which, with the block (what to pass to resume).
            ours = None if self.pipeline is None else self.pipeline.config.to_dict()
            theirs = (saved.get("config") or {"methods": sorted(saved.get("methods") or {})}
                      if isinstance(saved, Mapping) else None)
            refusal = resume_refusal(theirs, ours)
            assert refusal is not None  # one side has a block
            raise ConfigError(ConfigIssue("dataflex", refusal))
        if self.pipeline is not None and saved is not None:
            self.pipeline.load_state_dict(saved)
        history = state.get("history")
        if self.plan.reads_history and self.history is None:
            raise ConfigError(ConfigIssue("dataflex", "the host restores a prompt history before giving the "
                                          "runtime its prompt table (Runtime.set_prompts)"))
        if (history is None) != (self.history is None):
            raise ConfigError(ConfigIssue("dataflex", "checkpoint and config disagree on whether a per-prompt "
                                          "history is kept"))
        if self.history is not None and history is not None:
            self.history.load_state_dict(history)
        for cls in run_part_classes():
            part = self.parts.get(cls.key)
            if part is not None:
                part.load_state_dict(state.get(cls.key))
            elif state.get(cls.key) is not None:
                raise ConfigError(ConfigIssue("dataflex", f"checkpoint and config disagree on whether {cls.kept} is "
                                              "kept"))
        if self.predictor is not None:
            if state.get("predictor") is None:
                raise ConfigError(ConfigIssue("dataflex.predictor", "the checkpoint holds no predictor state"))
            self.predictor.load_state_dict(state["predictor"])
