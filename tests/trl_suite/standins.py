"""Local stand-ins for the hub models and datasets TRL's GRPOTrainer tests load, under the same names, built
once per process and never downloaded.

* Models: tiny random models of the named architecture (the hub's tiny test models are random too), with a
  character-level tokenizer holding the chat template's special tokens and the chat template TRL ships for that
  family (``trl.chat_template_utils``), written into a Hugging Face hub cache laid out as the hub client writes one
  (``models--org--name/refs/main`` -> ``snapshots/<revision>/``). With ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE``
  pointing there, every ``from_pretrained("trl-internal-testing/...")`` (the tests' and TRL's own) resolves locally.
* Datasets: ``trl-internal-testing/zen`` (``standard_prompt_only``, ``conversational_prompt_only``; train and test
  splits) built as :class:`datasets.Dataset` objects; :func:`load_dataset` serves them and hands every other
  name to :func:`datasets.load_dataset`.

A name with no stand-in (vision models, remote code, architectures not built here) stays unresolvable: the test
fails the same way under plain TRL and under the subclass, and the suite's report lists it as not run offline.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict, IterableDatasetDict
from datasets import load_dataset as datasets_load_dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

ORG = "trl-internal-testing"
#: The stand-in snapshots' revision (any 40-hex string: the hub client only reads it back from refs/main).
REVISION = "0" * 40

#: Special tokens of each chat family: (specials, pad, eos, chat template's name in trl.chat_template_utils).
_QWEN = (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
          "<tool_response>", "</tool_response>"], "<|endoftext|>", "<|im_end|>")
_LLAMA = (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|finetune_right_pad_id|>", "<|python_tag|>", "<|eom_id|>"], "<|finetune_right_pad_id|>", "<|eot_id|>")
_MISTRAL = (["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "</s>", "</s>")


def _tokenizer(specials: list[str], pad: str, eos: str, template: str | None) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus the family's special tokens (matched whole)."""
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(["<unk-char>", *specials, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk-char>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk-char>", pad_token=pad, eos_token=eos,
                                  additional_special_tokens=[s for s in specials if s not in (pad, eos)])
    if template is not None:
        out.chat_template = template
    return out


def _template(name: str) -> str:
    from trl import chat_template_utils

    return str(getattr(chat_template_utils, f"{name}_chat_template"))


def _qwen2(seq: bool) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    return Qwen2Config(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       intermediate_size=32), Qwen2ForSequenceClassification if seq else Qwen2ForCausalLM


def _qwen3(seq: bool) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

    return Qwen3Config(hidden_size=8, head_dim=4, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       intermediate_size=32), Qwen3ForSequenceClassification if seq else Qwen3ForCausalLM


def _qwen3_moe(seq: bool) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeConfig(hidden_size=8, head_dim=4, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=2, intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                          num_experts_per_tok=2), Qwen3MoeForCausalLM


def _llama(seq: bool) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    return LlamaConfig(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       intermediate_size=32), LlamaForSequenceClassification if seq else LlamaForCausalLM


def _mistral(seq: bool) -> tuple[PretrainedConfig, type[PreTrainedModel]]:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralConfig(hidden_size=8, head_dim=2, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, intermediate_size=32), MistralForCausalLM


#: Stand-in name -> (architecture builder, sequence classification?, chat family, TRL chat template name).
MODELS: dict[str, tuple[Callable[[bool], tuple[PretrainedConfig, type[PreTrainedModel]]], bool, tuple, str | None]] = {
    "tiny-Qwen2ForCausalLM-2.5": (_qwen2, False, _QWEN, "qwen2_5"),
    "tiny-Qwen2ForSequenceClassification-2.5": (_qwen2, True, _QWEN, "qwen2_5"),
    "tiny-Qwen3ForCausalLM": (_qwen3, False, _QWEN, "qwen3"),
    "tiny-Qwen3ForSequenceClassification": (_qwen3, True, _QWEN, "qwen3"),
    "tiny-Qwen3MoeForCausalLM": (_qwen3_moe, False, _QWEN, "qwen3"),
    "tiny-LlamaForCausalLM-3.2": (_llama, False, _LLAMA, "llama3_2"),
    "tiny-LlamaForSequenceClassification-3.2": (_llama, True, _LLAMA, "llama3_2"),
    "tiny-MistralForCausalLM-0.2": (_mistral, False, _MISTRAL, None),
}


def write_model(cache: Path, name: str, seed: int = 0) -> Path:
    """``name``'s stand-in as a hub-cache snapshot under ``cache`` (``HF_HUB_CACHE``); its folder."""
    build, seq, (specials, pad, eos), template = MODELS[name]
    repo = cache / f"models--{ORG}--{name}"
    folder = repo / "snapshots" / REVISION
    if (folder / "config.json").is_file():
        return folder
    tok = _tokenizer(specials, pad, eos, _template(template) if template else None)
    config, cls = build(seq)
    config.vocab_size = len(tok)
    config.pad_token_id, config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    if seq:
        config.num_labels = 1
    torch.manual_seed(seed)
    model = cls(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    return folder


def write_models(cache: Path) -> None:
    for name in MODELS:
        write_model(cache, name)


# ---------------------------------------------------------------------------------------------- datasets
#: Short prompts (our own), as many as the zen dataset's train split holds, and its test split's two.
_TRAIN = ["Simple is better than", "Flat beats", "Readability", "Errors should never", "In the face of doubt,",
          "There should be one", "Now is better", "If the plan is hard to explain,", "Namespaces are",
          "Beautiful code is", "Explicit says more than", "Sparse is kinder than", "Special cases are not",
          "Practicality wins over", "Unless silenced on purpose,", "Refuse the temptation", "Although never is"]
_TEST = ["Complex beats complicated, but", "If it is easy to explain,"]
ZEN = f"{ORG}/zen"


def _zen(config: str, split: str) -> Dataset:
    prompts = _TRAIN if split == "train" else _TEST
    if config == "standard_prompt_only":
        return Dataset.from_dict({"prompt": prompts})
    if config == "conversational_prompt_only":
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    raise ValueError(f"{ZEN}: the stand-in has no config {config!r} (standard_prompt_only, "
                     "conversational_prompt_only)")


def load_dataset(path: str, name: str | None = None, *args: Any, split: str | None = None, streaming: bool = False,
                 **kwargs: Any) -> Any:
    """:func:`datasets.load_dataset` with ``trl-internal-testing/zen`` served from the stand-in."""
    if path != ZEN:
        return datasets_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
    config = name or "standard_prompt_only"
    if split is not None:
        ds = _zen(config, split)
        return ds.to_iterable_dataset() if streaming else ds
    splits = {s: _zen(config, s) for s in ("train", "test")}
    if streaming:
        return IterableDatasetDict({s: d.to_iterable_dataset() for s, d in splits.items()})
    return DatasetDict(splits)


def describe(cache: Path) -> str:
    """What the stand-ins are, for the suite's report."""
    return json.dumps({"hub_cache": str(cache), "models": sorted(MODELS), "datasets": [ZEN]})
