"""The host registry: every host dataflex-bus runs on, and where the rest of the project finds what it asks of one.

A host is one folder (``dataflex_bus/<host>/``) plus one :class:`HostEntry` here: its describe (the
:class:`~dataflex_bus.host.HostDescription` factory), its ``dataflex doctor`` command, how a config file is told
to be its (``claims``), how ``dataflex validate`` checks such a file, and its driver of the host contract suite
(``tests/hosts``). ``dataflex_bus.cli``, ``dataflex_bus.checkconfig``, ``dataflex_bus.doctor`` and the suite
iterate :func:`registered` and name no host.

Every reference is a ``"module:function"`` string, like the CLI's command table, resolved only when used: the
registry itself imports nothing, so building the CLI's parser never imports a host's framework (verl, TRL).

An installed package registers a host of its own through the ``dataflex.hosts`` entry-point group: each entry
point names a :class:`HostEntry` (``lab = lab_host:ENTRY``; the module holding it imports no framework either).
They join the built-in hosts on the registry's first use; one that fails to load, is not a ``HostEntry`` or
takes a name already registered is left out with a warning naming it and its distribution.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import import_module, metadata
from typing import Any

from .errors import DataflexError

log = logging.getLogger("dataflex_bus")

#: The entry-point group through which an installed package registers a host.
GROUP = "dataflex.hosts"


@dataclass(frozen=True)
class Contract:
    """How the host contract suite (``tests/hosts``) drives a host.

    ``driver``: the module with ``run(block, world, batch=, steps=, tmp_path=, settings=)`` and
    ``description(settings=None)``; optionally ``CONFIGURATIONS`` (other framework settings, each described for
    the refusal cases), ``REL`` (relative tolerance against the reference host), ``BEHAVIOUR_IS_OLD`` and
    ``before_case(request)`` (fixtures the host needs before a case). ``requires``: modules that must be importable,
    else the host's cases are skipped. ``marks``: the pytest marks of its cases."""

    driver: str
    requires: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostEntry:
    """One host's registration. Every reference is ``"module:function"``, imported only when used."""

    name: str
    #: How prose names the host (the CLI's help).
    label: str
    #: Its :class:`~dataflex_bus.host.HostDescription` factory.
    describe: str
    #: ``dataflex doctor --host NAME``: takes the parsed arguments, returns the exit status (``None``: no doctor).
    doctor: str | None = None
    #: Takes a config file's mapping, returns why the file is written for this host (``None``: it is not).
    claims: str | None = None
    #: The host of a non-empty config file no other host claims (one host at most).
    fallback: bool = False
    #: ``dataflex validate FILE``: checks a whole config file of this host, returns the validated block (``None``:
    #: no method) or raises :class:`~dataflex_bus.errors.ConfigError` (``None``: the fallback host's check runs).
    check: str | None = None
    #: The file ``check`` reads, for the help text.
    check_form: str = ""
    #: What ``dataflex doctor --config`` and its overrides take for this host, for the help text.
    doctor_config: str = ""
    doctor_overrides: str = ""
    #: Its driver of the host contract suite (``None``: not under contract).
    contract: Contract | None = None


#: The built-in hosts, in the order prose and the contract suite list them. The first with a doctor is
#: ``dataflex doctor``'s host when neither ``--host`` nor ``--config`` says one.
_HOSTS: dict[str, HostEntry] = {e.name: e for e in (
    HostEntry("shim", "the CPU shim", "dataflex_bus.shim.host:describe", fallback=True,
              check="dataflex_bus.shim.config:check_config",
              check_form="a shim run config (examples/)", contract=Contract("shim_host")),
    HostEntry("verl", "verl", "dataflex_bus.verl.host:describe", doctor="dataflex_bus.verl.doctor:cmd_doctor",
              claims="dataflex_bus.verl.host:claims", check="dataflex_bus.verl.host:check_config",
              check_form="a verl config with a `dataflex:` block",
              doctor_config="a verl config file with a `dataflex:` block",
              doctor_overrides="your main_ppo overrides (trainer.v1.trainer_mode=... +dataflex.mechanism=...)",
              contract=Contract("verl_host", requires=("verl",), marks=("verl", "tq"))),
    HostEntry("trl", "TRL", "dataflex_bus.trl.host:describe", doctor="dataflex_bus.trl.doctor:cmd_doctor",
              claims="dataflex_bus.trl.host:claims",
              doctor_config="a YAML file with a `dataflex:` block and optional `grpo:` GRPOConfig fields (or a bare "
                            "block)",
              doctor_overrides="dataflex.KEY=VALUE and grpo.FIELD=VALUE",
              contract=Contract("trl_host", requires=("trl",), marks=("trl",))),
)}


class UnknownHostError(DataflexError, LookupError):
    """A host name no registration gives."""


#: The entry points of :data:`GROUP` already read (``"name = value"``) -> the host each registered (``""``:
#: none): each is read once, until :func:`unregister` removes its host.
_READ: dict[str, str] = {}
#: Whether the registry's first use has read the entry points.
_DISCOVERED = False


def discover() -> list[HostEntry]:
    """Register the hosts installed packages declare in :data:`GROUP` not read yet; returns those added.
    Runs on the registry's first use; call it again after installing a package in the running process."""
    added = []
    for ep in metadata.entry_points(group=GROUP):
        key = f"{ep.name} = {ep.value}"
        if key in _READ:
            continue
        _READ[key] = ""
        where = f"entry point {ep.name!r} ({ep.value}) of group {GROUP!r}" + (
            f" in distribution {ep.dist.name!r}" if ep.dist is not None else "")
        try:
            entry = ep.load()
        except Exception as exc:  # a broken package must not take the command line down with it
            log.warning("dataflex: host left out: %s failed to load: %s: %s", where, type(exc).__name__, exc)
            continue
        if not isinstance(entry, HostEntry):
            log.warning("dataflex: host left out: %s names a %s, not a dataflex_bus.hosts.HostEntry", where,
                        type(entry).__name__)
            continue
        try:
            _add(entry)
        except DataflexError as exc:
            log.warning("dataflex: host left out: %s: %s", where, exc)
            continue
        _READ[key] = entry.name
        added.append(entry)
    return added


def _hosts() -> dict[str, HostEntry]:
    """The registry, the installed packages' hosts read on first use."""
    global _DISCOVERED
    if not _DISCOVERED:
        _DISCOVERED = True
        discover()
    return _HOSTS


def registered() -> tuple[HostEntry, ...]:
    """Every registered host, in registration order (built-in ones first)."""
    return tuple(_hosts().values())


def get(name: str) -> HostEntry:
    """The registration of host ``name``; an unknown name is an error listing the registered ones."""
    _hosts()
    try:
        return _HOSTS[name]
    except KeyError:
        raise UnknownHostError(f"no host {name!r} is registered (registered: {', '.join(_HOSTS)})") from None


def register(entry: HostEntry) -> None:
    """Add a host (a test's; an installed package's goes through :data:`GROUP`); a name already registered is
    an error."""
    _hosts()
    _add(entry)


def _add(entry: HostEntry) -> None:
    if entry.name in _HOSTS:
        raise DataflexError(f"host {entry.name!r} is registered already")
    current = fallback()
    if entry.fallback and current is not None:
        raise DataflexError(f"host {entry.name!r} cannot be the fallback host: {current.name!r} is")
    _HOSTS[entry.name] = entry


def unregister(name: str) -> None:
    """Remove host ``name`` (what :func:`register` added)."""
    get(name)
    del _HOSTS[name]
    for key in [k for k, host in _READ.items() if host == name]:
        del _READ[key]  # (read again by the next discover())


def doctors() -> tuple[HostEntry, ...]:
    """The hosts ``dataflex doctor`` can check, the default first."""
    return tuple(e for e in _hosts().values() if e.doctor)


def fallback() -> HostEntry | None:
    """The host of a non-empty config no other host claims."""
    return next((e for e in _hosts().values() if e.fallback), None)


def load(target: str) -> Any:
    """The object a ``"module:function"`` reference names, imported now."""
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)


def describe(name: str, *args: Any, **kwargs: Any) -> Any:
    """Host ``name``'s description of its settings (the arguments its describe takes)."""
    return load(get(name).describe)(*args, **kwargs)
