"""TRL's own GRPOTrainer tests (tests/test_grpo_trainer.py of huggingface/trl) run against DataflexGRPOTrainer.

The upstream files are not in this repository (the project carries no other project's code): ``scripts/trl_suite.py
fetch`` copies them from a TRL git checkout or mirror at :data:`COMMIT` into ``tests/trl_suite/upstream/``
(git-ignored), checking each file's git blob id, so every run tests the same bytes. Nothing there: the suite is not
collected and ``test_trl_suite_source.py`` skips, saying how to fetch it.

How a run differs from TRL's own:

* the name the test module imported, ``GRPOTrainer``, is replaced for each test by the variant's class
  (:data:`VARIANTS`): ``no_block`` (``DataflexGRPOTrainer`` with no dataflex block), ``keep_everything`` (the same
  with a selection that keeps every group), ``trl`` (TRL's own class, the baseline); every test runs once per
  variant named in ``DATAFLEX_TRL_SUITE_VARIANTS`` (default ``no_block,keep_everything``);
* the hub models and datasets the tests load are local stand-ins under the same names (:mod:`standins`), offline;
* under bare ``pytest`` only :data:`SUBSET` runs (the rest is deselected, so the main run stays within minutes);
  ``DATAFLEX_TRL_SUITE=all`` (what ``scripts/trl_suite.py run`` sets) runs every test.

Every test here carries the ``trl_suite`` marker.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from trl_upstream import HERE, MODULE, UPSTREAM, upstream_present

#: A selection that keeps every group: the whole dataflex path (scores, decision, relayout) with nothing removed.
KEEP_EVERYTHING = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                   "actuator": {"name": "threshold_band", "params": {"low": 0.0, "high": 1.0}}}
VARIANTS = ("trl", "no_block", "keep_everything")
DEFAULT_VARIANTS = "no_block,keep_everything"

#: What bare ``pytest`` runs (about a minute per variant on 2 cores; the rest is ``scripts/trl_suite.py run``):
#: training with a reward model and with functions, conversational prompts, eval, two iterations, a reference
#: model, the loss types cispo/sapo/luspo/vespo, None rewards, the entropy mask and the entropy graph.
SUBSET = (
    "test_train[trl-internal-testing/tiny-Qwen2ForCausalLM-2.5]",
    "test_train_dataset_format[conversational_prompt_only]",
    "test_train_with_eval",
    "test_train_multiple_iterations",
    "test_train_beta_non_zero",
    "test_train_loss_types[cispo-False]",
    "test_train_loss_types[sapo-False]",
    "test_train_loss_types[luspo-False]",
    "test_train_loss_types[vespo-False]",
    "test_train_multiple_reward_funcs_with_None_output",
    "test_train_with_entropy_filter",
    "test_entropy_bonus_flows_gradients",
)


def variants() -> list[str]:
    names = [v.strip() for v in os.environ.get("DATAFLEX_TRL_SUITE_VARIANTS", DEFAULT_VARIANTS).split(",")
             if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise pytest.UsageError(f"DATAFLEX_TRL_SUITE_VARIANTS names {unknown}; known: {', '.join(VARIANTS)}")
    return names


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: TRL's own marker (its GPU-only tests)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # The upstream folder is a package (its test module imports ``.testing_utils``); without its files there is
    # nothing to collect.
    if collection_path.is_relative_to(UPSTREAM) and not upstream_present():
        return True
    return None


def _in_suite(item: pytest.Item) -> bool:
    return Path(str(item.fspath)).is_relative_to(HERE)


def _base_name(item: pytest.Item) -> str:
    """The test's name without the variant (its first parameter): ``test_train_loss_types[cispo-False]``."""
    name = item.name
    if "[" not in name:
        return name
    stem, params = name[:-1].split("[", 1)
    first, _, rest = params.partition("-")
    if first not in VARIANTS:
        return name
    return f"{stem}[{rest}]" if rest else stem


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    every = os.environ.get("DATAFLEX_TRL_SUITE", "subset") == "all"
    kept, deselected = [], []
    for item in items:
        if _in_suite(item):
            item.add_marker(pytest.mark.trl_suite)
            if not every and item.path.name == MODULE and _base_name(item) not in SUBSET:
                deselected.append(item)
                continue
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.module.__name__.endswith(MODULE.removesuffix(".py")):
        metafunc.parametrize("trl_suite_trainer", variants(), indirect=True)


def _trainer_class(variant: str) -> type:
    from trl import GRPOTrainer

    if variant == "trl":
        return GRPOTrainer
    from dataflex_bus.trl import DataflexGRPOTrainer

    if variant == "no_block":
        return DataflexGRPOTrainer

    class KeepEverythingGRPOTrainer(DataflexGRPOTrainer):
        """DataflexGRPOTrainer with a block that keeps every group (unless a test passes its own)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("dataflex", KEEP_EVERYTHING)
            super().__init__(*args, **kwargs)

    return KeepEverythingGRPOTrainer


@pytest.fixture(scope="session")
def trl_suite_hub(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The stand-ins' hub cache, with the hub client offline and pointed at it for the session."""
    pytest.importorskip("trl")
    import huggingface_hub.constants as hub
    import standins

    cache = tmp_path_factory.mktemp("trl-suite-hub")
    standins.write_models(cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hub, "HF_HUB_CACHE", str(cache))
        mp.setattr(hub, "HF_HUB_OFFLINE", True)
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield cache


@pytest.fixture(autouse=True)
def trl_suite_trainer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """In TRL's test module: the variant's trainer class in place of its ``GRPOTrainer``, the zen stand-in behind
    its ``load_dataset``, the stand-in models on the hub client's path."""
    module = request.module
    if not module.__name__.endswith(MODULE.removesuffix(".py")):
        return None
    import standins

    request.getfixturevalue("trl_suite_hub")
    variant = str(request.param)
    if hasattr(module, "GRPOTrainer"):
        monkeypatch.setattr(module, "GRPOTrainer", _trainer_class(variant))
    if hasattr(module, "load_dataset"):
        monkeypatch.setattr(module, "load_dataset", standins.load_dataset)
    _cpu_configs(monkeypatch)
    return variant


def _cpu_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's configs default to ``bf16=True``, which transformers refuses without an accelerator unless
    ``use_cpu`` is set; TRL's own test conftest sets ``use_cpu=True`` on every config on a CPU-only machine, and
    so does this one (nothing changes where an accelerator exists)."""
    from transformers.testing_utils import torch_device
    from trl.trainer.base_config import _BaseConfig

    if torch_device is not None and torch_device != "cpu":
        return
    post_init = _BaseConfig.__post_init__

    def on_cpu(self: Any) -> None:
        self.use_cpu = True
        post_init(self)

    monkeypatch.setattr(_BaseConfig, "__post_init__", on_cpu)


def _compat() -> None:
    """TRL's testing_utils at :data:`COMMIT` imports ``trl.import_utils.is_joblib_available``, which the installed
    TRL 1.16.0 no longer defines: supply it (joblib importable or not) so the helpers import."""
    import trl.import_utils as trl_imports

    if not hasattr(trl_imports, "is_joblib_available"):
        trl_imports.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None  # type: ignore[attr-defined]


if importlib.util.find_spec("trl") is not None and upstream_present():
    _compat()
