"""The GPU worker's own logic (tests/gpu/ep_worker.py: expected rows, combine reference and
checks) on the CPU, against the NumPy oracle, so a mistake in the checker cannot pass for a
correct kernel: it must accept the oracle's answer and reject a wrong one."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep_worker as W  # noqa: E402

from epcc.runtime.testing import oracle  # noqa: E402


def buf(rank: int, dtype: str):
    wl = types.SimpleNamespace(tokens=16, topk=4, experts=16, hidden=256, dtype=dtype, placement="blocked")
    return types.SimpleNamespace(plan=types.SimpleNamespace(workload=wl), num_ranks=4, rank=rank)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_worker_checks_agree_with_the_oracle(dtype):
    cpu = torch.device("cpu")
    cases = [W.Case(buf(r, dtype), "uniform", 3, cpu) for r in range(4)]
    c = cases[1]
    assert c.check_dispatch(c.want_rows, torch.from_numpy(c.rows_w), c.counts, torch.from_numpy(c.src[:, 2])) == []
    if dtype == "bf16":
        wrong = c.want_rows.clone()
        wrong[0, 0] += 1
        assert c.check_dispatch(wrong, torch.from_numpy(c.rows_w), c.counts)[0].startswith("rows differ")
    # every rank's expert outputs of the rows it received, then the oracle's combine
    ys = [d.y_for(d.want_rows, len(d.src)).view(torch.int16).numpy().view(np.uint16) for d in cases]
    ref, mag = oracle.combine_oracle(c.idx, c.E, c.placement, c.w, ys, c.H, return_abs=True)
    r, m = c.reference()
    assert np.allclose(r.numpy(), ref[1], rtol=0, atol=1e-6) and np.allclose(m.numpy(), mag[1], rtol=0, atol=1e-6)
    assert c.check_combine(torch.from_numpy(ref[1]).to(torch.bfloat16)) == []
    errs = c.check_combine(torch.from_numpy(ref[1] * 1.05).to(torch.bfloat16))
    assert len(errs) == 1 and errs[0].startswith("combine: token ")


def test_worker_without_a_gpu_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert W.main([]) == 1
    assert capsys.readouterr().err.strip() == (
        "ep_worker: no CUDA device visible (the GPU checks need GPUs; run it under torchrun there)")
