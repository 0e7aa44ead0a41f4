"""epcc.deep_ep: DeepEP V1's intranode API over token-major bundles, on the CPU backend over gloo.

The workers call the module the way DeepEP's tests/test_intranode.py does (layout, dispatch with
and without top-k, bf16 and fp8 with column-major scales, num_worst_tokens, cached handles,
combine with top-k weights, events) and check every output against what they compute on their
own from all ranks' routing: DeepEP's semantics, not the module's code.  The GPU run of DeepEP's
own test against the module is tests/gpu (it needs CUDA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import epcc.deep_ep as deep_ep  # noqa: E402
from epcc.cli import main as epcc_main  # noqa: E402
from epcc.deep_ep import bundles as bsel  # noqa: E402
from epcc.deep_ep.buffer import first_rows  # noqa: E402
from epcc.runtime.engines.cuda_direct.engine import CudaHandle  # noqa: E402
from epcc.runtime.testing.oracle import token_dispatch_oracle  # noqa: E402
from test_buffer import ONE_HOP  # noqa: E402

SHAPE = dict(tokens=40, hidden=256, topk=4, experts=16)


def compile_into(root: Path, name: str, *, r: int, t: int, h: int, k: int, e: int, dtype: str = "bf16",
                 placement: str = "blocked", layout: str = "token") -> Path:
    text = ONE_HOP.format(r=r, t=t, h=h, k=k, e=e, dtype=dtype)
    text = text.replace(" blocked ", f" {placement} ").replace("weights travel }", f"weights travel  layout {layout} }}")
    assert f"{placement}  weights travel  layout {layout} }}" in text
    src = root / f"{name}.sched"
    src.write_text(text, encoding="utf-8")
    out = root / "bundles" / name
    assert epcc_main(["compile", str(src), "--target", "none", "-o", str(out)]) == 0
    return out


def per_token_cast_to_fp8(x: torch.Tensor):
    """e4m3 with one float32 scale per 128 channels, the scales column-major (as DeepEP's test)."""
    m, n = x.shape
    v = x.float().view(m, -1, 128)
    amax = v.abs().amax(dim=2).clamp(1e-4)
    q = (v * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n)
    scales = (amax / 448.0).view(m, -1)
    return q, scales.T.contiguous().T


def cast_back(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (q.float().view(q.shape[0], -1, 128) * scales.view(q.shape[0], -1, 1)).view(q.shape).to(torch.bfloat16)


def _routing(rank: int, ranks: int, tokens: int, topk: int, experts: int, seed: int = 7):
    g = np.random.default_rng(seed * 100 + rank)
    idx = np.stack([g.choice(experts, size=topk, replace=False) for _ in range(tokens)]).astype(np.int64)
    idx[g.random(idx.shape) < 0.1] = -1
    return torch.from_numpy(idx)


def _worker(rank: int, ranks: int, bundles: str, store: str, result_dir: str) -> None:
    path = Path(result_dir) / f"rank{rank}.txt"
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
        torch.set_default_dtype(torch.bfloat16)  # as DeepEP's tests do: the module must not depend on the default
        _check_api(rank, ranks, bundles)
        dist.destroy_process_group()
        path.write_text("ok")
    except BaseException:
        path.write_text(traceback.format_exc())


def _check_api(rank: int, ranks: int, bundles: str) -> None:
    T, H, K, E = SHAPE["tokens"], SHAPE["hidden"], SHAPE["topk"], SHAPE["experts"]
    L = E // ranks
    group = dist.new_group(list(range(ranks)))
    buffer = deep_ep.Buffer(group, int(1e8), 0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True,
                            bundles=bundles, backend="cpu")
    all_idx = [_routing(r, ranks, T, K, E) for r in range(ranks)]
    topk_idx = all_idx[rank]
    x = torch.ones((T, H), dtype=torch.bfloat16) * rank
    g = torch.Generator().manual_seed(rank)
    x_rand = torch.randn((T, H), generator=g, dtype=torch.float32).to(torch.bfloat16)
    w_rank = torch.ones((T, K), dtype=torch.float32) * rank
    w_rand = torch.randn((T, K), generator=g, dtype=torch.float32)

    # the layout, from the routing alone
    want_in_rank = torch.zeros((T, ranks), dtype=torch.bool)
    for t in range(T):
        for e in topk_idx[t].tolist():
            if e >= 0:
                want_in_rank[t, e // L] = True
    want_per_expert = torch.tensor([(topk_idx == e).sum().item() for e in range(E)], dtype=torch.int32)
    per_rank, rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(topk_idx, E)
    assert rdma is None and event.event is None
    assert torch.equal(in_rank, want_in_rank) and torch.equal(per_expert, want_per_expert)
    assert torch.equal(per_rank, want_in_rank.sum(0).to(torch.int32))

    # what every rank sends every rank: rank_prefix_matrix, the rows and counts here
    sent = torch.tensor([[sum(any(e >= 0 and e // L == d for e in row.tolist()) for row in all_idx[s])
                          for d in range(ranks)] for s in range(ranks)])
    want_rpm = sent.cumsum(0).to(torch.int32)
    rows_here = int(sent[:, rank].sum())
    all_per_expert = sum(torch.stack([(i == e).sum() for e in range(E)]) for i in all_idx)
    want_counts = all_per_expert[rank * L:(rank + 1) * L].tolist()
    oracle = token_dispatch_oracle(torch.stack(all_idx).numpy(), E, "blocked", np.zeros((ranks, T, 1), np.uint8))[rank]
    fp8 = per_token_cast_to_fp8(x)
    layout_args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    for previous in (False, True):
        for async_finish in (False, True):
            for current_x in (x_rand, x, fp8):
                for with_topk in (False, True):
                    args = dict(x=current_x, config=deep_ep.Config(24, 8, 256), async_finish=async_finish,
                                **layout_args)
                    if with_topk:
                        args.update(topk_idx=topk_idx, topk_weights=w_rand if current_x is x_rand else w_rank)
                    if previous:
                        args["previous_event"] = buffer.capture()
                    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(**args)
                    if async_finish:
                        event.current_stream_wait()
                    else:
                        assert event.event is None
                    if isinstance(current_x, tuple):
                        assert recv_x[1].shape == (rows_here, H // 128) and recv_x[1].dtype == torch.float32
                        recv_x = cast_back(*recv_x)
                    assert torch.equal(handle[0], want_rpm), (handle[0], want_rpm)
                    assert recv_x.shape == (rows_here, H) and counts == want_counts
                    # rows in (source rank, token) order: each source's block holds its value
                    start = 0
                    for s in range(ranks):
                        end = int(handle[0][s][rank])
                        if current_x is x or isinstance(current_x, tuple):
                            assert bool((recv_x[start:end].float() == s).all())
                        start = end
                    if current_x is x_rand:
                        first = [torch.randn((T, H), generator=torch.Generator().manual_seed(s), dtype=torch.float32)
                                 for s in range(ranks)]  # each rank's x_rand
                        want = torch.cat([first[s].to(torch.bfloat16)[oracle.src[oracle.src[:, 0] == s][:, 1]]
                                          for s in range(ranks)])
                        assert torch.equal(recv_x, want)
                    if with_topk:
                        assert torch.equal(recv_idx, torch.from_numpy(oracle.topk_idx))
                        assert recv_idx.dtype == topk_idx.dtype
                        for i, c in enumerate(counts):
                            assert int((recv_idx == i).sum()) == c
                        assert bool((recv_w[recv_idx == -1] == 0).all())
                        if current_x is x:
                            assert bool((recv_w[recv_idx >= 0] == torch.from_numpy(oracle.src[:, 0]).float().view(
                                -1, 1).expand_as(recv_w)[recv_idx >= 0]).all())
                        # num_worst_tokens pads every output; the list comes back empty
                        worst = T * ranks
                        wx, wi, ww, empty, _, wev = buffer.dispatch(**args, num_worst_tokens=worst)
                        if async_finish:
                            wev.current_stream_wait()
                        wx = cast_back(*wx) if isinstance(wx, tuple) else wx
                        assert empty == [] and wx.shape[0] == wi.shape[0] == ww.shape[0] == worst
                        assert torch.equal(wx[:rows_here], recv_x) and torch.equal(wi[:rows_here], recv_idx)
                        assert torch.equal(ww[:rows_here], recv_w) and bool((wi[rows_here:] == -1).all())
                    else:
                        assert recv_idx is None and recv_w is None
                        # a cached dispatch reuses the handle: same rows, no top-k, no new handle
                        cached = dict(x=current_x, handle=handle, config=deep_ep.Config(24, 8, 256),
                                      async_finish=async_finish)
                        cx, ci, cw, cl, ch, cev = buffer.dispatch(**cached)
                        if async_finish:
                            cev.current_stream_wait()
                        assert ci is None and cw is None and cl is None and ch is None
                        cx = cast_back(*cx) if isinstance(cx, tuple) else cx
                        assert torch.equal(cx, recv_x)
                    # combine sums each token's rows at home, unweighted; the weights alike
                    cargs = dict(x=recv_x, handle=handle, async_finish=async_finish)
                    if with_topk:
                        cargs["topk_weights"] = recv_w
                    if previous:
                        cargs["previous_event"] = buffer.capture()
                    combined, combined_w, event = buffer.combine(**cargs)
                    if async_finish:
                        event.current_stream_wait()
                    ref = x_rand if current_x is x_rand else x
                    n_ranks = in_rank.sum(1, keepdim=True).float()
                    if isinstance(current_x, tuple):
                        ref = cast_back(*fp8)
                    want_x = (ref.float() * n_ranks).to(torch.bfloat16)
                    assert torch.equal(combined, want_x), float((combined.float() - want_x.float()).abs().max())
                    if with_topk:
                        w = w_rand if current_x is x_rand else w_rank
                        assert torch.equal(combined_w, torch.where(topk_idx >= 0, w, 0)), (combined_w, w)
                    else:
                        assert combined_w is None

    # a handle of an fp8 dispatch serves a bf16 one (DeepEP's test tunes that way), and the
    # default configurations after set_num_sms
    _, _, _, _, handle8, _ = buffer.dispatch(fp8, topk_idx=topk_idx, topk_weights=w_rank, **layout_args)
    deep_ep.Buffer.set_num_sms(24)
    for cfg in (deep_ep.Buffer.get_dispatch_config(ranks), None):
        rx, *_ = buffer.dispatch(x, handle=handle8, config=cfg)
        assert rx.shape == (rows_here, H) and torch.equal(rx, torch.cat([
            torch.full((int(sent[s, rank]), H), s, dtype=torch.bfloat16) for s in range(ranks)]))
    combined, _, _ = buffer.combine(rx, handle8, config=deep_ep.Buffer.get_combine_config(ranks))
    assert torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))
    # bias: one tensor or two, added to the sum
    b = torch.full((T, H), 0.5, dtype=torch.bfloat16)
    with_bias, _, _ = buffer.combine(rx, handle8, bias=(b, b))
    assert torch.equal(with_bias, (combined.float() + 1).to(torch.bfloat16))

    # refusals name the argument
    for bad, words in ((dict(x=x, handle=handle8, topk_idx=topk_idx), "cached dispatch"),
                       (dict(x=x, topk_idx=topk_idx), "together"),
                       (dict(x=x, num_tokens_per_rdma_rank=per_rank), "intranode"),
                       (dict(x=x[:3], handle=handle8), "tokens"),
                       (dict(x=(fp8[0], fp8[1][:, :1]), handle=handle8), "scales"),
                       (dict(x=x, handle=handle8, config=dict(num_sms=24)), "Config")):
        with pytest.raises((TypeError, ValueError), match=words):
            buffer.dispatch(**bad)
    with pytest.raises(ValueError, match=r"must lie in \[-1, 15\]"):
        buffer.get_dispatch_layout(topk_idx + E, E)
    with pytest.raises(ValueError, match="not a multiple"):
        buffer.get_dispatch_layout(topk_idx, E + 1)
    buffer.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.dispatch(x, handle=handle8)


def _spawn(tmp_path: Path, ranks: int, bundles: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(ranks, str(bundles), str(tmp_path / "store"), str(results)), nprocs=ranks, join=True)
    for r in range(ranks):
        text = (results / f"rank{r}.txt").read_text()
        assert text == "ok", f"rank {r}:\n{text}"


@pytest.mark.parametrize("ranks", [2, 4])
def test_deepep_intranode_semantics_on_cpu(tmp_path, ranks):
    """Every call of DeepEP's intranode test, checked against DeepEP's semantics."""
    shape = dict(r=ranks, t=SHAPE["tokens"], h=SHAPE["hidden"], k=SHAPE["topk"], e=SHAPE["experts"])
    compile_into(tmp_path, "bf16", **shape)
    compile_into(tmp_path, "fp8", **shape, dtype="fp8")
    compile_into(tmp_path, "bf16_expert_major", **shape, layout="expert")  # never chosen: expert-major
    _spawn(tmp_path, ranks, tmp_path / "bundles")


def _cand(tmp_path: Path, name: str, **kw) -> bsel.Candidate:
    base = dict(path=tmp_path / name, ranks=2, hidden=256, dtype="bf16", topk=4, experts=16, tokens=64,
                layout="token", placement="blocked", cuda=False)
    return bsel.Candidate(**{**base, **kw})


def test_bundle_choice(tmp_path):
    """The fewest tokens that fit, then the path; any top-k without topk_idx; cuda needs kernels."""
    shape = bsel.Shape(ranks=2, hidden=256, dtype="bf16", topk=4, experts=16, tokens=40)
    found = [_cand(tmp_path, "b", tokens=4096), _cand(tmp_path, "a", tokens=64), _cand(tmp_path, "c", tokens=32),
             _cand(tmp_path, "d", tokens=64, layout="expert")]
    assert bsel.choose(found, [], [tmp_path], shape, "cpu").path.name == "a"
    assert bsel.choose([_cand(tmp_path, "k8", topk=8)], [], [tmp_path], bsel.Shape(2, 256, "bf16", None, 16, 40),
                       "cpu").path.name == "k8"
    with pytest.raises(bsel.NoBundle, match="no CUDA kernels"):
        bsel.choose(found, [], [tmp_path], shape, "cuda")


def test_no_bundle_names_what_was_asked_and_what_exists(tmp_path):
    compile_into(tmp_path, "fp8_4096", r=2, t=4096, h=256, k=4, e=16, dtype="fp8")
    compile_into(tmp_path, "cyclic", r=2, t=64, h=256, k=4, e=16, placement="strided")
    (tmp_path / "bundles" / "broken").mkdir()
    (tmp_path / "bundles" / "broken" / "plan.json").write_text("{", encoding="utf-8")
    found, unreadable = bsel.scan([tmp_path / "bundles", tmp_path / "nowhere"])
    shape = bsel.Shape(ranks=2, hidden=256, dtype="bf16", topk=4, experts=16, tokens=40)
    with pytest.raises(bsel.NoBundle) as info:
        bsel.choose(found, unreadable, [tmp_path / "bundles"], shape, "cpu")
    text = str(info.value)
    for words in ("2 ranks, hidden 256, bf16, top-4 of 16 experts, 40 tokens per rank", "fp8_4096", "dtype fp8",
                  "cyclic", "placement strided", "unreadable", "broken", "nowhere: no such directory",
                  "--layout token"):
        assert words in text, (words, text)


def test_bundle_directories_come_from_the_argument_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(bsel.BUNDLES_ENV, os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert bsel.bundle_dirs(None) == [tmp_path / "a", tmp_path / "b"]
    assert bsel.bundle_dirs(str(tmp_path)) == [tmp_path]
    assert bsel.bundle_dirs([tmp_path, str(tmp_path / "x")]) == [tmp_path, tmp_path / "x"]
    with pytest.raises(TypeError, match="bundles"):
        bsel.bundle_dirs([3])


@pytest.mark.skipif(not bsel.can_compile(), reason="compiling needs the MLIR bindings")
def test_a_missing_bundle_is_compiled_on_request(tmp_path):
    """compile_missing: the one-hop schedule for the call's shape, compiled and then served."""
    shape = bsel.Shape(ranks=2, hidden=256, dtype="fp8", topk=None, experts=16, tokens=40)
    out = bsel.compile_for(shape, 8, "cpu")
    got = bsel.candidate(out)
    assert not got.misses(shape, "cpu") and got.topk == 2 and got.layout == "token"
    assert "sms 8" in (out.parent / "deep_ep.sched").read_text(encoding="utf-8")


def _compile_worker(rank: int, ranks: int, tokens: int, bundles: str, store: str, result_dir: str) -> None:
    """A dispatch no bundle in `bundles` serves, with compile_missing: what this rank compiled,
    what it got or raised, and when."""
    path = Path(result_dir) / f"rank{rank}.json"
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
        compiles = []
        real = bsel.compile_for

        def counted(*args, **kwargs):
            compiles.append(args[0])
            return real(*args, **kwargs)

        bsel.compile_for = counted
        T, H, K, E = tokens, SHAPE["hidden"], SHAPE["topk"], SHAPE["experts"]
        buffer = deep_ep.Buffer(dist.new_group(list(range(ranks))), 0, bundles=bundles, backend="cpu",
                                compile_missing=True, timeout_s=30.0)
        topk_idx = _routing(rank, ranks, T, K, E) if T else torch.zeros((0, K), dtype=torch.int64)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
        x = torch.ones((T, H), dtype=torch.bfloat16) * rank
        out: dict = {}
        try:
            recv_x, _, _, _, handle, _ = buffer.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=torch.ones((T, K), dtype=torch.float32))
            want = torch.cat([torch.full((c, H), s, dtype=torch.bfloat16) for s, c in enumerate(handle.recv_counts)])
            out.update(bundle=next(iter(handle.inner))[0], rows_ok=bool(torch.equal(recv_x, want)))
        except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
            out.update(error=str(e), type=type(e).__name__, at=time.time())
        out["compiles"] = len(compiles)
        buffer.destroy()
        dist.destroy_process_group()
        path.write_text(json.dumps(out))
    except BaseException:
        path.write_text(json.dumps({"crash": traceback.format_exc()}))


def _spawn_compile(tmp_path: Path, ranks: int, tokens: int) -> list[dict]:
    (tmp_path / "none").mkdir()
    results = tmp_path / "results"
    results.mkdir()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_compile_worker, args=(ranks, tokens, str(tmp_path / "none"), str(tmp_path / "store"), str(results)),
             nprocs=ranks, join=True)
    got = [json.loads((results / f"rank{r}.json").read_text()) for r in range(ranks)]
    for r, g in enumerate(got):
        assert "crash" not in g, f"rank {r}:\n{g['crash']}"
    return got


@pytest.mark.skipif(not bsel.can_compile(), reason="compiling needs the MLIR bindings")
def test_a_missing_bundle_is_compiled_once_for_the_group(tmp_path):
    """compile_missing over 2 ranks: rank 0 compiles, rank 1 loads what it wrote, and both dispatch."""
    got = _spawn_compile(tmp_path, 2, SHAPE["tokens"])
    assert [g["compiles"] for g in got] == [1, 0], got
    assert "error" not in got[0] and "error" not in got[1], got
    assert got[0]["bundle"] == got[1]["bundle"] and all(g["rows_ok"] for g in got), got


@pytest.mark.skipif(not bsel.can_compile(), reason="compiling needs the MLIR bindings")
def test_a_failed_compile_fails_every_rank_at_once_with_its_message(tmp_path):
    """No rank has a token: the compiler refuses the schedule (tokens per rank must be at least 1).
    Rank 0's compile fails; rank 1, which waits for it, raises the same error within seconds, not
    at its timeout (the compile's bound and the Buffer's, 630 s)."""
    got = _spawn_compile(tmp_path, 2, 0)
    assert [g["compiles"] for g in got] == [1, 0], got
    assert got[0]["type"] == got[1]["type"] == "GroupValueError", got
    assert got[0]["error"] == got[1]["error"], got
    assert got[0]["error"].startswith("the compile of a missing bundle failed on rank 0: epcc.deep_ep: compiling a "
                                      "bundle for 2 ranks"), got[0]["error"]
    assert "error: tokens per rank must be at least 1" in got[0]["error"], got[0]["error"]
    assert abs(got[0]["at"] - got[1]["at"]) < 10, got


def test_configuration_and_refusals():
    with pytest.raises(ValueError, match="even"):
        deep_ep.Buffer.set_num_sms(23)
    with pytest.raises(ValueError, match="0 < send < recv"):
        deep_ep.Config(24, 256, 256)
    with pytest.raises(TypeError, match="num_sms"):
        deep_ep.Config("24")
    assert deep_ep.Buffer.is_sm90_compiled()
    tail = ("DeepEP's low-latency mode, which epcc.deep_ep does not have (it runs DeepEP's intranode normal "
            "mode); for a low-latency (CUDA-graph capturable, no host sync) dispatch use epcc.runtime.Buffer's "
            "dispatch(..., sync=False)")
    buf = object.__new__(deep_ep.Buffer)  # the refusals do not depend on the group
    for name, call in (("get_low_latency_rdma_size_hint", lambda: deep_ep.Buffer.get_low_latency_rdma_size_hint(
                            128, 7168, 2, 256)),
                       ("clean_low_latency_buffer", lambda: buf.clean_low_latency_buffer(128, 7168, 256)),
                       ("low_latency_dispatch", lambda: buf.low_latency_dispatch(None, None, 128, 256)),
                       ("low_latency_combine", lambda: buf.low_latency_combine(None, None, None, None))):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"Buffer.{name}: {tail}"
    with pytest.raises(ValueError, match="takes no event|no event"):
        deep_ep.EventOverlap().current_stream_wait()
    with deep_ep.EventOverlap(deep_ep.Buffer.capture()) as ev:  # a finished event on the CPU
        assert ev.event is not None


def test_import_deep_ep_through_the_documented_shim(tmp_path):
    """A directory with deep_ep.py = `from epcc.deep_ep import *` makes `import deep_ep` this module."""
    (tmp_path / "deep_ep.py").write_text("from epcc.deep_ep import *\n", encoding="utf-8")
    code = ("import deep_ep, epcc.deep_ep as e\n"
            "assert deep_ep.Buffer is e.Buffer and deep_ep.Config is e.Config\n"
            "assert deep_ep.EventOverlap is e.EventOverlap\n"
            "print('ok')")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_cached_dispatch_without_a_host_round_keeps_the_handles_rows():
    """The cuda backend's cached dispatch runs the inner Buffer's low-latency mode (whole receive
    buffers, a handle of the capacity) and cuts everything to the rows the handle's counts give:
    bf16 and fp8 rows, top-k ids and weights, and the handle that combine checks its input by."""
    cap, rows, hidden = 10, 6, 256
    x = torch.arange(cap * hidden, dtype=torch.float32).view(cap, hidden).to(torch.bfloat16)
    idx, w = torch.arange(cap * 2).view(cap, 2), torch.rand(cap, 2)
    h = CudaHandle(dispatch_index=3, tokens=7, rows=cap, meta_index=2)
    rx, ridx, rw, counts, got, ev = first_rows((x, idx, w, "counts", h, None), rows)
    assert torch.equal(rx, x[:rows]) and torch.equal(ridx, idx[:rows]) and torch.equal(rw, w[:rows])
    assert got == CudaHandle(dispatch_index=3, tokens=7, rows=rows, meta_index=2) and h.rows == cap
    assert counts == "counts" and ev is None
    x8, sc = torch.zeros(cap, hidden, dtype=torch.uint8), torch.rand(cap, hidden // 128)
    (q, s), ridx, rw, _, got, _ = first_rows(((x8, sc), None, None, None, h, None), 0)
    assert q.shape == (0, hidden) and s.shape == (0, hidden // 128) and ridx is None and rw is None and got.rows == 0
