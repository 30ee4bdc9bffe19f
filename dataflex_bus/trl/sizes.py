"""What one rollout row takes in a TRL step, estimated from the model's shape and the lengths known at construction
(:attr:`~dataflex_bus.host.HostDescription.row_bytes`), so that an allocator's ``budget`` the machine cannot hold
is refused before TRL's forward dies allocating it.

Under allocation a step trains every rollout of the budget: TRL's no-grad passes and its training forward run on
micro-batches of ``rows / steps_per_generation`` rows, so the forward's memory grows with the budget. Per row
(``T = P + C`` tokens: the longest prompt ``P`` of a sample of the dataset, ``C = max_completion_length``, the
width TRL pads a large batch to; ``h`` hidden size, ``i`` intermediate size, ``a`` attention heads, ``L`` layers,
``V`` vocabulary, float32)::

    PYTHON_ROW_BYTES                                  the rollout's Python objects (texts, id lists, inputs, logs)
    + T x 4 x 8 + C x 6 x 4                           ids and masks (int64), per-token log-probs, weights
    + (L x T x 4 x (10 h + 4 i + 2 a T)               the forward's activations kept for backward (eager
       + C x V x 4 x 3) / steps_per_generation        attention's scores), the logits, log-softmax, entropy

Measured on the tiny Llama of tests/trl_tier/trl_tiny.py (h 32, i 64, a 4, L 2, V 45; 4-token prompts), peak RSS
growth per rollout between budgets: 68.5 KiB at C = 6 (estimate 71 KiB), 179 KiB at C = 24 with real sampling
(estimate 205 KiB); tests/trl_tier/test_trl_sizes.py holds it within a factor of 2. Under
``gradient_checkpointing`` only each layer's input is kept (``4 h`` bytes a token a layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .arguments import field_of

#: The Python objects TRL and the host keep per rollout (its prompt and completion texts, token id lists, the
#: inputs dict, logged completions): the measured per-row growth less the tensors' bytes.
PYTHON_ROW_BYTES = 16 * 1024
#: The model config fields the estimate reads (``transformers``' names).
MODEL_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
#: Dataset rows whose prompts are sampled for the longest one.
PROMPT_SAMPLE = 1000


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def model_shape(config: Any) -> dict[str, int] | None:
    """The :data:`MODEL_FIELDS` of a model config (a ``PretrainedConfig`` or a mapping; a multimodal model's
    ``text_config``), ``None`` when any is missing."""
    if config is None:
        return None
    text = _get(config, "text_config")
    source = text if text is not None and _get(config, "hidden_size") is None else config
    shape = {name: _get(source, name) for name in MODEL_FIELDS}
    if shape["intermediate_size"] is None and shape["hidden_size"] is not None:
        shape["intermediate_size"] = 4 * int(shape["hidden_size"])
    if any(v is None for v in shape.values()):
        return None
    return {k: int(v) for k, v in shape.items()}


def model_config(model: Any) -> Any:
    """The config of ``GRPOTrainer``'s ``model`` argument: a model's ``config``, or for a model id or folder the
    config ``transformers`` loads first (``None`` when it cannot be read)."""
    if not isinstance(model, str):
        return getattr(model, "config", None)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    except Exception:  # TRL reports a model it cannot load; the estimate then counts no activations
        return None


def longest_prompt(dataset: Any, tokenizer: Any) -> int:
    """Tokens of the longest text prompt (by characters) among the first :data:`PROMPT_SAMPLE` rows of
    ``dataset``; 0 when not known (no tokenizer, conversational prompts, no ``prompt`` column)."""
    if dataset is None or tokenizer is None or "prompt" not in (getattr(dataset, "column_names", None) or []):
        return 0
    try:
        texts = [p for p in dataset.select(range(min(len(dataset), PROMPT_SAMPLE)))["prompt"] if isinstance(p, str)]
        if not texts:
            return 0
        return len(tokenizer(max(texts, key=len), add_special_tokens=False)["input_ids"])
    except Exception:  # an estimate, never a reason to fail a run: the prompt is then not counted
        return 0


def row_bytes(args: Any, shape: Mapping[str, int] | None, prompt_tokens: int = 0) -> tuple[int, str]:
    """``(bytes, basis)`` of one rollout row in a TRL step (the module doc's formula) for the ``GRPOConfig``
    ``args`` (or a mapping of its fields), the model's ``shape`` (:func:`model_shape`; ``None``: not known, only
    the stored tensors and Python objects counted, a floor) and the longest prompt."""
    c = int(field_of(args, "max_completion_length", 512))
    t = prompt_tokens + c
    spg = max(int(field_of(args, "steps_per_generation", field_of(args, "gradient_accumulation_steps", 1))), 1)
    stored = PYTHON_ROW_BYTES + t * 4 * 8 + c * 6 * 4
    lengths = f"{prompt_tokens} prompt + {c} completion tokens (max_completion_length)"
    if shape is None:
        return stored, f"{lengths}, the model's activations not counted (its shape is not known)"
    h, i, a, n_layers, v = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                "num_hidden_layers", "vocab_size"))
    per_token = 4 * h if bool(field_of(args, "gradient_checkpointing", False)) else 4 * (10 * h + 4 * i + 2 * a * t)
    forward = n_layers * t * per_token + c * v * 4 * 3
    return stored + forward // spg, (f"{lengths}, a {n_layers}-layer model {h} wide, vocabulary {v}, the forward "
                                     f"on micro-batches of 1/{spg} of the rows")


#: Bytes a Python int in a list takes (the object and its pointer): TRL keeps a stored row's token ids as lists.
PYTHON_ID_BYTES = 36


def stored_row_bytes(args: Any, prompt_tokens: int = 0) -> tuple[int, str]:
    """``(bytes, basis)`` of one row in the replay store on TRL: the object TRL needs to train it again
    (:func:`~dataflex_bus.trl.replays.stored_object`: its prompt and completion ids as Python lists, texts,
    inputs and logs, :data:`PYTHON_ROW_BYTES`) and its behaviour log-probs (float32) over
    ``max_completion_length`` tokens."""
    c = int(field_of(args, "max_completion_length", 512))
    return (PYTHON_ROW_BYTES + (prompt_tokens + c) * PYTHON_ID_BYTES + 4 * c,
            f"{prompt_tokens} prompt + {c} completion tokens (max_completion_length) as Python id lists")
