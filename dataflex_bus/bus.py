"""The event bus the training loop talks to.

A host (the CPU shim or the verl trainer) builds one :class:`EventBus` per run and calls
:meth:`EventBus.emit` at each training event. Two roles subscribe:

* **participants**, the methods wired by the config (a :class:`~dataflex_bus.Pipeline`): they change
  training, so any exception, ``SystemExit`` included, stops the run at once, re-raised as
  :class:`~dataflex_bus.errors.PluginRuntimeError` naming the plugin and the hook; a
  ``KeyboardInterrupt`` stays an interrupt (:class:`PluginInterrupt`, naming where it arrived);
* **observers**, plugins that only watch (loggers, metric sinks): they run after every participant, see a
  read-only view of the decision and are isolated: an exception (or ``SystemExit``) is logged with its
  traceback the first time, then on the 2nd, 4th, 8th ... failure as one line, counted in
  :attr:`EventBus.observer_failures`, and the run goes on.

The contract for both roles: the batch is read, never written. A hook that changes a batch field in place
(or replaces one) would change what the host trains on without anyone deciding it, so the bus compares
the batch's tensors before and after every hook (through their version counters: no copy) and stops the
run with a :class:`PluginRuntimeError` naming the plugin and the fields. Writes that bypass torch's
version counter (through ``.data`` or a NumPy view) are not seen.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pluggy import PluginValidationError
from torch import Tensor

from .decision import Decision
from .discovery import new_plugin_manager
from .errors import BatchFieldError, PluginRuntimeError
from .hookspecs import EVENTS, PROJECT

if TYPE_CHECKING:
    from .batch import Batch
    from .discovery import PluginSet

log = logging.getLogger("dataflex_bus")
_MARK = f"{PROJECT}_impl"
#: The arguments every event hook may take (an implementation takes any subset).
HOOK_ARGS = ("batch", "step", "decision")


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
    """The tensors a batch holds (fields, row labels, cached derived values) with their version counters,
    to tell after a hook whether it wrote any of them in place or replaced one. Costs no copy."""

    __slots__ = ("_batch", "_seen")

    def __init__(self, batch: Any) -> None:
        self._batch = batch
        self._seen = _tensors(batch)

    def writes(self) -> list[tuple[str, str]]:
        """What changed since the watch began, as ``(name, how)``: ``("advantages", "in place")``,
        ``("rm_scores", "replaced")``, ``("Batch.is_padding", "removed")`` ..."""
        now = _tensors(self._batch)
        out = []
        for name, (tensor, version) in self._seen.items():
            current = now.get(name)
            if current is None:
                out.append((name, "removed"))
            elif current[0] is not tensor:
                out.append((name, "replaced"))
            elif tensor._version != version:
                out.append((name, "in place"))
        out += [(name, "added") for name in now if name not in self._seen and not name.startswith("Batch.")]
        return out


def _tensors(batch: Any) -> dict[str, tuple[Tensor, int]]:
    """Fields by name; labels and cached derived values (rewards, lengths, group index ...) as
    ``Batch.<attribute>``: later components and the host read them, so writing one changes training as much
    as writing a field."""
    fields = getattr(batch, "fields", None)
    if not isinstance(fields, dict):
        return {}
    out = {name: (t, t._version) for name, t in fields.items() if isinstance(t, Tensor)}
    for name, value in vars(batch).items():
        values = value if isinstance(value, tuple) else (value,)
        for i, item in enumerate(values):
            if isinstance(item, Tensor):
                key = f"Batch.{name.lstrip('_')}" + (f"[{i}]" if isinstance(value, tuple) else "")
                out[key] = (item, item._version)
    return out


def batch_write_error(plugin: str, hook: str, writes: list[tuple[str, str]]) -> PluginRuntimeError:
    """The error for a hook that changed the batch (or the decision, for an observer)."""
    (name, how), rest = writes[0], writes[1:]
    also = f"; also {', '.join(f'{n} ({h})' for n, h in rest)}" if rest else ""
    cause = BatchFieldError(plugin, name, f"changed {how} by the plugin{also}; plugins read the batch and state "
                            "changes through the decision (keep, weights, advantages), so the host trains only on "
                            "what was decided")
    return PluginRuntimeError(plugin, hook, cause)


# ---------------------------------------------------------------------------- the decision, read-only
class ReadOnlyDict(dict):  # type: ignore[type-arg]
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

    __slots__ = ("_decision", "_owner")

    def __init__(self, decision: Decision, owner: str) -> None:
        object.__setattr__(self, "_decision", decision)
        object.__setattr__(self, "_owner", owner)

    def __getattr__(self, name: str) -> Any:
        if name in ("drop", "restrict", "scale"):
            raise AttributeError(f"observer {self._owner!r}: the decision is read-only for observers "
                                 f"(Decision.{name} is for participants)")
        value = getattr(self._decision, name)
        return ReadOnlyDict(value) if isinstance(value, dict) else value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"observer {self._owner!r}: the decision is read-only for observers "
                             f"(tried to set {name!r})")

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    def __repr__(self) -> str:
        return f"DecisionView({self._decision!r})"


def _decision_tensors(decision: Decision) -> dict[str, tuple[Tensor, int]]:
    out = {}
    for name in ("keep", "advantages", "weights"):
        t = getattr(decision, name)
        if isinstance(t, Tensor):
            out[f"Decision.{name}"] = (t, t._version)
    return out


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


def _guard(plugin: object, name: str, *, observer: bool, failures: ObserverFailures) -> _Guarded:
    guarded = _Guarded(name)
    for hook in EVENTS:
        fn = getattr(plugin, hook, None)
        opts = getattr(fn, _MARK, None)
        if fn is None or opts is None:
            continue
        wrap = _observer_call if observer else _participant_call
        call = wrap(fn, name, hook, _arg_names(fn, name, hook), failures)
        spec = dict(opts)
        if observer:
            spec.update(trylast=True, tryfirst=False)
        setattr(call, _MARK, spec)
        setattr(guarded, hook, call)
    return guarded


def _arg_names(fn: Callable[..., Any], plugin: str, hook: str) -> tuple[str, ...]:
    names = tuple(inspect.signature(fn).parameters)
    unknown = [n for n in names if n not in HOOK_ARGS]
    if unknown:
        raise PluginValidationError(fn, f"plugin {plugin!r}: hook {hook!r} takes unknown argument(s) {unknown}; an "
                                        f"event hook takes any of {', '.join(HOOK_ARGS)}")
    return names


def _participant_call(fn: Callable[..., Any], plugin: str, hook: str, names: tuple[str, ...],
                      failures: ObserverFailures) -> Callable[..., Any]:
    def call(batch: Batch, step: int, decision: Decision) -> Any:
        given = {"batch": batch, "step": step, "decision": decision}
        watch = BatchWatch(batch)
        try:
            result = fn(**{n: given[n] for n in names})
        except PluginRuntimeError:
            raise
        except KeyboardInterrupt as exc:
            if isinstance(exc, PluginInterrupt):
                raise
            raise PluginInterrupt(plugin, hook) from exc
        except (Exception, SystemExit) as exc:
            # SystemExit too: a plugin calling sys.exit(0) must not end a run as a success.
            raise PluginRuntimeError(plugin, hook, exc) from exc
        writes = watch.writes()
        if writes:
            raise batch_write_error(plugin, hook, writes)
        return result

    return call


def _observer_call(fn: Callable[..., Any], plugin: str, hook: str, names: tuple[str, ...],
                   failures: ObserverFailures) -> Callable[..., Any]:
    def call(batch: Batch, step: int, decision: Decision) -> Any:
        given = {"batch": batch, "step": step, "decision": DecisionView(decision, plugin)}
        watch = BatchWatch(batch)
        before = _decision_tensors(decision)
        try:
            fn(**{n: given[n] for n in names})
        except KeyboardInterrupt as exc:
            if isinstance(exc, PluginInterrupt):
                raise
            raise PluginInterrupt(plugin, hook) from exc
        except (Exception, SystemExit) as exc:
            _observer_failed(failures, plugin, hook, step, exc)
        # An observer's write would change what is trained: isolation cannot undo it, so the run stops.
        writes = watch.writes() + [(k, "in place") for k, (t, v) in before.items() if t._version != v]
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


class EventBus:
    """pluggy-backed dispatcher for ``on_rollout``, ``on_advantage`` and ``on_step_end``."""

    def __init__(self, plugins: PluginSet | None = None) -> None:
        self.pm = new_plugin_manager()
        self.participants: list[str] = []
        self.observers: list[str] = []
        self.failures = ObserverFailures()
        if plugins is not None:
            for name, module in plugins.observers():
                self.add_observer(module, name)
        self._hooks = {event: getattr(self.pm.hook, event) for event in EVENTS}

    def add_participant(self, plugin: object, name: str) -> None:
        """Subscribe a component that changes training (fail fast, errors name ``name``)."""
        self.pm.register(_guard(plugin, name, observer=False, failures=self.failures), name=f"participant:{name}")
        self.pm.check_pending()
        self.participants.append(name)

    def add_observer(self, plugin: object, name: str) -> None:
        """Subscribe a watcher (errors are logged and counted, the run goes on)."""
        self.pm.register(_guard(plugin, name, observer=True, failures=self.failures), name=f"observer:{name}")
        self.pm.check_pending()
        self.observers.append(name)

    @property
    def observer_failures(self) -> list[dict[str, Any]]:
        """One entry per failing ``(observer, hook)``: ``observer``, ``hook``, ``count``, ``first_step``,
        ``last_step``, ``last_error``."""
        return self.failures.as_list()

    def emit(self, event: str, batch: Batch, step: int) -> Decision:
        """Emit one training event; returns what the participants decided."""
        decision = Decision()
        self._hooks[event](batch=batch, step=step, decision=decision)
        return decision
