"""README's two opening commands are the ones CI and users run: keep them true."""

import json
import re
import shlex
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


# ---------------------------------------------------------------------------- the README's numbers
RESULTS = ROOT / "docs" / "results"
INTERVAL = r"[+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]"


def readme_main_table() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("<!-- main-job-table:start -->\n")[1].split("\n<!-- main-job-table:end -->")[0]


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """A Markdown table's rows by their first cell (without ``(baseline)``), each as ``column -> cell``."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].removesuffix(" (baseline)").strip("`").split("`")[0]] = dict(zip(header, cells))
    return rows


def test_the_readme_main_job_table_is_the_table_its_command_prints():
    from dataflex_bus.shim.report import compare_table

    doc = json.loads((RESULTS / "main_job.json").read_text())
    # columns, labels, minus signs and digits: exactly what `dataflex compare` printed for that document
    assert readme_main_table() == compare_table(doc)
    # ... and the document is the README's main command's own output
    words = shlex.split(readme_commands()[0].split("&&")[-1])
    configs = [w for w in words if w.endswith(".yaml")]
    seeds = words[words.index("--seeds") + 1:]
    seeds = [int(s) for s in seeds[: next((i for i, s in enumerate(seeds) if not s.isdigit()), len(seeds))]]
    out = words[words.index("--out") + 1]
    assert list(doc["methods"]) == [Path(c).stem for c in configs] and doc["seeds"] == seeds
    assert all(run == f"{out}/{label}/seed{seed}" for label, runs in doc["runs"].items()
               for run, seed in zip(runs, seeds))
    assert doc["cpus"], "the table must name the CPU its runs ran on"
    assert f"computed on {doc['cpus'][0]}" in readme_main_table()


def test_the_readme_summary_of_every_example_quotes_the_five_seed_table():
    text = (ROOT / "README.md").read_text()
    section = text.split("## What the methods do on the shim")[1].split("\n## ")[0]
    five = table_rows((RESULTS / "examples_5seeds.md").read_text())
    summary = table_rows(section)
    assert summary, "the README's summary table is gone"
    for method, row in summary.items():
        steps, rollouts = list(row.values())[1:3]
        assert steps == five[method]["Δ vs grpo_baseline [95% CI]"], method
        expected = five[method]["Δ at equal rollouts [95% CI]"]
        assert rollouts == expected or (rollouts == "same" and expected == steps), method


def test_every_interval_the_readme_quotes_is_in_a_table_of_the_command():
    """Prose quotes a few numbers; each must be one a `dataflex compare` table printed (same digits and
    signs), so a regeneration that changes them cannot leave the prose behind unnoticed."""
    prose = "\n".join(line for line in (ROOT / "README.md").read_text().splitlines() if not line.startswith("|"))
    tables = readme_main_table() + "".join(p.read_text() for p in sorted(RESULTS.glob("*.md")))
    quoted = re.findall(INTERVAL, prose)
    assert quoted, "the README quotes no interval any more: drop this test"
    assert [q for q in quoted if q not in tables] == []
    assert "−" not in (ROOT / "README.md").read_text(), "the command prints ASCII minus signs"
