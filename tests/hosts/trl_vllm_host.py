"""TRL's ``GRPOTrainer`` with ``use_vllm=True`` (colocate) as a host of the contract suite: the TRL host's driver
(trl_host.py) with a colocated vLLM engine (vLLM's CPU build, the vllm tier's own environment).

The world's sessions are scripted, as for TRL (its ``rollout_func``), and vLLM is the behaviour policy of every
row: TRL syncs the policy's weights into vLLM before each round, and the scripted completions' sampling
log-probs are vLLM's (``prompt_logprobs`` of prompt + completion). So the host's vLLM path runs: TRL's
``sampling_per_token_logps``, the behaviour log-probs the host offers and stores (vLLM's, not the old ones), its
description under ``use_vllm=True``. TRL's own vLLM correction is off (the suite compares the kit's weights; the
vllm tier's mechanism tests run it on). A tiny Llama of head size 32 (vLLM's CPU attention needs 32 or more).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_tier"))

import trl_host
import vllm_cpu_support

#: TRL's advantages' 1e-4 (trl_host.REL).
REL = trl_host.REL
#: vLLM, the behaviour policy, holds the policy's weights (float32): a fresh row's behaviour log-probs are its old
#: ones to vLLM's kernels' rounding (the suite compares them within its tolerance).
BEHAVIOUR_IS_OLD = True
#: GRPOConfig fields of every run.
VLLM_ARGS = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 64,
             "vllm_gpu_memory_utilization": 0.05, "vllm_importance_sampling_correction": False}


def before_case(request: Any) -> None:
    """vLLM's CPU backend support (tests/vllm_tier/vllm_cpu_support.py) for the case."""
    context = vllm_cpu_support.cpu_backend()
    context.__enter__()
    request.addfinalizer(lambda: context.__exit__(None, None, None))


def _model(tok: Any) -> Any:
    """One layer, 2 heads of 32, saved (vLLM loads the model's folder)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float()
    folder = tempfile.mkdtemp(prefix="dataflex-contract-vllm-")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    model.name_or_path = model.config._name_or_path = folder
    return model


def _rollout(tok: Any) -> Any:
    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        from vllm import SamplingParams

        prompt_ids, completion_ids = trl_host.scripted(tok, prompts)
        llm = trainer.vllm_generation.llm  # TRL synced the policy's weights into it before this call
        outputs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompt_ids, completion_ids)],
                               SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        logprobs = []
        for p, c, out in zip(prompt_ids, completion_ids, outputs):
            scored = out.prompt_logprobs[len(p):]
            logprobs.append([float(step[t].logprob) for t, step in zip(c, scored)])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout_func


def run(block: dict[str, Any] | None, world: Any, *, batch: int, steps: int, tmp_path: Path | None = None,
        settings: Any = ()) -> list[Any]:
    return trl_host.run(block, world, batch=batch, steps=steps, tmp_path=tmp_path, model=_model,
                        rollout=_rollout, args=VLLM_ARGS)


def description(args: dict[str, Any] | None = None) -> Any:
    return trl_host.description({**VLLM_ARGS, **(args or {})})
