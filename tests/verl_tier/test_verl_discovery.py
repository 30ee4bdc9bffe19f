"""Real entry-point discovery by verl 0.9.1, in fresh interpreters (verl loads plugins on import).

The four probes run in parallel subprocesses (each pays verl's ~5-7 s import once).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.integration]

PROBE = textwrap.dedent("""
    import json, sys
    first = sys.argv[1]
    if first == "adapter":
        import dataflex_bus.verl.trainer
    import verl
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    cls = TRAINER_REGISTRY.get("dataflex_sync")
    out = {"registered": cls is not None,
           "cls": None if cls is None else f"{cls.__module__}.{cls.__qualname__}",
           "entry_loaded": "dataflex_bus.verl.entry" in sys.modules}
    if cls is not None and cls.__name__ == "DataflexSyncUnavailable":
        try:
            cls(None)
        except RuntimeError as exc:
            out["raised"] = str(exc)
    if first == "patch":  # what verl's FSDP worker does to every model it builds
        from transformers import LlamaConfig, LlamaForCausalLM
        from verl.models.transformers.monkey_patch import apply_monkey_patch
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        try:
            apply_monkey_patch(model)
            out["model_patch"] = "ok"
        except ImportError as exc:
            out["model_patch"] = repr(exc)
    print("PROBE" + json.dumps(out))
""")

# Simulates a broken install: the adapter module cannot be imported (as with a missing dependency).
BROKEN_SITECUSTOMIZE = textwrap.dedent("""
    import sys

    class _Broken:
        def find_spec(self, name, path=None, target=None):
            if name == "dataflex_bus.verl.trainer":
                raise ImportError("simulated broken install: dataflex adapter dependency missing")
            return None

    sys.meta_path.insert(0, _Broken())
""")

REAL = "dataflex_bus.verl.trainer.DataflexSyncTrainer"


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    pytest.importorskip("verl")
    shim = tmp_path_factory.mktemp("broken")
    (shim / "sitecustomize.py").write_text(BROKEN_SITECUSTOMIZE)
    script = tmp_path_factory.mktemp("probe") / "probe.py"
    script.write_text(PROBE)
    base = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "PYTHONPATH")}
    cases = {
        "auto": ({}, "verl"),
        "none": ({"VERL_USE_EXTERNAL_PLUGINS": "none"}, "verl"),
        "named": ({"VERL_USE_EXTERNAL_PLUGINS": "DataFlex"}, "verl"),  # verl lower-cases the policy
        "broken": ({"PYTHONPATH": str(shim)}, "verl"),
        "adapter_first": ({}, "adapter"),
        "patch": ({}, "patch"),
        "patch_without_plugin": ({"VERL_USE_EXTERNAL_PLUGINS": "none"}, "patch"),
    }
    doctor = [sys.executable, "-m", "dataflex_bus.cli", "doctor", "--json"]
    commands = {name: [sys.executable, str(script), first] for name, (_, first) in cases.items()}
    commands.update(doctor_broken=doctor, doctor_excluded=doctor, doctor_ignored=[
        sys.executable, "-m", "dataflex_bus.cli", "doctor", "--json", "trainer.v1.trainer_mode=sync",
        "+dataflex.mechanism=select", "+dataflex.scorer.name=group_solve_rate",
        "+dataflex.actuator.name=threshold_band", "+dataflex.no_such_key=1"])
    cases.update(doctor_ignored=({}, None))
    cases.update(doctor_broken=({"PYTHONPATH": str(shim)}, None))
    # verl told to skip our entry point, plus a broken dataflex method pack, under strict plugin loading
    pack = tmp_path_factory.mktemp("brokenpack")
    info = pack / "dataflex_broken_pack-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dataflex-broken-pack\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dataflex]\nbroken = dataflex_no_such_module_xyz\n")
    cases.update(doctor_excluded=({"PYTHONPATH": str(pack), "VERL_USE_EXTERNAL_PLUGINS": "none",
                                   "DATAFLEX_STRICT_PLUGINS": "1"}, None))
    cwd = {"doctor_excluded": str(pack)}
    # The checked-out code (not whichever copy is installed) goes after each case's own path.
    root = Path(__file__).parents[2]
    here = os.pathsep.join([str(root), str(root / "plugins")])

    def environ(env: dict) -> dict:
        path = env.get("PYTHONPATH")
        return {**base, **env, "PYTHONPATH": f"{path}{os.pathsep}{here}" if path else here}

    procs = {name: subprocess.Popen(commands[name], env=environ(env), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=cwd.get(name, str(shim)))
             for name, (env, _) in cases.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        if name.startswith("doctor"):
            assert out.strip(), f"{name}: doctor printed no report (rc={proc.returncode})\n{err[-3000:]}"
            results[name] = (proc.returncode, json.loads(out), err)
            continue
        line = next((ln for ln in out.splitlines() if ln.startswith("PROBE")), None)
        assert line is not None, f"{name}: probe printed nothing (rc={proc.returncode})\n{err[-3000:]}"
        results[name] = (json.loads(line[len("PROBE"):]), err)
    return results


def test_import_verl_registers_dataflex_sync(probes):
    out, err = probes["auto"]
    assert out == {"registered": True, "cls": REAL, "entry_loaded": True}
    assert "dataflex: the verl plugin could not import" not in err


def test_plugins_none_disables_discovery(probes):
    out, _ = probes["none"]
    assert out == {"registered": False, "cls": None, "entry_loaded": False}


def test_plugin_selected_by_lowercase_name(probes):
    out, _ = probes["named"]
    assert out["registered"] and out["cls"] == REAL


def test_adapter_imported_before_verl_registers_once(probes):
    # The adapter triggers `import verl`, whose plugin loader re-enters the half-imported adapter.
    out, err = probes["adapter_first"]
    assert out == {"registered": True, "cls": REAL, "entry_loaded": True}
    assert "could not import" not in err and "already registered" not in err


def test_verl_builds_its_models_beside_trl_1x(probes):
    """verl's monkey patch imports TRL's PPO value head whenever TRL is installed; TRL 1.x has none. With the
    dataflex plugin verl asks for the value head itself (dataflex_bus.verl.compat), and the build goes on."""
    from dataflex_bus.verl.compat import trl_has_value_head

    assert probes["patch"][0]["model_patch"] == "ok"
    if importlib.util.find_spec("trl") is not None and not trl_has_value_head():
        assert "AutoModelForCausalLMWithValueHead" in probes["patch_without_plugin"][0]["model_patch"]


def test_broken_install_fails_loudly(probes):
    out, err = probes["broken"]
    # 1. an ERROR with the traceback, although verl swallows plugin errors at DEBUG
    assert "dataflex: the verl plugin could not import dataflex_bus.verl.trainer" in err
    assert "Traceback" in err and "simulated broken install" in err
    # 2. a stand-in trainer whose construction names the real cause (not "Unknown trainer")
    assert out["registered"] and out["cls"].endswith("DataflexSyncUnavailable")
    assert "simulated broken install" in out["raised"] and "dataflex doctor" in out["raised"]


def test_entry_point_is_declared_lowercase():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="verl.plugins") if ep.value == "dataflex_bus.verl.entry"]
    assert [ep.name for ep in eps] == ["dataflex"]
    assert Path(__file__).parents[2].joinpath("dataflex_bus/verl/entry.py").exists()


def test_doctor_reports_health_and_fails_on_a_broken_install(probes, monkeypatch, capsys):
    import argparse

    from dataflex_bus.verl.doctor import cmd_doctor

    monkeypatch.delenv("VERL_USE_EXTERNAL_PLUGINS", raising=False)
    rc = cmd_doctor(argparse.Namespace(json=True))  # in this (healthy) process
    checks = json.loads(capsys.readouterr().out)
    by_name = {c["check"]: c for c in checks}
    assert rc == 0, checks
    assert by_name["verl"]["detail"] == "verl 0.9.1" and by_name["trainer mode"]["status"] == "ok"
    assert any(name.startswith("plugin ") for name in by_name)
    rc, checks, _ = probes["doctor_broken"]
    by_name = {c["check"]: c for c in checks}
    assert rc == 1
    assert by_name["trainer mode"]["status"] == "FAIL"
    assert "simulated broken install" in by_name["trainer mode"]["detail"]


def test_doctor_fails_when_verl_will_not_register_the_mode_and_reports_every_plugin(probes):
    # VERL_USE_EXTERNAL_PLUGINS=none: main_ppo would say "Unknown trainer 'dataflex_sync'", so doctor
    # must not say "all checks passed"; a broken method pack under strict loading is reported, not raised.
    rc, checks, _ = probes["doctor_excluded"]
    by_name = {c["check"]: c for c in checks}
    assert rc == 1, checks
    assert by_name["trainer mode"]["status"] == "FAIL"
    assert "VERL_USE_EXTERNAL_PLUGINS='none'" in by_name["trainer mode"]["detail"]
    assert by_name["VERL_USE_EXTERNAL_PLUGINS"]["status"] == "warn"
    assert by_name["plugin broken"]["status"] == "FAIL"
    assert "dataflex_no_such_module_xyz" in by_name["plugin broken"]["detail"]
    assert by_name["plugin select"]["status"] == "ok"  # the healthy packs are still listed


def test_doctor_with_verl_overrides_fails_a_block_the_mode_would_ignore(probes):
    rc, checks, err = probes["doctor_ignored"]
    by_name = {c["check"]: c for c in checks}
    assert rc == 1, checks
    assert by_name["dataflex block"]["status"] == "FAIL"
    assert "use trainer.v1.trainer_mode=dataflex_sync" in by_name["dataflex block"]["detail"]
    # verl's import-time chatter (no accelerator here, optional engines missing) is silenced
    assert "No supported accelerator" not in err and "engine is not available" not in err
