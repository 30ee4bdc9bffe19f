"""A tier's test directory never stands in for the package it tests: the tiers live in ``tests/trl_tier/`` and
``tests/verl_tier/`` (pytest puts ``tests/`` on sys.path, so a directory named ``trl`` would import as a namespace
package ``trl`` where TRL is not installed); where the package is missing, it is missing for every import and
check, so the tier's modules skip."""

import importlib.util
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("package", ["trl", "verl"])
def test_a_test_directory_never_imports_as_the_package_it_tests(package):
    assert not (TESTS / package).exists(), f"tests/{package}/ would import as the package {package!r}"
    spec = importlib.util.find_spec(package)
    assert spec is None or spec.origin is not None, spec
    if spec is None:
        with pytest.raises(ImportError):
            __import__(package)
