"""The vllm tier's models and runs: the TRL tier's fixture (tests/trl_tier/trl_tiny.py: tokenizer, Llama builder,
GRPOConfig, trainer run, reward functions, comparison) with what vLLM needs: a Llama vLLM's CPU attention accepts
(head size 32: hidden 128, 4 heads, 2 layers), TRL's colocated vLLM generation instead of scripted completions,
arithmetic prompts, and a trainer that also records every vLLM generation (prompt and completion ids, sampling
log-probs) and every micro-batch TRL's loss received.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import vllm_cpu_support  # noqa: F401  (the backend's environment, before torch and vLLM load)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trl_tier"))

import trl_tiny
from transformers import LlamaForCausalLM
from trl import GRPOTrainer

from dataflex_bus.trl.rows import BEHAVIOUR, REAL, WEIGHTS

G = trl_tiny.G
tokenizer, correct, length, compare = trl_tiny.tokenizer, trl_tiny.correct, trl_tiny.length, trl_tiny.compare
#: Head size 32 (vLLM's CPU attention takes 32 or more), every head its own key/value head.
SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4}
#: GRPOConfig fields of every run: TRL's vLLM generation in the trainer's process, a small engine.
VLLM_COLOCATE: dict[str, Any] = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 64,
                                 "vllm_gpu_memory_utilization": 0.05}


def model(seed: int = 0, tied: bool = False) -> LlamaForCausalLM:
    """The tier's Llama (:data:`SIZES`), the same random weights on every call, saved once to a folder vLLM and TRL's
    reference model load."""
    return trl_tiny.model(tokenizer(), seed, tied=tied, sizes=SIZES)


def rows(n: int = 32, start: int = 0) -> list[dict[str, Any]]:
    """``n`` arithmetic prompts ``"a+b="`` with their answers (domains ``"even"``/``"odd"`` by the answer)."""
    out = []
    for k in range(start, start + n):
        a, b = divmod(k % 100, 10)
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "domain": "even" if (a + b) % 2 == 0 else "odd"})
    return out


def _recording(cls: type[GRPOTrainer]) -> type[GRPOTrainer]:
    """``cls`` recording every vLLM generation and every micro-batch its loss trains, its engine released when
    training ends."""

    class Recording(cls):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.generations: list[dict[str, Any]] = []
            self.updates: list[dict[str, Any]] = []
            super().__init__(*args, **kwargs)

        def train(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().train(*args, **kwargs)
            finally:
                release(self)

        def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            completion_ids, logprobs = out[0], out[1]
            self.generations.append({"prompt_ids": [list(p) for p in prompt_ids],
                                     "completion_ids": [list(c) for c in completion_ids],
                                     "logprobs": None if logprobs is None else [list(x) for x in logprobs]})
            return out

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            keep = ("prompt_ids", "completion_ids", "completion_mask", "tool_mask", "advantages", WEIGHTS, REAL,
                    "old_per_token_logps", "sampling_per_token_logps", "importance_sampling_ratio", BEHAVIOUR)
            self.updates.append({k: v.detach().cpu().clone() for k, v in inputs.items() if k in keep})
            return super()._compute_loss(model, inputs)

    Recording.__name__ = Recording.__qualname__ = f"Recording{cls.__name__}"
    return Recording


def train(cls: type[GRPOTrainer] = GRPOTrainer, *, data: Sequence[dict[str, Any]] | None = None,
          reward_funcs: Sequence[Any] | None = None, tied: bool = False, rows_per_gen: int = 16,
          **kw: Any) -> dict[str, Any]:
    """Train ``cls`` (with vLLM colocate) on ``data`` through the TRL tier's runner (``kw``: its and GRPOConfig's
    arguments); what the tests compare, plus every vLLM generation and loss micro-batch."""
    run = trl_tiny.train(_recording(cls), rows=list(data or rows()), scripted=False,
                         reward_funcs=list(reward_funcs or [correct, length]), policy=model(tied=tied),
                         rows_per_gen=rows_per_gen, **{**VLLM_COLOCATE, **kw})
    run.update(generations=run["trainer"].generations, updates=run["trainer"].updates)
    return run


def release(trainer: Any) -> None:
    """The colocated engine shut down, so the next trainer of the process can build its own."""
    gen = getattr(trainer, "vllm_generation", None)
    llm = getattr(gen, "llm", None)
    if llm is None:
        return
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        shutdown()
    gen.llm = None
    gc.collect()
