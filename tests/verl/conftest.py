"""Fixtures of the verl tier: one Ray + TransferQueue session shared by every ``tq`` test.

Nothing here imports verl at module import, so collecting this directory costs nothing when the verl
tier is deselected (``-m "not verl"``).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def tq_session():
    """Ray with 4 logical CPUs and a 1-unit TransferQueue.

    The TQ controller and each storage unit reserve one Ray CPU; TQ's default of 2 units under
    ``num_cpus=2`` would block ``tq.init`` forever (verl.md section 8).
    """
    pytest.importorskip("verl")
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    if started:
        ray.shutdown()


@pytest.fixture
def clean_partition(tq_session):
    """Start and end each test with an empty ``train`` partition (and assert the trainer left it empty)."""
    _clear(tq_session)
    yield tq_session
    _clear(tq_session)


def _clear(tq) -> None:
    for partition, items in (tq.kv_list() or {}).items():
        if items:
            tq.kv_clear(keys=list(items), partition_id=partition)


@pytest.fixture
def verl_components():
    """Register the tests' small components in-process (see verl_components.py)."""
    import verl_components  # noqa: F401  (registers on import)

    yield


@pytest.fixture
def H(clean_partition, verl_components):
    """The harness module (verl_harness.py) with an empty TransferQueue partition and the tests' components."""
    import verl_harness

    return verl_harness
