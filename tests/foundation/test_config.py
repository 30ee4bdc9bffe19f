from __future__ import annotations

import pytest

from dataflex_bus.config import DataflexConfig, apply_overrides, load_config, load_yaml
from dataflex_bus.errors import ConfigError

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
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_yaml(tmp_path / "missing.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_yaml(top)


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
