"""The suite's own checks: the fetched TRL files are the pinned ones, and every stand-in resolves by its hub name
offline (what TRL's tests and TRL itself call)."""

from __future__ import annotations

import subprocess

import pytest
from trl_upstream import FILES, UPSTREAM, upstream_present

pytestmark = pytest.mark.trl_suite


def test_the_fetched_files_are_trl_s_at_the_pinned_commit():
    if not upstream_present():
        pytest.skip("TRL's tests are not fetched (this repository carries no other project's code): "
                    "scripts/trl_suite.py fetch --trl-git DIR, DIR a git repository of huggingface/trl")
    for path, blob in FILES.items():
        local = UPSTREAM / path.rsplit("/", 1)[1]
        got = subprocess.run(["git", "hash-object", str(local)], check=True, capture_output=True, text=True)
        assert got.stdout.strip() == blob, f"{local} is not {path} at the pinned commit"


def test_every_stand_in_loads_by_its_hub_name_offline(trl_suite_hub):
    import standins
    from transformers import AutoConfig, AutoTokenizer

    for name in standins.MODELS:
        repo = f"{standins.ORG}/{name}"
        config = AutoConfig.from_pretrained(repo)
        tokenizer = AutoTokenizer.from_pretrained(repo)
        assert config.vocab_size == len(tokenizer), repo
        assert tokenizer.eos_token is not None and tokenizer.pad_token is not None, repo
    zen = standins.load_dataset(standins.ZEN, "conversational_prompt_only", split="test")
    assert zen.column_names == ["prompt"] and zen[0]["prompt"][0]["role"] == "user"
