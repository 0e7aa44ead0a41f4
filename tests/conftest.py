"""Fixtures every test folder may use."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as a module (the bench scripts are not a package), loaded once: registered
    as bench_<name>_under_test, so that its dataclasses find their module."""
    key = f"bench_{name}_under_test"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


@pytest.fixture(scope="session")
def bench_script():
    """load_bench: a bench script as a module."""
    return load_bench
