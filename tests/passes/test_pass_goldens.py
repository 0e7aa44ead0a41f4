"""The IR after every pass is pinned for one real plan (goldens.py); every pass is registered under its name."""

from __future__ import annotations

import pytest

from epcc.passes import PIPELINE, REGISTRY
from epcc.passes import manager  # noqa: F401 - loads (and so registers) every pass

from goldens import SCHEDULES, golden_path, ir_after_each_pass


def test_registry_keys_are_pass_names():
    assert list(REGISTRY) and set(REGISTRY) == set(PIPELINE)
    for key, cls in REGISTRY.items():
        assert cls.name == key, f"REGISTRY['{key}'] is a pass named '{cls.name}'"
        assert cls.description


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ir_after_each_pass_matches_golden(schedule):
    texts = ir_after_each_pass(schedule)
    assert list(texts) == list(PIPELINE)
    for i, p in enumerate(PIPELINE, 1):
        expected = golden_path(schedule, i, p).read_text(encoding="utf-8")
        assert texts[p] == expected, (f"IR after '{p}' for {schedule} differs from "
                                      f"{golden_path(schedule, i, p).name}; run tests/passes/goldens.py and review")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_pass_changes_the_ir(schedule):
    """A pass that leaves the IR as it found it is not pinned by its golden: each must add something."""
    texts = ir_after_each_pass(schedule)
    prev = None
    for p in PIPELINE:
        assert texts[p] != prev, f"pass '{p}' did not change the IR of {schedule}"
        prev = texts[p]
