"""A test-only host, "lean": proof that a host is one folder plus one registration.

This folder is the whole host: its describe and contract driver (``driver.py``: the shim's step under another
name, lacking two capabilities) and its doctor (``doctor.py``); :data:`ENTRY` is its registration, read by the
registry through the ``dataflex.hosts`` entry-point group exactly as an installed package's host is
(``tests/hosts/test_lean_host.py`` installs the entry point ``lean = lean_host:ENTRY``). It imports the core only
through ``dataflex_bus.kit``. Nothing else in the project names it: the CLI's ``doctor --host``, config sniffing
and the contract suite find it through the registry.
"""

from __future__ import annotations

from dataflex_bus.kit import Contract, HostEntry

NAME = "lean"

ENTRY = HostEntry(NAME, "the lean test host", "lean_host.driver:description", doctor="lean_host.doctor:cmd_doctor",
                  claims="lean_host.driver:claims", doctor_config="a YAML file with a `lean:` section",
                  doctor_overrides="none", contract=Contract("lean_host.driver"))
