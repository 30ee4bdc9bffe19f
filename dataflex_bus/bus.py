"""The event bus the training loop talks to.

A host (the CPU shim or the verl trainer) builds one :class:`EventBus` per run and calls
:meth:`EventBus.emit` at each training event. Two roles subscribe:

* **participants**, the methods wired by the config (a :class:`~dataflex_bus.Pipeline`): they change
  training, so an exception stops the run at once, re-raised as
  :class:`~dataflex_bus.errors.PluginRuntimeError` naming the plugin and the hook;
* **observers**, plugins that only watch (loggers, metric sinks): they run after every participant and
  are isolated, so an exception is logged and the run goes on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .decision import Decision
from .discovery import new_plugin_manager
from .errors import DataflexError, PluginRuntimeError
from .hookspecs import EVENTS, PROJECT

if TYPE_CHECKING:
    from .batch import Batch
    from .discovery import PluginSet

log = logging.getLogger("dataflex_bus")
_MARK = f"{PROJECT}_impl"


class _Guarded:
    """A stand-in plugin whose event hooks call the real ones inside an error guard."""

    def __init__(self, name: str) -> None:
        self.__name__ = name


def _guard(plugin: object, name: str, *, observer: bool) -> _Guarded:
    guarded = _Guarded(name)
    for hook in EVENTS:
        fn = getattr(plugin, hook, None)
        opts = getattr(fn, _MARK, None)
        if fn is None or opts is None:
            continue
        setattr(guarded, hook, _wrap(fn, name, hook, observer=observer, opts=dict(opts)))
    return guarded


def _wrap(fn: Callable[..., Any], plugin: str, hook: str, *, observer: bool,
          opts: dict[str, Any]) -> Callable[..., Any]:
    if observer:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception:
                log.exception("dataflex: observer %r failed in %s; the run goes on", plugin, hook)
                return None

        opts.update(trylast=True, tryfirst=False)
    else:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except DataflexError as exc:
                if isinstance(exc, PluginRuntimeError):
                    raise
                raise PluginRuntimeError(plugin, hook, exc) from exc
            except Exception as exc:
                raise PluginRuntimeError(plugin, hook, exc) from exc

    # functools.wraps copied the original marker dict; give the wrapper its own (observers run last).
    setattr(call, _MARK, opts)
    return call


class EventBus:
    """pluggy-backed dispatcher for ``on_rollout``, ``on_advantage`` and ``on_step_end``."""

    def __init__(self, plugins: PluginSet | None = None) -> None:
        self.pm = new_plugin_manager()
        self.participants: list[str] = []
        self.observers: list[str] = []
        if plugins is not None:
            for name, module in plugins.observers():
                self.add_observer(module, name)
        self._hooks = {event: getattr(self.pm.hook, event) for event in EVENTS}

    def add_participant(self, plugin: object, name: str) -> None:
        """Subscribe a component that changes training (fail fast, errors name ``name``)."""
        self.pm.register(_guard(plugin, name, observer=False), name=f"participant:{name}")
        self.pm.check_pending()
        self.participants.append(name)

    def add_observer(self, plugin: object, name: str) -> None:
        """Subscribe a watcher (errors are logged, the run goes on)."""
        self.pm.register(_guard(plugin, name, observer=True), name=f"observer:{name}")
        self.pm.check_pending()
        self.observers.append(name)

    def emit(self, event: str, batch: Batch, step: int) -> Decision:
        """Emit one training event; returns what the participants decided."""
        decision = Decision()
        self._hooks[event](batch=batch, step=step, decision=decision)
        return decision
