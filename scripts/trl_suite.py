#!/usr/bin/env python3
"""TRL's own GRPOTrainer tests against DataflexGRPOTrainer (tests/trl_suite; docs/trl.md "TRL's own tests").

  scripts/trl_suite.py fetch --trl-git DIR   copy TRL's tests/test_grpo_trainer.py and tests/testing_utils.py at
                                             the pinned commit from a TRL git repository (a checkout or a bare
                                             mirror) into tests/trl_suite/upstream/, checking their blob ids
  scripts/trl_suite.py run [--variants trl,no_block,keep_everything] [--chunks N] [--lock FILE] [-k EXPR]
                                             every test (not only the subset bare pytest runs) under every variant,
                                             in N pytest processes (chunks of test functions; each under
                                             ``flock FILE`` when given: a shared machine's heavy-job lock); prints
                                             pass/fail/skip per variant and every test whose outcome differs from
                                             TRL's own class

Run from the repository root with the project's environment active.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "trl_suite"
sys.path.insert(0, str(SUITE))

from trl_upstream import COMMIT, FILES, UPSTREAM  # noqa: E402

VARIANTS = ("trl", "no_block", "keep_everything")


def fetch(trl_git: Path) -> None:
    UPSTREAM.mkdir(exist_ok=True)
    for path, blob in FILES.items():
        text = subprocess.run(["git", "-C", str(trl_git), "show", f"{COMMIT}:{path}"], check=True,
                              capture_output=True).stdout
        got = subprocess.run(["git", "hash-object", "--stdin"], input=text, check=True,
                             capture_output=True).stdout.decode().strip()
        if got != blob:
            raise SystemExit(f"{path} at {COMMIT} has blob {got}, expected {blob}")
        (UPSTREAM / Path(path).name).write_bytes(text)
    (UPSTREAM / "__init__.py").write_text(f"# TRL's tests at {COMMIT} (scripts/trl_suite.py fetch)\n")
    print(f"fetched {', '.join(FILES)} at {COMMIT} into {UPSTREAM.relative_to(ROOT)}")


def collect(keyword: str | None) -> list[str]:
    """The test functions (``path::Class::test``), each once: a chunk runs every parametrization and variant."""
    cmd = [sys.executable, "-m", "pytest", str(UPSTREAM), "--collect-only", "-q", "-p", "no:cacheprovider"]
    if keyword:
        cmd += ["-k", keyword]
    env = {**os.environ, "DATAFLEX_TRL_SUITE": "all", "DATAFLEX_TRL_SUITE_VARIANTS": "trl"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True).stdout
    return list(dict.fromkeys(line.split("[", 1)[0] for line in out.splitlines() if "::" in line))


def run_chunks(functions: list[str], variants: str, chunks: int, lock: str | None, out: Path,
               keyword: str | None) -> dict[str, dict[str, str]]:
    """Each test's outcome (passed, failed, error, skipped) per variant; one pytest per chunk of functions, every
    variant in it, its JUnit report kept in ``out``."""
    outcomes: dict[str, dict[str, str]] = {v: {} for v in variants.split(",")}
    size = -(-len(functions) // max(1, chunks))
    env = {**os.environ, "DATAFLEX_TRL_SUITE": "all", "DATAFLEX_TRL_SUITE_VARIANTS": variants}
    out.mkdir(parents=True, exist_ok=True)
    for n, start in enumerate(range(0, len(functions), size)):
        report = out / f"chunk{n}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               *functions[start:start + size], *(["-k", keyword] if keyword else [])]
        subprocess.run(["flock", lock, *cmd] if lock else cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        read_report(report, outcomes)
        print(f"  chunk {n}: {len(functions[start:start + size])} functions, report {report}", flush=True)
    return outcomes


def read_report(report: Path, outcomes: dict[str, dict[str, str]]) -> None:
    """``outcomes[variant][test without the variant]`` from a JUnit report."""
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        stem, _, params = name.partition("[")
        variant, _, rest = params.rstrip("]").partition("-")
        if variant not in outcomes:
            continue
        kinds = {child.tag for child in case}
        outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        outcomes[variant][f"{stem}[{rest}]" if rest else stem] = outcome


def summary(results: dict[str, dict[str, str]]) -> None:
    for variant, outcomes in results.items():
        counts = Counter(outcomes.values())
        print(f"{variant}: {counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
              f"{counts['skipped']} skipped (of {len(outcomes)})")
    if "trl" in results:
        for variant, outcomes in results.items():
            if variant == "trl":
                continue
            for name, trl_outcome in sorted(results["trl"].items()):
                if outcomes.get(name) != trl_outcome:
                    print(f"  differs under {variant}: {name}: trl {trl_outcome}, {variant} {outcomes.get(name)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--trl-git", type=Path, required=True, help="a git repository of huggingface/trl holding "
                   f"commit {COMMIT}")
    r = sub.add_parser("run")
    r.add_argument("--variants", default=",".join(VARIANTS))
    r.add_argument("--chunks", type=int, default=1)
    r.add_argument("--lock", default=None)
    r.add_argument("-k", dest="keyword", default=None)
    r.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "trl_suite",
                   help="where each chunk's JUnit report is kept")
    a = parser.parse_args()
    if a.command == "fetch":
        fetch(a.trl_git)
        return
    if not (UPSTREAM / "test_grpo_trainer.py").is_file():
        raise SystemExit("TRL's tests are not fetched: scripts/trl_suite.py fetch --trl-git DIR")
    results = run_chunks(collect(a.keyword), a.variants, a.chunks, a.lock, a.out, a.keyword)
    summary(results)


if __name__ == "__main__":
    main()
