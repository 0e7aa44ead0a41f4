"""epcc.runtime.Buffer over torch.distributed (gloo), one process per rank, on the CPU backend.

Each test compiles a small bundle, spawns R processes that each dispatch and combine their own
tokens through it, and compares with the NumPy oracle (which every process can compute, since
all inputs are derived from one seed).  Argument errors must name the argument.
"""

from __future__ import annotations

import hashlib
import json
import os
import traceback
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from epcc.cli import main as epcc_main  # noqa: E402
from epcc.runtime.buffer import Buffer, GroupError
from epcc.runtime.testing.oracle import (combine_oracle, compare_combine, dispatch_oracle, token_combine_oracle,
                                        token_dispatch_oracle)
from epcc.plan.bundle import BundleError, load

ROOT = Path(__file__).resolve().parents[2]

ONE_HOP = """\
topology t {{
  levels node 1, gpu {r}
  rank gpu
  relation peer = other gpu
  link nv p2p {{ connects peer  bandwidth 450 GB/s  shared per gpu  latency 3 us }}
  link hbm local {{ bandwidth 3000 GB/s }}
}}
workload {{ tokens {t}  hidden {h}  dtype {dtype}  topk {k}  experts {e} blocked  weights travel }}
dispatch {{
  defaults chunk 16 tokens depth 2
  step meta: exchange counts with all
  step push: send tokens for peer from input to peer.output over nv
  step keep: permute input into output
}}
combine reverse of dispatch
"""


def compile_bundle(tmp_path: Path, text: str) -> Path:
    src = tmp_path / "s.sched"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "bundle"
    assert epcc_main(["compile", str(src), "-o", str(out)]) == 0
    return out


def _inputs(rank: int, ranks: int, tokens: int, hidden: int, topk: int, experts: int, seed: int):
    g = np.random.default_rng(seed * 1000 + rank)
    idx = np.array([g.choice(experts, size=topk, replace=False) for _ in range(tokens)],
                   dtype=np.int64).reshape(tokens, topk)
    idx[g.random(idx.shape) < 0.05] = -1  # some empty slots
    w = g.random((tokens, topk)).astype(np.float32)
    x = torch.from_numpy(g.standard_normal((tokens, hidden)).astype(np.float32)).to(torch.bfloat16)
    return x, torch.from_numpy(idx), torch.from_numpy(w)


def _worker(rank: int, ranks: int, bundle: str, store: str, result_dir: str, shape: dict) -> None:
    path = Path(result_dir) / f"rank{rank}.txt"
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
        t, h, k, e = shape["tokens"], shape["hidden"], shape["topk"], shape["experts"]
        buf = Buffer(None, bundle)
        kept = None
        rank_tokens = shape.get("rank_tokens", [t] * ranks)
        for seed in (1, 2):  # twice: the second call reuses the peer buffers
            ins = [_inputs(r, ranks, rank_tokens[r], h, k, e, seed) for r in range(ranks)]
            x, idx, w = ins[rank]
            recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(x, idx, w)
            if kept is None:
                kept = (recv_x, recv_x.clone())
            # the oracle's inputs: every rank's tokens, the shorter ones padded with tokens of no expert
            tmax = max(rank_tokens)
            rows = np.zeros((ranks, tmax, 2 * h), dtype=np.uint8)
            idx_all = np.full((ranks, tmax, k), -1, dtype=np.int64)
            w_all = np.zeros((ranks, tmax, k), dtype=np.float32)
            for r, (xr, ir, wr) in enumerate(ins):
                n = rank_tokens[r]
                if n:  # (torch cannot view an empty tensor's stride-0 rows as bytes)
                    rows[r, :n], idx_all[r, :n], w_all[r, :n] = xr.view(torch.uint8).numpy(), ir.numpy(), wr.numpy()
            token_major = shape.get("layout") == "token"
            if token_major:
                want = token_dispatch_oracle(idx_all, e, "blocked", rows, w_all)[rank]
                assert np.array_equal(recv_idx.numpy(), want.topk_idx), "dispatch top-k experts differ"
                assert np.array_equal(recv_w.numpy(), want.topk_weights), "dispatch top-k weights differ"
            else:
                want = dispatch_oracle(idx_all, e, "blocked", rows, w_all)[rank]
                assert np.array_equal(recv_idx.numpy(), want.src[:, 2]), "dispatch experts differ"
                assert np.array_equal(recv_w.numpy(), want.weights), "dispatch weights differ"
            assert np.array_equal(recv_x.view(torch.uint8).numpy(), want.rows), "dispatch rows differ"
            assert counts == [int(c) for c in want.counts], "per-expert counts differ"
            y = (recv_x.float() * 0.5 + 1).to(torch.bfloat16)  # a stand-in expert
            got = buf.combine(y, handle)
            ys = [None] * ranks
            dist.all_gather_object(ys, y.view(torch.int16).numpy().view(np.uint16))
            if token_major:
                ref, mag = token_combine_oracle(idx_all, e, "blocked", ys, h, return_abs=True)
            else:
                ref, mag = combine_oracle(idx_all, e, "blocked", w_all, ys, h, return_abs=True)
            assert got.shape == (rank_tokens[rank], h), f"combine returned {list(got.shape)}"
            n = rank_tokens[rank]
            check = compare_combine(got.float().numpy(), ref[rank][:n], mag[rank][:n], k)
            assert check.ok, f"combine differs: {check}"
        # recv_x is the caller's: the second call reused the peer segment it was received in
        assert torch.equal(kept[0], kept[1]), "the first dispatch's recv_x changed under a later call"
        buf.close()
        dist.destroy_process_group()
        path.write_text("ok")
    except BaseException:
        path.write_text(traceback.format_exc())


def _spawn(tmp_path: Path, ranks: int, bundle: Path, shape: dict) -> None:
    store = tmp_path / "store"
    results = tmp_path / "results"
    results.mkdir()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(ranks, str(bundle), str(store), str(results), shape), nprocs=ranks, join=True)
    for r in range(ranks):
        text = (results / f"rank{r}.txt").read_text()
        assert text == "ok", f"rank {r}:\n{text}"


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_dispatch_combine_match_oracle(tmp_path, ranks):
    shape = dict(tokens=48, hidden=256, topk=min(4, ranks * 2), experts=ranks * 4)
    bundle = compile_bundle(tmp_path, ONE_HOP.format(r=ranks, t=shape["tokens"], h=shape["hidden"], dtype="bf16",
                                                     k=shape["topk"], e=shape["experts"]))
    _spawn(tmp_path, ranks, bundle, shape)


@pytest.mark.parametrize("ranks", [2, 4])
def test_token_major_dispatch_combine_match_oracle(tmp_path, ranks):
    """`layout token`: DeepEP's outputs (one row per token and rank, per-rank top-k), its combine the adjoint."""
    shape = dict(tokens=48, hidden=256, topk=min(4, ranks * 2), experts=ranks * 4, layout="token")
    text = ONE_HOP.format(r=ranks, t=shape["tokens"], h=shape["hidden"], dtype="bf16", k=shape["topk"],
                          e=shape["experts"]).replace("weights travel }", "weights travel  layout token }")
    assert "layout token" in text
    _spawn(tmp_path, ranks, compile_bundle(tmp_path, text), shape)


def test_ranks_dispatch_their_own_numbers_of_tokens(tmp_path):
    """3 ranks (no shipped topology has 3), one dispatching no token, one 5, one the bundle's 48."""
    shape = dict(tokens=48, hidden=256, topk=4, experts=12, rank_tokens=[0, 5, 48])
    bundle = compile_bundle(tmp_path, ONE_HOP.format(r=3, t=shape["tokens"], h=shape["hidden"], dtype="bf16",
                                                     k=shape["topk"], e=shape["experts"]))
    _spawn(tmp_path, 3, bundle, shape)


def test_two_hop_schedule_through_staging(tmp_path):
    """h200x4_2vnode's plan (RDMA-class hop to the same-index GPU, NVLink forward), scaled down."""
    text = (ROOT / "schedules" / "h200x4_2vnode.sched").read_text()
    text = text.replace("tokens 4096 per rank", "tokens 40 per rank").replace("hidden 7168", "hidden 256")
    shape = dict(tokens=40, hidden=256, topk=8, experts=256)
    bundle = compile_bundle(tmp_path, text)
    _spawn(tmp_path, 4, bundle, shape)


def _arg_worker(rank: int, bundle: str, store: str, result_dir: str) -> None:
    out = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        buf = Buffer(None, bundle)
        x = torch.zeros(8, 256, dtype=torch.bfloat16)
        idx = torch.zeros(8, 4, dtype=torch.int64)
        idx[:] = torch.arange(4)
        cases = [
            (lambda: buf.dispatch(x.float(), idx), "dispatch: x must be torch.bfloat16, not torch.float32"),
            (lambda: buf.dispatch(x[:, :128], idx), "dispatch: x must have shape [*, 256], got [8, 128]"),
            (lambda: buf.dispatch(x, idx[:, :2]), "dispatch: topk_idx must have shape [8, 4], got [8, 2]"),
            (lambda: buf.dispatch(x, idx.float()), "dispatch: topk_idx must be int64 or int32, not torch.float32"),
            (lambda: buf.dispatch(x, idx + 100), "dispatch: topk_idx values must lie in [-1, 7] (-1: no expert)"),
            (lambda: buf.dispatch(torch.zeros(9, 256, dtype=torch.bfloat16), torch.zeros(9, 4, dtype=torch.int64)),
             "dispatch: x has 9 tokens, but the bundle was compiled for at most 8 per rank (workload `tokens`)"),
            (lambda: buf.get_dispatch_layout(idx, 16),
             "get_dispatch_layout: num_experts is 16, but the bundle was compiled for 8 experts"),
            (lambda: buf.combine(x, None), "combine: handle must be the handle dispatch returned, not NoneType"),
            (lambda: buf.get_dispatch_layout(idx, "8"), "get_dispatch_layout: num_experts must be an int, not str"),
            (lambda: buf.dispatch(x, idx, topk_weight=torch.ones(8, 4)),
             "dispatch: unexpected keyword argument(s) topk_weight (besides x, topk_idx, topk_weights, sync, "
             "expert_alignment and handle it takes DeepEP's layout arguments, ignored: allocate_on_comm_stream, "
             "async_finish, is_token_in_rank, num_tokens_per_expert, num_tokens_per_rank, num_tokens_per_rdma_rank, "
             "previous_event)"),
            (lambda: buf.dispatch(x, idx, torch.full((8, 4), float("nan"))),
             "dispatch: topk_weights[0, 0] is nan; routing weights must be finite"),
        ]
        w = torch.rand(8, 4, requires_grad=True)  # weights that require grad are read, not refused
        recv_x, _, _, _, handle, _ = buf.dispatch(x, idx, w)
        cases.append((lambda: buf.combine(recv_x, handle, (w * 2).detach()),
                      "combine: topk_weights differ from the weights dispatch was given (combine applies dispatch's; "
                      "dispatch again to change them)"))
        for fn, msg in cases:
            try:
                fn()
                out.append(f"no error for: {msg}")
            except GroupError as e:  # a collective call: both ranks refused it, both raise the same error
                want = f"{e.call} failed on ranks 0, 1: {msg}"
                if not isinstance(e, (TypeError, ValueError)) or e.rebuild or str(e) != want:
                    out.append(f"expected {want!r} (a TypeError or ValueError, the Buffer usable), got "
                               f"{type(e).__name__} {str(e)!r}, rebuild={e.rebuild}")
            except (TypeError, ValueError) as e:  # get_dispatch_layout: no collective, this rank's own error
                if str(e) != msg:
                    out.append(f"expected {msg!r}, got {str(e)!r}")
        buf.combine(recv_x, handle, w.detach())  # the same weights: accepted
        empty = torch.zeros(256, 0, dtype=torch.bfloat16).t()  # no rows, and a last stride that is not 1
        buf.dispatch(empty, torch.zeros(0, 4, dtype=torch.int64))
        buf.close()
        dist.destroy_process_group()
        (Path(result_dir) / f"rank{rank}.txt").write_text("\n".join(out) or "ok")
    except BaseException:
        (Path(result_dir) / f"rank{rank}.txt").write_text(traceback.format_exc())


def test_bad_arguments_name_the_argument(tmp_path):
    bundle = compile_bundle(tmp_path, ONE_HOP.format(r=2, t=8, h=256, dtype="bf16", k=4, e=8))
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_arg_worker, args=(str(bundle), str(tmp_path / "store"), str(results)), nprocs=2, join=True)
    for r in range(2):
        assert (results / f"rank{r}.txt").read_text() == "ok"


def test_bundle_for_another_group_size_is_refused(tmp_path):
    bundle = compile_bundle(tmp_path, ONE_HOP.format(r=2, t=8, h=256, dtype="bf16", k=4, e=8))
    plan = load(bundle).plan
    assert plan.num_ranks == 2
    with pytest.raises(BundleError, match="not an epcc bundle"):
        load(tmp_path)
    (bundle / "manifest.json").write_text("{broken", encoding="utf-8")
    with pytest.raises(BundleError) as e:
        load(bundle)
    assert str(e.value) == (f"{bundle / 'manifest.json'}: not a manifest written by epcc (not valid JSON: Expecting "
                            f"property name enclosed in double quotes: line 1 column 2 (char 1)); recompile the bundle")
    (bundle / "manifest.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(BundleError) as e:
        load(bundle)
    assert str(e.value) == (f"{bundle / 'manifest.json'}: not a manifest written by epcc (the top level is not a "
                            f"JSON object); recompile the bundle")
    (bundle / "manifest.json").unlink()
    with pytest.raises(BundleError) as e:
        load(bundle)
    assert str(e.value) == (f"{bundle}: not an epcc bundle (no manifest.json); write one with `epcc compile FILE -o "
                            f"{bundle}`")


def test_a_plan_whose_ranks_are_a_string_is_refused_by_name(tmp_path):
    """`"num_ranks": "2"` is a BundleError naming the field, before the group's size is compared."""
    bundle = compile_bundle(tmp_path, ONE_HOP.format(r=2, t=8, h=256, dtype="bf16", k=4, e=8))
    plan = bundle / "plan.json"
    d = json.loads(plan.read_text(encoding="utf-8"))
    plan.write_text(json.dumps({**d, "num_ranks": "2"}), encoding="utf-8")
    m = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    m["sha256"]["plan.json"] = hashlib.sha256(plan.read_bytes()).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(m), encoding="utf-8")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError) as e:  # the group's error (every rank raises it) carrying the bundle's
            Buffer(None, bundle)
    finally:
        dist.destroy_process_group()
    assert e.value.reason == (f"{plan}: not a plan written by 'epcc compile': num_ranks: expected a whole number, got "
                              f"the string '2'")
    assert str(e.value) == f"making the Buffer failed on rank 0: {e.value.reason}"


@pytest.mark.parametrize("bad", ["5", -1, 0, float("nan"), True, float("inf"), 1e18, 86400.001])
def test_a_bad_timeout_is_refused_before_any_collective(tmp_path, bad):
    bundle = compile_bundle(tmp_path, ONE_HOP.format(r=2, t=8, h=256, dtype="bf16", k=4, e=8))
    with pytest.raises(ValueError) as e:
        Buffer(None, bundle, timeout_s=bad)  # no process group: the check comes first
    assert str(e.value) == (f"Buffer: timeout_s must be a number of seconds > 0 and at most 86400 (one day), "
                            f"not {bad!r}")
    with pytest.raises(TypeError) as e:
        Buffer(None, None)
    assert str(e.value) == "Buffer: bundle must be a path (str or pathlib.Path), not NoneType"


@pytest.mark.parametrize("kw, err, msg", [
    ({"rdma_chunk_tokens": 0}, ValueError, "Buffer: rdma_chunk_tokens must be at least 1, not 0"),
    ({"rdma_depth": 1 << 17}, ValueError, "Buffer: rdma_depth must be at least 1 and at most 65536, not 131072"),
    ({"rdma_depth": True}, TypeError, "Buffer: rdma_depth must be a whole number or None, not bool"),
    ({"rdma_chunk_tokens": "8"}, TypeError, "Buffer: rdma_chunk_tokens must be a whole number or None, not str")])
def test_a_bad_rdma_chunking_is_refused_before_any_collective(tmp_path, kw, err, msg):
    bundle = compile_bundle(tmp_path, ONE_HOP.format(r=2, t=8, h=256, dtype="bf16", k=4, e=8))
    with pytest.raises(err) as e:
        Buffer(None, bundle, **kw)  # no process group: the check comes first
    assert str(e.value) == msg


def _rechunk_worker(rank: int, one_hop: str, two_vnode: str, store: str, result_dir: str) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        try:
            Buffer(None, one_hop, rdma_chunk_tokens=8)
            raise AssertionError("a plan without RDMA steps took rdma_chunk_tokens")
        except ValueError as e:  # every rank's error (agree.py), carrying the refusal's own text
            assert e.reason == (f"Buffer: rdma_chunk_tokens / rdma_depth re-chunk RDMA steps, and the plan of "
                                f"{one_hop} has none"), str(e)
        buf = Buffer(None, two_vnode, rdma_chunk_tokens=3, rdma_depth=2)
        rdma = [s for s in buf.plan.steps if s.link_kind == "rdma"]
        assert rdma and all(s.depth == 2 for s in rdma), [(s.name, s.depth) for s in rdma]
        x, idx, w = _inputs(rank, 2, 40, 256, 8, 256, seed=3)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, idx, w)
        sizes = {int(n) for c in handle.layout.copies if c.step == "rdma" and c.rank == rank
                 for n in np.diff(c.chunk_starts)}
        assert max(sizes) == 3, sizes  # the layout the engine ran was chunked at 3 tokens
        ins = [_inputs(r, 2, 40, 256, 8, 256, seed=3) for r in range(2)]
        rows = np.stack([i[0].view(torch.uint8).numpy() for i in ins])
        want = dispatch_oracle(np.stack([i[1].numpy() for i in ins]), 256, "blocked", rows,
                               np.stack([i[2].numpy() for i in ins]))[rank]
        assert np.array_equal(recv_x.view(torch.uint8).numpy(), want.rows), "dispatch rows differ"
        buf.combine(recv_x, handle)
        buf.close()
        dist.destroy_process_group()
        (Path(result_dir) / f"rank{rank}.txt").write_text("ok")
    except BaseException:
        (Path(result_dir) / f"rank{rank}.txt").write_text(traceback.format_exc())


def test_rdma_chunking_re_chunks_the_plan_the_engine_runs(tmp_path):
    """Buffer(rdma_chunk_tokens=, rdma_depth=): the engine lays out and runs the re-chunked plan
    (what bench/ep_bench.py --rdma-chunks relies on); a plan without RDMA steps refuses them."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one_hop = compile_bundle(tmp_path / "a", ONE_HOP.format(r=2, t=8, h=256, dtype="bf16", k=4, e=8))
    text = (ROOT / "schedules" / "h200x2_2vnode.sched").read_text()
    text = text.replace("tokens 4096 per rank", "tokens 40 per rank").replace("hidden 7168", "hidden 256")
    two_vnode = compile_bundle(tmp_path / "b", text)
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_rechunk_worker, args=(str(one_hop), str(two_vnode), str(tmp_path / "store"), str(results)),
             nprocs=2, join=True)
    for r in range(2):
        assert (results / f"rank{r}.txt").read_text() == "ok", f"rank {r}"
