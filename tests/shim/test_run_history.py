"""The run record tells the whole story: every session (killed, interrupted, failed, resumed), the step a
resume continues from, package versions that changed, observers that failed; a resume never shortens a run."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from dataflex_bus import hookimpl
from dataflex_bus.bus import PluginInterrupt
from dataflex_bus.errors import ConfigError, PluginRuntimeError
from dataflex_bus.shim import run_training
from dataflex_bus.shim.files import CheckpointError, load_checkpoint

from . import faults
from .conftest import tiny, without_times


def record(out):
    return json.loads((out / "run.json").read_text())


def sel(actuator, scorer="t_reward"):
    return {"mechanism": "select", "scorer": {"name": scorer}, "actuator": actuator}


@pytest.mark.integration
def test_repeated_kills_keep_every_session_and_mark_them_interrupted(tmp_path):
    cfg = tiny(trainer={"save_every": 1})
    out = tmp_path / "run"
    killed_at = []
    for attempt in range(2):
        proc = faults.start_run(cfg, out, steps=100_000, resume=attempt > 0)
        try:
            killed_at.append(faults.wait_for_checkpoint(out, proc, at_least=(killed_at[-1] + 2 if killed_at else 2)))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        assert record(out)["status"] == "running"  # what a killed process leaves behind
    ckpt = load_checkpoint(out / "checkpoint.pt")["step"]
    result = run_training(cfg, steps=ckpt + 2, out=out, resume=True)
    rec = record(out)
    sessions = rec["sessions"]
    assert [s["status"] for s in sessions] == ["interrupted", "interrupted", "complete"]
    assert sessions[0]["start_step"] == 0 and sessions[1]["start_step"] == sessions[0]["end_step"]
    assert sessions[2]["start_step"] == ckpt == sessions[1]["end_step"] and sessions[2]["end_step"] == ckpt + 2
    assert all("killed" in s["error"] for s in sessions[:2]) and len({s["pid"] for s in sessions}) == 3
    assert [e["event"] for e in rec["events"]] == ["interrupted", "resumed", "interrupted", "resumed"]
    assert rec["status"] == "complete" and len(result.metrics) == ckpt + 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == ckpt + 2


def test_a_resume_cannot_shorten_a_run(tmp_path):
    out = tmp_path / "run"
    run_training(tiny(), steps=4, out=out)
    before = (out / "metrics.jsonl").read_text(), (out / "run.json").read_text()
    with pytest.raises(ConfigError, match=r"trainer\.steps: 2 is below the step of the checkpoint .* \(4\)"):
        run_training(tiny(), steps=2, out=out, resume=True)
    assert ((out / "metrics.jsonl").read_text(), (out / "run.json").read_text()) == before


def test_resuming_a_complete_run_at_its_length_changes_nothing_it_trained(tmp_path):
    out = tmp_path / "run"
    first = run_training(tiny(), steps=3, out=out)
    again = run_training(tiny(), steps=3, out=out, resume=True)
    assert without_times(again.metrics) == without_times(first.metrics) and len(again.metrics) == 3
    rec = record(out)
    assert rec["steps"] == 3 and rec["counters"]["steps_done"] == 3 and rec["status"] == "complete"
    assert [(s["start_step"], s["end_step"]) for s in rec["sessions"]] == [(0, 3), (3, 3)]


def test_a_plugin_calling_sys_exit_fails_the_run_and_keeps_the_checkpoint(tmp_path, shim_components, register):
    from dataflex_bus import Selection, Selector

    class ExitAt(Selector):
        def select(self, batch, score, step_id):
            if step_id == 2:
                raise SystemExit(0)
            return Selection(torch.ones(len(batch), dtype=torch.bool))

    register("selector", "t_exit_at", ExitAt)
    out = tmp_path / "run"
    with pytest.raises(PluginRuntimeError, match=r"'local:t_exit_at' failed .*SystemExit: 0"):
        run_training(tiny(sel({"name": "t_exit_at"})), steps=4, out=out)
    rec = record(out)
    assert rec["status"] == "failed" and rec["sessions"][0]["status"] == "failed"
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 2


def test_an_interrupt_is_recorded_as_interrupted_not_failed(tmp_path, shim_components, register):
    from dataflex_bus import Selection, Selector

    class CtrlCAt(Selector):
        def select(self, batch, score, step_id):
            if step_id == 1:
                raise KeyboardInterrupt
            return Selection(torch.ones(len(batch), dtype=torch.bool))

    register("selector", "t_ctrl_c", CtrlCAt)
    out = tmp_path / "run"
    with pytest.raises(PluginInterrupt, match="local:t_ctrl_c"):
        run_training(tiny(sel({"name": "t_ctrl_c"})), steps=4, out=out)
    rec = record(out)
    assert rec["status"] == "interrupted" and "interrupted at step 1" in rec["error"]
    assert rec["sessions"][0]["status"] == "interrupted"
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 1


def test_changed_package_versions_are_warned_and_recorded(tmp_path, monkeypatch, dataflex_log):
    from foundation.fakedist import forget_modules, make_dist

    from dataflex_bus.discovery import reset_plugins

    def install(version):
        root = tmp_path / f"site-{version}"
        make_dist(root, "dataflex-watch", version, {"watch_pack.plugin": "X = 1\n"}, {"watch": "watch_pack.plugin"})
        monkeypatch.syspath_prepend(str(root))
        forget_modules("watch_pack")
        reset_plugins()

    monkeypatch.setenv("DATAFLEX_STRICT_PLUGINS", "0")
    out = tmp_path / "run"
    try:
        install("1.0.0")
        run_training(tiny(), steps=2, out=out)
        install("1.1.0")  # earlier on sys.path: the upgraded pack
        run_training(tiny(), steps=3, out=out, resume=True)
    finally:
        forget_modules("watch_pack")
        reset_plugins()
    assert "dataflex-watch 1.0.0 -> 1.1.0" in dataflex_log.text
    rec = record(out)
    assert [s["plugins"] for s in rec["sessions"]] == [["dataflex-bus==0.1.0", "dataflex-watch==1.0.0"],
                                                       ["dataflex-bus==0.1.0", "dataflex-watch==1.1.0"]]
    changed = [e for e in rec["events"] if e["event"] == "versions_changed"]
    assert len(changed) == 1 and changed[0]["changes"] == ["dataflex-watch 1.0.0 -> 1.1.0"]
    assert changed[0]["before"]["plugins"] == rec["sessions"][0]["plugins"]


def test_failing_observer_is_counted_in_the_record_and_the_run_completes(tmp_path, observers):
    class Noisy:
        @hookimpl
        def on_advantage(self, step):
            raise ValueError(f"observer bug at step {step}")

    observers["noisy"] = Noisy()
    out = tmp_path / "run"
    result = run_training(tiny(), steps=3, out=out)
    assert result.record["status"] == "complete"
    failures = record(out)["observer_failures"]
    assert failures == [{"observer": "noisy", "hook": "on_advantage", "count": 3, "first_step": 0, "last_step": 2,
                         "last_error": "ValueError: observer bug at step 2", "session": 0}]


def test_observer_trying_to_skip_updates_is_not_obeyed(tmp_path, observers):
    class Meddler:
        @hookimpl
        def on_rollout(self, decision):
            decision.skip_update = True

    plain = without_times(run_training(tiny(), steps=3).metrics)
    observers["meddler"] = Meddler()
    result = run_training(tiny(), steps=3, out=tmp_path / "run")
    assert without_times(result.metrics) == plain and result.record["counters"]["skipped_updates"] == 0
    assert result.record["observer_failures"][0]["count"] == 3


def test_a_checkpoint_records_what_produced_it(tmp_path):
    out = tmp_path / "run"
    run_training(tiny(), steps=1, out=out)
    provenance = load_checkpoint(out / "checkpoint.pt")["provenance"]
    assert provenance["dataflex_bus"] == "0.1.0" and "dataflex-bus==0.1.0" in provenance["plugins"]


@pytest.mark.parametrize(("garbage", "message"), [
    (b"{ damaged", "is not valid JSON"),
    (b"\xff\xfe garbage", "is not valid JSON"),
    (b"[1, 2]", "holds a JSON list, not an object"),
    (b'{"sessions": "oops"}', "'sessions' holds str, not a list of objects"),
    (b'{"sessions": [1, 2]}', "'sessions' holds a list with int, not a list of objects"),
    (b'{"events": {"a": 1}}', "'events' holds dict, not a list of objects"),
])
def test_a_damaged_record_at_resume_is_refused_and_kept(tmp_path, garbage, message):
    """A damaged record was overwritten by the resume (exit 0, no warning): the earlier sessions were lost."""
    out = tmp_path / "run"
    run_training(tiny(), steps=2, out=out)
    (out / "run.json").write_bytes(garbage)
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CheckpointError, match=message) as err:
        run_training(tiny(), steps=3, out=out, resume=True)
    assert str(out / "run.json") in str(err.value) and "move it away" in str(err.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept


def test_a_missing_record_at_resume_is_noted_not_fatal(tmp_path):
    out = tmp_path / "run"
    run_training(tiny(), steps=2, out=out)
    (out / "run.json").unlink()   # what the refusal of a damaged record tells its owner to do, if they choose
    run_training(tiny(), steps=3, out=out, resume=True)
    rec = record(out)
    assert rec["events"][0]["event"] == "record_missing" and rec["status"] == "complete"
    assert [s["start_step"] for s in rec["sessions"]] == [2]
