"""A tier's test directory (``tests/trl/``, ``tests/verl/``) never stands in for the package it tests: where the
package is not installed, it is missing for every import and check, so the tier's modules skip."""

import importlib.util

import pytest


@pytest.mark.parametrize("package", ["trl", "verl"])
def test_a_test_directory_never_imports_as_the_package_it_tests(package):
    spec = importlib.util.find_spec(package)
    assert spec is None or spec.origin is not None, spec
    if spec is None:
        with pytest.raises(ImportError):
            __import__(package)
