"""A download-free TRL fixture: a character-level tokenizer, a 2-layer random Llama, arithmetic prompts and
a scripted ``rollout_func`` (TRL's public generation hook), so two trainers can be fed the very same
completions; and a runner recording what an exactness test compares (every accumulated gradient, the logged
losses, the final parameters).

Nothing here is imported at collection unless trl is installed (the tests import it after ``importorskip``).
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

G = 4
ALPHABET = list("0123456789+-=?:abcdefghijklmnopqrstuvwxyz ")


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *ALPHABET])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


#: The tier's Llama: 2 layers, hidden 32, 4 attention heads (head size 8) sharing 2 key/value heads.
SIZES: dict[str, int] = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                         "num_key_value_heads": 2}
_SAVED: dict[tuple[Any, ...], tuple[LlamaForCausalLM, str]] = {}


def model(tok: PreTrainedTokenizerFast, seed: int = 0, *, tied: bool = False,
          sizes: dict[str, int] | None = None) -> LlamaForCausalLM:
    """The same random weights on every call (per seed, ``sizes`` and ``tied``), saved once to a folder the model
    names as its path (TRL builds the reference model, and vLLM its engine, from the folder)."""
    sizes = {**SIZES, **(sizes or {})}
    key = (seed, tied, *sorted(sizes.items()))
    if key not in _SAVED:
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(tok), num_hidden_layers=2, max_position_embeddings=128,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                          tie_word_embeddings=tied, **sizes)
        m = LlamaForCausalLM(cfg).float()
        m.generation_config.pad_token_id = tok.pad_token_id
        m.generation_config.eos_token_id = tok.eos_token_id
        folder = tempfile.mkdtemp(prefix="dataflex-tiny-llama-")
        m.save_pretrained(folder)
        tok.save_pretrained(folder)
        _SAVED[key] = (m, folder)
    m, folder = _SAVED[key]
    out = copy.deepcopy(m)
    out.config._name_or_path = folder
    out.name_or_path = folder
    return out


def _hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


def completion(prompt: str, answer: str, j: int, width: int) -> str:
    """The ``j``-th scripted sample of ``prompt``: even answers are always right (a flat group), multiples of
    3 always wrong (flat), the rest mixed; lengths vary."""
    h = _hash(prompt, j % G)
    a = int(answer)
    right = True if a % 2 == 0 else False if a % 3 == 0 else h % 2 == 0
    text = answer if right else str((a + 1 + h % 7) % 19)
    return (text + "abcdefgh"[: (h >> 8) % max(1, width - len(text))])[:width]


def rollout(answers: dict[str, str], width: int,
            env_mask: Callable[[list[int]], list[int]] | None = None) -> Callable[..., dict[str, Any]]:
    """``rollout_func``: the same completions for the same (prompt, sample index), the index counted over
    the whole generation batch of every process (a group split across processes gets the same samples).
    ``env_mask``: each completion's TRL ``env_mask`` (0: a token out of the loss) from its ids."""

    def rollout_func(prompts: Sequence[str], trainer: Any) -> dict[str, Any]:
        from accelerate.utils import gather_object

        tok = trainer.processing_class
        everyone = gather_object([list(prompts)])
        seen: dict[str, int] = {}
        mine = []
        for rank, batch in enumerate(everyone):
            for p in batch:
                k = seen.get(p, 0)
                seen[p] = k + 1
                if rank == trainer.accelerator.process_index:
                    mine.append(k)
        prompt_ids, completion_ids = [], []
        for p, j in zip(prompts, mine):
            prompt_ids.append(tok(p, add_special_tokens=False)["input_ids"])
            ids = tok(completion(p, answers[p], j, width), add_special_tokens=False)["input_ids"][:width]
            if _hash("eos", p, j % G) % 2 == 0 and len(ids) < width:
                ids = [*ids, tok.eos_token_id]
            completion_ids.append(ids)
        out: dict[str, Any] = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
        if env_mask is not None:
            out["env_mask"] = [env_mask(ids) for ids in completion_ids]
        return out

    return rollout_func


def correct(completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]


def length(completions: Sequence[str], **_: Any) -> list[float]:
    """A reward that varies within every group (for batch statistics and real-sampling parity)."""
    return [0.1 * len(c) for c in completions]


def prompts(width: int = 6) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Prompts whose scripted groups are mixed, and prompts whose groups are flat (all right or all wrong)."""
    mixed, flat = [], []
    for a in range(10):
        for b in range(10):
            p, ans = f"{a}+{b}=", str(a + b)
            outcomes = {completion(p, ans, j, width).startswith(ans) for j in range(G)}
            (mixed if len(outcomes) == 2 else flat).append({"prompt": p, "answer": ans})
    return mixed, flat


def interleave(keep: list[dict[str, Any]], drop: list[dict[str, Any]], per_keep: int, per_drop: int) -> list[dict]:
    """Generation batches holding ``per_keep`` kept and ``per_drop`` dropped prompts, alternating."""
    out: list[dict[str, Any]] = []
    ki = di = 0
    while ki < len(keep):
        ks, ds = list(keep[ki:ki + per_keep]), list(drop[di:di + per_drop])
        ki, di = ki + per_keep, di + per_drop
        while ks or ds:
            if ds:
                out.append(ds.pop(0))
            if ks:
                out.append(ks.pop(0))
    return out


class Grads(TrainerCallback):
    """Every accumulated gradient, just before the optimizer steps."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        m = getattr(model, "module", model)
        self.grads.append({n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None})


def config(out: str, *, rows_per_gen: int, spg: int = 1, ga: int = 1, processes: int = 1, steps: int = 2,
           width: int = 6, **extra: Any) -> GRPOConfig:
    """Plain SGD, no clipping, constant LR: a step is -lr * grad, so every normaliser shows in the weights."""
    per_device = rows_per_gen // (spg * processes)
    assert per_device * spg * processes == rows_per_gen, (rows_per_gen, spg, processes)
    extra.setdefault("save_strategy", "no")
    return GRPOConfig(output_dir=out, per_device_train_batch_size=per_device, steps_per_generation=spg,
                      gradient_accumulation_steps=ga, num_generations=extra.pop("num_generations", G),
                      max_completion_length=width,
                      max_steps=steps, use_cpu=True, bf16=False, report_to=[], logging_steps=1,
                      gradient_checkpointing=False, shuffle_dataset=False, max_grad_norm=0.0, disable_tqdm=True,
                      **{"seed": 0, "loss_type": "dapo", "optim": "sgd", "learning_rate": 0.5,
                         "lr_scheduler_type": "constant", **extra})


def train(cls: type[GRPOTrainer] = GRPOTrainer, *, rows: list[dict[str, Any]], scripted: bool = True,
          reward_funcs: Sequence[Any] | None = None, width: int = 6, trainer_kwargs: dict[str, Any] | None = None,
          resume: str | None = None, out: str | None = None,
          env_mask: Callable[[list[int]], list[int]] | None = None, policy: LlamaForCausalLM | None = None,
          **cfg: Any) -> dict[str, Any]:
    """Train ``cls`` on ``rows`` (``policy``: the model to train, else :func:`model`'s); returns the trainer,
    gradients, final parameters, logged losses and metrics."""
    tok = tokenizer()
    answers = {r["prompt"]: r["answer"] for r in rows}
    args = config(out or tempfile.mkdtemp(prefix="dataflex-grpo-"), width=width, **cfg)
    grads = Grads()
    trainer = cls(model=policy if policy is not None else model(tok), reward_funcs=list(reward_funcs or [correct]),
                  args=args,
                  train_dataset=Dataset.from_list(rows), processing_class=tok,
                  rollout_func=rollout(answers, width, env_mask) if scripted else None, callbacks=[grads],
                  **(trainer_kwargs or {}))
    trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=resume)
    return {"trainer": trainer, "grads": grads.grads, "out": args.output_dir,
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "logs": [h for h in trainer.state.log_history if "loss" in h]}


def compare(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference over every recorded gradient and the final parameters (0.0: bit-identical)."""
    assert len(a["grads"]) == len(b["grads"]) > 0, (len(a["grads"]), len(b["grads"]))
    pairs = [(x[n], y[n]) for x, y in zip(a["grads"], b["grads"]) for n in y]
    pairs += [(a["params"][n], b["params"][n]) for n in b["params"]]
    worst = 0.0
    for x, y in pairs:
        if not torch.equal(x, y):
            worst = max(worst, float((x - y).abs().max()))
    return worst
