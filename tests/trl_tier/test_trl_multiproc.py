"""Two CPU processes (gloo, torchrun): every process decides the same from TRL's gathered rewards (the
trainer checks it), groups span processes, kept rows are laid out as TRL lays out a batch of that many, and
the update is bit-identical to plain TRL on two processes on only the kept groups; a method deciding by
process is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

pytestmark = [pytest.mark.trl, pytest.mark.integration]

HERE = Path(__file__).resolve().parent


def test_two_processes_decide_the_same_and_train_exactly(tmp_path):
    out = tmp_path / "mp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run([str(torchrun), "--nproc_per_node", "2", str(HERE / "trl_multiproc.py"), str(out)],
                          env=env, timeout=900, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    cases = {c["name"]: c for c in result["cases"]}
    assert len(cases) == 11
    for name, c in cases.items():
        assert c["ok"], (name, c)
        if "uneven" not in name and "max_abs_diff" in c:
            assert c["max_abs_diff"] == 0.0, name
    assert cases["refill, rounds drawn the same on both (bnpo)"]["trained_rows"] == [16.0, 16.0]
    assert cases["a reweight stack with old log-probs"]["weight_std"] > 0
    assert cases["rows dropped at on_advantage, laid out again"]["trained_rows"] == [8.0, 8.0]
    # Replay over two processes decides as one process does and trains the same to float rounding.
    import torch
    import trl_tiny as T
    from test_trl_replay import REPO, ROWS

    from dataflex_bus.trl import DataflexGRPOTrainer

    two = cases["replay, stored rows laid out over both processes"]
    one = T.train(DataflexGRPOTrainer, rows=ROWS, rows_per_gen=16, steps=3, trainer_kwargs={"dataflex": REPO})
    m = one["trainer"].dataflex_metrics
    assert two["replayed"] == [x["dataflex/replay/rows"] for x in m] == [0.0, 8.0, 8.0]
    assert two["trained"] == [x["dataflex/trained/rows"] for x in m]
    params = torch.load(two["params"])
    assert max(float((params[n] - p).abs().max()) for n, p in one["params"].items()) < 1e-5
