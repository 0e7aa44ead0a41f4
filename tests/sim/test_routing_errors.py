"""Bad --routing values for the compiler (simulate/compile): exact messages, exit 1."""

from __future__ import annotations

import numpy as np
import pytest

from epcc.cli import main

SCHED = "schedules/h200x4.sched"  # top-8 of 256 experts


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("make, message", [
    (lambda: np.zeros((16, 4), dtype=np.int64),
     "top-k indices have 4 columns; the workload's topk is 8"),
    (lambda: np.full((16, 8), 300, dtype=np.int64),
     "expert indices must lie in 0..255"),
    (lambda: np.zeros((16, 8), dtype=np.int64),
     "a token lists the same expert twice"),
    (lambda: -np.ones(256),
     "popularity must be >= 0 with at least topk=8 positive entries"),
    (lambda: np.ones((2, 2, 2), dtype=np.float32),
     "expected int [N, 8] top-k indices or float [256] expert popularity, got float32 [2, 2, 2]"),
])
def test_bad_routing_file(tmp_path, capsys, make, message):
    p = tmp_path / "r.npy"
    np.save(p, make())
    rc, out, err = run(["simulate", SCHED, "--routing", str(p)], capsys)
    assert rc == 1 and out == ""
    assert err == f"epcc: error: {p}: {message}\n"


def test_routing_file_missing_or_not_npy(tmp_path, capsys):
    rc, _, err = run(["simulate", SCHED, "--routing", str(tmp_path / "none.npy")], capsys)
    assert rc == 1 and err == f"epcc: error: {tmp_path / 'none.npy'}: no such file\n"
    bad = tmp_path / "bad.npy"
    bad.write_text("not numpy")
    rc, _, err = run(["simulate", SCHED, "--routing", str(bad)], capsys)
    assert rc == 1 and err.startswith(f"epcc: error: {bad}: not a NumPy .npy array (")


def test_negative_zipf_exponent(capsys):
    rc, _, err = run(["compile", SCHED, "--emit", "route-analysis", "--routing", "zipf:-1"], capsys)
    assert rc == 1 and err == "epcc: error: --routing zipf:-1: the Zipf exponent must be a finite number in 0..16, not -1\n"


def test_measured_routing_is_used_and_labelled(tmp_path, capsys):
    rng = np.random.default_rng(0)
    idx = np.stack([rng.choice(256, 8, replace=False) for _ in range(64)])
    p = tmp_path / "m.npy"
    np.save(p, idx)
    rc, out, _ = run(["simulate", SCHED, "--routing", str(p), "--json"], capsys)
    assert rc == 0 and '"routing": "measured m.npy (sampled: 64 tokens)"' in out
