"""Exception types. Every error names its culprit: a config key, a plugin, a component or a field."""

from __future__ import annotations

from collections.abc import Iterable


class DataflexError(Exception):
    """Base class of every error raised by dataflex-bus."""


#: Characters of an error message kept where it is stored or printed (a plugin's message may be megabytes);
#: a traceback keeps :data:`TRACEBACK_LIMIT`.
MESSAGE_LIMIT = 8_000
TRACEBACK_LIMIT = 32_000


def clip_text(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` when at most ``limit`` characters, else its head and tail (about half each) around a marker
    saying how many characters were cut: the start says what failed, the end where."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - head - tail:,} characters cut ...]\n{text[len(text) - tail:]}"


def format_traceback(exc: BaseException, limit: int = TRACEBACK_LIMIT) -> str:
    """``exc``'s formatted traceback (its cause chain first), clipped to ``limit`` characters."""
    import traceback

    return clip_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), limit)


def add_note(exc: BaseException, note: str) -> None:
    """Attach a line the command line prints after the error (PEP 678 notes; also before Python 3.11)."""
    exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]


class ConfigIssue:
    """One problem found in a config: the dotted key, what is wrong, what would be allowed, and a hint
    (a did-you-mean) shown last."""

    __slots__ = ("allowed", "hint", "key", "message")

    def __init__(self, key: str, message: str, allowed: Iterable[object] | None = None, hint: str = "") -> None:
        self.key = key
        self.message = message
        self.allowed = list(allowed) if allowed is not None else None
        self.hint = hint

    def __str__(self) -> str:
        text = f"{self.key}: {self.message}"
        if self.allowed:
            text += f" (allowed: {', '.join(str(a) for a in self.allowed)})"
        if self.hint:
            text += f"; {self.hint}"
        return text

    def __repr__(self) -> str:
        return f"ConfigIssue({self.key!r}, {self.message!r})"


class ConfigError(DataflexError, ValueError):
    """A config failed validation. ``issues`` lists every problem found, not only the first."""

    def __init__(self, issues: ConfigIssue | Iterable[ConfigIssue]) -> None:
        self.issues = [issues] if isinstance(issues, ConfigIssue) else list(issues)
        lines = "\n".join(f"  - {issue}" for issue in self.issues)
        super().__init__(f"invalid dataflex config ({len(self.issues)} problem(s)):\n{lines}")

    def __reduce__(self):  # keep type and issues across pickling (Ray hands errors back to the driver)
        return (type(self), (self.issues,))


class ConfigFileError(ConfigError):
    """A config file that cannot be read as one: missing, unreadable, not UTF-8, not YAML, not a mapping.
    Its one issue is the message: the file is the problem, not the config it would hold."""

    def __init__(self, issues: ConfigIssue | Iterable[ConfigIssue]) -> None:
        super().__init__(issues)
        self.args = ("; ".join(str(issue) for issue in self.issues),)


class PluginLoadError(DataflexError, RuntimeError):
    """A plugin could not be imported or registered (raised in strict mode)."""


class CollisionError(DataflexError, LookupError):
    """A component name is provided by more than one distribution."""


class UnknownComponentError(DataflexError, LookupError):
    """No installed plugin provides the requested component."""


class RemoteCause(Exception):
    """Stand-in for a plugin's exception that does not survive pickling (a local class, an ``__init__``
    with required arguments): its type name, message and formatted traceback, as plain strings."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "") -> None:
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.type_name, self.message, self.traceback_text))


def _type_name(exc: BaseException) -> str:
    return exc.type_name if isinstance(exc, RemoteCause) else type(exc).__name__


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles and unpickles, else a :class:`RemoteCause` carrying what it said."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RemoteCause(type(exc).__name__, clip_text(str(exc)), format_traceback(exc))


class PluginRuntimeError(DataflexError, RuntimeError):
    """A participant (a component wired by the config) raised inside a bus event."""

    def __init__(self, plugin: str, hook: str, cause: BaseException) -> None:
        self.plugin = plugin
        self.hook = hook
        self.cause = cause
        super().__init__(f"plugin {plugin!r} failed in hook {hook!r}: {_type_name(cause)}: {clip_text(str(cause))}")

    def __reduce__(self):
        # Ray pickles the error back to the driver: a cause that cannot make the trip would make the
        # whole error fail to unpickle and lose the plugin's name, so it travels as plain text instead.
        return (type(self), (self.plugin, self.hook, _portable(self.cause)))


class BatchFieldError(DataflexError, ValueError):
    """A batch lacks a field a component requires, or a field holds NaN/inf or a wrong shape."""

    def __init__(self, component: str, field: str, message: str) -> None:
        self.component = component
        self.field = field
        self.detail = message
        super().__init__(f"{component}: field {field!r}: {message}")

    def __reduce__(self):
        return (type(self), (self.component, self.field, self.detail))


class SignalInterrupt(KeyboardInterrupt):
    """A signal ending a run (SIGTERM; SIGINT where the command line turned it into one): an interrupt of the
    run, never of the plugin whose code happened to be running when it arrived. The host sets ``step``."""

    def __init__(self, signal_name: str, step: int | None = None) -> None:
        self.signal_name = signal_name
        self.step = step
        super().__init__(signal_name)

    def __reduce__(self):
        return (type(self), (self.signal_name, self.step))
