"""A test-only host registered through the registry (``lean_host/``: its folder and its ``ENTRY``) passes the
contract cases its description offers, is refused the ones it lacks, and is reached by ``dataflex doctor`` and
config sniffing with no edit anywhere else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lean_host import ENTRY, NAME
from lean_host.driver import LACKS
from test_allocation_contract import (  # noqa: F401  (the contract cases, run here on the lean host)
    test_an_absurd_size_is_refused_at_validation_on_every_host,
    test_an_allocations_counts_are_the_rollouts_generated,
)
from test_contract import (  # noqa: F401
    reference,
    test_a_field_the_host_lacks_is_refused_naming_the_host,
    test_every_capability_the_host_lacks_is_refused_naming_the_host,
    test_the_same_decisions_are_carried_out_the_same_way,
)

from dataflex_bus import hosts

pytestmark = pytest.mark.hosts


def installed(site: Path, dist: str, entry_points: str) -> None:
    """A distribution as pip installs one in ``site`` (put on ``sys.path``): its metadata and entry points."""
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def registered(tmp_path_factory, monkeypatch) -> Iterator[hosts.HostEntry]:
    """The lean host registered as an installed package registers one (its one registration): an entry point
    of the ``dataflex.hosts`` group, read by the registry."""
    site = tmp_path_factory.mktemp("site")
    installed(site, "lean_host", f"[{hosts.GROUP}]\n{NAME} = lean_host:ENTRY\n")
    monkeypatch.syspath_prepend(str(site))
    assert hosts.discover() == [ENTRY]
    try:
        yield ENTRY
    finally:
        hosts.unregister(NAME)


def test_a_host_entry_point_that_fails_is_left_out_naming_it(tmp_path, monkeypatch, caplog):
    """A broken host package leaves the command line working: it is left out with a warning naming it."""
    installed(tmp_path, "broken_hosts", f"[{hosts.GROUP}]\nbroken = no_such_module_k45:ENTRY\n"
                                        "notentry = lean_host:NAME\nagain = lean_host:ENTRY\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hosts.register(ENTRY)  # (so the entry point "again" takes a name already registered)
    names = [e.name for e in hosts.registered()]
    try:
        with caplog.at_level("WARNING", logger="dataflex_bus"):
            assert hosts.discover() == []
        text = caplog.text
        assert "'broken' (no_such_module_k45:ENTRY)" in text and "'broken_hosts'" in text and "failed to load" in text
        assert "'notentry' (lean_host:NAME)" in text and "names a str, not a dataflex_bus.hosts.HostEntry" in text
        assert "'again' (lean_host:ENTRY)" in text and f"host {NAME!r} is registered already" in text
        assert [e.name for e in hosts.registered()] == names
    finally:
        hosts.unregister(NAME)


@pytest.fixture(params=[NAME])
def host(request, registered, host_under_contract):
    """The contract suite's ``host``, here the lean host, built the way the suite builds every registered one."""
    return host_under_contract(request.param, request)


def test_the_lean_host_lacks_what_it_says(registered):
    description = hosts.describe(NAME)
    assert description.name == NAME and not set(LACKS) & description.capabilities
    assert NAME in [e.name for e in hosts.registered()]


def test_an_unknown_host_names_the_registered_ones():
    with pytest.raises(hosts.UnknownHostError, match=r"no host 'nowhere' is registered \(registered: shim, verl"):
        hosts.get("nowhere")


def test_a_registered_host_is_sniffed_and_doctored_through_the_registry(registered, tmp_path, capsys, monkeypatch):
    from dataflex_bus import logs
    from dataflex_bus.checkconfig import config_host
    from dataflex_bus.cli import build_parser, main

    assert config_host({"lean": {}, "dataflex": {}}) == (NAME, "it has a `lean:` section")
    doctor = build_parser()._subparsers._group_actions[0].choices["doctor"]
    assert NAME in next(a for a in doctor._actions if "--host" in a.option_strings).choices
    path = tmp_path / "lean.yaml"
    path.write_text("lean: {}\n")
    monkeypatch.setattr(logs, "configure", lambda **_: None)  # the command's log set-up would outlive capsys
    assert main(["doctor", "--config", str(path)]) == 0
    captured = capsys.readouterr()
    assert "[  ok] lean host" in captured.out and f"checking host {NAME!r}" in captured.err
