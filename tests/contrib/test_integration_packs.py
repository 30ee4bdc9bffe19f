"""Method packs as real packages: wheels built from this checkout, installed into a scratch venv.

Once per session: build wheels of dataflex-bus, of each contrib pack and of the fixture packs
(``tests/contrib/fixtures``) from copies of their sources (the checkout is never written to), create a
virtual environment, and install the wheels there with ``--no-deps --no-index``. The venv sees the
project venv's third-party packages (torch, pluggy, pytest, ...) through a directory of symlinks that
leaves out every ``dataflex*`` distribution and the editable-install hooks, so what runs in the venv is
the wheels, and the first test proves it. The venv gets its own pip (ensurepip, offline), so nothing
depends on the version of the pip running the tests. Every check runs the installed ``dataflex`` console script or
the venv's Python in a subprocess with a clean environment (no ``DATAFLEX_*``, no ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PACKS = {"dataflex-gfpo": ("gfpo", "gfpo", "selector"),
         "dataflex-tscl": ("tscl", "tscl", "mixer"),
         "dataflex-length": ("length", "response_length", "scorer")}
FIXTURE_PACKS = ("dataflex-broken", "dataflex-marker", "dataflex-collide-a", "dataflex-collide-b", "dataflex-noep",
                 "dataflex-halfbroken", "dataflex-badtarget")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", "*.pyc")
_HIDDEN_PREFIXES = ("dataflex", "__editable__", "pip", "_distutils_hack", "distutils-precedence")


@dataclass
class PackEnv:
    root: Path
    venv: Path
    wheels: dict[str, Path]

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @cached_property
    def site(self) -> Path:
        return Path(self.run_py("import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        # No DATAFLEX_* but the cache location: the suite's runs never write the user's ~/.cache.
        env = {k: v for k, v in os.environ.items() if (not k.startswith("DATAFLEX_") or k == "DATAFLEX_CACHE_DIR")
               and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.venv)
        env.update(extra or {})
        return env

    def run(self, *args: str | Path, env: Mapping[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(a) for a in args], cwd=self.root, env=self.env(env), capture_output=True,
                              text=True, timeout=timeout)

    def run_py(self, code: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        proc = self.run(self.python, "-c", code, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc

    def dataflex(self, *args: str | Path, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return self.run(self.venv / "bin" / "dataflex", *args, env=env)

    def plugins(self, env: Mapping[str, str] | None = None) -> dict[str, dict]:
        proc = self.dataflex("plugins", "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        return {r["distribution"]: r for r in json.loads(proc.stdout)}

    def pip(self, *args: str | Path) -> None:
        proc = subprocess.run([str(self.python), "-m", "pip", "--disable-pip-version-check", *map(str, args)],
                              capture_output=True, text=True, timeout=300, cwd=self.root, env=self.env())
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def install(self, *dists: str) -> None:
        self.pip("install", "--no-deps", "--no-index", "-q", *(self.wheels[d] for d in dists))

    def uninstall(self, *dists: str) -> None:
        self.pip("uninstall", "-y", "-q", *dists)

    @contextmanager
    def installed(self, *dists: str) -> Iterator[None]:
        self.install(*dists)
        try:
            yield
        finally:
            self.uninstall(*dists)


def _offline_build_ok() -> bool:
    """True if this interpreter can build the projects itself (setuptools>=68 and wheel present)."""
    try:
        import setuptools
        import wheel  # noqa: F401
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 68


def _build_wheels(sources: list[Path], wheelhouse: Path) -> None:
    # Offline and fast when the build backend is already installed (the project venv); otherwise (a CI
    # venv created bare) let pip build each project in an isolated environment from the index.
    flags = ["--no-build-isolation", "--no-index"] if _offline_build_ok() else []
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *flags, "-q", "-w", str(wheelhouse),
         *map(str, sources)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _copy_bus_source(dest: Path) -> Path:
    dest.mkdir()
    for name in ("dataflex_bus", "dataflex_verl", "plugins"):
        shutil.copytree(ROOT / name, dest / name, ignore=_IGNORE)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    if not (dest / "README.md").exists():  # pyproject names a readme; the checkout may not have it yet
        (dest / "README.md").write_text("dataflex-bus\n")
    return dest


def _parent_view(dest: Path) -> Path:
    """Symlinks to the project venv's site-packages minus dataflex*, pip and editable hooks."""
    dest.mkdir()
    parent = Path(sysconfig.get_paths()["purelib"])
    for entry in parent.iterdir():
        if entry.name.lower().startswith(_HIDDEN_PREFIXES) or entry.suffix == ".pth":
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


@pytest.fixture(scope="session")
def packenv(tmp_path_factory: pytest.TempPathFactory) -> PackEnv:
    root = tmp_path_factory.mktemp("packs")
    sources = root / "src"
    sources.mkdir()
    build = [_copy_bus_source(sources / "dataflex-bus")]
    for name in PACKS:
        build.append(Path(shutil.copytree(ROOT / "contrib" / name, sources / name, ignore=_IGNORE)))
    for name in FIXTURE_PACKS:
        build.append(Path(shutil.copytree(FIXTURES / name, sources / name, ignore=_IGNORE)))
    wheelhouse = root / "wheels"
    _build_wheels(build, wheelhouse)
    wheels = {}
    for whl in wheelhouse.glob("*.whl"):
        wheels[whl.name.split("-")[0].replace("_", "-")] = whl
    assert set(wheels) == {"dataflex-bus", *PACKS, *FIXTURE_PACKS}, sorted(wheels)

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = PackEnv(root, venv, wheels)
    (env.site / "_dataflex_parent_view.pth").write_text(f"{_parent_view(root / 'parent-view')}\n")
    env.install("dataflex-bus", *PACKS)
    return env


def test_the_venv_runs_the_wheels_not_the_checkout(packenv):
    site = str(packenv.site)
    out = packenv.run_py(textwrap.dedent("""
        import json, importlib.metadata as md
        import dataflex_bus, dataflex_gfpo, dataflex_tscl, dataflex_length, torch
        dists = [d for d in md.distributions() if d.metadata["Name"] == "dataflex-bus"]
        print(json.dumps({
            "bus": dataflex_bus.__file__, "packs": [m.__file__ for m in (dataflex_gfpo, dataflex_tscl,
            dataflex_length)], "bus_dists": [str(d.locate_file("")) for d in dists],
            "installer": dists[0].read_text("INSTALLER"), "direct_url": dists[0].read_text("direct_url.json"),
            "torch": torch.__file__}))
    """)).stdout
    info = json.loads(out)
    assert info["bus"].startswith(site) and all(p.startswith(site) for p in info["packs"])
    assert info["bus_dists"] == [site], "one dataflex-bus distribution, the wheel's"
    assert "file://" in (info["direct_url"] or "") and ".whl" in info["direct_url"]
    assert not info["torch"].startswith(site)  # torch comes from the project venv, not reinstalled


def test_plugins_json_lists_each_pack_active_with_version_and_components(packenv):
    report = packenv.plugins()
    for dist, (plugin, component, kind) in PACKS.items():
        rec = report[dist]
        assert (rec["name"], rec["version"], rec["status"], rec["error"]) == (plugin, "0.1.0", "active", None)
        assert [(c["name"], c["kind"]) for c in rec["components"]] == [(component, kind)]
        assert rec["components"][0]["summary"] and rec["warnings"] == []
    table = packenv.dataflex("plugins").stdout
    assert "dataflex-gfpo" in table and "gfpo (selector)" in table and "tscl (mixer)" in table
    only_packs = {"DATAFLEX_LOAD_PLUGINS": ",".join(PACKS)}
    assert packenv.dataflex("plugins", "--check", env=only_packs).returncode == 0


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


SMALL_RUN = """\
trainer: {steps: 3, group_size: 4, prompts_per_step: 8, eval_every: 0, save_every: 0}
model: {hidden: 16}
"""


@pytest.mark.parametrize(("method", "block", "metric"), [
    ("gfpo", """\
        dataflex:
          mechanism: select
          scorer: {name: response_length}
          actuator: {name: gfpo, params: {metric: reward_per_token, k: 2}}
     """, "dataflex/kept_rows"),
    ("tscl", """\
        dataflex:
          mechanism: mix
          scorer: {name: reward_difficulty}
          actuator: {name: tscl, params: {window: 4, temperature: 0.5}}
     """, "dataflex/tscl/domains_updated"),
])
def test_a_config_naming_the_pack_trains_with_dataflex_run(packenv, method, block, metric):
    cfg = _write(packenv.root / f"{method}.yaml", SMALL_RUN + textwrap.dedent(block))
    proc = packenv.dataflex("validate", cfg)
    assert proc.returncode == 0, proc.stderr
    out = packenv.root / f"run-{method}"
    proc = packenv.dataflex("run", cfg, "--steps", "2", "--out", out, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(lines) == 2 and all(metric in m for m in lines)
    record = json.loads((out / "run.json").read_text())
    assert f"dataflex-{method}==0.1.0" in json.dumps(record)


@pytest.mark.parametrize("dist", sorted(PACKS))
def test_each_pack_passes_its_own_tests_against_the_installed_wheel(packenv, dist):
    # A copy of the pack's sources (pyproject + tests); the package itself is imported from the wheel.
    project = packenv.root / "src" / dist
    proc = packenv.run(packenv.python, "-m", "pytest", project, "-q", "-p", "no:cacheprovider")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout


def test_uninstalling_a_pack_removes_it(packenv):
    cfg = _write(packenv.root / "length.yaml", """\
        dataflex:
          mechanism: select
          scorer: {name: response_length}
          actuator: {name: gfpo, params: {k: 2}}
    """)
    assert packenv.dataflex("validate", cfg).returncode == 0
    packenv.uninstall("dataflex-length")
    try:
        assert "dataflex-length" not in packenv.plugins()
        proc = packenv.dataflex("validate", cfg)
        assert proc.returncode == 2
        assert "unknown scorer 'response_length'" in proc.stderr
    finally:
        packenv.install("dataflex-length")
    assert packenv.plugins()["dataflex-length"]["status"] == "active"


def test_allow_and_deny_lists_never_import_a_disabled_pack(packenv):
    marker = packenv.root / "marker.txt"
    base = {"DATAFLEX_TEST_MARKER": str(marker)}
    with packenv.installed("dataflex-marker"):
        report = packenv.plugins({**base, "DATAFLEX_DISABLE_PLUGINS": "dataflex-marker"})
        assert report["dataflex-marker"]["status"] == "disabled" and report["dataflex-marker"]["components"] == []
        assert report["dataflex-gfpo"]["status"] == "active"
        report = packenv.plugins({**base, "DATAFLEX_LOAD_PLUGINS": "dataflex-gfpo,tscl"})  # dist or plugin name
        assert {d for d, r in report.items() if r["status"] == "active"} == {"dataflex-gfpo", "dataflex-tscl"}
        report = packenv.plugins({**base, "DATAFLEX_LOAD_PLUGINS": ""})
        assert {r["status"] for r in report.values()} == {"disabled"}
        assert not marker.exists(), "a disabled plugin was imported"
        report = packenv.plugins(base)
        assert report["dataflex-marker"]["status"] == "active"
        assert [(c["name"], c["kind"]) for c in report["dataflex-marker"]["components"]] == [("marker_score", "scorer")]
        assert marker.read_text().startswith("imported by pid")


def test_a_broken_pack_fails_alone_and_check_exits_1(packenv):
    cfg = _write(packenv.root / "gfpo-check.yaml", """\
        dataflex:
          mechanism: select
          scorer: {name: response_length}
          actuator: {name: gfpo, params: {keep_fraction: 0.5}}
    """)
    with packenv.installed("dataflex-broken"):
        proc = packenv.dataflex("plugins", "--json")
        assert proc.returncode == 0
        report = {r["distribution"]: r for r in json.loads(proc.stdout)}
        broken = report["dataflex-broken"]
        assert broken["status"] == "failed" and broken["version"] == "0.0.1"
        assert "ImportError" in broken["error"] and "broken on purpose" in broken["error"]
        assert all(report[d]["status"] == "active" for d in PACKS)
        assert "dataflex-broken" in proc.stderr  # reported once on stderr, not swallowed
        check = packenv.dataflex("plugins", "--check")
        assert check.returncode == 1 and "failed" in check.stdout
        assert packenv.dataflex("validate", cfg).returncode == 0  # the others keep working
        strict = packenv.dataflex("validate", cfg, env={"DATAFLEX_STRICT_PLUGINS": "1"})
        assert strict.returncode != 0 and "broken" in strict.stderr
        assert packenv.dataflex("plugins", "--check",
                                env={"DATAFLEX_DISABLE_PLUGINS": "dataflex-broken"}).returncode == 0


def _scorer_config(packenv: PackEnv, name: str) -> Path:
    return _write(packenv.root / f"uses-{name}.yaml", f"""\
        dataflex:
          mechanism: select
          scorer: {{name: {name}}}
          actuator: {{name: gfpo, params: {{k: 2}}}}
    """)


def test_unknown_names_point_at_a_pack_without_entry_point_and_at_failed_plugins(packenv):
    with packenv.installed("dataflex-noep"):
        proc = packenv.dataflex("validate", _scorer_config(packenv, "noep_scorer"))
        assert proc.returncode == 2
        assert "unknown scorer 'noep_scorer'" in proc.stderr
        assert ("installed but invisible, declaring no 'dataflex' entry point: dataflex-noep 0.1.0 (declare "
                "[project.entry-points.dataflex] in its pyproject.toml and reinstall it)") in proc.stderr, proc.stderr
        info = packenv.dataflex("info", "noep_scorer")
        assert info.returncode == 2 and "dataflex-noep 0.1.0" in info.stderr
        # the allowlist names an installed distribution: not "no installed distribution"
        listed = packenv.dataflex("plugins", env={"DATAFLEX_LOAD_PLUGINS": "dataflex-gfpo,dataflex-noep"})
        assert ("DATAFLEX_LOAD_PLUGINS entry 'dataflex-noep' names dataflex-noep 0.1.0, which is installed but "
                "declares no 'dataflex' entry point, so it provides no plugin") in listed.stderr, listed.stderr
        assert "names no installed" not in listed.stderr

    with packenv.installed("dataflex-halfbroken", "dataflex-broken"):
        proc = packenv.dataflex("validate", _scorer_config(packenv, "half_score"))
        assert proc.returncode == 2
        assert ("scorer 'half_score' is declared by plugin 'halfbroken' (dataflex-halfbroken==0.1.0), which failed "
                "to load: RuntimeError: dataflex-halfbroken fails after registering half_score") in proc.stderr
        # a plugin that failed before declaring anything may be the provider: named with its error
        assert ("plugins that failed to load (what they provide is unknown): plugin 'broken' "
                "(dataflex-broken==0.0.1): ImportError: dataflex-broken is broken on purpose") in proc.stderr
        other = packenv.dataflex("validate", _scorer_config(packenv, "nowhere_score"))
        assert "plugin 'broken' (dataflex-broken==0.0.1): ImportError" in other.stderr
        assert "plugin 'halfbroken' (dataflex-halfbroken==0.1.0): RuntimeError" in other.stderr


def test_a_name_collision_names_both_packs_and_qualified_names_resolve_it(packenv):
    def config(name: str) -> Path:
        return _write(packenv.root / "twin.yaml", f"""\
            dataflex:
              mechanism: select
              scorer: {{name: "{name}"}}
              actuator: {{name: gfpo, params: {{k: 2}}}}
        """)

    with packenv.installed("dataflex-collide-a", "dataflex-collide-b"):
        report = packenv.plugins()
        assert report["dataflex-collide-a"]["status"] == report["dataflex-collide-b"]["status"] == "active"
        proc = packenv.dataflex("validate", config("twin"))
        assert proc.returncode == 2
        assert "dataflex-collide-a:twin" in proc.stderr and "dataflex-collide-b:twin" in proc.stderr
        for qualified in ("dataflex-collide-a:twin", "dataflex-collide-b:twin"):
            ok = packenv.dataflex("validate", config(qualified))
            assert ok.returncode == 0, ok.stderr


def test_collisions_and_components_that_cannot_import_are_flagged_by_plugins_check_and_doctor(packenv):
    pytest.importorskip("verl")
    collide_a = ("scorer name 'twin' is also provided by dataflex-collide-b:twin (plugin 'collide'): configs must "
                 "name it 'dataflex-collide-a:twin'")
    with packenv.installed("dataflex-collide-a", "dataflex-collide-b", "dataflex-badtarget"):
        listed = packenv.dataflex("plugins")
        assert listed.returncode == 0 and f"warning: {collide_a}" in listed.stdout, listed.stdout
        assert collide_a in packenv.plugins()["dataflex-collide-a"]["warnings"]
        check = packenv.dataflex("plugins", "--check")
        assert check.returncode == 1
        assert ("scorer name 'twin' is provided by more than one plugin: dataflex-collide-a:twin (plugin 'collide'), "
                "dataflex-collide-b:twin (plugin 'collide')") in check.stdout, check.stdout
        assert "'misspelt_target' -> 'dataflex_badtarget.scorerz:Misspelt'" in check.stdout
        doctor = packenv.dataflex("doctor", "--json")
        checks = json.loads(doctor.stdout)
        assert doctor.returncode == 1, checks
        (bad,) = [c for c in checks if c["check"] == "plugin badtarget"]
        assert bad["status"] == "FAIL" and "misspelt_target (scorer) cannot be used" in bad["detail"]
        assert "ModuleNotFoundError" in bad["detail"]
        twins = [c for c in checks if c["check"] == "plugin collide"]
        assert [c["status"] for c in twins] == ["warn", "warn"] and collide_a in twins[0]["detail"]
        assert "broken: plugin badtarget" in packenv.dataflex("doctor").stdout


def test_the_template_pack_builds_installs_and_passes_its_own_tests(packenv):
    proc = packenv.dataflex("new-plugin", "demo-pack", "--dir", packenv.root)  # the wheel's template data
    assert proc.returncode == 0, proc.stderr
    project = packenv.root / "dataflex-demo-pack"
    wheelhouse = packenv.root / "demo-wheel"
    _build_wheels([project], wheelhouse)
    (whl,) = wheelhouse.glob("*.whl")
    packenv.pip("install", "--no-deps", "--no-index", "-q", whl)
    try:
        # Offline, the pack's `dataflex-bus` requirement is met by the dataflex-bus built from this checkout
        # (nothing is published yet), so `pip install -e .` in a generated pack needs no index for it.
        met = packenv.run_py(textwrap.dedent("""
            from importlib.metadata import requires, version
            from packaging.requirements import Requirement
            (bus,) = [r for r in map(Requirement, requires("dataflex-demo-pack")) if r.name == "dataflex-bus"]
            print(bus.specifier.contains(version("dataflex-bus")), bus)
        """)).stdout.split()
        assert met[0] == "True", met
        rec = packenv.plugins()["dataflex-demo-pack"]
        assert (rec["status"], rec["version"]) == ("active", "0.1.0")
        assert [(c["name"], c["kind"]) for c in rec["components"]] == [("demo_pack", "scorer")]
        check = packenv.dataflex("plugins", "--check", env={"DATAFLEX_LOAD_PLUGINS": "dataflex-demo-pack"})
        assert check.returncode == 0 and "check ok" in check.stdout, check.stdout + check.stderr
        info = packenv.dataflex("info", "demo_pack")
        assert info.returncode == 0 and "scale: float" in info.stdout, info.stdout + info.stderr
        tests = packenv.run(packenv.python, "-m", "pytest", project, "-q", "-p", "no:cacheprovider")
        assert tests.returncode == 0, tests.stdout + tests.stderr
        assert "5 passed" in tests.stdout and "skipped" not in tests.stdout, tests.stdout
    finally:
        packenv.uninstall("dataflex-demo-pack")
