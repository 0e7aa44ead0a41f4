"""runtime/testing/ranks.py: the rank processes the multi-process tests start end with the call,
whatever happens to it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from epcc.runtime.testing import ranks  # noqa: E402


def test_a_rank_that_cannot_start_takes_the_started_ones_with_it(monkeypatch):
    started = []
    real = subprocess.Popen

    def popen(cmd, **kw):
        if started:
            raise OSError("no such file")
        started.append(real([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        return started[-1]

    monkeypatch.setattr(ranks.subprocess, "Popen", popen)
    with pytest.raises(OSError, match="^no such file$"):
        ranks.run_ranks(["rank"], 2, timeout_s=60)
    assert started and started[0].poll() is not None  # killed and reaped, not left sleeping


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_spawn_ranks_names_and_kills_the_ranks_past_the_deadline():
    t0 = time.monotonic()
    hung = ranks.spawn_ranks(_sleep, lambda r: (60.0 if r == 1 else 0.0,), 3, timeout_s=10)
    assert hung == [1] and time.monotonic() - t0 < 40
