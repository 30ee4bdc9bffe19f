"""One cache variable: the shim's warm start and the TRL examples' SmolLM2 copy both live under
``$DATAFLEX_CACHE_DIR`` (once the examples read ``DATAFLEX_CACHE``, the shim ``DATAFLEX_CACHE_DIR``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dataflex_bus.cache import cache_root

ROOT = Path(__file__).resolve().parents[2]


def _smollm2():
    spec = importlib.util.spec_from_file_location("smollm2_example", ROOT / "examples" / "trl" / "smollm2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shim_and_the_trl_examples_read_the_same_variable(tmp_path, monkeypatch):
    from dataflex_bus.shim import warmstart

    monkeypatch.delenv("DATAFLEX_CACHE", raising=False)
    monkeypatch.setenv("DATAFLEX_CACHE_DIR", str(tmp_path / "mine"))
    smollm2 = _smollm2()
    assert warmstart.cache_root() == cache_root() == tmp_path / "mine"
    assert smollm2.cache_folder() == tmp_path / "mine" / "smollm2-135m-instruct-f32"
    monkeypatch.delenv("DATAFLEX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.cache_folder() == tmp_path / "xdg" / "dataflex" / "smollm2-135m-instruct-f32"
    monkeypatch.setenv("DATAFLEX_CACHE_DIR", "")  # set but empty: no disk cache
    assert smollm2.cache_folder() is None and cache_root() is None


def test_the_old_variable_alone_is_refused_naming_the_new_one(tmp_path, monkeypatch):
    monkeypatch.delenv("DATAFLEX_CACHE_DIR", raising=False)
    monkeypatch.setenv("DATAFLEX_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="set DATAFLEX_CACHE_DIR"):
        _smollm2().cache_folder()
