"""Training regimes: the fixed pool cycled in epochs (data.train_pool), the level mix (data.level_weights),
their checks, and the --regime overlay of run and compare (recorded, a changed one refused at resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from dataflex_bus.cli import main
from dataflex_bus.errors import ConfigError
from dataflex_bus.shim import run_training
from dataflex_bus.shim.config import prepare, resolve_config
from dataflex_bus.shim.pool import TrainingSampler, pool_per_level
from dataflex_bus.shim.regime import load_regime
from dataflex_bus.shim.split import Split
from dataflex_bus.shim.warmstart import cache_key

from .conftest import tiny, without_times

NAMES = ["copy", "sort", "reverse", "random"]


def sampler(pool: int = 0, level_weights: dict | None = None, seed: int = 0) -> TrainingSampler:
    split = Split(NAMES, seed, 600)
    return TrainingSampler(split, {"seed": seed, "train_pool": pool, "level_weights": level_weights or {}})


def keys(s: TrainingSampler, domains: torch.Tensor, gen: torch.Generator) -> list[tuple[int, int]]:
    p = s.draw(domains, gen)
    return list(zip(p.domains.tolist(), s.split.train_rows(p).tolist()))


# ---------------------------------------------------------------------------- the sampler
def test_without_regime_keys_the_draws_are_the_splits_own():
    s = sampler()
    domains = torch.tensor([0, 1, 2, 3] * 8)
    a = s.draw(domains, torch.Generator().manual_seed(3))
    b = s.split.draw(domains, torch.Generator().manual_seed(3))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)


def test_the_pool_is_cycled_in_epochs_each_a_fresh_permutation():
    s = sampler(pool=20)
    gen = torch.Generator().manual_seed(0)
    drawn = [keys(s, torch.full((7,), 1), gen) for _ in range(9)]  # 63 draws: 3 epochs and 3 more
    flat = [k for step in drawn for k in step]
    epochs = [flat[i: i + 20] for i in (0, 20, 40)]
    assert all(len(set(e)) == 20 for e in epochs)  # every pool prompt once per epoch
    assert set(epochs[0]) == set(epochs[1]) == set(epochs[2])
    assert epochs[0] != epochs[1]  # a fresh order
    assert s.metrics() == {"data/epoch": 63 / (20 * 4)}


def test_the_pool_depends_on_the_data_seed_only_and_holds_no_heldout_prompt():
    a, b, c = sampler(pool=50), sampler(pool=50), sampler(pool=50, seed=1)
    pa = set(keys(a, torch.full((50,), 2), torch.Generator().manual_seed(0)))
    pb = set(keys(b, torch.full((50,), 2), torch.Generator().manual_seed(9)))  # another run seed
    pc = set(keys(c, torch.full((50,), 2), torch.Generator().manual_seed(0)))
    assert pa == pb and len(pa) == 50 and pa != pc
    split = a.split
    held = {(int(d), int(n)) for d, n in zip(split.heldout.domains, split.heldout_cells * 100_000 +
                                              split.heldout_index)}
    cells = a.pool_cells[2]
    assert not ({(2, int(x)) for x in cells * 100_000 + a.pool_index[2]} & held)


def test_level_weights_set_the_level_mix():
    s = sampler(level_weights={"copy": [0, 1], "sort": [1, 3]})
    gen = torch.Generator().manual_seed(0)
    copy_levels = s.draw(torch.zeros(400, dtype=torch.long), gen).levels
    sort_levels = s.draw(torch.ones(4000, dtype=torch.long), gen).levels
    reverse_levels = s.draw(torch.full((4000,), 2), gen).levels
    assert bool((copy_levels == 1).all())
    assert abs(float(sort_levels.double().mean()) - 0.75) < 0.03
    assert abs(float(reverse_levels.double().mean()) - 0.5) < 0.03  # not named: uniform
    pooled = sampler(pool=10, level_weights={"copy": [0, 1], "sort": [1, 3]})
    assert bool((pooled.pool_cells[0] == 1).all())  # copy's cells 0, 1: all of the pool on level 1
    assert pool_per_level("sort", 10, {"sort": [1, 3]}) == [3, 7]


# ---------------------------------------------------------------------------- checks
@pytest.mark.parametrize(("data", "key", "words"), [
    ({"train_pool": -1}, "data.train_pool", "out of range"),
    ({"train_pool": 2000}, "data.train_pool", "only 700 training prompts"),
    ({"level_weights": 3}, "data.level_weights", "expected dict"),
    ({"level_weights": {"copy": [1]}}, "data.level_weights.copy", "list of 2 weights"),
    ({"level_weights": {"copy": [0, 0]}}, "data.level_weights.copy", "not all 0"),
    ({"level_weights": {"copy": [-1, 2]}}, "data.level_weights.copy", "0 or more"),
    ({"level_weights": {"copy": [True, 1]}}, "data.level_weights.copy", "list of 2 weights"),
    ({"level_weights": {"cpy": [1, 1]}}, "data.level_weights.cpy", "not in data.domains"),
])
def test_a_bad_regime_value_names_its_key(data, key, words):
    with pytest.raises(ConfigError) as info:
        resolve_config(tiny(data=data))
    assert {i.key for i in info.value.issues} == {key}
    assert words in str(info.value)


def test_the_regime_keys_leave_the_base_policy_alone():
    plain = resolve_config(tiny())
    regime = resolve_config(tiny(data={"train_pool": 30, "level_weights": {"copy": [0, 1]}}))
    assert cache_key(plain, NAMES) == cache_key(regime, NAMES)


# ---------------------------------------------------------------------------- runs
def test_a_pool_run_reports_its_epochs_and_resumes_exactly(tmp_path):
    cfg = tiny(data={"train_pool": 5}, trainer={"steps": 4})
    whole = run_training(cfg).metrics
    assert [m["data/epoch"] for m in whole] == [4 * (k + 1) / 20 for k in range(4)]
    run_training(cfg, steps=2, out=tmp_path / "r")
    resumed = run_training(cfg, out=tmp_path / "r", resume=True)
    assert without_times(resumed.metrics) == without_times(whole)
    assert "data/epoch" not in run_training(tiny(trainer={"steps": 1})).metrics[0]


def _write(path: Path, content: dict) -> Path:
    path.write_text(yaml.safe_dump(content))
    return path


def test_regime_files_set_only_the_testbed(tmp_path):
    with pytest.raises(ConfigError, match="a regime sets only"):
        load_regime(_write(tmp_path / "bad.yaml", {"model": {"hidden": 8}}))
    with pytest.raises(ConfigError, match="empty regime"):
        load_regime(_write(tmp_path / "empty.yaml", {}))
    regime = load_regime(_write(tmp_path / "r.yaml", {"data": {"train_pool": 9}}))
    merged = regime.apply(tiny(data={"heldout": 300}))
    assert merged["data"] == {"heldout": 300, "train_pool": 9} and merged["trainer"] == tiny()["trainer"]


@pytest.mark.parametrize("path", sorted(Path("examples/regimes").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_regimes_fit_every_example(path):
    regime = load_regime(path)
    for example in sorted(Path("examples").glob("*.yaml")):
        prepare(regime.apply(yaml.safe_load(example.read_text())), steps=1)


def test_run_records_the_regime_and_a_resume_refuses_another(tmp_path, capsys):
    cfg = _write(tmp_path / "cfg.yaml", tiny(trainer={"steps": 2}))
    pool = _write(tmp_path / "pool.yaml", {"data": {"train_pool": 6}})
    other = _write(tmp_path / "other.yaml", {"data": {"train_pool": 6}, "trainer": {"steps": 3}})
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--regime", str(pool), "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "run.json").read_text())
    assert record["regime"]["overlay"] == {"data": {"train_pool": 6}}
    assert record["config"]["data"]["train_pool"] == 6
    assert main(["run", str(cfg), "--regime", str(other), "--out", str(out), "--no-progress", "--resume"]) == 2
    assert "--regime" in capsys.readouterr().err
    assert main(["run", str(cfg), "--out", str(out), "--no-progress", "--resume", "data.train_pool=6"]) == 2
    # The same overlay under another file name is the same regime.
    same = _write(tmp_path / "same.yaml", {"data": {"train_pool": 6}})
    assert main(["run", str(cfg), "--regime", str(same), "--out", str(out), "--no-progress", "--resume",
                 "--steps", "3"]) == 0


def test_compare_merges_the_regime_over_every_config(tmp_path, capsys):
    a = _write(tmp_path / "a.yaml", tiny(trainer={"steps": 2, "eval_every": 1}))
    b = _write(tmp_path / "b.yaml", tiny(trainer={"steps": 2, "eval_every": 1, "lr": 0.001}))
    regime = _write(tmp_path / "r.yaml", {"data": {"train_pool": 4}})
    out = tmp_path / "cmp"
    assert main(["compare", str(a), str(b), "--regime", str(regime), "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "compare.json").read_text())
    assert summary["regime"]["name"] == "r"
    for label in ("a", "b"):
        record = json.loads((out / label / "seed0" / "run.json").read_text())
        assert record["config"]["data"]["train_pool"] == 4 and record["regime"]["name"] == "r"
    # Longer runs under another regime: the same config but for steps, which a resume may change; refused.
    longer = _write(tmp_path / "r3.yaml", {"data": {"train_pool": 4}, "trainer": {"steps": 3}})
    capsys.readouterr()
    assert main(["compare", str(a), str(b), "--regime", str(longer), "--out", str(out), "--no-progress",
                 "--resume", "--force"]) == 2
    assert "regime 'r'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Two finished tiny runs: one plain, one under the regime ``pool`` (train_pool 4), and the regime files."""
    root = tmp_path_factory.mktemp("finished")
    cfg = _write(root / "cfg.yaml", tiny(trainer={"steps": 2, "eval_every": 1}))
    pool = _write(root / "pool.yaml", {"data": {"train_pool": 4}})
    _write(root / "other.yaml", {"data": {"train_pool": 5}})
    assert main(["run", str(cfg), "--out", str(root / "plain"), "--no-progress"]) == 0
    assert main(["run", str(cfg), "--regime", str(pool), "--out", str(root / "pooled"), "--no-progress"]) == 0
    import shutil

    shutil.copytree(root / "pooled", root / "pooled_b")  # a second method's label over the same runs
    return root


def test_compare_regime_over_run_dirs_that_never_used_it_is_refused_naming_dir_and_regimes(finished, capsys):
    root = finished
    capsys.readouterr()
    out = root / "cmp_refused"
    assert main(["compare", str(root / "plain"), str(root / "pooled"), "--regime", str(root / "pool.yaml"),
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(root / "plain") in err and "no regime" in err and "regime 'pool'" in err
    assert not (out / "compare.json").exists()
    # another regime recorded than the one asked for: both named
    assert main(["compare", str(root / "pooled"), str(root / "pooled_b"), "--regime", str(root / "other.yaml"),
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(root / "pooled") in err and "regime 'pool'" in err and "regime 'other'" in err


def test_a_plain_run_dir_is_never_paired_with_a_fresh_run_under_a_regime(finished, capsys):
    root = finished
    capsys.readouterr()
    out = root / "cmp_mixed"
    assert main(["compare", str(root / "plain"), str(root / "cfg.yaml"), "--regime", str(root / "pool.yaml"),
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert str(root / "plain") in err and "no regime" in err and "regime 'pool'" in err
    assert not (out / "cfg").exists()  # refused before anything trained


def test_compare_of_run_dirs_reports_their_own_regime(finished, capsys):
    root = finished
    out = root / "cmp_own"
    assert main(["compare", str(root / "pooled"), str(root / "pooled_b"), "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "compare.json").read_text())
    assert summary["regime"]["name"] == "pool" and summary["regime"]["overlay"] == {"data": {"train_pool": 4}}
    # the same run directories under --regime pool: accepted, recorded once
    assert main(["compare", str(root / "pooled"), str(root / "pooled_b"), "--regime", str(root / "pool.yaml"),
                 "--out", str(out), "--no-progress", "--force"]) == 0
    # runs of two regimes without --regime: refused, both named
    capsys.readouterr()
    assert main(["compare", str(root / "plain"), str(root / "pooled"), "--out", str(out), "--no-progress",
                 "--force"]) == 2
    err = capsys.readouterr().err
    assert str(root / "plain") in err and str(root / "pooled") in err and "regime 'pool'" in err
