"""Discovery with real distributions on the path (fake ``.dist-info``), as pip would leave them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dataflex_bus.discovery import ACTIVE, DISABLED, FAILED, discover, get_plugins, reset_plugins
from dataflex_bus.errors import CollisionError, PluginLoadError, UnknownComponentError

from .fakedist import forget_modules, make_dist

COMPONENTS = """
import torch
from dataflex_bus import Score, Scorer

class LengthScore(Scorer):
    requires = ("response_mask",)
    def score(self, batch, step_id, **ctx):
        return Score(batch.lengths.float(), "response")
"""


def _register_module(name: str, target: str, marker: str | None = None) -> str:
    touch = f"open({marker!r}, 'w').write('imported')\n" if marker else ""
    return f"""
from dataflex_bus import hookimpl
{touch}
@hookimpl
def dataflex_register(register):
    register("scorer", {name!r}, {target!r})
"""


@pytest.fixture
def packs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Four fake installed packs: good, broken on import, a second provider of 'length', a misspelt hook."""
    marker = tmp_path / "marker_good_imported"
    make_dist(tmp_path, "dataflex-good", "1.2.0", {
        "good_pack.components": COMPONENTS,
        "good_pack.plugin": _register_module("length", "good_pack.components:LengthScore", str(marker)),
    }, {"good": "good_pack.plugin"})
    make_dist(tmp_path, "dataflex-broken", "0.1.0", {
        "broken_pack.plugin": "raise ImportError('this pack is broken on purpose')\n",
    }, {"broken": "broken_pack.plugin"})
    make_dist(tmp_path, "dataflex-twin", "2.0.0", {
        "twin_pack.plugin": _register_module("length", "good_pack.components:LengthScore"),
    }, {"twin": "twin_pack.plugin"})
    make_dist(tmp_path, "dataflex-typo", "0.3.0", {
        "typo_pack.plugin": """
from dataflex_bus import hookimpl

@hookimpl
def on_rollot(batch, step, decision):
    pass
""",
    }, {"typo": "typo_pack.plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DATAFLEX_STRICT_PLUGINS", "0")
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "good,dataflex-broken,twin,typo")
    forget_modules("good_pack", "broken_pack", "twin_pack", "typo_pack")
    reset_plugins()
    yield {"root": tmp_path, "marker": marker}
    reset_plugins()
    forget_modules("good_pack", "broken_pack", "twin_pack", "typo_pack")


def _by_name(plugin_set):
    return {r.name: r for r in plugin_set.records}


def test_working_broken_and_typo_packs_are_reported(packs, capsys):
    records = _by_name(discover())
    good = records["good"]
    assert (good.status, good.distribution, good.version) == (ACTIVE, "dataflex-good", "1.2.0")
    assert [(c.kind, c.name) for c in good.components] == [("scorer", "length")]
    broken = records["broken"]
    assert broken.status == FAILED
    assert "this pack is broken on purpose" in broken.error
    assert broken.distribution == "dataflex-broken" and broken.version == "0.1.0"
    typo = records["typo"]
    assert typo.status == FAILED and "on_rollot" in typo.error and "on_rollout" in typo.error
    # The failures are reported on stderr, once per plugin, and the others still load.
    err = capsys.readouterr().err
    assert err.count("'broken'") == 1 and "failed to load" in err
    assert records["twin"].status == ACTIVE


def test_listing_does_not_import_components(packs):
    plugin_set = discover()
    assert "good_pack.components" not in sys.modules
    spec = plugin_set.registry().resolve("scorer", "dataflex-good:length")
    assert spec.load().__name__ == "LengthScore"
    assert "good_pack.components" in sys.modules


def test_collision_names_both_and_qualified_name_resolves(packs):
    registry = discover().registry()
    with pytest.raises(CollisionError) as err:
        registry.resolve("scorer", "length")
    assert "dataflex-good:length" in str(err.value) and "dataflex-twin:length" in str(err.value)
    assert registry.resolve("scorer", "dataflex-twin:length").distribution == "dataflex-twin"
    assert registry.resolve("scorer", "dataflex_good:length").distribution == "dataflex-good"
    with pytest.raises(UnknownComponentError, match="did you mean 'length'"):
        registry.resolve("scorer", "lenght")


def test_denylist_never_imports(packs, monkeypatch):
    monkeypatch.setenv("DATAFLEX_DISABLE_PLUGINS", "dataflex-good, BROKEN")
    records = _by_name(discover())
    assert records["good"].status == DISABLED and records["broken"].status == DISABLED
    assert not packs["marker"].exists(), "a disabled plugin must never be imported"
    assert "good_pack.plugin" not in sys.modules


def test_allowlist_unset_means_all_and_empty_means_none(packs, monkeypatch):
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "")
    assert all(r.status == DISABLED for r in discover().records)
    assert not packs["marker"].exists()
    monkeypatch.delenv("DATAFLEX_LOAD_PLUGINS")
    records = _by_name(discover())
    assert records["good"].status == ACTIVE and records["broken"].status == FAILED
    assert records["scorers"].status == ACTIVE  # the first-party packs are ordinary plugins too


def test_allowlist_by_distribution_name(packs, monkeypatch):
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "dataflex_twin")
    records = _by_name(discover())
    assert records["twin"].status == ACTIVE
    assert {r.status for n, r in records.items() if n != "twin"} == {DISABLED}


def test_strict_mode_reraises(packs, monkeypatch):
    monkeypatch.setenv("DATAFLEX_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match=r"broken.*this pack is broken on purpose"):
        discover()


def test_get_plugins_is_memoised(packs):
    first = get_plugins()
    assert get_plugins() is first
    assert get_plugins(refresh=True) is not first


def test_register_rejects_bad_calls(tmp_path, monkeypatch):
    make_dist(tmp_path, "dataflex-badreg", "1.0", {
        "badreg_pack.plugin": """
from dataflex_bus import hookimpl

@hookimpl
def dataflex_register(register):
    register("scorerr", "x", "badreg_pack.plugin:X")
""",
    }, {"badreg": "badreg_pack.plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DATAFLEX_STRICT_PLUGINS", "0")
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "badreg")
    forget_modules("badreg_pack")
    record = _by_name(discover())["badreg"]
    assert record.status == FAILED and "kind 'scorerr'" in record.error
    forget_modules("badreg_pack")


def _cli(args, root: Path, **env):
    full_env = {**os.environ, "PYTHONPATH": str(root), "DATAFLEX_STRICT_PLUGINS": "0", **env}
    return subprocess.run([sys.executable, "-m", "dataflex_bus.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


@pytest.mark.integration
def test_cli_plugins_json_and_check(packs):
    root = packs["root"]
    out = _cli(["plugins", "--json"], root, DATAFLEX_LOAD_PLUGINS="good,broken,scorers")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [r["name"] for r in report] == sorted(r["name"] for r in report)
    by = {r["name"]: r for r in report}
    assert set(by["good"]) == {"name", "distribution", "version", "status", "error", "warnings", "disabled_by",
                               "components"}
    assert by["good"]["components"] == [{"name": "length", "kind": "scorer", "summary": "",
                                         "target": "good_pack.components:LengthScore"}]
    assert by["good"]["warnings"] == [] and by["good"]["disabled_by"] is None
    assert by["broken"]["status"] == "failed" and "broken on purpose" in by["broken"]["error"]
    assert by["twin"]["status"] == "disabled" and by["twin"]["error"] is None
    assert by["twin"]["disabled_by"] == "DATAFLEX_LOAD_PLUGINS"
    check = _cli(["plugins", "--check"], root, DATAFLEX_LOAD_PLUGINS="good,broken")
    assert check.returncode == 1
    assert "failed" in check.stdout and "broken on purpose" in check.stdout
    ok = _cli(["plugins", "--check"], root, DATAFLEX_LOAD_PLUGINS="good")
    assert ok.returncode == 0 and "length (scorer)" in ok.stdout


def test_cli_plugins_never_imports_torch(packs):
    code = ("import sys; from dataflex_bus.cli import main; rc = main(['plugins', '--json']);"
            "sys.stdout.flush(); assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'structlog' not in sys.modules, 'structlog imported'; sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(packs["root"]), "DATAFLEX_STRICT_PLUGINS": "0"}
    env.pop("DATAFLEX_LOAD_PLUGINS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr


def test_installed_observer_plugins_watch_the_run_and_are_isolated(tmp_path, monkeypatch, caplog):
    """A pack implementing event hooks is an observer of every run; one that raises does not stop it."""
    import logging

    import torch

    from dataflex_bus import Batch, Runtime

    log_file = tmp_path / "events.txt"
    make_dist(tmp_path, "dataflex-watch", "0.2.0", {
        "watch_pack.plugin": f"""
from dataflex_bus import hookimpl

@hookimpl
def on_rollout(batch, step):
    open({str(log_file)!r}, "a").write(f"rollout {{step}} {{len(batch)}}\\n")

@hookimpl
def on_step_end(step, decision):
    open({str(log_file)!r}, "a").write(f"end {{step}}\\n")
""",
        "exit_pack.plugin": "import sys\nsys.exit(3)\n",
        "boom_pack.plugin": """
from dataflex_bus import hookimpl

@hookimpl
def on_rollout(batch):
    raise RuntimeError("observer exploded")
""",
    }, {"watch": "watch_pack.plugin", "boom": "boom_pack.plugin", "exits": "exit_pack.plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DATAFLEX_STRICT_PLUGINS", "0")
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "dataflex-watch")
    forget_modules("watch_pack", "boom_pack", "exit_pack")
    try:
        plugin_set = discover()
        assert _by_name(plugin_set)["exits"].status == FAILED
        assert "SystemExit" in _by_name(plugin_set)["exits"].error
        runtime = Runtime(None, plugins=plugin_set)
        assert sorted(runtime.bus.observers) == ["boom", "watch"]
        batch = Batch.from_tensors(uid=["a", "a"], rm_scores=torch.zeros(2, 3), response_mask=torch.ones(2, 3))
        logger = logging.getLogger("dataflex_bus")
        logger.addHandler(caplog.handler)
        try:
            for event in ("on_rollout", "on_advantage", "on_step_end"):
                runtime.emit(event, batch, 7)
        finally:
            logger.removeHandler(caplog.handler)
        assert log_file.read_text() == "rollout 7 2\nend 7\n"
        assert "observer 'boom' failed in on_rollout" in caplog.text
    finally:
        forget_modules("watch_pack", "boom_pack", "exit_pack")


def test_registration_goes_through_pluggy_per_plugin(tmp_path, monkeypatch):
    """dataflex_register is called through pluggy (argument subsetting, hook wrappers), once per plugin,
    and what a plugin registers is attributed to that plugin alone."""
    make_dist(tmp_path, "dataflex-two-parts", "1.0.0", {
        "two_parts.a": _register_module("part_a", "two_parts.a:X"),
        "two_parts.b": '''
from dataflex_bus import hookimpl
CALLS = []

@hookimpl(hookwrapper=True)
def dataflex_register():
    # A wrapper taking none of the spec's arguments: only pluggy's own caller can call it so.
    CALLS.append("before")
    yield
    CALLS.append("after")
''',
    }, {"a": "two_parts.a", "b": "two_parts.b"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DATAFLEX_STRICT_PLUGINS", "1")
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "dataflex-two-parts")
    forget_modules("two_parts")
    try:
        records = _by_name(discover())
        assert records["a"].status == records["b"].status == ACTIVE
        assert [c.name for c in records["a"].components] == ["part_a"] and records["b"].components == []
        import two_parts.b

        # b's wrapper ran around its own registration only, never around a's
        assert two_parts.b.CALLS == ["before", "after"]
    finally:
        forget_modules("two_parts")
        reset_plugins()


def test_a_pack_installed_and_built_in_place_on_the_path_is_one_plugin(tmp_path, monkeypatch):
    """``pip install ./pack`` leaves ``src/*.egg-info`` in the source tree; with ``src`` on sys.path too the
    distribution is seen twice, and must still provide its component once (no collision with itself)."""
    module = {"egg_pack.plugin": """
from dataflex_bus import hookimpl

@hookimpl
def dataflex_register(register):
    register("selector", "egg_sel", "egg_pack.plugin:Sel")
"""}
    make_dist(tmp_path / "site", "dataflex-egg", "0.1.0", module, {"egg": "egg_pack.plugin"})
    src = tmp_path / "src"
    src.mkdir()
    (src / "egg_pack").symlink_to(tmp_path / "site" / "egg_pack")
    info = src / "dataflex_egg.egg-info"
    info.mkdir()
    (info / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: dataflex-egg\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[dataflex]\negg = egg_pack.plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.setenv("DATAFLEX_LOAD_PLUGINS", "dataflex-egg")
    forget_modules("egg_pack")
    reset_plugins()
    try:
        plugins = get_plugins()
        assert [r.name for r in plugins.records if r.distribution == "dataflex-egg"] == ["egg"]
        assert plugins.registry().resolve("actuator", "egg_sel").provider == "dataflex-egg"
    finally:
        reset_plugins()
        forget_modules("egg_pack")
