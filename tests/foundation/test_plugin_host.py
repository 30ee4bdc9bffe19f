"""The plugin host for authors and users: `dataflex info`, `plugins --check`, allow/deny-list diagnostics,
swapped slots, hooks without @hookimpl, packs that end the process, invalid class declarations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dataflex_bus.cli import main
from dataflex_bus.discovery import ACTIVE, FAILED, discover, reset_plugins
from dataflex_bus.errors import ConfigError, PluginLoadError, UnknownComponentError
from dataflex_bus.pipeline import validate
from dataflex_bus.registry import ComponentSpec, Registry

from .fakedist import forget_modules, make_dist

GOOD_COMPONENTS = """
from dataflex_bus import Param, Score, Scorer, Selector, Selection

class Length(Scorer):
    \"\"\"Response length per row.\"\"\"
    requires = ("response_mask",)
    params = {"scale": Param(float, default=1.0, low=0.0, low_open=True, doc="multiplies the length")}
    def score(self, batch, step, **ctx):
        return Score(self.scale * batch.lengths.float(), "response")

class Shorter(Selector):
    \"\"\"Keep rows whose score is below a cut.\"\"\"
    params = {"cut": Param(float, doc="keep scores strictly below this")}
    def select(self, batch, score, step):
        return Selection((score.values < self.cut) & batch.valid_rows)
"""


def registration(*calls: str, decorate: bool = True) -> str:
    body = "\n".join(f"    register({c})" for c in calls) or "    pass"
    return f"from dataflex_bus import hookimpl\n\n{'@hookimpl' if decorate else ''}\n" \
           f"def dataflex_register(register):\n{body}\n"


MODULES = ("hostgood_pack", "hostbad_pack", "hostexit_pack", "hostnohook_pack", "hostattr_pack", "hostcexit_pack",
           "hostkill_pack")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Fake installed packs (dist-info on a temp path); only the ones a test lists are loaded."""
    make_dist(tmp_path, "dataflex-hostgood", "1.0.0", {
        "hostgood_pack.components": GOOD_COMPONENTS,
        "hostgood_pack.plugin": registration(
            '"scorer", "len_score", "hostgood_pack.components:Length", summary="length of each response"',
            '"selector", "len_score", "hostgood_pack.components:Shorter", summary="keep short responses"'),
    }, {"hostgood": "hostgood_pack.plugin"})
    make_dist(tmp_path, "dataflex-hostbad", "0.2.0", {
        "hostbad_pack.plugin": registration('"scorer", "typo_target", "hostbad_pack.component:Missing"'),
    }, {"hostbad": "hostbad_pack.plugin"})
    make_dist(tmp_path, "dataflex-hostexit", "0.3.0", {
        "hostexit_pack.plugin": "import os\nos._exit(7)\n",
    }, {"hostexit": "hostexit_pack.plugin"})
    make_dist(tmp_path, "dataflex-hostnohook", "0.4.0", {
        "hostnohook_pack.plugin": registration('"scorer", "never_seen", "x.y:Z"', decorate=False),
    }, {"hostnohook": "hostnohook_pack.plugin"})
    make_dist(tmp_path, "dataflex-hostattr", "0.5.0", {
        "hostattr_pack.components": """
from dataflex_bus import Scorer

class Lunch(Scorer):
    timing = "after_lunch"
""",
        "hostattr_pack.plugin": registration('"scorer", "lunch", "hostattr_pack.components:Lunch"'),
    }, {"hostattr": "hostattr_pack.plugin"})
    make_dist(tmp_path, "dataflex-hostkill", "0.7.0", {
        "hostkill_pack.plugin": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    }, {"hostkill": "hostkill_pack.plugin"})
    make_dist(tmp_path, "dataflex-hostcexit", "0.6.0", {
        "hostcexit_pack.components": "import os\nos._exit(9)\n",
        "hostcexit_pack.plugin": registration('"scorer", "exits", "hostcexit_pack.components:Gone"'),
    }, {"hostcexit": "hostcexit_pack.plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DATAFLEX_STRICT_PLUGINS", "0")
    monkeypatch.delenv("DATAFLEX_DISABLE_PLUGINS", raising=False)
    forget_modules(*MODULES)
    reset_plugins()
    yield tmp_path
    reset_plugins()
    forget_modules(*MODULES)


def cli(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path]), "DATAFLEX_STRICT_PLUGINS": "0",
            **env}
    return subprocess.run([sys.executable, "-m", "dataflex_bus.cli", *args], capture_output=True, text=True,
                          env=full, timeout=300)


# ---------------------------------------------------------------------------- dataflex info
def test_info_shows_parameters_timing_events_and_a_valid_example(capsys):
    assert main(["info", "group_solve_rate"]) == 0
    out = capsys.readouterr().out
    assert "group_solve_rate (scorer) from dataflex-bus==0.1.0" in out
    assert "fraction of a prompt's rollouts" in out                       # the registered summary
    assert "success_threshold: float, default 0.5" in out
    assert "granularity:  prompt" in out and "timing:       post_reward" in out
    assert "requires:     rm_scores, response_mask, uid" in out
    assert "on_rollout" in out and "on_advantage" in out
    assert main(["info", "threshold_band", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert (entry["kind"], entry["provider"], entry["mechanism"]) == ("selector", "dataflex-bus==0.1.0", "select")
    params = {p["name"]: p for p in entry["parameters"]}
    assert params["low"]["required"] and params["inclusive"]["default"] is True
    assert entry["accepts"] == ["prompt", "response"] and "on_rollout" in entry["events"]
    import yaml

    block = yaml.safe_load(entry["example"])["dataflex"]
    assert block["actuator"]["name"] == "threshold_band" and entry["example_validated"]
    validate(block)


@pytest.mark.parametrize("name", ["reward_difficulty", "token_prob", "dapo", "max_variance", "softmax", "dump_ucb"])
def test_every_info_example_passes_validation(name, capsys):
    import yaml

    assert main(["info", name, "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["example_validated"], entry["example"]
    block = yaml.safe_load(entry["example"])["dataflex"]
    assert name in (block["scorer"]["name"], block["actuator"]["name"])
    validate(block)


def test_info_unknown_name_suggests_and_kind_narrows(capsys):
    assert main(["info", "group_solve_rat"]) == 2
    err = capsys.readouterr().err
    assert "unknown component 'group_solve_rat'" in err and "did you mean 'group_solve_rate'" in err
    assert main(["info", "group_solve_rate", "--kind", "selector"]) == 2
    err = capsys.readouterr().err
    assert "unknown selector" in err and "there is a scorer of that name" in err


@pytest.mark.parametrize(("typed", "meant"), [
    ("GROUP_SOLVE_RATE", "group_solve_rate"), ("THRESHOLD_BAND", "threshold_band"), ("Group_Solve_Rate",
                                                                                      "group_solve_rate"),
    ("group-solve-rate", "group_solve_rate"), ("GROUP-SOLVE-RAT", "group_solve_rate")])
def test_info_suggests_the_name_whatever_its_case_or_dashes(capsys, typed, meant):
    assert main(["info", typed]) == 2
    err = capsys.readouterr().err
    assert f"unknown component {typed!r}" in err and f"did you mean {meant!r}" in err


def test_a_block_name_in_capitals_gets_a_suggestion_at_validation():
    band = {"low": 0.1, "high": 0.9}
    for block, meant in [
        ({"mechanism": "SELECT", "scorer": {"name": "group_solve_rate"},
          "actuator": {"name": "threshold_band", "params": band}}, "select"),
        ({"mechanism": "select", "scorer": {"name": "GROUP_SOLVE_RATE"},
          "actuator": {"name": "threshold_band", "params": band}}, "group_solve_rate"),
        ({"mechanism": "select", "scorer": {"name": "group_solve_rate"},
          "actuator": {"name": "Threshold-Band", "params": band}}, "threshold_band"),
    ]:
        with pytest.raises(ConfigError) as err:
            validate(block)
        assert f"did you mean {meant!r}" in str(err.value)


@pytest.mark.parametrize("name", ["allocate", "allocator"])
def test_info_on_a_mechanism_says_what_it_does_and_which_components_implement_it(capsys, name):
    from dataflex_bus.mechanisms import mechanism
    from dataflex_bus.validation import installed_registry

    assert main(["info", name]) == 0
    out = capsys.readouterr().out
    assert "'allocate' is a mechanism" in out and mechanism("allocate").summary in out
    allocators = installed_registry().names("actuator", ["allocator"])
    assert allocators and all(a in out for a in allocators)
    assert main(["info", "select", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert (entry["kind"], entry["actuator_kind"]) == ("mechanism", "selector")
    assert "threshold_band" in entry["actuators"]


def test_info_on_a_name_in_both_slots_shows_both_or_the_chosen_kind(site, monkeypatch, capsys):
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "hostgood")
    assert main(["info", "len_score"]) == 0
    out = capsys.readouterr().out
    assert "names 2 components" in out and "--kind" in out
    assert "len_score (scorer) from dataflex-hostgood==1.0.0" in out
    assert "len_score (selector) from dataflex-hostgood==1.0.0" in out
    assert "length of each response" in out and "keep short responses" in out
    assert "cut: float, required  (keep scores strictly below this)" in out
    assert main(["info", "len_score", "--kind", "selector", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["kind"] == "selector" and entry["summary"] == "keep short responses"
    assert entry["example_validated"] and "required" in entry["example"]


def test_summary_shows_in_plugins_table_and_json(site, capsys):
    proc = cli(site, "plugins", DATAFLEX_LOAD_PLUGINS="hostgood,dataflex-bus")
    assert proc.returncode == 0, proc.stderr
    assert "len_score (scorer)  length of each response" in proc.stdout
    assert "group_solve_rate (scorer)  fraction of a prompt's rollouts" in proc.stdout
    report = {r["name"]: r for r in json.loads(cli(site, "plugins", "--json",
                                                   DATAFLEX_LOAD_PLUGINS="hostgood").stdout)}
    assert {c["summary"] for c in report["hostgood"]["components"]} == {"length of each response",
                                                                       "keep short responses"}


# ---------------------------------------------------------------------------- plugins --check
@pytest.mark.integration
def test_check_names_a_misspelt_target_and_passes_a_good_pack(site):
    bad = cli(site, "plugins", "--check", DATAFLEX_LOAD_PLUGINS="hostgood,hostbad")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "check failed: 1 problem(s)" in bad.stdout
    problem = next(line for line in bad.stdout.splitlines() if "typo_target" in line and "->" in line)
    assert "plugin 'hostbad'" in problem and "'hostbad_pack.component:Missing'" in problem
    assert "ModuleNotFoundError" in problem
    ok = cli(site, "plugins", "--check", "--json", DATAFLEX_LOAD_PLUGINS="hostgood")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    report = {r["name"]: r for r in json.loads(ok.stdout)}
    assert [c["check"] for c in report["hostgood"]["components"]] == ["ok", "ok"]
    assert {r["status"] for n, r in report.items() if n != "hostgood"} == {"disabled"}


def test_check_refuses_invalid_class_attributes(site):
    proc = cli(site, "plugins", "--check", DATAFLEX_LOAD_PLUGINS="hostattr")
    assert proc.returncode == 1
    assert "Lunch.timing = 'after_lunch'" in proc.stdout and "post_reward" in proc.stdout


def test_check_keeps_the_listing_process_torch_free(site):
    code = ("import sys; from dataflex_bus.cli import main; rc = main(['plugins', '--check']);"
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path]), "DATAFLEX_STRICT_PLUGINS": "0",
           "DATAFLEX_LOAD_PLUGINS": "hostgood"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check ok" in proc.stdout


def test_a_pack_ending_the_process_is_named_by_check_and_the_rest_is_checked(site):
    proc = cli(site, "plugins", "--check", "--json", DATAFLEX_LOAD_PLUGINS="hostgood,hostexit,hostcexit,hostbad")
    assert proc.returncode == 1, proc.stderr
    report = {r["name"]: r for r in json.loads(proc.stdout)}
    assert report["hostexit"]["status"] == FAILED and "os._exit(7)" in report["hostexit"]["error"]
    (exits,) = report["hostcexit"]["components"]
    assert "'hostcexit_pack.components:Gone'" in exits["check"] and "exit status 9" in exits["check"]
    assert [c["check"] for c in report["hostgood"]["components"]] == ["ok", "ok"]      # checked after it
    assert "ModuleNotFoundError" in report["hostbad"]["components"][0]["check"]


@pytest.mark.integration
def test_a_pack_killing_the_process_at_import_is_named_by_check(site):
    proc = cli(site, "plugins", "--check", "--json", DATAFLEX_LOAD_PLUGINS="hostgood,hostkill")
    assert proc.returncode == 1, proc.stderr
    report = {r["name"]: r for r in json.loads(proc.stdout)}
    assert report["hostkill"]["status"] == FAILED
    assert "process ended while this plugin was imported" in report["hostkill"]["error"]
    assert "killed by signal 9" in report["hostkill"]["error"]
    assert [c["check"] for c in report["hostgood"]["components"]] == ["ok", "ok"]


def test_a_pack_calling_os_exit_at_import_is_a_named_failure_of_a_plain_listing(site):
    """`dataflex plugins` once ended with exit status 7 and no word: only --check and debug mode named it."""
    proc = cli(site, "plugins", DATAFLEX_LOAD_PLUGINS="hostgood,hostexit")
    assert proc.returncode == 0, proc.stderr
    assert ("dataflex: plugin 'hostexit' (dataflex-hostexit 0.3.0) failed to load and is skipped: SystemExit: "
            "os._exit(7) called while the plugin was imported") in proc.stderr
    assert "hostexit" in proc.stdout and "len_score" in proc.stdout            # the others are still listed


def test_debug_names_the_plugin_being_imported_when_the_process_dies(site):
    quiet = cli(site, "plugins", DATAFLEX_LOAD_PLUGINS="hostgood,hostkill")
    assert quiet.returncode == -9 and "hostkill" not in quiet.stderr        # what no Python code can report
    loud = cli(site, "plugins", DATAFLEX_LOAD_PLUGINS="dataflex-bus,hostgood,hostkill", DATAFLEX_DEBUG="1")
    assert loud.returncode == -9
    lines = loud.stderr.strip().splitlines()
    assert lines[-1] == "dataflex: loading plugin 'hostkill' (dataflex-hostkill==0.7.0)"
    assert "dataflex: loading plugin 'scorers' (dataflex-bus==0.1.0)" in lines  # loaded before it


@pytest.mark.integration
def test_debug_names_the_component_module_being_imported(site, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dataflex:\n  mechanism: select\n  scorer: {name: exits}\n  actuator: {name: topk_fraction}\n")
    proc = cli(site, "validate", str(cfg), DATAFLEX_LOAD_PLUGINS="dataflex-bus,hostcexit", DATAFLEX_DEBUG="1")
    assert proc.returncode == 9
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "dataflex: importing scorer 'exits' from 'hostcexit_pack.components:Gone' (plugin 'hostcexit'")


# ---------------------------------------------------------------------------- hooks without @hookimpl
def test_register_without_hookimpl_is_warned_in_record_listing_and_stderr_once(site, monkeypatch, capsys):
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "hostnohook,hostgood")
    records = {r.name: r for r in discover().records}
    nohook = records["hostnohook"]
    assert nohook.status == ACTIVE and nohook.components == []
    assert nohook.warnings == ["defines dataflex_register() without @hookimpl, so it registers no component: "
                               "decorate it with @dataflex_bus.hookimpl"]
    assert records["hostgood"].warnings == []
    err = capsys.readouterr().err
    assert err.count("without @hookimpl") == 1 and "plugin 'hostnohook'" in err
    proc = cli(site, "plugins", DATAFLEX_LOAD_PLUGINS="hostnohook")
    assert "warning: defines dataflex_register() without @hookimpl" in proc.stdout
    assert proc.stderr.count("without @hookimpl") == 1
    listing = cli(site, "plugins", "--json", DATAFLEX_LOAD_PLUGINS="hostnohook")
    report = {r["name"]: r for r in json.loads(listing.stdout)}
    assert report["hostnohook"]["warnings"] and "without @hookimpl" in report["hostnohook"]["warnings"][0]


def test_event_hook_without_hookimpl_and_an_empty_plugin_are_warned(tmp_path, monkeypatch):
    make_dist(tmp_path, "dataflex-hostobs", "1.0", {
        "hostobs_pack.plugin": "def on_step_end(step, decision):\n    pass\n",
        "hostempty_pack.plugin": "X = 1\n",
    }, {"hostobs": "hostobs_pack.plugin", "hostempty": "hostempty_pack.plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DATAFLEX_STRICT_PLUGINS", "0")
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "dataflex-hostobs")
    forget_modules("hostobs_pack", "hostempty_pack")
    try:
        records = {r.name: r for r in discover().records}
        assert "on_step_end() without @hookimpl, so it is never called" in records["hostobs"].warnings[0]
        assert records["hostempty"].warnings == ["registers no component and implements no event hook"]
    finally:
        forget_modules("hostobs_pack", "hostempty_pack")


# ---------------------------------------------------------------------------- allow / deny lists
def test_unknown_list_entries_are_warned_with_did_you_mean(site, monkeypatch, capsys):
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "hostgod,dataflex-bus")
    monkeypatch.setenv("DATAFLEX_DISABLE_PLUGINS", "dataflex-hostbadd")
    plugins = discover()
    err = capsys.readouterr().err
    assert "DATAFLEX_LOAD_PLUGINS entry 'hostgod' names no installed plugin" in err
    assert "did you mean 'hostgood'" in err
    assert "DATAFLEX_DISABLE_PLUGINS entry 'dataflex-hostbadd'" in err and "'dataflex-hostbad'" in err
    assert "dataflex-bus" not in err.split("installed:")[0]          # a real name is not warned about
    assert len(plugins.warnings) == 2


def test_builtins_obey_the_allowlist_and_the_error_names_variable_and_plugin(site, monkeypatch):
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "hostgood")
    block = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
             "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}}
    with pytest.raises(ConfigError) as err:
        validate(block)
    found = {i.key: str(i) for i in err.value.issues}
    scorer = found["dataflex.scorer.name"]
    assert "unknown scorer 'group_solve_rate'" in scorer
    assert "plugin 'scorers' (dataflex-bus 0.1.0)" in scorer and "DATAFLEX_LOAD_PLUGINS='hostgood'" in scorer
    assert scorer.endswith("add dataflex-bus to DATAFLEX_LOAD_PLUGINS")
    assert "plugin 'select' (dataflex-bus 0.1.0)" in found["dataflex.actuator.name"]
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "hostgood,dataflex-bus")
    monkeypatch.setenv("DATAFLEX_DISABLE_PLUGINS", "scorers")
    reset_plugins()
    with pytest.raises(ConfigError) as err:
        validate(block)
    (issue,) = err.value.issues
    assert "plugin 'scorers' (dataflex-bus 0.1.0), which DATAFLEX_DISABLE_PLUGINS='scorers' lists it" in str(issue)
    assert str(issue).endswith("take it off DATAFLEX_DISABLE_PLUGINS")
    monkeypatch.delenv("DATAFLEX_DISABLE_PLUGINS")
    reset_plugins()
    validate(block)


def test_a_disabled_third_party_pack_is_named_but_never_imported(site, monkeypatch):
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "dataflex-bus")
    monkeypatch.setenv("DATAFLEX_DISABLE_PLUGINS", "hostgood")
    registry = discover().registry()
    with pytest.raises(UnknownComponentError) as err:
        registry.resolve("scorer", "len_score")
    text = str(err.value)
    assert "'hostgood' (dataflex-hostgood 1.0.0) (DATAFLEX_DISABLE_PLUGINS='hostgood' lists it)" in text
    assert "'hostexit' (dataflex-hostexit 0.3.0) (DATAFLEX_LOAD_PLUGINS='dataflex-bus' leaves it out)" in text
    assert "hostgood_pack.plugin" not in sys.modules
    # Without any variable set, the message is the plain one.
    plain = Registry([])
    with pytest.raises(UnknownComponentError) as err:
        plain.resolve("scorer", "len_score")
    assert "DATAFLEX" not in str(err.value)


# ---------------------------------------------------------------------------- swapped slots
@pytest.mark.parametrize(("slot", "name", "says"), [
    ("scorer", "threshold_band", "that is a selector, which goes under dataflex.actuator.name"),
    ("scorer", "advantage_reweight", "that is a reweighter, which goes under dataflex.actuator.name"),
    ("actuator", "group_solve_rate", "that is a scorer, which goes under dataflex.scorer.name"),
])
def test_a_name_in_the_wrong_slot_says_where_it_belongs(slot, name, says):
    other = "actuator" if slot == "scorer" else "scorer"
    block = {"mechanism": "select", slot: {"name": name},
             other: {"name": "reward_difficulty" if other == "scorer" else "dapo"}}
    with pytest.raises(ConfigError) as err:
        validate(block)
    (issue,) = [i for i in err.value.issues if i.key == f"dataflex.{slot}.name"]
    assert says in str(issue) and f"unknown {slot} '{name}'" in str(issue)


# ---------------------------------------------------------------------------- invalid class attributes
def _component(base: str, **attrs):
    import dataflex_bus

    return type("Broken", (getattr(dataflex_bus, base),), attrs)


@pytest.mark.parametrize(("kind", "base", "attrs", "message"), [
    ("scorer", "Scorer", {"timing": "after_lunch"}, "Broken.timing = 'after_lunch'"),
    ("scorer", "Scorer", {"granularity": "sentence"}, "Broken.granularity = 'sentence'"),
    ("scorer", "Scorer", {"requires": "rm_scores"}, "Broken.requires = 'rm_scores'"),
    ("scorer", "Scorer", {"params": {"k": 3}}, "Broken.params['k'] = 3: expected a Param"),
    ("scorer", "Scorer", {"params": [("k", 3)]}, "Broken.params = [('k', 3)]"),
    ("scorer", "Scorer", {"params": {"bad-key": 3}}, "Broken.params: key 'bad-key' is not a Python identifier"),
    ("selector", "Selector", {"accepts": "prompt"}, "Broken.accepts = 'prompt'"),
    ("selector", "Selector", {"accepts": ("prompt", "row")}, "Broken.accepts = ('prompt', 'row')"),
    ("reweighter", "Reweighter", {"min_timing": ["post_advantage"]}, "Broken.min_timing = ['post_advantage']"),
    ("mixer", "Mixer", {"needs_groups": "yes"}, "Broken.needs_groups = 'yes'"),
])
def test_invalid_class_attributes_are_named_at_load(kind, base, attrs, message):
    spec = ComponentSpec(kind, "broken", _component(base, **attrs), "host-test", "dataflex-host-test", "1.0")
    with pytest.raises(PluginLoadError) as err:
        spec.load()
    text = str(err.value)
    assert message in text and "plugin 'host-test'" in text and f"{kind} 'broken'" in text


def test_a_param_default_that_breaks_its_own_declaration_is_refused():
    from dataflex_bus import Param

    spec = ComponentSpec("scorer", "bad_default", _component("Scorer", params={
        "rate": Param(float, default=2.0, low=0.0, high=1.0)}), "host-test")
    with pytest.raises(PluginLoadError, match=r"params\['rate'\].default = 2.0: the default breaks"):
        spec.load()


def test_validation_reports_invalid_attributes_as_a_config_issue(dataflex_register_plugin):
    dataflex_register_plugin("scorer", "lunch", _component("Scorer", timing="after_lunch"))
    with pytest.raises(ConfigError) as err:
        validate({"mechanism": "select", "scorer": {"name": "lunch"}, "actuator": {"name": "dapo"}})
    (issue,) = err.value.issues
    assert issue.key == "dataflex.scorer.name" and "Broken.timing = 'after_lunch'" in issue.message


def test_an_info_example_writes_small_floats_as_yaml_floats():
    """PyYAML reads ``1e-06`` as a string: an example holding a parameter of 1e-6 (ada_downsample's eps) must
    write it so that the block it shows validates."""
    import yaml

    from dataflex_bus.catalog import _yaml_value

    for value in (1e-6, 1e20, 2.5e-7, 0.5, 3, "x", True):
        assert yaml.safe_load(f"v: {_yaml_value(value)}")["v"] == value


@pytest.mark.parametrize(("actuator", "scorer"), [("ada_downsample", "reward_difficulty"),
                                                  ("exclude_solved", "max_solve_rate"), ("top_b", "mopps")])
def test_an_actuators_info_example_pairs_it_with_its_intended_scorer(actuator, scorer, capsys):
    import yaml

    assert main(["info", actuator, "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["example_validated"]
    assert yaml.safe_load(entry["example"])["dataflex"]["scorer"]["name"] == scorer
