"""TRL's ``GRPOTrainer`` as a host of the contract suite: the real :class:`DataflexGRPOTrainer` (TRL's
``train`` loop, its reward gathering, advantages and loss inputs; the kit's decisions, the removal and
re-layout of rows, the refill rounds) on a tiny random Llama, with only the generation scripted.

The scripted generation is TRL's public ``rollout_func``: each prompt's rollouts are the world's sessions
(the first completion token is the session's digit, the length the world's response length, the last token
EOS), and the reward function reads the world's reward back from that digit and the ``data_source`` column.
What the update trains on is recorded where TRL's loss receives it (``_compute_loss``: rows, advantages,
weights, loss-mask tokens).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from world import N, StepRecord, World, add_row, kit_metrics, response_length, reward, row_record

#: TRL's GRPO advantage divides by the group std + 1e-4 (hard-coded in TRL), the shim's and verl's by std + 1e-6:
#: advantages and what derives from them (weights, a mixer's statistics) agree to about 2e-4 relative.
REL = 1e-3
#: Transformers' generation samples with the policy that computes a step's old log-probs.
BEHAVIOUR_IS_OLD = True
#: The seed of the host's prompt stream and domain sampler (the shim driver's verl data.seed).
SEED = 7


def _recording_trainer() -> Any:
    from dataflex_bus.trl import DataflexGRPOTrainer
    from dataflex_bus.trl.rows import BEHAVIOUR, REAL, WEIGHTS

    class Recording(DataflexGRPOTrainer):
        """Records every micro-batch the loss trains and the domain probabilities each step publishes."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.updates: list[tuple[int, bool, dict[str, Any]]] = []
            self.published: list[dict[str, float] | None] = []

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            real = inputs.get(REAL)
            keep = {k: v.detach().cpu() for k, v in inputs.items() if k in (
                "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages", WEIGHTS,
                "old_per_token_logps", BEHAVIOUR)}
            keep["real"] = None if real is None else real.detach().cpu()
            self.updates.append((self.dataflex_batch.generations - 1, self.dataflex_batch.skip, keep))
            return super()._compute_loss(model, inputs)

        def _dfx_end(self) -> None:
            super()._dfx_end()
            self.published.append(self.dataflex.domain_probs)

    return Recording


def _tokenizer() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"0123456789 abcdefghijklmnopqrstuvwxyz"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _model(tok: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(cfg).float()


def scripted(tok: Any, prompts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """The world's sessions of ``prompts`` as token ids: ``(prompt_ids, completion_ids)``."""
    digit = {str(i): tok.convert_tokens_to_ids(str(i)) for i in range(10)}
    seen: dict[str, int] = {}
    prompt_ids, completion_ids = [], []
    for p in prompts:
        session = seen.get(p, 0) % N
        seen[p] = seen.get(p, 0) + 1
        row = int(p.split()[1])
        length = response_length(row, session)
        prompt_ids.append(tok(p, add_special_tokens=False)["input_ids"])
        completion_ids.append([digit[str(session)]] + [digit["0"]] * (length - 2) + [tok.eos_token_id])
    return prompt_ids, completion_ids


def _rollout(tok: Any) -> Any:
    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        prompt_ids, completion_ids = scripted(tok, prompts)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout_func


def world_reward(completions: list[str], data_source: list[str], **_: Any) -> list[float]:
    """The world's reward of each rollout: its domain and session (the completion's first character)."""
    return [reward(domain, int(text[0])) for text, domain in zip(completions, data_source)]


def _args(out: str, *, batch: int, steps: int, **extra: Any) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(output_dir=out, per_device_train_batch_size=batch * N, num_generations=N,
                      max_completion_length=6, max_steps=steps, use_cpu=True, bf16=False, report_to=[],
                      logging_steps=1, save_strategy="no", gradient_checkpointing=False, shuffle_dataset=False,
                      seed=SEED, learning_rate=1e-3, disable_tqdm=True, **extra)


def run(block: dict[str, Any] | None, world: World, *, batch: int, steps: int,
        tmp_path: Path | None = None, settings: Any = (), model: Any = None, rollout: Any = None,
        args: dict[str, Any] | None = None) -> list[StepRecord]:
    """``steps`` steps of ``block`` on the world (``settings``: another host's framework settings a case needs,
    none here). A variant of the host (TRL with vLLM, trl_vllm_host.py) gives its ``model(tok)``, its
    ``rollout(tok)`` (the scripted ``rollout_func``) and more ``GRPOConfig`` ``args``."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    from dataflex_bus.trl.rows import BEHAVIOUR

    tok = _tokenizer()
    rows = [{"prompt": f"{domain} {row}", "data_source": domain} for domain, row in world.prompts]
    out = str(tmp_path or tempfile.mkdtemp(prefix="dataflex-trl-host-"))
    trainer = _recording_trainer()(model=(model or _model)(tok), reward_funcs=[world_reward],
                                   args=_args(out, batch=batch, steps=steps, **(args or {})),
                                   train_dataset=Dataset.from_list(rows), processing_class=tok,
                                   rollout_func=(rollout or _rollout)(tok), dataflex=block)
    trainer.remove_callback(PrinterCallback)
    # Rows recorded in the host's order, fresh before replayed (a prompt's k-th row in a step is the same row on
    # every host): TRL's shuffle of a generation batch that is one micro-batch changes nothing it trains.
    import trl.trainer.grpo_trainer as grpo

    shuffle = grpo.shuffle_sequence_dict
    grpo.shuffle_sequence_dict = lambda batch: batch
    try:
        trainer.train()
    finally:
        grpo.shuffle_sequence_dict = shuffle
        llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
        if llm is not None:  # a colocated vLLM engine: let go before the next trainer builds its own
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            trainer.vllm_generation.llm = None
    records = [StepRecord(metrics=kit_metrics(m), domain_probs=p)
               for m, p in zip(trainer.dataflex_metrics, trainer.published)]
    for index, skipped, inputs in trainer.updates:
        record = records[index]
        if skipped:
            record.skipped = True
            continue
        real = inputs["real"]
        weights = inputs.get("dataflex_weights")
        for i in range(inputs["completion_ids"].size(0)):
            if real is not None and not bool(real[i]):
                continue
            ids = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
            domain, row = tok.decode(ids).split()
            session = int(tok.convert_ids_to_tokens(int(inputs["completion_ids"][i, 0])))
            mask = inputs["completion_mask"][i]  # TRL's loss mask: completion_mask x tool_mask
            mask = mask if "tool_mask" not in inputs else mask * inputs["tool_mask"][i]
            adv = inputs["advantages"][i]
            adv = adv.expand(mask.numel()) if adv.dim() == 0 else adv
            old, mu = inputs.get("old_per_token_logps"), inputs.get(BEHAVIOUR)
            add_row(record, domain, int(row), session,
                    row_record(adv, None if weights is None else weights[i], mask, None if old is None else old[i],
                               None if mu is None else mu[i]))
    return records


def description(args: dict[str, Any] | None = None) -> Any:
    from dataflex_bus.trl.host import describe

    return describe({"num_generations": N, "loss_type": "dapo", **(args or {})})
