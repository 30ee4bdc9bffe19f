"""The contract suite on TRL with ``use_vllm=True`` (colocate, vLLM's CPU build): a host parameter of its own
(``trl-vllm``, registered here for the tier, trl_vllm_host.py), every case its description offers carried out as
on the other hosts, the cases it lacks refused (skips derived from its description). Marker ``vllm``: it runs in
the vllm tier's environment and skips, saying why, wherever vllm is not importable."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_allocation_contract import (  # noqa: F401  (the contract cases, run here on TRL with vLLM)
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

NAME = "trl-vllm"
ENTRY = hosts.HostEntry(NAME, "TRL with vLLM", "trl_vllm_host:description",
                        contract=hosts.Contract("trl_vllm_host", requires=("trl", "vllm"), marks=("trl", "vllm")))

pytestmark = [pytest.mark.hosts, pytest.mark.vllm]


@pytest.fixture
def registered() -> Iterator[hosts.HostEntry]:
    hosts.register(ENTRY)
    try:
        yield ENTRY
    finally:
        hosts.unregister(NAME)


@pytest.fixture(params=[NAME])
def host(request, registered, host_under_contract):
    """The contract suite's ``host``, here TRL with vLLM, built the way the suite builds every registered one."""
    return host_under_contract(request.param, request)
