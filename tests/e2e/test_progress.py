"""The e2e tier reports its progress on the terminal, past pytest's capture (no main_ppo: a stand-in)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().with_name("conftest.py")

#: Logs a verl file-logger line per step, a step every 0.7 s, as main_ppo would (but in a few seconds).
STAND_IN = textwrap.dedent("""
    import json, os, pathlib, time
    path = pathlib.Path(os.environ["VERL_FILE_LOGGER_PATH"])
    for step in range(1, 5):
        time.sleep(0.7)
        with path.open("a") as fh:
            fh.write(json.dumps({"step": step, "data": {"loss": 0.5}}) + "\\n")
""")


def test_the_e2e_tier_names_each_test_and_reports_a_running_main_ppo(pytester, monkeypatch):
    monkeypatch.setenv("DATAFLEX_E2E_HEARTBEAT", "1")
    pytester.makeconftest(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("e2e_conftest", {str(CONFTEST)!r})
        e2e = importlib.util.module_from_spec(spec)
        sys.modules["e2e_conftest"] = e2e
        spec.loader.exec_module(e2e)
        pytest_configure = e2e.pytest_configure
        pytest_runtest_logstart = e2e.pytest_runtest_logstart
    """)
    pytester.makepyfile(test_stand_in=f"""
        import os, sys
        from e2e_conftest import harness, launch

        def test_stand_in(pytestconfig, tmp_path):
            gpu_check = harness.load_gpu_check()
            print("captured, never shown")
            result = launch(pytestconfig, gpu_check, gpu_check.Run("stand_in", []), tmp_path, dict(os.environ),
                            command=[sys.executable, "-c", {STAND_IN!r}])
            assert result.returncode == 0 and sorted(result.metrics) == [1, 2, 3, 4]
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "e2e: test_stand_in.py::test_stand_in ..." in out
    assert "e2e: main_ppo run 'stand_in' started (timeout 900 s; log " in out
    assert "e2e: main_ppo run 'stand_in': 1 s, " in out  # the heartbeat (1 s here), while it runs
    assert "e2e: main_ppo run 'stand_in' ended: exit 0 after " in out and "4 step(s) logged" in out
    assert "captured, never shown" not in out
    assert out.index("started") < out.index("ended")

