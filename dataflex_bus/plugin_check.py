"""``dataflex plugins --check``: import every allowed plugin and every component it registers in a child
process, so a pack that ends the interpreter (``os._exit``, a crash) or hangs at import is named in its
record instead of taking the listing process with it; the child is then rerun without that pack, so the
others are still checked. The calling process imports no plugin.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from .discovery import (
    DISABLED,
    ENV_STRICT,
    FAILED,
    PluginRecord,
    _dist_of,
    _load_one,
    _plan,
    new_plugin_manager,
    plugin_key,
)
from .errors import DataflexError, PluginLoadError

_CHECK_SKIP = "_DATAFLEX_CHECK_SKIP"  # set by check_plugins for its child: plugins/components not to touch


def _component_key(plugin_key: str, kind: str, name: str) -> str:
    return f"{plugin_key}|{kind}:{name}"


def _check_child(progress: str) -> None:
    """Body of the ``plugins --check`` child: load, register and import everything, reporting each step
    to ``progress`` (JSON lines, flushed) *before* doing it, so a process that dies is explained."""
    skip = set(json.loads(os.environ.get(_CHECK_SKIP) or "[]"))
    with open(progress, "a", encoding="utf-8") as out:
        def emit(**event: Any) -> None:
            out.write(json.dumps(event) + "\n")
            out.flush()

        pm = new_plugin_manager()
        for ep, variable, reason in _plan().entries:
            dist_name, version = _dist_of(ep)
            key = plugin_key(dist_name, ep.name)
            if variable is not None:
                record = PluginRecord(ep.name, dist_name, version, DISABLED, disabled_by=variable,
                                      disabled_reason=reason)
                emit(event="record", key=key, record=record.as_json())
                continue
            if key in skip:
                emit(event="skipped", key=key)
                continue
            emit(event="loading", key=key, name=ep.name, distribution=dist_name, version=version)
            record = _load_one(ep, pm, strict=False)
            emit(event="record", key=key, record=record.as_json())
            for spec in record.components:
                ckey = _component_key(key, spec.kind, spec.name)
                if ckey in skip:
                    continue
                emit(event="importing", key=ckey, target=spec.target_text)
                try:
                    spec.load()
                    emit(event="checked", key=ckey, error=None)
                except (Exception, SystemExit) as exc:
                    text = str(exc) if isinstance(exc, PluginLoadError) else f"{type(exc).__name__}: {exc}"
                    emit(event="checked", key=ckey, error=text)
        emit(event="done")


def _how_it_ended(returncode: int | None, timeout: float) -> str:
    if returncode is None:
        return f"did not finish within {timeout:g} s (killed)"
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit status {returncode}, no Python exception (os._exit or a crash?)"


def check_plugins(timeout: float = 300.0) -> list[dict[str, Any]]:
    """Import every allowed plugin *and every component it registers* in a child process, checking each
    target is a component of the declared kind with valid class attributes.

    Returns the ``plugins --json`` records, each component with a ``check`` entry (``"ok"`` or the
    error). A plugin or component module that ends the child (``os._exit``, a crash, a hang past
    ``timeout`` seconds) is named in its record; the child is then rerun without it, so the others are
    still checked. The calling process imports no plugin.
    """
    import subprocess  # only --check pays for these imports; listing stays lean
    import tempfile

    dead: dict[str, dict[str, Any]] = {}   # plugin key -> failed record made up here
    dead_components: dict[str, str] = {}   # component key -> error
    env = {**os.environ, ENV_STRICT: "0",
           # The child sees exactly this process's import path (tests and tools may have extended it).
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = "import sys; from dataflex_bus.plugin_check import _check_child; _check_child(sys.argv[1])"
    with tempfile.TemporaryDirectory(prefix="dataflex-check-") as tmp:
        for attempt in range(1000):
            progress = os.path.join(tmp, f"pass{attempt}.jsonl")
            env[_CHECK_SKIP] = json.dumps(sorted([*dead, *dead_components]))
            returncode: int | None
            try:
                proc = subprocess.run([sys.executable, "-c", code, progress], env=env, timeout=timeout,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                returncode, stderr = proc.returncode, proc.stderr
            except subprocess.TimeoutExpired as exc:
                returncode = None
                stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            events = []
            if os.path.exists(progress):
                with open(progress, encoding="utf-8") as f:
                    events = [json.loads(line) for line in f if line.endswith("\n")]
            if events and events[-1]["event"] == "done":
                break
            last = events[-1] if events else None
            how = _how_it_ended(returncode, timeout)
            if last is not None and last["event"] == "loading":
                dead[last["key"]] = PluginRecord(
                    last["name"], last["distribution"], last["version"], FAILED,
                    error=f"the process ended while this plugin was imported and registered: {how}").as_json()
            elif last is not None and last["event"] == "importing":
                dead_components[last["key"]] = (f"the process ended while importing {last['target']!r}: {how}")
            else:
                tail = stderr.strip().splitlines()[-5:]
                raise DataflexError(f"plugins --check: the checking process failed ({how}): "
                                    + (" | ".join(tail) or "no output"))
    keyed = [(e["key"], dead[e["key"]] if e["event"] == "skipped" else e["record"])
             for e in events if e["event"] in ("skipped", "record")]
    checks = {e["key"]: e["error"] for e in events if e["event"] == "checked"}
    checks.update(dead_components)
    records = [record for _, record in keyed]
    for key, record in keyed:
        for component in record["components"]:
            error = checks.get(_component_key(key, component["kind"], component["name"]))
            component["check"] = "ok" if error is None else error
    return records


