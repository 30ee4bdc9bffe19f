"""A plugin's error message of megabytes is stored and printed clipped (its head and tail around a marker
saying how much was cut), in debug mode too: run.json stays small and still says which plugin failed, where,
and how its message ended."""

from __future__ import annotations

import json
import sys

import pytest

from dataflex_bus import Scorer
from dataflex_bus.cli import main
from dataflex_bus.errors import MESSAGE_LIMIT, PluginRuntimeError, clip_text

from .conftest import tiny

HUGE = 20 * 1024 * 1024


class Shouts(Scorer):
    requires = ("rm_scores", "response_mask")

    def score(self, batch, step, **ctx):
        raise ValueError("start of it " + "x" * HUGE + " end of it")


def test_clip_text_keeps_the_head_and_the_tail_and_says_how_much_was_cut():
    text = "a" * 100 + "b" * 100
    assert clip_text(text, 1000) == text
    clipped = clip_text(text, 40)
    assert clipped.startswith("a" * 20) and clipped.endswith("b" * 20) and "[... 160 characters cut ...]" in clipped


@pytest.mark.parametrize("debug", ["1", "0"])
def test_a_huge_plugin_message_leaves_a_small_run_record_and_stderr(register, tmp_path, capsys, monkeypatch, debug):
    import yaml

    monkeypatch.setenv("DATAFLEX_DEBUG", debug)
    register("scorer", "t_shouts", Shouts)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny({"mechanism": "select", "scorer": {"name": "t_shouts"},
                                        "actuator": {"name": "topk_fraction"}})))
    assert main(["run", str(cfg), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err) < 200_000 and "characters cut" in err and "end of it" in err
    assert "dataflex run: error: plugin 't_shouts' failed in hook" in err or "failed in hook" in err
    raw = (tmp_path / "run" / "run.json").read_text()
    assert len(raw) < 300_000
    record = json.loads(raw)
    assert record["status"] == "failed" and "t_shouts" in record["error"] and "characters cut" in record["error"]
    assert "in score" in record["traceback"] and record["traceback"].rstrip().endswith("end of it")


def test_the_error_object_keeps_the_whole_cause():
    cause = ValueError("y" * (MESSAGE_LIMIT * 3))
    err = PluginRuntimeError("p", "on_rollout", cause)
    assert len(str(err)) < MESSAGE_LIMIT + 200 and err.cause is cause


HUGE = 20_000_000


def test_a_huge_import_error_is_clipped_in_debug_output_and_records(tmp_path, monkeypatch, capsys):
    """DATAFLEX_DEBUG=1 prints a failing plugin's and component module's traceback: head and tail only."""
    from importlib.metadata import EntryPoint

    from dataflex_bus.discovery import _load_one, new_plugin_manager
    from dataflex_bus.errors import PluginLoadError
    from dataflex_bus.registry import ComponentSpec

    (tmp_path / "huge_failing_plugin.py").write_text(f"raise ValueError('z' * {HUGE} + 'end of it')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DATAFLEX_DEBUG", "1")
    record = _load_one(EntryPoint("huge", "huge_failing_plugin", "dataflex"), new_plugin_manager(), strict=False)
    err = capsys.readouterr().err
    assert record.status == "failed" and len(record.error) < 2 * MESSAGE_LIMIT and "end of it" in record.error
    assert len(err) < 200_000 and "characters cut" in err and "end of it" in err
    sys.modules.pop("huge_failing_plugin", None)
    spec = ComponentSpec("scorer", "huge", "huge_failing_plugin:Scorer", "huge")
    with pytest.raises(PluginLoadError) as exc:
        spec.load()
    err = capsys.readouterr().err
    assert len(str(exc.value)) < 2 * MESSAGE_LIMIT and "end of it" in str(exc.value)
    assert len(err) < 200_000 and "characters cut" in err
