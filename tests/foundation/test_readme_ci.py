"""README's two opening commands are the ones CI and users run: keep them true."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_readme_opens_with_run_and_test_commands():
    run, test = readme_commands()
    # The main job is a comparison on the CPU shim: plain GRPO against a method, on the same seeds.
    assert "dataflex compare examples/" in run and run.startswith("pip install torch==2.13.0")
    assert test.startswith("pip install torch==2.13.0") and test.endswith("pytest")
    configs = [word for word in run.split("dataflex compare ")[1].split() if word.endswith(".yaml")]
    assert "examples/grpo_baseline.yaml" in configs and len(configs) == 2
    for config in configs:
        assert (ROOT / config).is_file(), f"README's main job uses a missing config {config}"


def test_ci_runs_the_exact_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci
    assert ci.index("python -m pip install --quiet torch==2.13.0") < ci.index(readme_commands()[1])
