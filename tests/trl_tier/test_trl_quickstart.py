"""docs/trl.md's quick start runs as written, offline, in seconds: the block after its ``trl-quickstart``
marker is executed verbatim (once the page's quick start left out ``processing_class`` and the model, and a
model built from a config then failed inside the Hub client)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

pytestmark = pytest.mark.trl

DOC = Path(__file__).resolve().parents[2] / "docs" / "trl.md"
MARKED = re.compile(r"<!-- trl-quickstart:[^\n]*-->\n```python\n(.*?)^```", re.S | re.M)


def quick_start() -> str:
    found = MARKED.findall(DOC.read_text(encoding="utf-8"))
    assert len(found) == 1, "docs/trl.md must hold exactly one block after a trl-quickstart marker"
    return found[0]


def test_the_quick_start_runs_verbatim_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # its output_dir is relative
    namespace: dict = {"__name__": "__main__"}
    exec(compile(quick_start(), f"{DOC.name}[trl-quickstart]", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 3 and len(trainer.dataflex_metrics) == 3
    assert trainer.processing_class is namespace["tokenizer"]
    kept = [m["dataflex/kept_fraction"] for m in trainer.dataflex_metrics]
    assert all(0.0 < k <= 1.0 for k in kept) and min(kept) < 1.0, kept  # the selection acted, and trained
    out = capsys.readouterr().out
    assert "step 0: kept" in out and "step 2: kept" in out


def test_the_quick_start_is_the_whole_script():
    text = quick_start()
    for needle in ("processing_class=tokenizer", "LlamaConfig(", "PreTrainedTokenizerFast(", '"mechanism": "select"',
                   "trainer.train()", 'HF_HUB_OFFLINE'):
        assert needle in text, needle
