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
import proxy_worker as P  # noqa: E402
import uneven_worker as U  # noqa: E402

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


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_worker_checks_with_uneven_tokens_agree_with_the_oracle(dtype):
    """Ranks with 15, 9, 0 and 16 of 16 tokens, a quarter of the slots empty: a rank's inputs are
    its first tokens only, the expected rows never name a token beyond its rank's count, and the
    combine reference is the oracle's over those tokens (a result with every token is refused)."""
    cpu = torch.device("cpu")
    tokens = [15, 9, 0, 16]
    cases = [W.Case(buf(r, dtype), "masked", 5, cpu, tokens=tokens) for r in range(4)]
    c = cases[1]
    assert (c.idx == -1).mean() > 0.25 and all((c.idx[r, n:] == -1).all() for r, n in enumerate(tokens))
    for d in cases:
        x, idx, w = d.gpu_inputs()
        n = tokens[d.me]
        assert tuple(idx.shape) == (n, 4) and tuple(w.shape) == (n, 4)
        assert (x[0] if dtype == "fp8" else x).shape[0] == n
        assert all(t < tokens[h] for h, t, _ in d.src.tolist())
        assert d.check_dispatch(d.want_rows, torch.from_numpy(d.rows_w), d.counts) == []
    ys = [d.y_for(d.want_rows, len(d.src)).view(torch.int16).numpy().view(np.uint16) for d in cases]
    ref, mag = oracle.combine_oracle(c.idx, c.E, c.placement, c.w, ys, c.H, return_abs=True)
    for d in cases:
        n = tokens[d.me]
        r, m = d.reference()
        assert np.allclose(r.numpy(), ref[d.me][:n], rtol=0, atol=1e-6)
        assert d.check_combine(torch.from_numpy(ref[d.me][:n]).to(torch.bfloat16)) == []
    errs = c.check_combine(torch.from_numpy(ref[1]).to(torch.bfloat16))  # all 16 tokens: 7 too many
    assert errs == ["combine: out has shape [16, 256], want [9, 256]"]


def test_uneven_worker_rotates_its_token_counts_over_the_ranks():
    assert U.token_patterns(128, 2) == [[127, 120], [120, 0], [0, 128], [128, 127]]
    assert U.token_patterns(128, 4) == [[127, 120, 0, 128], [120, 0, 128, 127], [0, 128, 127, 120],
                                        [128, 127, 120, 0]]
    assert U.token_patterns(4096, 2) == [[4096, 200], [200, 0], [0, 257], [257, 4096]]


def test_worker_without_a_gpu_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert W.main([]) == 1
    assert capsys.readouterr().err.strip() == (
        "ep_worker: no CUDA device visible (the GPU checks need GPUs; run it under torchrun there)")


def test_proxy_worker_rotates_token_counts_with_a_rank_of_none():
    assert P.token_patterns(128, 2) == [("128/127", [128, 127]), ("127/0", [127, 0]), ("0/65", [0, 65]),
                                        ("65/128", [65, 128]), ("T-1-7r", [127, 120])]
    assert all(0 in t for _, t in P.token_patterns(4096, 4)[:4])


def _proxy_buf(metadata="device", layout=None, rdma=("dispatch", "combine"), failure=None, posted=5):
    engines = [types.SimpleNamespace(program=p, failure=lambda: failure) for p in rdma]
    eng = types.SimpleNamespace(manifest={"metadata": {"lowering": metadata}}, on_device=metadata == "device",
                                proxy=bool(rdma), rdma=engines, layout=layout,
                                rdma_stats=lambda: {e.program: {"writes_posted": posted} for e in engines})
    return types.SimpleNamespace(engine=eng), engines


def test_proxy_worker_refuses_what_is_not_the_proxy_path_from_the_gpus_tables(monkeypatch):
    """Its checks must fail a Buffer whose tables come from the host, whose proxy is missing, set
    up anew, failed, or posted nothing, and pass the one that is right."""
    monkeypatch.setattr(P.dist, "barrier", lambda: None)
    good, engines = _proxy_buf()
    assert P.setup_errors(good) == [] and P.proxy_state_errors(good, engines, {"dispatch": 4, "combine": 4}) == []
    assert P.setup_errors(_proxy_buf(metadata="host")[0])[0].startswith("metadata is not the GPU's")
    assert P.setup_errors(_proxy_buf(rdma=())[0]) == [
        "the bundle does not run the GPU proxy path (compile it with --rdma proxy)"]
    again, _ = _proxy_buf()
    assert P.proxy_state_errors(again, engines) == [
        "the proxy path was set up anew (it must be set up once, for every routing)"]
    host, engines = _proxy_buf(layout=object())
    assert P.proxy_state_errors(host, engines) == ["a layout was computed on the host"]
    failed, engines = _proxy_buf(failure="epcc: wait timed out")
    assert P.proxy_state_errors(failed, engines) == ["proxy dispatch: epcc: wait timed out",
                                                     "proxy combine: epcc: wait timed out"]
    idle, engines = _proxy_buf(posted=4)
    assert P.proxy_state_errors(idle, engines, {"dispatch": 4, "combine": 3}) == [
        "dispatch: the proxy posted no chunk (4 writes, 4 before)"]


def test_proxy_worker_reports_the_ipc_mappings_and_refuses_one_across_domains(monkeypatch):
    """ipc_check: the mappings summed over the ranks (all_reduce: one rank here) and the number of
    domains in its line; a mapped peer of another domain, or a mapping with no peer, is an error."""
    monkeypatch.setattr(P.dist, "all_reduce", lambda t: None)
    checks = types.SimpleNamespace(dev=torch.device("cpu"))

    def buf(domains, peers, opened):
        return types.SimpleNamespace(engine=types.SimpleNamespace(rank=0, domains=domains, ipc_peers=frozenset(peers),
                                                                  opened=list(range(opened))))

    assert P.ipc_check(buf(["box0", "box1"], (), 0), checks) == (
        "CUDA IPC: 0 mappings opened on all ranks, 2 domain(s)", [])
    assert P.ipc_check(buf(["h", "h"], (1,), 7), checks) == ("CUDA IPC: 7 mappings opened on all ranks, 1 domain(s)", [])
    assert P.ipc_check(buf(["box0", "box1"], (1,), 7), checks)[1] == ["maps rank 1, of CUDA IPC domain 'box1', from 'box0'"]
    assert P.ipc_check(buf(["box0", "box1"], (), 2), checks)[1] == ["2 CUDA IPC mapping(s) opened with no peer to map"]


def test_a_case_kept_for_later_is_the_case_drawn_anew():
    """host_case keeps a Case's host side for the next bundle: a second Case gets the same arrays
    as one drawn after the cache is emptied, whatever the first Case did to its own."""
    cpu = torch.device("cpu")
    first = W.Case(buf(2, "bf16"), "masked", 9, cpu, tokens=[16, 3, 0, 11])
    for a in (first.idx, first.w, first.src, first.rows_w, first.local):
        a[...] = 0
    first.counts[0] = -1
    again = W.Case(buf(2, "bf16"), "masked", 9, cpu, tokens=[16, 3, 0, 11])
    W.host_case.cache_clear()
    fresh = W.Case(buf(2, "bf16"), "masked", 9, cpu, tokens=[16, 3, 0, 11])
    for name in ("idx", "w", "src", "rows_w", "local"):
        assert np.array_equal(getattr(again, name), getattr(fresh, name)), name
    assert again.counts == fresh.counts and sum(fresh.counts) == len(fresh.src) > 0
    assert torch.equal(again.want_rows, fresh.want_rows)
