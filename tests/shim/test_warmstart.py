"""The base policy's on-disk cache: a cached run is bit for bit an uncached one; the key covers everything the
base policy depends on; damage, a cache that cannot be written and two runs at once are all survived."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dataflex_bus.shim import run_training, warmstart
from dataflex_bus.shim.config import resolve_config
from dataflex_bus.shim.files import load_checkpoint, read_checked, write_checked

from . import faults
from .conftest import tiny, without_times

#: Enough pretraining that a cache hit is worth something, small enough for the unit tier.
CFG = tiny(trainer={"save_every": 1}, model={"hidden": 16, "pretrain_steps": 20, "pretrain_batch": 32})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache of this test's own, and this process's memory of base policies forgotten."""
    root = tmp_path / "cache"
    monkeypatch.setenv("DATAFLEX_CACHE_DIR", str(root))
    monkeypatch.setattr(warmstart, "_MEMORY", {})
    return root


def entries(root: Path) -> list[Path]:
    return sorted((root / "warmstart").glob("*.pt"))


class Pretrains:
    """Counts pretraining calls (a cache hit makes none)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = warmstart.pretrain

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(warmstart, "pretrain", counted)


def test_a_run_from_the_cache_is_bit_identical_to_one_that_pretrained(cache, tmp_path, monkeypatch):
    pretrains = Pretrains(monkeypatch)
    first = run_training(CFG, steps=2, seed=1, out=tmp_path / "first")
    assert pretrains.calls == 1 and len(entries(cache)) == 1
    warmstart._MEMORY.clear()  # a new process: only the disk remembers
    second = run_training(CFG, steps=2, seed=1, out=tmp_path / "second")
    assert pretrains.calls == 1, "the second run pretrained again"
    monkeypatch.setenv("DATAFLEX_CACHE_DIR", "")  # no disk cache at all
    warmstart._MEMORY.clear()
    uncached = run_training(CFG, steps=2, seed=1, out=tmp_path / "uncached")
    assert pretrains.calls == 2
    assert without_times(second.metrics) == without_times(first.metrics) == without_times(uncached.metrics)
    a, b = (load_checkpoint(tmp_path / d / "checkpoint.pt") for d in ("uncached", "second"))
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])
    assert all(torch.equal(a["rng"][k], b["rng"][k]) for k in a["rng"])


def test_the_key_covers_what_the_base_policy_depends_on_and_nothing_else(monkeypatch):
    resolved = resolve_config(CFG)
    domains = list(resolved["data"]["domains"])
    key = warmstart.cache_key(resolved, domains)

    def changed(section: str, name: str, value) -> str:
        other = json.loads(json.dumps(resolved))
        other[section][name] = value
        return warmstart.cache_key(other, domains)

    for section, name, value in [("model", "seed", 1), ("model", "hidden", 8), ("model", "pretrain_steps", 3),
                                 ("data", "seed", 2), ("data", "heldout", 90)]:
        assert changed(section, name, value) != key, f"{section}.{name}"
    # the RL run's settings are not the base policy's
    for name, value in [("seed", 3), ("lr", 0.1), ("steps", 9)]:
        assert changed("trainer", name, value) == key, f"trainer.{name}"
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0.0")
        assert warmstart.cache_key(resolved, domains) != key
    with monkeypatch.context() as m:
        m.setattr(warmstart, "_code_digest", lambda: "edited")
        assert warmstart.cache_key(resolved, domains) != key
    with monkeypatch.context() as m:
        m.setattr(warmstart, "cpu_model", lambda: "Another CPU")
        assert warmstart.cache_key(resolved, domains) != key
    with monkeypatch.context() as m:
        m.setattr(warmstart, "__version__", "9.9.9")
        assert warmstart.cache_key(resolved, domains) != key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert warmstart.cache_key(resolved, domains) != key
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_entry_is_ignored_rebuilt_and_rewritten(cache, tmp_path, monkeypatch, dataflex_log, damage):
    pretrains = Pretrains(monkeypatch)
    good = run_training(CFG, steps=1).metrics
    (entry,) = entries(cache)
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        entry.write_bytes(bytes(data))
    elif damage == "truncate":
        entry.write_bytes(bytes(data[: len(data) // 2]))
    else:  # whole, but written for another key (a copied or renamed file)
        content = torch.load(io.BytesIO(read_checked(entry, "")), weights_only=True)
        write_checked(entry, {**content, "key": "another key"})
    warmstart._MEMORY.clear()
    again = run_training(CFG, steps=1).metrics
    assert pretrains.calls == 2 and without_times(again) == without_times(good)
    assert f"the cached base policy {entry} is unusable" in dataflex_log.text and "rebuilt" in dataflex_log.text
    warmstart._MEMORY.clear()
    run_training(CFG, steps=1)
    assert pretrains.calls == 2, "the rewritten entry was not used"


def test_a_cache_that_cannot_be_written_never_fails_a_run(tmp_path, monkeypatch, dataflex_log):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DATAFLEX_CACHE_DIR", str(blocker))
    monkeypatch.setattr(warmstart, "_MEMORY", {})
    assert len(run_training(CFG, steps=1).metrics) == 1
    assert "cannot cache the base policy" in dataflex_log.text and "DATAFLEX_CACHE_DIR" in dataflex_log.text


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.delenv("DATAFLEX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert warmstart.cache_root() == tmp_path / "xdg" / "dataflex"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert warmstart.cache_root() == tmp_path / "home" / ".cache" / "dataflex"
    monkeypatch.setenv("DATAFLEX_CACHE_DIR", str(tmp_path / "mine"))
    assert warmstart.cache_root() == tmp_path / "mine"
    monkeypatch.setenv("DATAFLEX_CACHE_DIR", "")
    assert warmstart.cache_root() is None


@pytest.mark.integration
def test_two_runs_warm_starting_at_once_share_one_good_entry(tmp_path):
    cfg = tiny(model={"hidden": 32, "pretrain_steps": 150, "pretrain_batch": 64})
    env = {**faults.env(), "DATAFLEX_CACHE_DIR": str(tmp_path / "cache")}
    code = textwrap.dedent(f"""
        import json, sys
        from dataflex_bus.shim import run_training
        result = run_training(json.loads({json.dumps(json.dumps(cfg))}), steps=2, seed=int(sys.argv[1]))
        print(json.dumps([{{k: v for k, v in m.items() if not k.startswith("time/")}} for m in result.metrics]))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(seed)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    (entry,) = entries(tmp_path / "cache")
    assert not list((tmp_path / "cache" / "warmstart").glob(".*.tmp")), "a temporary file was left behind"
    # the entry both wrote is whole, and a third run from it trains as the first did
    third = subprocess.run([sys.executable, "-c", code, "0"], env=env, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr
    assert json.loads(third.stdout) == json.loads(outs[0][0])
    assert entry.stat().st_size > 0


def test_the_command_line_shows_the_warm_start_and_where_its_base_policy_came_from(cache, tmp_path, capsys):
    import yaml

    from dataflex_bus.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(CFG))
    args = ["run", str(config), "--steps", "1", "--out", str(tmp_path / "o"), "--force"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "dataflex: warm start: pretraining the base policy (20 steps of 32 prompts)" in err
    assert "warm start [########################] 20/20" in err  # its progress bar, before step 1's
    assert err.index("warm start [") < err.index("] 1/1")
    (entry,) = entries(cache)
    assert f"cached in {entry}" in err
    warmstart._MEMORY.clear()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"dataflex: warm start: base policy read from the cache {entry}" in err and "warm start [" not in err
