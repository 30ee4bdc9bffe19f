from __future__ import annotations

import pytest

from dataflex_bus.block import DataflexConfig
from dataflex_bus.config import apply_overrides, load_config, load_yaml
from dataflex_bus.errors import ConfigError, ConfigFileError

SEED = """
dataflex:
  mechanism: select            # select | reweight | mix
  scorer:   {name: group_solve_rate, params: {success_threshold: 0.5}}
  actuator: {name: threshold_band, params: {low: 0.2, high: 0.8}}
  warmup_step: 0
"""

SEED_OVERRIDES = [
    "+dataflex.mechanism=select", "+dataflex.scorer.name=group_solve_rate",
    "+dataflex.scorer.params.success_threshold=0.5", "+dataflex.actuator.name=threshold_band",
    "+dataflex.actuator.params.low=0.2", "+dataflex.actuator.params.high=0.8", "+dataflex.warmup_step=0",
]


def test_seed_yaml_and_seed_overrides_agree(tmp_path):
    path = tmp_path / "seed.yaml"
    path.write_text(SEED)
    from_yaml = load_config(path)
    from_overrides = load_config(None, SEED_OVERRIDES)
    assert from_yaml == from_overrides
    cfg = DataflexConfig.from_dict(from_yaml["dataflex"])
    assert cfg.scorer.params == {"success_threshold": 0.5}
    assert cfg.actuator.params == {"low": 0.2, "high": 0.8}
    assert (cfg.mechanism, cfg.warmup_step, cfg.on_empty, cfg.on_nonfinite) == ("select", 0, "skip", "error")


def test_overrides_types_and_forms():
    base = {"dataflex": {"scorer": {"name": "a"}}, "keep": 1}
    out = apply_overrides(base, ["dataflex.scorer.name=b", "++x.y=[1, 2]", "z=true", "w=null",
                                 "s='0.5'", "~keep", "dataflex.domains=[math, code]"])
    assert out == {"dataflex": {"scorer": {"name": "b"}, "domains": ["math", "code"]},
                   "x": {"y": [1, 2]}, "z": True, "w": None, "s": "0.5"}
    assert base["keep"] == 1 and base["dataflex"]["scorer"]["name"] == "a"  # input untouched


@pytest.mark.parametrize("bad", ["novalue", "=3", "a..b=1", "+"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="malformed override"):
        apply_overrides({}, [bad])


def test_override_through_a_scalar_is_refused():
    with pytest.raises(ConfigError, match="'a' holds 1"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataflex: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(bad)
    with pytest.raises(ConfigError) as err:
        load_yaml(tmp_path / "missing.yaml")
    # the file is the problem, not a config it would hold
    assert str(err.value) == f"{tmp_path / 'missing.yaml'}: no such config file"
    assert "invalid dataflex config" not in str(err.value)
    with pytest.raises(ConfigError, match=r"cannot read config file: Is a directory"):
        load_yaml(tmp_path)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_yaml(top)


def test_a_missing_config_named_like_an_example_points_at_it(tmp_path, monkeypatch):
    (tmp_path / "examples" / "trl").mkdir(parents=True)
    (tmp_path / "examples" / "trl" / "mine.yaml").write_text("dataflex: null\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigFileError) as err:
        load_config("mine")
    assert str(err.value) == "mine: no such config file; did you mean 'examples/trl/mine.yaml'?"



def test_block_errors_are_all_reported_with_keys():
    with pytest.raises(ConfigError) as err:
        DataflexConfig.from_dict({
            "mechanism": "shuffle", "scorer": {"name": "x", "parms": {}}, "warmup_step": -1,
            "on_empty": "panic", "typo_key": 1, "domains": ["a", "a"],
        })
    keys = {i.key for i in err.value.issues}
    assert keys == {"dataflex.mechanism", "dataflex.scorer.parms", "dataflex.actuator", "dataflex.warmup_step",
                    "dataflex.on_empty", "dataflex.typo_key", "dataflex.domains"}
    text = str(err.value)
    assert "select, reweight, mix" in text and "skip, keep_all, error" in text


def test_to_dict_round_trip():
    cfg = DataflexConfig.from_dict({"mechanism": "mix", "scorer": "s", "actuator": {"name": "m"},
                                    "domains": ["a", "b"], "update_step": 5})
    assert DataflexConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------- files as users write them
@pytest.mark.parametrize(("text", "value"), [
    ("1e-3", 0.001), ("3e-4", 0.0003), ("1E5", 100000.0), ("-2.5e+3", -2500.0), ("1.0e5", 100000.0),
    ("+1e10", 1e10), (".5e-2", 0.005), ("1.5", 1.5), ("7", 7), ("0x1f", 31), ("1e", "1e"), ("e5", "e5"),
    ("1e-3.5", "1e-3.5"), ("'1e-3'", "1e-3"),
])
def test_scientific_numbers_are_floats_in_files_and_overrides(tmp_path, text, value):
    path = tmp_path / "lr.yaml"
    path.write_text(f"optim: {{lr: {text}}}\n")
    from_file = load_yaml(path)["optim"]["lr"]
    from_override = apply_overrides({}, [f"optim.lr={text}"])["optim"]["lr"]
    assert from_file == from_override == value
    assert type(from_file) is type(value)


def test_non_utf8_file_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# caf\u00e9 config\ndataflex: {mechanism: select}\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        load_yaml(path)
    (issue,) = err.value.issues
    assert issue.key == str(path) and "not UTF-8" in issue.message and "line 1" in issue.message
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfdataflex: {warmup_step: 2}\n")  # a UTF-8 byte-order mark is fine
    assert load_yaml(bom) == {"dataflex": {"warmup_step": 2}}


@pytest.mark.parametrize(("text", "line", "what"), [
    ("dataflex:\n  scorer: [unclosed\n  actuator: x\n", "line 3, column 11", "started at line 2"),
    ("dataflex:\n\tmechanism: select\n", "line 2", "'\\t'"),
    ("a: 1\n b: 2\n", "line 2", "mapping values are not allowed"),
])
def test_yaml_errors_name_the_file_and_line(tmp_path, text, line, what):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_yaml(path)
    message = str(err.value)
    assert str(path) in message and line in message and what in message
    assert "<unicode string>" not in message


def test_cli_reports_file_errors_without_a_traceback(tmp_path, capsys):
    from dataflex_bus.cli import main

    path = tmp_path / "bad.yaml"
    path.write_bytes(b"dataflex: {scorer: \xff}\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and str(path) in err and "Traceback" not in err


# ---------------------------------------------------------------------------- duplicate keys
@pytest.mark.parametrize(("text", "key", "lines"), [
    # a second `trainer:` section would reset group_size and prompts_per_step to their defaults
    ("trainer:\n  group_size: 16\n  prompts_per_step: 4\nmodel: {}\ntrainer:\n  steps: 5\n", "trainer", (1, 5)),
    # of two `dataflex:` blocks only the second would run
    ("dataflex:\n  mechanism: select\n\ndataflex:\n  mechanism: mix\n", "dataflex", (1, 4)),
    ("dataflex:\n  actuator:\n    params:\n      low: 0.1\n      low: 0.2\n", "dataflex.actuator.params.low", (4, 5)),
    ("dataflex:\n  methods:\n    - scorer: {name: a, name: b}\n", "dataflex.methods[0].scorer.name", (3, 3)),
])
def test_duplicate_yaml_keys_are_an_error_naming_file_key_and_both_lines(tmp_path, text, key, lines):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as err:
        load_yaml(path)
    (issue,) = err.value.issues
    assert issue.key == str(path)
    assert f"duplicate key {key!r}" in issue.message and f"lines {lines[0]} and {lines[1]}" in issue.message


def test_duplicate_trainer_sections_fail_validate_and_run_from_the_cli(tmp_path, capsys):
    from dataflex_bus.cli import main

    path = tmp_path / "twice.yaml"
    path.write_text("trainer:\n  group_size: 16\ntrainer:\n  steps: 5\n")
    for argv in (["validate", str(path)], ["run", str(path), "--dry-run"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "duplicate key 'trainer'" in err and str(path) in err and "Traceback" not in err


def test_distinct_keys_and_merge_keys_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &b {low: 0.1, high: 0.9}\nactuator:\n  <<: *b\n  high: 0.8\nlist: [{a: 1}, {a: 2}]\n")
    assert load_yaml(path) == {"base": {"low": 0.1, "high": 0.9}, "actuator": {"low": 0.1, "high": 0.8},
                               "list": [{"a": 1}, {"a": 2}]}


def test_an_override_value_naming_a_key_twice_is_refused():
    with pytest.raises(ConfigError, match="names key 'low' twice"):
        apply_overrides({}, ["dataflex.actuator.params={low: 0.1, low: 0.2}"])


def test_trl_dataflex_file_with_two_blocks_is_refused_by_the_shared_loader(tmp_path):
    from dataflex_bus.trl.block import load_block

    path = tmp_path / "trl.yaml"
    path.write_text("dataflex:\n  mechanism: select\ndataflex:\n  mechanism: reweight\n")
    with pytest.raises(ConfigFileError, match=r"duplicate key 'dataflex' on lines 1 and 3"):
        load_block(str(path))
