"""Test-only CPU backend that lets verl 0.9.1's real ``main_ppo`` train on a CPU box.

Loaded into the driver and every Ray worker through verl's own hook ``VERL_USE_EXTERNAL_MODULES=verl_cpu``
(``verl/__init__.py`` imports it right after ``DataProto``), so it must stay importable by that name on
``PYTHONPATH`` (the e2e harness puts ``tests/e2e`` there). It never ships with the package.

What verl 0.9.1 lacks for CPU, and what this module supplies (docs: shared spec ``verl.md`` section 14):

* **A platform** (``PlatformRegistry`` + ``set_platform``): device ``cpu``, collectives ``gloo``, and a
  device module that answers the memory/stream/RNG calls verl makes on ``torch.cuda``.
* **A process group without a duplicate device**: verl asks for ``"cpu:gloo,<device>:<backend>"``, which
  is ``"cpu:gloo,cpu:gloo"`` here; the wrapper asks for plain ``gloo``.
* **A training engine**: verl registers its FSDP engines for ``cuda``/``npu``; ``VERL_ENGINE_DEVICE`` (verl's
  own override) makes the ``cuda`` registration serve ``cpu`` (FSDP2 runs on gloo).
* **A rollout backend** ``cpu_hf`` registered in ``RolloutReplicaRegistry`` and ``_ROLLOUT_REGISTRY``: a Ray
  actor per replica running HF ``forward`` token by token, weights pushed by the ``naive`` checkpoint
  engine through :class:`CPUServerAdapter`.

Sampling is seeded per request so that two runs from the same weights produce the same rollouts: the seed
of a request is a hash of (``rollout.seed``, the trainer's ``global_steps`` of the weights, the prompt token
ids, how many requests with the same prompt these weights have already served). ``global_steps``, not a
count of weight pushes, so that a run resumed from step ``k`` seeds step ``k + 1`` as the uninterrupted
run does. The ``n`` samples of a GRPO group share a prompt, so they get seeds ``0..n-1`` in arrival order:
arrival order may differ between runs, but the group's set of responses does not, and neither does
anything GRPO computes from it (the harness trains one PPO mini-batch per step, so the row order within
the batch does not matter either).

Test-only knobs, read from the run's environment (Ray workers inherit it), so the e2e tier can make verl's
real agent loop meet what a GPU server does to it:

* ``DATAFLEX_CPU_HF_DELAY=<seconds>``: each request waits up to that long before generating, the wait drawn
  from the request's seed (reproducible run after run), so requests finish in another order than they arrived.
* ``DATAFLEX_CPU_HF_FAIL=<k>``: the ``k``-th request the server receives in the run (0-based, arrival order)
  raises instead of generating: one failed session, so its group is verl's ``failure``.
* ``DATAFLEX_CPU_HF_JOURNAL=<path>``: every request appends ``arrived <k>``, then ``done <k>`` or
  ``failed <k>``, so a test can see the completion order it caused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import zlib
from collections import Counter
from types import SimpleNamespace
from typing import Any

import ray
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform
from verl.utils import distributed as verl_distributed
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

log = logging.getLogger("verl_cpu")

#: ``actor_rollout_ref.rollout.name`` of the CPU backend.
ROLLOUT_NAME = "cpu_hf"
#: The test-only knobs (module docstring).
DELAY_ENV, FAIL_ENV, JOURNAL_ENV = "DATAFLEX_CPU_HF_DELAY", "DATAFLEX_CPU_HF_FAIL", "DATAFLEX_CPU_HF_JOURNAL"


class InjectedFailure(RuntimeError):
    """The one request ``DATAFLEX_CPU_HF_FAIL`` names."""


def request_delay(seed: int, longest: float) -> float:
    """The seconds a request waits before generating: a share of ``longest`` drawn from its seed."""
    return longest * (seed % 1009) / 1008 if longest > 0 else 0.0


# ---------------------------------------------------------------------------------------------- platform
def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


#: What verl calls on ``get_torch_device()`` (``torch.cuda`` on GPUs), answered for host memory.
CPU_DEVICE_MODULE = SimpleNamespace(
    is_available=lambda: True,
    current_device=lambda: "cpu",
    device_count=lambda: 1,
    set_device=_nothing,
    synchronize=_nothing,
    empty_cache=_nothing,
    ipc_collect=_nothing,
    set_per_process_memory_fraction=_nothing,
    memory_allocated=_zero,
    max_memory_allocated=_zero,
    memory_reserved=_zero,
    max_memory_reserved=_zero,
    mem_get_info=lambda *_a, **_k: (1 << 40, 1 << 40),
    get_device_name=lambda *_a, **_k: "cpu",
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=lambda *_a, **_k: torch.get_rng_state(),
    set_rng_state=lambda state, *_a, **_k: torch.set_rng_state(state),
    current_stream=torch.cpu.current_stream,
    stream=torch.cpu.stream,
    Stream=torch.cpu.Stream,
    Event=torch.cpu.Event,
)


class PlatformCPU(PlatformBase):
    """verl platform for host-only runs (device ``cpu``, collectives ``gloo``).

    The Ray resource stays ``GPU``: verl's resource pools always ask for GPUs
    (``single_controller/ray/base.py``), so the harness declares one logical GPU to Ray.
    """

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> Any:
        # A string, not 0: verl reads an int as "accelerator 0" (fsdp_utils) and moves tensors there.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


# ---------------------------------------------------------------------------------------------- sampling
def request_seed(base_seed: int, version: int, prompt_ids: list[int], occurrence: int) -> int:
    """A 63-bit seed from the request's content (stable across processes, unlike ``hash``)."""
    payload = torch.tensor([base_seed, version, occurrence, *prompt_ids], dtype=torch.int64).numpy().tobytes()
    high, low = zlib.crc32(payload), zlib.adler32(payload)
    return ((high << 31) ^ low) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's top-k / top-p filtering on one row of logits (``top_k <= 0``: off, ``top_p >= 1``: off)."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        order = torch.argsort(logits, descending=True)
        probs = torch.softmax(logits[order], dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


@ray.remote(num_cpus=0)
class CPUGenerateServer:
    """One rollout replica: an HF causal LM generating token by token, one request at a time.

    Implements the calls verl 0.9.1 makes on a rollout server actor (``LLMServerClient.generate``, the
    replica's sleep/wake/abort/cache methods, ``set_global_steps``) plus ``load_weights`` for
    :class:`CPUServerAdapter`.
    """

    def __init__(self, config: Any, model_path: str, replica_rank: int) -> None:
        from transformers import AutoModelForCausalLM

        # One thread: the box has two cores shared with the trainer, and a fixed thread count keeps
        # every reduction in the same order run after run.
        torch.set_num_threads(1)
        self.config = config
        self.replica_rank = replica_rank
        self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.global_steps: int | None = None
        self.served: Counter[tuple[int, ...]] = Counter()
        self.arrived = 0  # requests received in the run, the DATAFLEX_CPU_HF_FAIL ordinal
        self.longest_delay = float(os.environ.get(DELAY_ENV, "0") or 0)
        fail = os.environ.get(FAIL_ENV, "")
        self.fail_ordinal = int(fail) if fail else None
        self.journal = os.environ.get(JOURNAL_ENV) or None

    def _note(self, what: str, ordinal: int) -> None:
        if self.journal is not None:
            with open(self.journal, "a") as fh:
                fh.write(f"{what} {ordinal}\n")

    # ------------------------------------------------------------------ generation
    def _max_tokens(self, prompt_len: int, sampling_params: dict[str, Any]) -> int:
        cfg = self.config
        max_model_len = cfg.max_model_len or (cfg.prompt_length + cfg.response_length)
        room = max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room within max_model_len={max_model_len}")
        wanted = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
        if wanted is None:
            wanted = min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)
        return max(1, min(int(wanted), room))

    @torch.no_grad()
    def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], seed: int
                  ) -> tuple[list[int], list[float]]:
        temperature = float(sampling_params.get("temperature", 1.0))
        top_k = int(sampling_params.get("top_k", -1) or -1)
        top_p = float(sampling_params.get("top_p", 1.0))
        ignore_eos = bool(sampling_params.get("ignore_eos", False))
        generator = torch.Generator().manual_seed(seed)
        max_tokens = self._max_tokens(len(prompt_ids), sampling_params)
        inputs = torch.tensor([prompt_ids], dtype=torch.long)
        past = None
        tokens: list[int] = []
        log_probs: list[float] = []
        for _ in range(max_tokens):
            out = self.model(input_ids=inputs, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            if temperature <= 0:
                token = int(torch.argmax(logits))
                logp = torch.log_softmax(logits, dim=-1)
            else:
                # The trainer recomputes log-probs with logits / temperature (no top-k/p), as vLLM reports.
                logp = torch.log_softmax(logits / temperature, dim=-1)
                probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            tokens.append(token)
            log_probs.append(float(logp[token]))
            if token in self.eos_ids and not ignore_eos:
                break
            inputs = torch.tensor([[token]], dtype=torch.long)
        return tokens, log_probs

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **_kwargs: Any) -> TokenOutput:
        if image_data is not None or video_data is not None:
            raise NotImplementedError("the cpu_hf rollout is text-only")
        prompt = tuple(int(t) for t in prompt_ids)
        occurrence = self.served[prompt]
        self.served[prompt] += 1
        version = -1 if self.global_steps is None else int(self.global_steps)
        seed = request_seed(int(self.config.seed), version, list(prompt), occurrence)
        ordinal, self.arrived = self.arrived, self.arrived + 1
        self._note("arrived", ordinal)
        # Everything above ran at arrival (the seed too): the wait reorders completions, not samples.
        delay = request_delay(seed, self.longest_delay)
        if delay:
            await asyncio.sleep(delay)
        if ordinal == self.fail_ordinal:
            self._note("failed", ordinal)
            raise InjectedFailure(f"cpu_hf: request {ordinal} of the run fails ({FAIL_ENV}={ordinal}, test-only)")
        tokens, log_probs = self._generate(list(prompt), dict(sampling_params), seed)
        self._note("done", ordinal)
        want_logprobs = bool(sampling_params.get("logprobs", False))
        return TokenOutput(token_ids=tokens, log_probs=log_probs if want_logprobs else None,
                           stop_reason="completed", extra_fields={"global_steps": self.global_steps})

    # ------------------------------------------------------------------ weights
    def load_weights(self, named: dict[str, torch.Tensor], global_steps: int | None) -> int:
        """Load a full HF state dict pushed by the trainer; returns how many tensors were loaded."""
        own = self.model.state_dict()
        unknown = sorted(set(named) - set(own))
        if unknown:
            raise KeyError(f"cpu_hf rollout: weights the model does not have: {unknown[:5]}")
        missing = [k for k in own if k not in named and not self._tied(k)]
        if missing:
            raise KeyError(f"cpu_hf rollout: the trainer sent no value for {missing[:5]}")
        self.model.load_state_dict({k: v.to(torch.float32) for k, v in named.items()}, strict=False)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        self.served.clear()
        if global_steps is not None:
            self.global_steps = global_steps
        return len(named)

    def _tied(self, key: str) -> bool:
        return key == "lm_head.weight" and bool(getattr(self.model.config, "tie_word_embeddings", False))

    async def set_global_steps(self, global_steps: int) -> None:
        if global_steps != self.global_steps:
            self.served.clear()
        self.global_steps = global_steps

    # ------------------------------------------------------------------ lifecycle calls verl makes
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        # Requests run to completion inside one actor call, so nothing is ever in flight here.
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id}

    async def start_profile(self, **_kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def server_name(replica_rank: int) -> str:
    return f"{ROLLOUT_NAME}_server_{replica_rank}"


class CPUReplica(RolloutReplica):
    """A ``cpu_hf`` replica: one :class:`CPUGenerateServer` actor (hybrid mode, tensor parallel 1)."""

    async def launch_servers(self) -> None:
        if self.world_size != 1:
            raise ValueError(f"cpu_hf rollout supports tensor/data/pipeline parallel 1, got world size "
                             f"{self.world_size}")
        model_path = self.model_config.get("local_path") or self.model_config["path"]
        server = CPUGenerateServer.options(name=server_name(self.replica_rank)).remote(
            config=self.config, model_path=model_path, replica_rank=self.replica_rank)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{ROLLOUT_NAME}-replica-{self.replica_rank}"

    def rollout_worker_use_gpu(self) -> bool:
        return False


class CPUServerAdapter(rollout_base.BaseRollout):
    """The rollout side inside each hybrid actor worker: pushes the trainer's weights to the server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank if replica_rank == -1 else replica_rank
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Any, global_steps: int | None = None,
                             wire_format: str = "named_tensors", **_kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"cpu_hf rollout takes full named tensors, not {wire_format!r}")
        named = {}
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                named[name] = tensor.detach().to("cpu").clone()
        else:
            for name, tensor in weights:
                named[name] = tensor.detach().to("cpu").clone()
        await self._server_handle().load_weights.remote(named, global_steps)


# ---------------------------------------------------------------------------------------------- install
def _gloo_process_group(original):
    def initialize(timeout_second: int | None = None, backend: str | None = None) -> None:
        # verl builds "cpu:gloo,<device>:<backend>", a duplicate "cpu" entry when the device is the CPU.
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize.__wrapped__ = original
    return initialize


def install() -> None:
    """Register the CPU platform, process group, engine device and rollout backend in this process."""
    PlatformRegistry.register("cpu")(PlatformCPU)
    set_platform(PlatformCPU())
    if not hasattr(verl_distributed.initialize_global_process_group_ray, "__wrapped__"):
        verl_distributed.initialize_global_process_group_ray = _gloo_process_group(
            verl_distributed.initialize_global_process_group_ray)
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: CPUReplica)
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.CPUServerAdapter"


install()
