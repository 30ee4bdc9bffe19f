"""Real faults for the run-directory tests: read-only directories, a process holding a run's lock, a
process killed mid-run. Each either produces the fault for real or skips the test where the machine cannot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _writable(path: Path) -> bool:
    probe = path / ".probe"
    try:
        probe.write_text("x")
    except OSError:
        return False
    probe.unlink()
    return True


def make_read_only(path: Path) -> str:
    """Make the directory ``path`` refuse new files, for real: ``chmod`` (a normal user) or ``chattr +i``
    (root, whom permissions do not stop). Returns how, for :func:`make_writable`; skips if neither works."""
    path.chmod(0o555)
    if not _writable(path):
        return "chmod"
    path.chmod(0o755)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        if not _writable(path):
            return "chattr"
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    pytest.skip("cannot make a directory read-only here (root without chattr +i)")


def make_writable(path: Path, how: str) -> None:
    if how == "chattr":
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=True)
    else:
        path.chmod(0o755)


@contextmanager
def read_only(path: Path):
    how = make_read_only(path)
    try:
        yield
    finally:
        make_writable(path, how)


def env() -> dict[str, str]:
    paths = [str(ROOT), str(ROOT / "plugins"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


@contextmanager
def lock_holder(out: Path):
    """Another process holding ``out``'s run lock (as a running ``dataflex run`` does) until the block ends."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from dataflex_bus.shim.files import make_run_dir, run_dir_lock
        out = Path({str(out)!r})
        make_run_dir(out)
        with run_dir_lock(out):
            print("locked", flush=True)
            sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)


def start_run(config: dict, out: Path, steps: int, resume: bool = False) -> subprocess.Popen:
    """``run_training`` in another process (to be killed)."""
    code = textwrap.dedent(f"""
        import json
        from dataflex_bus.shim import run_training
        run_training(json.loads({json.dumps(json.dumps(config))}), steps={steps}, out={str(out)!r},
                     resume={resume})
    """)
    return subprocess.Popen([sys.executable, "-c", code], env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def wait_for_checkpoint(out: Path, proc: subprocess.Popen, at_least: int, timeout: float = 300) -> int:
    """Wait until the run in ``proc`` recorded a checkpoint at step >= ``at_least``; returns the step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it was to be killed"
        try:
            last = json.loads((out / "run.json").read_text())["sessions"][-1]
        except (OSError, ValueError, KeyError, IndexError):
            last = {}
        if last.get("pid") == proc.pid and (last.get("checkpoint_step") or 0) >= at_least:
            return int(last["checkpoint_step"])
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint at step {at_least} within {timeout}s")
