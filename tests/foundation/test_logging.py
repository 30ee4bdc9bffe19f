import json
import subprocess
import sys

SCRIPT = """
from dataflex_bus import Runtime
Runtime(None)
"""


def run(env_extra):
    import os

    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)


def test_json_lines_record_plugins_and_config():
    out = run({"DATAFLEX_LOG_FORMAT": "json"})
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    rec = next(e for e in events if e["event"] == "dataflex.runtime")
    assert "dataflex-bus==0.1.0" in rec["plugins"] and rec["dataflex"] is None and rec["level"] == "info"


def test_console_is_the_default():
    out = run({"DATAFLEX_LOG_FORMAT": ""})
    assert "dataflex.runtime" in out.stderr and not out.stderr.lstrip().startswith("{")
