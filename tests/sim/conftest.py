"""Fixtures of the simulator tests: tests/gpu/bundles.py (which derives the schedules the GPU
bundles are compiled from) and the 2-GPU schedule of the h200x2 bundles."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def gpu_bundles():
    """tests/gpu/bundles.py as a module."""
    spec = importlib.util.spec_from_file_location("epcc_gpu_bundles", REPO / "tests" / "gpu" / "bundles.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["epcc_gpu_bundles"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def ep2(gpu_bundles, tmp_path_factory) -> str:
    """schedules/h200x4.sched on 2 GPUs, as tests/gpu/bundles.py derives it for the h200x2 bundles."""
    return str(gpu_bundles.ep2_source(tmp_path_factory.mktemp("ep2")))
