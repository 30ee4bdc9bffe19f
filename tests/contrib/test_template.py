"""``dataflex new-plugin``: names, refusals, and a generated pack whose own tests pass."""

import subprocess
import sys

import pytest

from dataflex_bus.cli import main
from dataflex_bus.template import TemplateError, create_pack, pack_names

pytest_plugins = ["pytester"]


@pytest.mark.parametrize(("name", "dist", "module", "component", "cls"), [
    ("my-scorer", "dataflex-my-scorer", "dataflex_my_scorer", "my_scorer", "MyScorer"),
    ("len2_reward", "dataflex-len2-reward", "dataflex_len2_reward", "len2_reward", "Len2Reward"),
    ("dataflex-short", "dataflex-short", "dataflex_short", "short", "Short"),
])
def test_names(name, dist, module, component, cls):
    n = pack_names(name)
    assert (n.dist, n.module, n.component, n.cls) == (dist, module, component, cls)


@pytest.mark.parametrize("name", ["", "My-Scorer", "2fast", "a--b", "with space", "x-", "dataflex-", "ünï"])
def test_invalid_names_are_refused(name, tmp_path):
    with pytest.raises(TemplateError, match="invalid plugin name"):
        create_pack(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["bus", "dataflex-bus", "plugins", "dataflex-plugins"])
def test_names_of_dataflex_bus_itself_are_refused(name, tmp_path):
    # dataflex-bus / dataflex_bus (or dataflex_plugins) would shadow or replace the bus when installed
    with pytest.raises(TemplateError, match="dataflex-bus itself"):
        create_pack(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_existing_dir_and_bad_parent(tmp_path, capsys):
    assert main(["new-plugin", "demo", "--dir", str(tmp_path)]) == 0
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["new-plugin", "demo", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "dataflex-demo" in err and "already exists" in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert main(["new-plugin", "demo", "--dir", str(tmp_path / "missing")]) == 2
    assert "not an existing directory" in capsys.readouterr().err
    assert main(["new-plugin", "Bad Name", "--dir", str(tmp_path)]) == 2
    assert "invalid plugin name 'Bad Name'" in capsys.readouterr().err


def test_generated_files(tmp_path):
    root = create_pack("demo-pack", tmp_path)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == ["README.md", "pyproject.toml", "src/dataflex_demo_pack/__init__.py",
                     "src/dataflex_demo_pack/plugin.py", "src/dataflex_demo_pack/scorer.py",
                     "tests/test_dataflex_demo_pack.py"]
    text = "\n".join(p.read_text() for p in root.rglob("*") if p.is_file())
    assert "{{" not in text and "__module__" not in text
    pyproject = (root / "pyproject.toml").read_text()
    assert 'name = "dataflex-demo-pack"' in pyproject
    assert '[project.entry-points.dataflex]\ndemo_pack = "dataflex_demo_pack.plugin"' in pyproject
    for path in root.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")


def test_generated_tests_pass_against_a_fake_install(tmp_path, pytester):
    """The generated tests, with the pack 'installed' as a dist-info on sys.path (the wheel install is
    in the integration tier). The shim run is checked there too."""
    root = create_pack("demo-pack", tmp_path)
    site = tmp_path / "site"
    info = site / "dataflex_demo_pack-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dataflex-demo-pack\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[dataflex]\ndemo_pack = dataflex_demo_pack.plugin\n")
    pytester.syspathinsert(root / "src")
    pytester.syspathinsert(site)
    try:
        result = pytester.runpytest(str(root / "tests"), "-p", "no:cacheprovider", "-p", "no:asyncio",
                                    "-k", "not short_training")
        result.assert_outcomes(passed=4, deselected=1)
    finally:
        for name in [m for m in sys.modules if m.startswith("dataflex_demo_pack")]:
            del sys.modules[name]


@pytest.mark.integration
@pytest.mark.parametrize("asyncio", [[], ["-p", "no:asyncio"]], ids=["with-pytest-asyncio", "without"])
def test_the_generated_pyproject_configures_pytest_without_a_warning(tmp_path, asyncio):
    """As a pack's author sees it, in a process of its own: with pytest-asyncio (which verl installs) its
    deprecation warning about an unset loop scope, without it pytest's "unknown config option", neither."""
    root = create_pack("demo-pack", tmp_path)
    # collecting src/ (no test files) configures pytest from the pack's pyproject and imports nothing of it
    shown = subprocess.run([sys.executable, "-m", "pytest", str(root / "src"), "--collect-only", "-p",
                            "no:cacheprovider", *asyncio], cwd=root, capture_output=True, text=True, timeout=120)
    said = shown.stdout + shown.stderr
    assert shown.returncode == pytest.ExitCode.NO_TESTS_COLLECTED and "configfile: pyproject.toml" in said, said
    assert "PytestDeprecationWarning" not in said and "Unknown config option" not in said, said
    assert "warning" not in said.lower(), said
