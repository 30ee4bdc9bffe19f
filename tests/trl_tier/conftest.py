"""The TRL tier: ``-m trl`` (tiny random models built in the tests) and ``-m trl_model`` (SmolLM2-135M).

Nothing here imports trl at collection: each test module skips itself when trl is absent (CI refuses to
run without it, tests/conftest.py), so collecting this directory costs nothing with the tier deselected.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub at run time: every model is built or read locally
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings its telemetry otherwise
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func (the scripted generation) warns per trainer
