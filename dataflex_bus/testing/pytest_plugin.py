"""pytest plugin shipped with dataflex-bus (entry point ``pytest11``): fixtures for plugin authors.

Kept import-light: pytest loads it in every session of every project that has dataflex-bus installed,
so nothing here imports torch or loads plugins until a fixture is used.

Fixtures:

* ``dataflex_fresh_plugins`` - forget memoised plugin discovery before and after the test.
* ``dataflex_plugin_env`` - a function ``(load=None, disable=None) -> PluginSet`` that sets
  ``DATAFLEX_LOAD_PLUGINS`` / ``DATAFLEX_DISABLE_PLUGINS`` (``None`` leaves a variable unset, ``[]``
  means "none") and rediscovers; the environment and the memo are restored afterwards.
* ``dataflex_isolated_plugins`` - no installed plugin is loaded during the test (allowlist set to
  empty), so only in-process registrations are visible. Returns the (empty) ``PluginSet``.
* ``dataflex_register_plugin`` - a function ``(kind, name, target, summary="") -> ComponentSpec`` that
  registers a component in this process; every registration is removed after the test.
* ``dataflex_batch`` - :func:`dataflex_bus.testing.make_batch`.
* ``dataflex_run_training`` - :func:`dataflex_bus.testing.run_short_training`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from dataflex_bus.discovery import PluginSet
    from dataflex_bus.registry import ComponentSpec

_ENV_LOAD = "DATAFLEX_LOAD_PLUGINS"
_ENV_DISABLE = "DATAFLEX_DISABLE_PLUGINS"


#: pytest-asyncio (installed with verl) warns in every session that leaves this unset; the template sets it.
_ASYNCIO_LOOP_SCOPE = "asyncio_default_fixture_loop_scope"


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """Declare pytest-asyncio's loop-scope option where pytest-asyncio will not, so a pack's pyproject can
    set it (silencing that plugin's deprecation warning where it is installed) without pytest calling it
    an unknown option where it is not."""
    import importlib.util

    if importlib.util.find_spec("pytest_asyncio") is None or pluginmanager.is_blocked("asyncio"):
        parser.addini(_ASYNCIO_LOOP_SCOPE, type="string", default=None,
                      help="pytest-asyncio's default event-loop scope of async fixtures (declared by dataflex-bus's "
                           "plugin while pytest-asyncio is not loaded)")


def _reset() -> None:
    from dataflex_bus.discovery import reset_plugins

    reset_plugins()


@pytest.fixture
def dataflex_fresh_plugins() -> Iterator[None]:
    """Forget memoised plugin discovery before and after the test."""
    _reset()
    yield
    _reset()


@pytest.fixture
def dataflex_plugin_env() -> Iterator[Callable[..., PluginSet]]:
    """Choose which installed plugins load: ``env(load=["dataflex-mine"], disable=None)``."""
    monkeypatch = pytest.MonkeyPatch()

    def configure(load: Sequence[str] | None = None, disable: Sequence[str] | None = None) -> PluginSet:
        from dataflex_bus.discovery import get_plugins

        for var, names in ((_ENV_LOAD, load), (_ENV_DISABLE, disable)):
            if names is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, ",".join(names))
        _reset()
        return get_plugins()

    _reset()
    yield configure
    monkeypatch.undo()
    _reset()


@pytest.fixture
def dataflex_isolated_plugins(dataflex_plugin_env: Callable[..., PluginSet]) -> PluginSet:
    """Load no installed plugin: the test sees only what it registers in-process."""
    return dataflex_plugin_env(load=[], disable=None)


@pytest.fixture
def dataflex_register_plugin() -> Iterator[Callable[..., ComponentSpec]]:
    """Register components in-process for one test: ``register("scorer", "mine", MyScorer)``.

    ``target`` is a class or a ``"module:Class"`` string. Registering a name twice in one test replaces
    the first registration. Everything registered is removed afterwards, and discovery is reset on
    both ends so registries built during the test never leak into the next one.
    """
    from dataflex_bus.registry import local_specs, register_local, slot_of, unregister_local

    # (kind, name, registration it shadowed): a name already registered in-process (by a decorator)
    # is put back as it was after the test.
    registered: list[tuple[str, str, ComponentSpec | None]] = []

    def register(kind: str, name: str, target: Any, summary: str = "") -> ComponentSpec:
        previous = next((s for s in local_specs()
                         if s.name == name and slot_of(s.kind) == slot_of(kind)), None)
        spec = register_local(kind, name, target, summary=summary)
        registered.append((kind, name, previous))
        return spec

    _reset()
    yield register
    for kind, name, previous in reversed(registered):
        unregister_local(kind, name)
        if previous is not None:
            register_local(previous.kind, previous.name, previous.target, summary=previous.summary)
    _reset()


@pytest.fixture
def dataflex_batch() -> Callable[..., Any]:
    """The batch factory :func:`dataflex_bus.testing.make_batch`."""
    from dataflex_bus.testing.factories import make_batch

    return make_batch


@pytest.fixture
def dataflex_run_training() -> Callable[..., list[dict[str, float]]]:
    """The quick shim run :func:`dataflex_bus.testing.run_short_training`."""
    from dataflex_bus.testing.training import run_short_training

    return run_short_training
