"""The vllm tier's models and runs: a tiny random Llama vLLM's CPU attention accepts (head size 32: hidden 128,
4 heads, 2 layers) saved with a locally built tokenizer, arithmetic prompts, and a runner training a TRL trainer
with ``use_vllm=True`` (colocate) that records what the exactness tests compare: every accumulated gradient, the
final parameters, the logged losses, every vLLM generation (prompt and completion ids, sampling log-probs) and
every micro-batch TRL's loss received.

The tokenizer, reward functions and comparison are the TRL tier's (tests/trl_tier/trl_tiny.py).
"""

from __future__ import annotations

import copy
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import vllm_cpu_support  # noqa: F401  (the backend's environment, before torch and vLLM load)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trl_tier"))

import torch
import trl_tiny
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from dataflex_bus.trl.rows import BEHAVIOUR, REAL, WEIGHTS

G = 4
tokenizer, correct, length, compare, Grads = (trl_tiny.tokenizer, trl_tiny.correct, trl_tiny.length,
                                              trl_tiny.compare, trl_tiny.Grads)
_SAVED: dict[tuple[int, bool], tuple[LlamaForCausalLM, str]] = {}


def model(seed: int = 0, tied: bool = False) -> LlamaForCausalLM:
    """The same random weights on every call, saved once to a folder vLLM and TRL's reference model load."""
    key = (seed, tied)
    if key not in _SAVED:
        tok = tokenizer()
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                          tie_word_embeddings=tied)
        m = LlamaForCausalLM(cfg).float()
        m.generation_config.pad_token_id = tok.pad_token_id
        m.generation_config.eos_token_id = tok.eos_token_id
        folder = tempfile.mkdtemp(prefix="dataflex-vllm-llama-")
        m.save_pretrained(folder)
        tok.save_pretrained(folder)
        _SAVED[key] = (m, folder)
    m, folder = _SAVED[key]
    out = copy.deepcopy(m)
    out.config._name_or_path = folder
    out.name_or_path = folder
    return out


def rows(n: int = 32, start: int = 0) -> list[dict[str, Any]]:
    """``n`` arithmetic prompts ``"a+b="`` with their answers (domains ``"even"``/``"odd"`` by the answer)."""
    out = []
    for k in range(start, start + n):
        a, b = divmod(k % 100, 10)
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "domain": "even" if (a + b) % 2 == 0 else "odd"})
    return out


def config(out: str, *, rows_per_gen: int = 16, spg: int = 1, ga: int = 1, steps: int = 2, width: int = 6,
           **extra: Any) -> GRPOConfig:
    """Colocated vLLM; plain SGD, no clipping, constant LR (every normaliser shows in the weights)."""
    per_device = rows_per_gen // spg
    extra.setdefault("save_strategy", "no")
    return GRPOConfig(output_dir=out, per_device_train_batch_size=per_device, steps_per_generation=spg,
                      gradient_accumulation_steps=ga, num_generations=extra.pop("num_generations", G),
                      max_completion_length=width, max_steps=steps, use_cpu=True, bf16=False, report_to=[],
                      logging_steps=1, gradient_checkpointing=False, shuffle_dataset=False, max_grad_norm=0.0,
                      disable_tqdm=True, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,
                      vllm_gpu_memory_utilization=0.05,
                      **{"seed": 0, "loss_type": "dapo", "optim": "sgd", "learning_rate": 0.5,
                         "lr_scheduler_type": "constant", **extra})


def _recording(cls: type[GRPOTrainer]) -> type[GRPOTrainer]:
    """``cls`` recording every vLLM generation and every micro-batch its loss trains."""

    class Recording(cls):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.generations: list[dict[str, Any]] = []
            self.updates: list[dict[str, Any]] = []
            super().__init__(*args, **kwargs)

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
          reward_funcs: Sequence[Any] | None = None, trainer_kwargs: dict[str, Any] | None = None,
          tied: bool = False, **cfg: Any) -> dict[str, Any]:
    """Train ``cls`` (with vLLM colocate) on ``data``; what the tests compare."""
    tok = tokenizer()
    args = config(tempfile.mkdtemp(prefix="dataflex-vllm-grpo-"), **cfg)
    grads = Grads()
    trainer = _recording(cls)(model=model(tied=tied), reward_funcs=list(reward_funcs or [correct, length]),
                              args=args, train_dataset=Dataset.from_list(list(data or rows())),
                              processing_class=tok, callbacks=[grads], **(trainer_kwargs or {}))
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    finally:
        release(trainer)
    return {"trainer": trainer, "grads": grads.grads,
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "generations": trainer.generations, "updates": trainer.updates}


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
    import gc

    gc.collect()
