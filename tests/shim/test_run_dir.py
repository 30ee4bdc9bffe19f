"""What a run directory guarantees: one run at a time (a lock naming the holder), unique temporaries,
checksummed checkpoints, damage named by file and line, and unwritable output refused or recorded."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from dataflex_bus import hookimpl
from dataflex_bus.errors import ConfigError
from dataflex_bus.shim import CheckpointError, RunDirError, run_training
from dataflex_bus.shim import files as files_mod
from dataflex_bus.shim.files import (
    LOCK,
    atomic_write_bytes,
    load_checkpoint,
    make_run_dir,
    read_metrics,
    run_dir_lock,
    save_checkpoint,
    write_json,
)

from . import comps, faults
from .conftest import tiny, without_times


def record(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


# ---------------------------------------------------------------------------- the lock
@pytest.mark.integration
def test_second_run_on_a_locked_directory_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    with faults.lock_holder(out) as pid:
        for resume in (False, True):
            with pytest.raises(RunDirError, match=rf"in use by another dataflex run \(pid {pid}"):
                run_training(tiny(), steps=1, out=out, resume=resume)
        assert sorted(p.name for p in out.iterdir()) == [LOCK]  # nothing written, nothing removed
    # released when the holder ends (the kernel releases it even if the holder is killed)
    assert len(run_training(tiny(), steps=1, out=out).metrics) == 1


def test_the_lock_is_held_for_the_whole_run_and_released_after_it(tmp_path, observers):
    out = tmp_path / "run"
    seen = []

    class Probe:
        @hookimpl
        def on_step_end(self, step):
            # Another thread of this process asks for the directory mid-run: refused.
            errors = []
            t = threading.Thread(target=lambda: _try_lock(out, errors))
            t.start()
            t.join()
            seen.append(errors[0])

    observers["probe"] = Probe()
    run_training(tiny(), steps=2, out=out)
    assert len(seen) == 2 and all("in use by another run in this process" in e for e in seen)
    with run_dir_lock(out):  # free again once the run is over
        pass


def _try_lock(out, errors):
    try:
        with run_dir_lock(out):
            errors.append("acquired")
    except RunDirError as exc:
        errors.append(str(exc))


def test_the_lock_is_released_when_the_run_fails(tmp_path, shim_components):
    out = tmp_path / "run"
    cfg = tiny({"mechanism": "select", "scorer": {"name": "t_reward"},
                "actuator": {"name": "t_fail_at", "params": {"at": 1}}})
    with pytest.raises(Exception, match="boom at step 1"):
        run_training(cfg, steps=3, out=out)
    errors = []
    _try_lock(out, errors)
    assert errors == ["acquired"]


def test_nested_use_in_one_thread_is_refused(tmp_path):
    """run_training is the one owner of a run directory: nobody holds it around a run (no re-entrant lock)."""
    with run_dir_lock(tmp_path):
        with pytest.raises(RunDirError, match="in use by another run in this process"):
            with run_dir_lock(tmp_path):
                pass
        errors = []
        _try_lock(tmp_path, errors)  # the refusal left the holder's claim in place
        assert errors and errors[0] != "acquired"
    with run_dir_lock(tmp_path):  # and released it with the holder
        pass


def test_unsupported_locking_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_fcntl(name, *args, **kwargs):
        if name == "fcntl":
            raise ImportError("No module named 'fcntl'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fcntl)
    with pytest.raises(RunDirError, match=r"file locking \(fcntl\) is not available"):
        with run_dir_lock(tmp_path):
            pass


def test_a_file_system_refusing_locks_is_a_clear_error(tmp_path, monkeypatch):
    import fcntl

    def refuse(fd, op):
        if op & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    with pytest.raises(RunDirError, match=r"No locks available.*not supported on this file system"):
        with run_dir_lock(tmp_path):
            pass


# ---------------------------------------------------------------------------- temporaries
def test_temporary_names_are_unique_and_never_left_behind(tmp_path):
    target = tmp_path / "run.json"
    # What the old fixed name would have collided with: another writer's temporary, or junk.
    (tmp_path / "run.json.tmp").mkdir()
    write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}

    def fail(fh):
        fh.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RunDirError, match=r"run\.json: cannot write \(No space left on device\); the disk is full"):
        atomic_write_bytes(target, fail)
    assert json.loads(target.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.json.tmp"]


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_stale_temporaries_of_dead_writers_are_removed_when_the_lock_is_taken(tmp_path):
    """What a kill -9 between write and rename leaves behind: once stayed after the run completed."""
    out = tmp_path / "run"
    run_training(tiny(), steps=1, out=out)
    dead, alive = _dead_pid(), os.getpid()
    stale = out / f".checkpoint.pt.{dead}.0badc0de.tmp"
    stale.write_bytes(b"half a checkpoint")
    live = out / f".metrics.jsonl.{alive}.12345678.tmp"      # a writer still running keeps its own
    live.write_bytes(b"x")
    other = out / ".notes.txt.tmp"                            # not one of ours: never touched
    other.write_text("mine")
    run_training(tiny(), steps=2, out=out, resume=True)
    assert not stale.exists() and live.exists() and other.exists()
    with run_dir_lock(out):
        pass
    assert live.exists()


@pytest.mark.integration
def test_a_checkpoint_temporary_left_by_kill_9_is_gone_after_the_resume(tmp_path):
    import signal
    import subprocess
    import sys
    import textwrap

    out = tmp_path / "run"
    run_training(tiny(), steps=1, out=out)
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from dataflex_bus.shim.files import atomic_write_bytes
        def write(fh):
            fh.write(b"half")
            fh.flush()
            print("writing", flush=True)
            time.sleep(600)
        atomic_write_bytes(Path({str(out / "checkpoint.pt")!r}), write)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=faults.env())
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    (leftover,) = [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert leftover.startswith(f".checkpoint.pt.{proc.pid}.")
    run_training(tiny(), steps=2, out=out, resume=True)
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_concurrent_writers_of_one_file_do_not_collide(tmp_path):
    target = tmp_path / "metrics.jsonl"
    errors = []

    def writer(k):
        try:
            for _ in range(50):
                atomic_write_bytes(target, lambda fh: fh.write(f"{k}\n".encode() * 100))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(target.read_text().splitlines())) == 1  # one writer's whole file, never a mix
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


# ---------------------------------------------------------------------------- checkpoints
@pytest.fixture
def finished(tmp_path):
    out = tmp_path / "run"
    run_training(tiny(trainer={"save_every": 2}), steps=4, out=out)
    return out


@pytest.mark.parametrize("where", [0.25, 0.5, 0.99])
def test_a_flipped_byte_in_the_checkpoint_is_refused(finished, where):
    path = finished / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        run_training(tiny(trainer={"save_every": 2}), steps=6, out=finished, resume=True)


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: b[:-10], "truncated or extended"),
    (lambda b: b + b"x", "truncated or extended"),
    (lambda b: b"X" + b[1:], "no dataflex-checkpoint/1 header"),
    (lambda b: b.replace(b"bytes=", b"bytes=x", 1), "damaged header"),
    (lambda b: b"", "no dataflex-checkpoint/1 header"),
])
def test_a_truncated_or_rewritten_checkpoint_is_refused(finished, damage, message):
    path = finished / "checkpoint.pt"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_an_intact_checkpoint_round_trips(tmp_path):
    state = {"step": 3, "t": torch.arange(5), "nested": {"x": [1.5, None]}}
    save_checkpoint(state, tmp_path)
    back = load_checkpoint(tmp_path / "checkpoint.pt")
    assert back["step"] == 3 and torch.equal(back["t"], state["t"]) and back["nested"] == state["nested"]


@pytest.mark.parametrize(("entry", "value", "message"), [
    ("runtime", "oops", "entry 'runtime' holds str 'oops', not a mapping"),
    ("runtime", 7, "entry 'runtime' holds int 7, not a mapping"),
    ("step", "3", "entry 'step' holds str '3', not an integer"),
    ("step", True, "entry 'step' holds bool True, not an integer"),
    ("rng", [1, 2], "entry 'rng' holds list"),
    ("counters", None, "entry 'counters' holds NoneType"),
    # Once reported as "written by a different config: - : checkpoint None, config {...}".
    ("fingerprint", None, "entry 'fingerprint' holds NoneType None, not a mapping"),
    ("fingerprint", "abc", "entry 'fingerprint' holds str 'abc', not a mapping"),
    # Once reported as "metrics.jsonl holds 0 steps but the checkpoint is at step -3".
    ("step", -3, "entry 'step' holds -3, not a step count"),
])
def test_checkpoint_entries_of_the_wrong_type_are_named(finished, entry, value, message):
    state = load_checkpoint(finished / "checkpoint.pt")
    if value is None and entry == "fingerprint":
        del state[entry]
    else:
        state[entry] = value
    save_checkpoint(state, finished)  # a valid checksum: the content itself is wrong
    before = {p.name: p.read_bytes() for p in finished.iterdir() if p.name != "run.json"}
    with pytest.raises(CheckpointError, match=message) as err:
        run_training(tiny(trainer={"save_every": 2}), steps=6, out=finished, resume=True)
    assert "the checkpoint is damaged" in str(err.value) and "different config" not in str(err.value)
    # Nothing of the run is lost: the checkpoint and the metrics stay as they were.
    assert {p.name: p.read_bytes() for p in finished.iterdir() if p.name != "run.json"} == before


def test_plugin_state_of_the_wrong_type_is_a_checkpoint_error(tmp_path, shim_components):
    cfg = tiny({"mechanism": "mix", "scorer": {"name": "t_reward"}, "actuator": {"name": "t_all_on_first"}})
    out = tmp_path / "run"
    run_training(cfg, steps=2, out=out)
    for runtime in ({"pipeline": "oops"}, {"pipeline": {"methods": "oops"}},
                    {"pipeline": {"methods": {"mix:t_all_on_first": {"actuator": 5}}}}):
        state = load_checkpoint(out / "checkpoint.pt")
        state["runtime"] = runtime
        save_checkpoint(state, out)
        with pytest.raises(CheckpointError, match=r"checkpoint\.pt"):
            run_training(cfg, steps=3, out=out, resume=True)


# ---------------------------------------------------------------------------- metrics.jsonl
@pytest.mark.parametrize(("line", "message"), [
    ('{"step": 1.0, "rew', r"line 2 is not valid JSON"),
    ("[1, 2]", r"line 2 holds a JSON list, not an object"),
    ("3", r"line 2 holds a JSON int, not an object"),
])
def test_a_damaged_metrics_line_names_file_and_line(finished, line, message):
    path = finished / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = line
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CheckpointError, match=rf"metrics\.jsonl: {message}"):
        run_training(tiny(trainer={"save_every": 2}), steps=6, out=finished, resume=True)
    with pytest.raises(CheckpointError, match=rf"metrics\.jsonl: {message}"):
        read_metrics(path)


def test_non_utf8_metrics_are_named(finished):
    path = finished / "metrics.jsonl"
    data = path.read_bytes().split(b"\n")
    data[2] = b'{"step": 2.0, "\xff": 1}'
    path.write_bytes(b"\n".join(data))
    with pytest.raises(CheckpointError, match=r"line 3 is not UTF-8"):
        read_metrics(path)


def test_a_line_cut_short_after_the_checkpoint_is_redone_not_fatal(tmp_path):
    cfg = tiny(trainer={"save_every": 2})
    full = without_times(run_training(cfg, steps=4, out=tmp_path / "full").metrics)
    out = tmp_path / "cut"
    run_training(cfg, steps=2, out=out)
    with open(out / "metrics.jsonl", "a") as fh:  # a kill while step 3's line was being written
        fh.write('{"step": 2.0, "reward/me')
    resumed = run_training(cfg, steps=4, out=out, resume=True)
    assert without_times(resumed.metrics) == full
    assert without_times(read_metrics(out / "metrics.jsonl")) == full


def test_compare_names_a_damaged_metrics_file(finished, tmp_path, capsys):
    from dataflex_bus.cli import main

    path = finished / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = "{oops"
    path.write_text("\n".join(lines) + "\n")
    rc = main(["compare", str(finished), "--out", str(tmp_path / "cmp"), "--metric", "dataflex/rollout/reward_mean",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"{path}: line 3 is not valid JSON" in err


# ---------------------------------------------------------------------------- unwritable output
def test_out_naming_a_file_or_a_path_under_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(RunDirError, match="exists and is not a directory"):
        run_training(tiny(), steps=1, out=afile)
    with pytest.raises(RunDirError, match=rf"cannot create the run directory: {afile} is a file"):
        run_training(tiny(), steps=1, out=afile / "sub" / "run")
    assert afile.read_text() == "not a directory"


def test_read_only_directory_is_refused_before_training(tmp_path, observers):
    recorder = observers["recorder"] = comps.Recorder()
    out = tmp_path / "run"
    out.mkdir()
    with faults.read_only(out):
        with pytest.raises(RunDirError, match=rf"{out}.*cannot .*check the permissions"):
            run_training(tiny(), steps=1, out=out)
    assert recorder.events == []  # no step ran, no warm start was wasted on a run that could not be saved
    parent = tmp_path / "ro_parent"
    parent.mkdir()
    with faults.read_only(parent):
        with pytest.raises(RunDirError, match="cannot create the run directory"):
            run_training(tiny(), steps=1, out=parent / "run")


def test_directory_turning_read_only_mid_run_fails_named_and_is_marked(tmp_path, observers):
    out = tmp_path / "run"
    state = {}

    class Locker:
        @hookimpl
        def on_step_end(self, step):
            if step == 1 and "how" not in state:
                state["how"] = faults.make_read_only(out)

    observers["locker"] = Locker()
    try:
        with pytest.raises(RunDirError, match=r"checkpoint\.pt: cannot write"):
            run_training(tiny(trainer={"save_every": 1}), steps=5, out=out)
    finally:
        if "how" in state:
            faults.make_writable(out, state["how"])
    rec = record(out)
    assert rec["status"] == "failed" and "checkpoint.pt: cannot write" in rec["error"]
    assert rec["sessions"][-1]["status"] == "failed" and rec["sessions"][-1]["checkpoint_step"] == 1
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 1
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == []
    # and it resumes from the intact checkpoint
    assert len(run_training(tiny(trainer={"save_every": 1}), steps=5, out=out, resume=True).metrics) == 5


def test_disk_full_while_writing_metrics_is_named_and_marked(tmp_path, monkeypatch):
    """ENOSPC injected at the one place a step's metrics line reaches the OS (a full disk cannot be
    produced portably); everything after it (the record, the lock) is the real code path."""
    out = tmp_path / "run"
    real_open = open
    state = {"lines": 0}

    class FullDisk:
        def __init__(self, fh):
            self.fh = fh

        def write(self, text):
            state["lines"] += 1
            if state["lines"] == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.fh.write(text)

        def __getattr__(self, name):
            return getattr(self.fh, name)

    def opener(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        return FullDisk(fh) if str(path).endswith("metrics.jsonl") and "a" in mode else fh

    monkeypatch.setattr("builtins.open", opener)
    with pytest.raises(RunDirError, match=r"metrics\.jsonl: cannot append step 2 \(No space left on device\)"):
        run_training(tiny(), steps=5, out=out)
    rec = record(out)
    assert rec["status"] == "failed" and "No space left" in rec["error"]


def test_record_falls_back_to_an_in_place_rewrite(tmp_path, monkeypatch):
    """When the directory takes no new file (rename refused) the failure still reaches run.json."""
    out = tmp_path / "run"
    make_run_dir(out)
    write_json(out / "run.json", {"status": "running"})
    calls = {"n": 0}
    real_replace = files_mod.os.replace

    def refuse(src, dst):
        calls["n"] += 1
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files_mod.os, "replace", refuse)
    from dataflex_bus.shim.run import _RecordWriter

    _RecordWriter(out).write({"status": "failed"})
    monkeypatch.setattr(files_mod.os, "replace", real_replace)
    assert record(out) == {"status": "failed"} and calls["n"] == 1
    assert [p.name for p in out.iterdir()] == ["run.json"]


def test_config_errors_come_before_the_directory_is_touched(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"trainer\.group_size"):
        run_training(tiny(trainer={"group_size": 100_000_000_000}), out=out)
    assert not out.exists()


@pytest.mark.integration
def test_force_never_removes_the_files_of_a_run_in_progress(tmp_path):
    """What `dataflex run --force` and `dataflex compare --force` do before a run: refused while another run
    holds the directory, before any of its files is removed."""
    from dataflex_bus.shim.files import check_run_dir

    out = tmp_path / "run"
    run_training(tiny(), steps=1, out=out)
    before = (out / "run.json").read_bytes()
    with faults.lock_holder(out) as pid:
        with pytest.raises(RunDirError, match=rf"pid {pid}"):
            run_training(tiny(), steps=1, out=out, force=True)
    assert (out / "run.json").read_bytes() == before
    with run_dir_lock(out):
        check_run_dir(out, force=True)
    assert not (out / "run.json").exists()
