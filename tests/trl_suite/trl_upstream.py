"""Where TRL's own test files come from: the commit, each file's git blob id, the folder they are fetched into
(``scripts/trl_suite.py fetch``; git-ignored: the repository carries no other project's code)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"
#: TRL's commit the files come from: the newest of huggingface/trl's history as mirrored here (main, 2026-07-24,
#: version 1.10.0.dev0), the closest to the installed 1.16.0 that the mirror holds.
COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"
#: path in TRL's repository -> its git blob id at COMMIT.
FILES = {"tests/test_grpo_trainer.py": "3a46eb3d50d5709f50557632f110f41f239690bf",
         "tests/testing_utils.py": "66ed16701ceb5e9e090dabc6ab02b8fc4d75c485"}
MODULE = "test_grpo_trainer.py"


def upstream_present() -> bool:
    return (UPSTREAM / MODULE).is_file()
