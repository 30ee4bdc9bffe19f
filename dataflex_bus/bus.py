"""The event bus the training loop talks to.

A host (the CPU shim or the verl trainer) builds one :class:`EventBus` per run and calls
:meth:`EventBus.emit` at each training event. Two roles subscribe:

* **participants**, the methods wired by the config (a :class:`~dataflex_bus.Pipeline`): they change
  training, so any exception, ``SystemExit`` included, stops the run at once, re-raised as
  :class:`~dataflex_bus.errors.PluginRuntimeError` naming the plugin and the hook; a
  ``KeyboardInterrupt`` stays an interrupt (:class:`PluginInterrupt`, naming where it arrived; a
  :class:`~dataflex_bus.errors.SignalInterrupt` passes through unnamed: the signal is not the plugin's);
* **observers**, plugins that only watch (loggers, metric sinks): they run after every participant, see a
  read-only view of the decision and are isolated: an exception (or ``SystemExit``) is logged with its
  traceback the first time, then on the 2nd, 4th, 8th ... failure as one line, counted in
  :attr:`EventBus.observer_failures`, and the run goes on.

The contract for both roles: the batch is read, never written. A hook that changes a batch field or label
in place (or replaces one) would change what the host trains on without anyone deciding it. The components
of a method are always checked (:meth:`~dataflex_bus.method.Method` compares the batch around every
scorer/actuator call: microseconds against their work). Checking every bus hook costs more than a do-nothing
hook itself, so it is on where plugins are tried (the CPU shim turns it on), in debug mode
(``DATAFLEX_DEBUG=1``), or with ``EventBus(check_writes=True)``: after every hook that takes the batch
the bus compares the batch's tensors with the snapshot taken when the event was emitted (identity and
version counter: no copy) and stops the run with a :class:`PluginRuntimeError` naming the plugin and the
field; the same holds for an observer writing the decision's tensors in place. Writes that bypass torch's
version counter (through ``.data`` or a NumPy view) are seen by fingerprints (:mod:`.fingerprint`): always
for the fields a scorer or actuator declared it reads (``requires``), before and after its call; for every
field around every hook in debug mode. The cost, measured in ``benchmarks/bench_read_fingerprint.py``: one
pass of 5-16 ms per field and side at 16,384 x 2,048 on one thread.
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from pluggy import PluginValidationError
from torch import Tensor

from .decision import Decision
from .discovery import new_plugin_manager
from .errors import BatchFieldError, PluginRuntimeError, SignalInterrupt
from .fingerprint import fingerprint
from .hookspecs import EVENTS, PROJECT
from .registry import debug_mode

if TYPE_CHECKING:
    from .batch import Batch
    from .discovery import PluginSet

log = logging.getLogger("dataflex_bus")
_MARK = f"{PROJECT}_impl"
_VERSION = operator.attrgetter("_version")
T = TypeVar("T")


class PluginInterrupt(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` (Ctrl-C, or a plugin raising it) that arrived inside a plugin's hook: still an
    interrupt, not a failure, but it names where it arrived."""

    def __init__(self, plugin: str, hook: str) -> None:
        self.plugin = plugin
        self.hook = hook
        super().__init__(f"interrupted in plugin {plugin!r}, hook {hook!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.plugin, self.hook))


# ---------------------------------------------------------------------------- batch writes
class BatchWatch:
    """The tensors a batch holds (fields, row labels, cached derived values) with their identities and
    version counters, to tell after a hook whether it wrote one in place, replaced, added or removed one.
    Costs no copy; :meth:`changed` is a few C-level reads per tensor (it runs after every hook). The fields
    named in ``reads`` are also fingerprinted (:mod:`.fingerprint`: one pass over each, before and after),
    which sees writes that bypass the version counter (``.data``, a NumPy view)."""

    __slots__ = ("_attr_keys", "_attrs", "_batch", "_field_keys", "_fields", "_items", "_prints", "_reads",
                 "_tensors", "_versions", "_views_written")

    def __init__(self, batch: Any, reads: Iterable[str] = ()) -> None:
        self._batch = batch
        fields = getattr(batch, "fields", None)
        self._fields: dict[str, Any] | None = fields if isinstance(fields, dict) else None
        items: list[tuple[str, Any]] = []
        attrs: list[tuple[str, Any]] = []
        tensors: list[Tensor] = []
        if self._fields is not None:
            for key, value in self._fields.items():
                if isinstance(value, Tensor):
                    items.append((key, value))
                    tensors.append(value)
            # Labels and cached derived values (rewards, lengths, group index ...) are read by later
            # components and by the host: writing one changes training as much as writing a field.
            for key, value in vars(batch).items():
                if isinstance(value, Tensor):
                    attrs.append((key, value))
                    tensors.append(value)
                elif type(value) is tuple:
                    inner = [x for x in value if isinstance(x, Tensor)]
                    if inner:
                        attrs.append((key, value))
                        tensors.extend(inner)
        self._items = tuple(items)
        self._attrs = tuple(attrs)
        self._field_keys = [k for k, _ in items]
        self._attr_keys = [k for k, _ in attrs]
        self._tensors = tensors
        self._versions = list(map(_VERSION, tensors))
        fields = self._fields or {}
        self._prints = tuple((k, t, fingerprint(t)) for k in dict.fromkeys(reads)
                             if isinstance(t := fields.get(k), Tensor))
        # A jagged field's dense view (Batch pads one when a component reads the field per token) is the field
        # to its readers: one written in place is a write.
        self._reads = tuple(dict.fromkeys(reads))
        self._views_written = _written_views(batch, self._reads)

    @classmethod
    def for_component(cls, batch: Any, requires: Iterable[str]) -> BatchWatch:
        """The watch around one scorer or actuator call: the fields it declared it reads are fingerprinted
        (every field in debug mode, ``DATAFLEX_DEBUG=1``, where speed matters less than coverage)."""
        fields = getattr(batch, "fields", None)
        return cls(batch, fields if debug_mode() and isinstance(fields, dict) else requires)

    def _bypassed(self) -> list[str]:
        """Fingerprinted fields whose bytes changed behind an unchanged tensor and version."""
        return [k for k, t, before in self._prints if fingerprint(t) != before]

    def changed(self) -> bool:
        """Whether anything the watch covers was written since it began (the fast check)."""
        fields = self._fields
        if fields is None:
            return False
        batch = self._batch
        if batch.fields is not fields or len(fields) != len(self._items):
            return True
        if list(map(_VERSION, self._tensors)) != self._versions:
            return True
        if not all(map(operator.is_, map(fields.get, self._field_keys), (v for _, v in self._items))):
            return True
        state = vars(batch)
        if not all(map(operator.is_, map(state.get, self._attr_keys), (v for _, v in self._attrs))):
            return True
        if _written_views(batch, self._reads) != self._views_written:
            return True
        return bool(self._prints) and bool(self._bypassed())

    def writes(self) -> list[tuple[str, str]]:
        """What changed, as ``(name, how)``: ``("advantages", "in place")``, ``("rm_scores", "replaced")``,
        ``("Batch.is_padding", "in place")``, ``("extra", "added")`` ... (the slow path)."""
        if not self.changed():
            return []
        before = _named(self._items, self._attrs)
        fields = self._batch.fields if isinstance(self._batch.fields, dict) else {}
        state = vars(self._batch)
        now = _named(tuple(fields.items()), tuple((k, state.get(k)) for k, _ in self._attrs))
        versions = {id(t): v for t, v in zip(self._tensors, self._versions)}
        out = []
        for name, tensor in before.items():
            current = now.get(name)
            if current is None:
                out.append((name, "removed"))
            elif current is not tensor:
                out.append((name, "replaced"))
            elif tensor._version != versions[id(tensor)]:
                out.append((name, "in place"))
        out += [(name, "added") for name in now if name not in before]
        out += [written for written in _written_views(self._batch, self._reads) if written not in self._views_written]
        if not out:
            out = [(name, "bypassed") for name in self._bypassed()]
        return out


def _written_views(batch: Any, reads: tuple[str, ...]) -> list[tuple[str, str]]:
    """The dense views of jagged fields ``batch`` says were written, as ``(name, how)`` (those of ``reads`` also
    behind the version counter); none for a batch without views."""
    written = getattr(batch, "written_views", None)
    return written(reads) if callable(written) else []


def _named(items: tuple[tuple[str, Any], ...], attrs: tuple[tuple[str, Any], ...]) -> dict[str, Tensor]:
    """Fields by name, labels and cached values as ``Batch.<attribute>`` (``[i]`` inside a tuple)."""
    out = {k: v for k, v in items if isinstance(v, Tensor)}
    for name, value in attrs:
        values = value if isinstance(value, tuple) else (value,)
        for i, item in enumerate(values):
            if isinstance(item, Tensor):
                out[f"Batch.{name.lstrip('_')}" + (f"[{i}]" if isinstance(value, tuple) else "")] = item
    return out


def batch_write_error(plugin: str, hook: str, writes: list[tuple[str, str]]) -> PluginRuntimeError:
    """The error for a hook that changed the batch (or the decision, for an observer)."""
    (name, how), rest = writes[0], writes[1:]
    also = f"; also {', '.join(f'{n} ({h})' for n, h in rest)}" if rest else ""
    done = {"in place": "written in place",
            "bypassed": "written in place behind torch's version counter (through .data or a NumPy view)"}.get(how, how)
    cause = BatchFieldError(plugin, name, f"{done} by the plugin{also}; plugins read the batch and state "
                            "changes through the decision (keep, weights, advantages), so the host trains only on "
                            "what was decided")
    return PluginRuntimeError(plugin, hook, cause)


def guarded_call(fn: Callable[..., T], args: tuple[Any, ...], plugin: str, hook: str,
                 watch: BatchWatch | None) -> T:
    """Call a plugin's function: any failure (``SystemExit`` included: a plugin calling ``sys.exit(0)``
    must not end a run as a success) becomes a :class:`PluginRuntimeError`, an interrupt a
    :class:`PluginInterrupt`, each naming ``plugin`` and ``hook``; with a ``watch``, a write to the batch
    it covers is an error too."""
    try:
        result = fn(*args)
    except (PluginRuntimeError, PluginInterrupt, SignalInterrupt):  # a signal is the run's, not the plugin's
        raise
    except KeyboardInterrupt as exc:
        raise PluginInterrupt(plugin, hook) from exc
    except (Exception, SystemExit) as exc:
        raise PluginRuntimeError(plugin, hook, exc) from exc
    if watch is not None and watch.changed():
        raise batch_write_error(plugin, hook, watch.writes())
    return result


# ---------------------------------------------------------------------------- the decision, read-only
class ReadOnlyDict(dict[str, Any]):
    """A copy of one of the decision's dicts that refuses writes (a ``dict``, so a metric sink can still
    ``json.dumps`` it)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("the decision is read-only for observers")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]


class DecisionView:
    """What an observer sees of the decision: every attribute readable, nothing writable (``metrics`` and
    ``domain_probs`` are read-only copies). The tensors are the decision's own; writing them in place is
    caught like a batch write."""

    __slots__ = ("_decision",)

    def __init__(self, decision: Decision) -> None:
        object.__setattr__(self, "_decision", decision)

    def __getattr__(self, name: str) -> Any:
        if name in ("drop", "restrict", "scale", "keep_tokens"):
            raise AttributeError(f"the decision is read-only for observers (Decision.{name} is for participants)")
        value = getattr(self._decision, name)
        return ReadOnlyDict(value) if isinstance(value, dict) else value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the decision is read-only for observers (tried to set {name!r})")

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def __repr__(self) -> str:
        return f"DecisionView({self._decision!r})"


# ---------------------------------------------------------------------------- guards
class _Guarded:
    """A stand-in plugin whose event hooks call the real ones inside an error guard."""

    def __init__(self, name: str) -> None:
        self.__name__ = name


class ObserverFailures:
    """Failures of observers, per ``(observer, hook)``: count, first and last step, last error."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], dict[str, Any]] = {}

    def add(self, plugin: str, hook: str, step: Any, exc: BaseException) -> int:
        entry = self.entries.setdefault((plugin, hook), {"observer": plugin, "hook": hook, "count": 0,
                                                         "first_step": step})
        entry["count"] += 1
        entry["last_step"] = step
        entry["last_error"] = f"{type(exc).__name__}: {exc}"
        return int(entry["count"])

    def as_list(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.entries.values()]


_Picker = Callable[[tuple[Any, ...]], tuple[Any, ...]]


def _picker(argnames: tuple[str, ...]) -> _Picker:
    """Picks, from ``(batch, step, decision)``, the arguments a hook takes, in its order."""
    index = [("batch", "step", "decision").index(a) for a in argnames]
    if not index:
        return lambda given: ()
    getter = operator.itemgetter(*index)
    return (lambda given: (getter(given),)) if len(index) == 1 else getter


def _positions(fn: Callable[..., Any]) -> tuple[int | None, int | None, int | None]:
    """Where pluggy puts ``batch``, ``step`` and ``decision`` among the positional arguments it passes: the
    implementation's parameters without a default, in order (pluggy passes no others)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None, None, None
    names = [p.name for p in params if p.default is p.empty
             and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    batch, step, decision = (names.index(a) if a in names else None for a in ("batch", "step", "decision"))
    return batch, step, decision


class EventBus:
    """pluggy-backed dispatcher for ``on_rollout``, ``on_advantage`` and ``on_step_end``.

    Participants and observers sit in two plugin managers (each validates its hooks against the specs and
    orders them). Observers are called after every participant, with a read-only view of the decision, in
    pluggy's order but by the bus itself: a second hook call per event would cost more than the bus may
    add to a bare pluggy call.
    """

    def __init__(self, plugins: PluginSet | None = None, *, check_writes: bool | None = None) -> None:
        #: Compare the batch around every hook (see the module doc); ``None``: in debug mode (DATAFLEX_DEBUG).
        self.check_writes = debug_mode() if check_writes is None else check_writes
        self.pm = new_plugin_manager()
        self.observer_pm = new_plugin_manager()
        self.participants: list[str] = []
        self.observers: list[str] = []
        self.failures = ObserverFailures()
        # What the hooks of the event being emitted compare against (None: writes are not checked).
        self._watch: BatchWatch | None = None
        self._decision_versions: tuple[tuple[str, Tensor, int], ...] = ()
        self._hooks = {event: getattr(self.pm.hook, event) for event in EVENTS}
        self._observer_hooks = {event: getattr(self.observer_pm.hook, event) for event in EVENTS}
        #: Per event, the guarded observer hooks in pluggy's call order, each with the positions of the
        #: arguments it takes in ``(batch, step, decision)``.
        self._observer_calls: dict[str, list[tuple[Callable[..., Any], _Picker]]] = {}
        if plugins is not None:
            for name, module in plugins.observers():
                self.add_observer(module, name)

    def add_participant(self, plugin: object, name: str) -> None:
        """Subscribe a component that changes training (fail fast, errors name ``name``)."""
        self.pm.register(self._guard(plugin, name, observer=False), name=f"participant:{name}")
        self.pm.check_pending()
        self.participants.append(name)

    def add_observer(self, plugin: object, name: str) -> None:
        """Subscribe a watcher (errors are logged and counted, the run goes on)."""
        guarded = self._guard(plugin, name, observer=True)
        self.observer_pm.register(guarded, name=f"observer:{name}")
        self.observer_pm.check_pending()
        self.observers.append(name)
        for event in EVENTS:
            # pluggy calls the last-registered implementation first (tryfirst/trylast applied).
            impls = reversed(self._observer_hooks[event].get_hookimpls())
            calls = [(impl.function, _picker(impl.argnames)) for impl in impls]
            if calls:
                self._observer_calls[event] = calls

    def observed(self, event: str) -> bool:
        """True when an observer implements ``event``."""
        return event in self._observer_calls

    @property
    def observer_failures(self) -> list[dict[str, Any]]:
        """One entry per failing ``(observer, hook)``: ``observer``, ``hook``, ``count``, ``first_step``,
        ``last_step``, ``last_error``."""
        return self.failures.as_list()

    def emit(self, event: str, batch: Batch, step: int, *, observed: bool = True) -> Decision:
        """Emit one training event; returns what the participants decided. ``observed=False``: the participants
        decide but the observers do not hear it (a partial batch the host asks about early, e.g. a round's
        groups screened as they arrive; the observers hear the whole batch when it is emitted)."""
        decision = Decision()
        if self.check_writes:
            self._emit_checked(event, batch, step, decision, observed)
            return decision
        self._hooks[event](batch=batch, step=step, decision=decision)
        if observed:
            self._notify(event, batch, step, decision)
        return decision

    def _notify(self, event: str, batch: Batch, step: int, decision: Decision) -> None:
        """Call the observers of ``event`` (each with the arguments it takes; the decision read-only)."""
        calls = self._observer_calls.get(event)
        if calls is None:
            return
        if self.check_writes:
            self._decision_versions = tuple(
                (f"Decision.{name}", t, t._version) for name, t in
                (("keep", decision.keep), ("advantages", decision.advantages), ("weights", decision.weights),
                 ("tokens", decision.tokens))
                if isinstance(t, Tensor))
        given = (batch, step, DecisionView(decision))
        for fn, pick in calls:
            fn(*pick(given))

    def _emit_checked(self, event: str, batch: Batch, step: int, decision: Decision, observed: bool) -> None:
        outer = self._watch, self._decision_versions
        # In debug mode every field is fingerprinted too (writes behind the version counter, any hook).
        self._watch = BatchWatch(batch, batch.fields if debug_mode() else ())
        try:
            self._hooks[event](batch=batch, step=step, decision=decision)
            if observed:
                self._notify(event, batch, step, decision)
        finally:
            self._watch, self._decision_versions = outer

    # ------------------------------------------------------------------ guards
    def _guard(self, plugin: object, name: str, *, observer: bool) -> _Guarded:
        guarded = _Guarded(name)
        for hook in EVENTS:
            fn = getattr(plugin, hook, None)
            opts = getattr(fn, _MARK, None)
            if fn is None or opts is None:
                continue
            if opts.get("hookwrapper") or opts.get("wrapper"):
                raise PluginValidationError(fn, f"plugin {name!r}: the event hook {hook!r} is declared a hook wrapper; "
                                            "event hooks are plain implementations")
            call = (self._observer_call if observer else self._participant_call)(fn, name, hook)
            # functools.wraps copied the original's marker dict; the wrapper gets its own.
            setattr(call, _MARK, dict(opts))
            setattr(guarded, hook, call)
        return guarded

    def _participant_call(self, fn: Callable[..., Any], plugin: str, hook: str) -> Callable[..., Any]:
        takes_batch = _positions(fn)[0] is not None

        # pluggy reads the parameters through functools.wraps (so it validates and passes exactly the
        # implementation's own arguments, positionally).
        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            return guarded_call(fn, args, plugin, hook, self._watch if takes_batch else None)

        return call

    def _observer_call(self, fn: Callable[..., Any], plugin: str, hook: str) -> Callable[..., Any]:
        batch_at, step_at, decision_at = _positions(fn)
        failures = self.failures

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            try:
                fn(*args)
            except KeyboardInterrupt as exc:
                if isinstance(exc, (PluginInterrupt, SignalInterrupt)):
                    raise
                raise PluginInterrupt(plugin, hook) from exc
            except (Exception, SystemExit) as exc:
                step = args[step_at] if step_at is not None and step_at < len(args) else None
                _observer_failed(failures, plugin, hook, step, exc)
            watch = self._watch
            if watch is not None:
                # An observer's write would change what is trained: isolation cannot undo it, so the run stops.
                writes = watch.writes() if batch_at is not None else []
                if decision_at is not None:
                    writes += [(n, "in place") for n, t, v in self._decision_versions if t._version != v]
                if writes:
                    raise batch_write_error(plugin, hook, writes)
            return None  # an observer's return value is never part of the decision

        return call


def _observer_failed(failures: ObserverFailures, plugin: str, hook: str, step: Any, exc: BaseException) -> None:
    n = failures.add(plugin, hook, step, exc)
    if n == 1:
        # The traceback from the observer's own frame on: the bus's wrapper frame says nothing to its author.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        log.error("dataflex: observer %r failed in %s at step %s; the run goes on (further failures of it are "
                  "counted in the run record)", plugin, hook, step, exc_info=(type(exc), exc, tb))
    elif n & (n - 1) == 0:  # 2nd, 4th, 8th ...: visible, but no flood
        log.warning("dataflex: observer %r failed again in %s at step %s (%d failures so far): %s: %s",
                    plugin, hook, step, n, type(exc).__name__, exc)
