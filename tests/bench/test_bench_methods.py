"""The methods of bench/ep_bench/ on the CPU, without GPUs or DeepEP: epcc's rows driven through a
Buffer-shaped stand-in that follows the engines' handle rules, DeepEP's host-side parts (its
received rows' sources, the expert-major permute and its inverse, the per-token partials) against
the oracle, the report's records and byte conventions, and the re-chunked tables of a proxy
bundle through the NumPy emulator of the kernels."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from epcc.cli import main as epcc_main  # noqa: E402
from epcc.plan.bundle import cuda_manifest, load  # noqa: E402
from epcc.runtime.bf16 import BF16_ROUNDOFF  # noqa: E402
from epcc.runtime.engines.base import KernelTimeout  # noqa: E402
from epcc.runtime.engines.cuda_table.tables import partial_rounding  # noqa: E402
from epcc.runtime.layout import compute_layout  # noqa: E402
from epcc.runtime.testing import compare_torch, inputs, oracle  # noqa: E402
from epcc.runtime.testing.emulate import emulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))
data = importlib.import_module("ep_bench.data")
deepep = importlib.import_module("ep_bench.deepep")
epcc_rows = importlib.import_module("ep_bench.epcc")
report = importlib.import_module("ep_bench.report")
child = importlib.import_module("ep_bench.child")
predict = importlib.import_module("ep_bench.predict")
timing = importlib.import_module("ep_bench.timing")

R, T, H, K, E, SEED = 2, 16, 256, 4, 8, 3
CPU = torch.device("cpu")


def _plan():
    wl = SimpleNamespace(tokens=T, hidden=H, dtype="bf16", topk=K, experts=E, placement="blocked")
    return SimpleNamespace(workload=wl, num_ranks=R, steps=[])


def _rows(rank: int, stream: int) -> torch.Tensor:
    return data.gen_rows(T, H, "bf16", SEED, rank, stream, CPU)


class RankOfTwo:
    """Rank `rank` of 2 in one process: collectives answer with the peer's tensors made as the
    peer makes them (data.make_data's), statuses as if the peer agreed."""

    dry, dev, world, shared = True, CPU, R, False

    def __init__(self, rank: int = 0):
        self.rank = rank

    def all_gather_object(self, obj):
        return [obj] * R

    def barrier(self):
        pass

    def all_gather(self, t):
        parts = []
        for r in range(R):
            rows = _rows(r, 0)
            parts.append(rows if t.dtype == torch.uint8 else data.gen_features(rows, H, "bf16", SEED, r, CPU))
        assert torch.equal(parts[self.rank], t)
        return torch.stack(parts)


def _routing():
    idx = inputs.make_topk("uniform", R, T, K, E, "blocked", seed=SEED).topk_idx
    return idx, inputs.make_weights(idx, seed=SEED + 1)


def _data(rank: int = 0):
    idx, w = _routing()
    return data.make_data(RankOfTwo(rank), _plan(), T, idx, w, SEED), idx, w


# --------------------------------------------------------------------------- epcc's rows


class StubEngine:
    def __init__(self):
        self.stamped = 0

    def enable_timeline(self):
        self.stamped += 1

    def read_timeline(self):
        role = {"step": "push", "blocks": 4, "start_ms": 0.01, "end_ms": 0.2}
        return {p: {"roles": [role], "end_ms": 0.3} for p in ("dispatch", "combine")}

    def rdma_summary(self):
        return ["dispatch: 1 channel over emulated"]

    def rdma_stats(self):
        return {"dispatch": {"writes_posted": 3, "post_ns": 3000}}


class StubBuffer:
    """What epcc.runtime.Buffer returns to rank 0 of 2 on the table-driven engine, computed from
    the oracle, with the engines' rules: combine takes the handle of the latest dispatch, a
    cached dispatch takes a handle and no routing.  `wrong` corrupts one received row."""

    def __init__(self, d: data.RankData, idx, wrong: bool = False):
        self.d, self.idx, self.wrong = d, idx, wrong
        self.engine = StubEngine()
        self.calls: list[str] = []
        self.dispatches = 0

    def dispatch(self, x, topk_idx=None, topk_weights=None, *, handle=None, sync=True):
        assert sync
        if handle is not None:
            assert topk_idx is None and isinstance(handle, dict), "a cached dispatch takes a handle and no routing"
            self.calls.append("cached")
        else:
            assert torch.equal(topk_idx, self.d.topk) and torch.equal(topk_weights, self.d.weights)
            self.calls.append("fresh")
        s = 0 if torch.equal(x.view(torch.uint8), self.d.x_sets[0]) else 1
        peer = torch.stack([_rows(r, s) for r in range(R)])
        src = self.d.src
        rows = peer[src[:, 0], src[:, 1]].clone()
        if self.wrong:
            rows[0, 0] ^= 1
        self.dispatches += 1
        h = {"index": self.dispatches, "set": s}
        return rows.view(torch.bfloat16), src[:, 2].clone(), None, [], h, None

    def combine(self, y, handle):
        assert handle["index"] == self.dispatches, "combine must take the latest dispatch's handle"
        self.calls.append("combine")
        out = self.d.ref if torch.equal(y, self.d.y_sets[0]) else -0.5 * self.d.ref
        return out.to(torch.bfloat16)

    def synchronize(self):
        pass


def _epcc_rows(buf: StubBuffer, d: data.RankData, idx) -> object:
    comm = RankOfTwo()
    cfg = {"warmup": 2, "iters": 3}
    manifest = {"kernels": [{"program": "dispatch", "kind": "main", "grid": 8, "roles": []}]}
    return epcc_rows.EpccRows(cfg, comm, timing.Timer(comm, False), buf, _plan(), manifest, d, idx, direct=False)


def test_epcc_fresh_row_gives_the_routing_every_iteration():
    d, idx, _ = _data()
    buf = StubBuffer(d, idx)
    out = _epcc_rows(buf, d, idx).fresh()
    assert buf.calls == ["fresh", "combine"] * 6  # 2 warm-up, 1 checked, 3 timed
    assert len(out["dispatch_ms"]) == len(out["combine_ms"]) == 3 and out["check"]["max_ulp"] <= 2
    assert out["sms"] == {"dispatch": 8}


def test_epcc_cached_row_reuses_one_layout_then_stamps_rounds():
    d, idx, _ = _data()
    buf = StubBuffer(d, idx)
    out = _epcc_rows(buf, d, idx).cached()
    assert buf.calls[0] == "fresh" and "fresh" not in buf.calls[1:]  # the layout once, untimed
    assert buf.calls[1:] == ["cached", "combine"] * (6 + epcc_rows.TIMELINE_ROUNDS)
    assert out["timeline"]["dispatch"]["launches"] == epcc_rows.TIMELINE_ROUNDS and buf.engine.stamped == 1
    assert out["rdma"] == ["dispatch: 1 channel over emulated"] and out["rdma_stats"]["dispatch"]["writes_posted"] == 3


def test_epcc_row_with_a_wrong_row_reports_no_numbers():
    d, idx, _ = _data()
    with pytest.raises(data.CheckFailed, match=r"epcc dispatch: 1 of \d+ rows differ \(first \[0\]\)"):
        _epcc_rows(StubBuffer(d, idx, wrong=True), d, idx).fresh()


def test_failure_detail_prefers_the_engines_report():
    class Dead:
        def synchronize(self):
            raise KernelTimeout("rank 1 dispatch step push chunk 3: wait timed out after 10 s")

    assert epcc_rows.failure_detail(Dead(), RuntimeError("CUDA error: unspecified launch failure")) == \
        "rank 1 dispatch step push chunk 3: wait timed out after 10 s"
    assert epcc_rows.failure_detail(None, RuntimeError("boom")) == "RuntimeError: boom"
    assert epcc_rows.failure_detail(Dead(), KernelTimeout("its own report")) == "its own report"


def test_a_failure_stops_the_rows_and_tells_the_peers(capsys):
    told = []

    class Comm(RankOfTwo):
        def all_gather_object(self, obj):
            told.append(obj)
            return [obj] * R

    out = {"methods": {"epcc": {"dispatch_ms": [1.0]}}}
    timing.stop_rows(out, Comm(), "epcc_cached", RuntimeError("x"), "rank 0 step push: wait timed out")
    assert out == {"methods": {"epcc": {"dispatch_ms": [1.0]}, "epcc_cached": {"error": "rank 0 step push: wait "
                                                                                     "timed out"}}, "failed": True}
    assert told == [(False, "rank 0 step push: wait timed out")]  # what the peers' next align() meets
    assert "[rank 0] epcc_cached: rank 0 step push: wait timed out" in capsys.readouterr().err
    out = {"methods": {}}
    timing.stop_rows(out, Comm(), "epcc", timing.PeerFailed("rank 1: boom"), "unused")
    assert out == {"methods": {"epcc": {"error": "a peer failed: rank 1: boom"}}, "failed": True} and len(told) == 1


# --------------------------------------------------------------------------- DeepEP's host-side parts


def _deepep_view(rank: int, idx: np.ndarray, w: np.ndarray):
    """What DeepEP's intranode dispatch gives `rank` (its documented outputs, made from the
    oracle): token-major rows by (home, token), rank_prefix_matrix, recv_src_idx, local expert
    of each slot (-1 elsewhere) and the slots' weights."""
    src = data.dedup_src(idx, E, "blocked", rank)
    prefix = np.cumsum([[int((src[:, 0] == i).sum()) if j == rank else 0 for j in range(R)] for i in range(R)], axis=0)
    tk = idx[src[:, 0], src[:, 1]]
    local = np.where((tk >= 0) & (tk // (E // R) == rank), tk % (E // R), -1)
    return (torch.from_numpy(src), torch.from_numpy(prefix).int(), torch.from_numpy(src[:, 1]).int(),
            torch.from_numpy(local), torch.from_numpy(w[src[:, 0], src[:, 1]]))


def test_deepep_sources_and_token_rows_are_checked():
    d, idx, w = _data()
    src, prefix, src_idx, _, _ = _deepep_view(0, idx, w)
    got = deepep.recv_sources(prefix, src_idx, 0)
    assert torch.equal(got, src)
    want = data.dedup_src(idx, E, "blocked", 0)
    rows = d.x_all[src[:, 0], src[:, 1]]
    deepep.check_token_rows(rows, got, d, want, "deepep dispatch")
    bad = rows.clone()
    bad[2, 5] ^= 1
    with pytest.raises(data.CheckFailed, match="deepep dispatch: 1 of .* rows differ"):
        deepep.check_token_rows(bad, got, d, want, "deepep dispatch")
    with pytest.raises(data.CheckFailed, match="received .* tokens, not the"):
        deepep.check_token_rows(rows[1:], got[1:], d, want, "deepep dispatch")


def test_deepep_permute_is_the_oracles_expert_major_order():
    """argsort by local expert (stable) of token-major rows ordered by (home, token) is the
    oracle's (local expert, home, token): epcc's fused-permute order."""
    d, idx, w = _data()
    src, _, _, local, _ = _deepep_view(0, idx, w)
    rows, slots = deepep.expert_major(local, E // R)
    assert torch.equal(deepep.permuted_sources(src, local, rows, slots, 0, E // R), d.src)


def test_deepep_partials_combine_to_the_reference():
    """Per rank, the expert outputs weighted and summed per received token (unpermute), summed
    over ranks at home (what DeepEP's combine does) = the combine reference, within the bf16
    rounding of the partials."""
    idx, w = _routing()
    ds = [_data(r)[0] for r in range(R)]
    total = torch.zeros((R, T, H), dtype=torch.float32)
    for r in range(R):
        src, _, _, local, wts = _deepep_view(r, idx, w)
        parts = deepep.partial_sets(ds[r], src, local, wts, r, E // R)
        total[src[:, 0], src[:, 1]] += parts[0].float()
        assert torch.equal(parts[1], (parts[0].float() * -0.5).to(torch.bfloat16))  # exact: a power of two
    for h in range(R):
        data.check_combine(total[h].to(torch.bfloat16), ds[h].ref, ds[h].mag, K, "deepep combine", BF16_ROUNDOFF)
    with pytest.raises(data.CheckFailed):
        data.check_combine((total[0] * 1.01).to(torch.bfloat16), ds[0].ref, ds[0].mag, K, "deepep combine",
                           BF16_ROUNDOFF)


def test_combine_check_names_the_first_bad_value_past_a_chunk_and_agrees_with_compare_torch():
    """check_combine's chunks: a value off in the second chunk is reported at its own token and
    channel; the host's NumPy comparison and the device's (compare_torch, run here on CPU tensors)
    give the same CombineCheck, of [n, hidden] indices, on every chunk; a result of another shape
    is a failed check, not an error."""
    g = torch.Generator().manual_seed(3)
    n, hid = data.CHECK_CHUNK + 40, 96
    ref = torch.randn(n, hid, generator=g)
    mag = ref.abs() * 2
    got = ref.to(torch.bfloat16)
    assert data.check_combine(got, ref, mag, K, "c") == {"max_ulp": 0, "max_rel": pytest.approx(
        float(((got.double() - ref.double()).abs() / ref.double().abs()).max()))}
    bad = got.clone()
    bad[data.CHECK_CHUNK + 5, 17] = 4 * ref[data.CHECK_CHUNK + 5, 17] + 1
    with pytest.raises(data.CheckFailed) as e:
        data.check_combine(bad, ref, mag, K, "c")
    assert str(e.value).startswith(f"c: token {data.CHECK_CHUNK + 5} channel 17: got ")
    lo = data.CHECK_CHUNK
    host = data.combine_check(bad[lo:], ref[lo:], mag[lo:], K, BF16_ROUNDOFF)
    assert host == compare_torch.compare_combine(bad[lo:], ref[lo:], mag[lo:], K, partial_rounding=BF16_ROUNDOFF)
    assert host.first_bad == (5, 17) and not host.ok
    with pytest.raises(data.CheckFailed) as e:
        data.check_combine(got[:-1], ref, mag, K, "c")
    assert str(e.value) == f"c: shape [{n - 1}, {hid}], expected [{n}, {hid}]"


def test_deepep_settings_and_skips():
    assert deepep.parse_sms("24, 48,24") == [24, 48]
    for bad, msg in (("23", "--deepep-sms: '23' is not an even number of SMs >= 2"), ("", "--deepep-sms: no SM count"),
                     ("x", "--deepep-sms: 'x' is not")):
        with pytest.raises(ValueError, match=msg):
            deepep.parse_sms(bad)
    assert deepep.row_names([24]) == ["deepep@24", "deepep_cached@24", "deepep_permute@24"]
    assert deepep.skip_reason(True, False, "blocked", 2) == "dry run: DeepEP needs GPUs"
    assert deepep.skip_reason(False, True, "blocked", 4).startswith("ranks share GPUs")
    if not deepep.available():
        assert deepep.skip_reason(False, False, "blocked", 2).startswith("deep_ep is not importable")


def test_deepep_is_left_out_of_the_default_methods_where_it_is_missing(monkeypatch):
    cli = importlib.import_module("ep_bench.cli")
    monkeypatch.setattr(deepep, "available", lambda: False)
    assert cli.parse(["--bundles", "b", "--out", "o"]).methods == ["epcc", "torch_megatron", "nccl_a2a"]
    assert cli.parse(["--bundles", "b", "--out", "o", "--methods", "deepep"]).methods == ["deepep"]
    monkeypatch.setattr(deepep, "available", lambda: True)
    args = cli.parse(["--bundles", "b", "--out", "o", "--deepep-sms", "24,48"])
    assert args.methods[-1] == "deepep" and args.deepep_sms == [24, 48]


class FakeDeepEp:
    """deep_ep.Buffer as rank 0 of 2 sees it (test_intranode.py's usage, outputs from the oracle):
    the peer's rows and combine partials made as the peer would make them."""

    def __init__(self, idx, w):
        self.idx, self.w = idx, w
        self.peer = _data(1)[0]
        self.calls: list[str] = []

    def get_dispatch_layout(self, topk, experts):
        self.calls.append("layout")
        return None, None, None, None, None

    def dispatch(self, x, handle=None, topk_idx=None, topk_weights=None, config=None, **layout):
        src, prefix, src_idx, local, wts = _deepep_view(0, self.idx, self.w)
        s = 0 if torch.equal(x.view(torch.uint8), data.gen_rows(T, H, "bf16", SEED, 0, 0, CPU)) else 1
        self.set = s
        rows = torch.stack([_rows(r, s) for r in range(R)])[src[:, 0], src[:, 1]].view(torch.bfloat16)
        if handle is not None:
            assert topk_idx is None and not layout
            self.calls.append("cached")
            return rows, None, None, None, None, None
        assert topk_idx is not None and set(layout) == {"num_tokens_per_rank", "is_token_in_rank",
                                                          "num_tokens_per_expert"}
        self.calls.append("dispatch")
        return rows, local, wts, [], (prefix, None, None, src_idx, None, None), None

    def combine(self, x, handle, config=None):
        """Rank 0's partials of its own tokens plus the peer's (the set of the last dispatch)."""
        self.calls.append("combine")
        src = deepep.recv_sources(handle[0], handle[3], 0)
        out = torch.zeros((T, H), dtype=torch.float32)
        mine = src[:, 0] == 0
        out[src[mine, 1]] += x[mine].float()
        psrc, _, _, plocal, pw = _deepep_view(1, self.idx, self.w)
        theirs = psrc[:, 0] == 0
        out[psrc[theirs, 1]] += deepep.partial_sets(self.peer, psrc, plocal, pw, 1, E // R)[self.set][theirs].float()
        return out.to(torch.bfloat16), None, None


def _deepep_rows(fake: FakeDeepEp, wrong_counts: bool = False):
    d, idx, w = _data()
    comm = RankOfTwo()
    counts = np.bincount(d.src[:, 2].numpy() % (E // R), minlength=E // R) + (1 if wrong_counts else 0)
    xs = [data.as_x(r, H, "bf16") for r in d.x_sets]
    return deepep.DeepEpRows({"warmup": 1, "iters": 2}, comm, timing.Timer(comm, False), fake, (None, None), d, xs,
                             data.dedup_src(idx, E, "blocked", 0), counts, E // R, _plan().workload)


@pytest.mark.parametrize("variant, calls", [
    ("deepep", ["layout", "dispatch", "combine"]),
    ("deepep_cached", ["cached", "combine"]),
    ("deepep_permute", ["layout", "dispatch", "combine"])])
def test_deepep_variants_time_and_check_each_iteration(variant, calls):
    """Each variant through a deep_ep.Buffer stand-in: warm-up, the checked and the timed
    iterations call what the variant times (the cached one reuses one fresh dispatch's handle),
    and the check passes the oracle's rows and combine."""
    idx, w = _routing()
    fake = FakeDeepEp(idx, w)
    out = getattr(_deepep_rows(fake), variant)()
    first = ["layout", "dispatch"] if variant != "deepep_permute" else []  # the partials (and the cached handle)
    assert fake.calls == first + calls * 4
    assert len(out["dispatch_ms"]) == 2 and out["check"]["max_ulp"] <= 2


def test_deepep_permute_with_other_counts_reports_no_numbers():
    idx, w = _routing()
    with pytest.raises(data.CheckFailed, match="deepep_permute dispatch: rows per local expert"):
        _deepep_rows(FakeDeepEp(idx, w), wrong_counts=True).deepep_permute()


# --------------------------------------------------------------------------- records and bytes


def test_wire_bytes_by_method():
    tr = {"dispatch": {"remote_dedup": [100 * 10, 100 * 20]},
          "combine": {"remote_dedup": [7, 8], "remote_rows": [70, 80]}}
    assert report.wire_for("deepep@24", tr, 100, 8, None) == {"dispatch": [1000 + 10 * 96, 2000 + 20 * 96],
                                                               "combine": [7, 8]}
    assert report.wire_for("deepep_cached@48", tr, 100, 8, None) == {"dispatch": [1000, 2000], "combine": [7, 8]}
    assert report.wire_for("torch_megatron", tr, 100, 8, None)["dispatch"] == [1000 + 10 * 64, 2000 + 20 * 64]
    assert report.wire_for("epcc_cached", tr, 100, 8, {"dispatch": [1], "combine": [2]}) == \
        {"dispatch": [1], "combine": [2]}


def test_per_method_merges_the_ranks_answers():
    ok = {"dispatch_ms": [1.0], "combine_ms": [2.0]}
    got = child.per_method([{"methods": {"epcc": ok, "epcc_cached": {"error": "WRONG: x"}}},
                            {"methods": {"epcc": ok}, "error": "RuntimeError: y", "failed": True}], "epcc")
    assert list(got) == ["epcc", "epcc_cached"]
    assert got["epcc_cached"][1] == {"error": "RuntimeError: y"}
    assert child.per_method([{"error": "no answer"}, {"error": "no answer"}], "deepep") == \
        {"deepep": [{"error": "no answer"}, {"error": "no answer"}]}


def test_method_record_and_the_prediction_row():
    tr = {op: {"remote_dedup": [1e6, 1e6], "remote_rows": [2e6, 2e6], "deepep": [3e6, 3e6]}
          for op in ("dispatch", "combine")}
    per_rank = [{"dispatch_ms": [1.0, 3.0, 2.0], "combine_ms": [1.0, 1.0, 1.0], "check": {"max_ulp": 0},
                 "host_ms": {"layout_tables": h}, "sms": {"dispatch": 24, "combine": 24}} for h in (5.0, 7.0)]
    rec = report.method_record(per_rank, tr, 100, 8, "epcc")
    assert rec["summary"]["dispatch"]["median_ms"] == 2.0 and rec["host_ms_max"] == 7.0
    assert rec["summary"]["dispatch"]["gbps_remote_dedup"] == pytest.approx(0.5)
    failed = report.method_record([{"error": "a peer failed: rank 1: x"}, {"error": "boom"}], tr, 100, 8, "epcc")
    assert failed["error"] == "rank 1: boom" and "summary" not in failed
    sim = {"tokens": 64, "sms": None, **{p: {"total_ms": 1.0, "serial_ms": 1.5, "bottleneck": "rdma", "steps": {}}
                                        for p in ("dispatch", "combine")}}
    fresh = {"summary": {p: {"median_ms": 3.0} for p in ("dispatch", "combine")}}
    cached = {"summary": {p: {"median_ms": 1.1} for p in ("dispatch", "combine")}}
    rep = {"bundles": [{"name": "v", "workload": {"tokens": 64}, "simulate": sim,
                        "methods": {"epcc": fresh, "epcc_cached": cached}}]}
    lines = report.format_predictions(rep)
    assert lines[1].startswith("v (epcc_cached): dispatch measured 1.100 ms, simulate 1.000 ms (+10 %")
    rep["bundles"][0]["methods"]["epcc_cached"] = {"error": "WRONG: x"}
    assert report.format_predictions(rep)[1].startswith("v: dispatch measured 3.000 ms")
    rep["args"] = {"dry_run": True}
    assert report.format_predictions(rep) == ["against epcc simulate: not compared (a dry run: wall-clock times "
                                              "on the CPU)"]


# --------------------------------------------------------------------------- re-chunked tables


def test_rechunked_proxy_tables_move_every_row_as_the_oracle_says(tmp_path):
    """A proxy bundle's plan re-chunked as --rdma-chunks does, its layout and every rank's CUDA
    tables through the NumPy emulator of the kernels: dispatch rows exact, combine within the
    oracle's tolerance (what the GPU engine uploads per routing at that chunking)."""
    bundle = tmp_path / "b"
    assert epcc_main(["compile", str(ROOT / "schedules" / "h200x2_2vnode.sched"), "--target", "cuda",
                      "--rdma", "proxy", "-o", str(bundle)]) == 0
    plan = predict.rechunk(load(bundle).plan, (8, 2))
    manifest = cuda_manifest(bundle)
    wl, tokens = plan.workload, 32
    idx = inputs.make_topk("uniform", 2, tokens, wl.topk, wl.experts, wl.placement, seed=1).topk_idx
    w = inputs.make_weights(idx, seed=2)
    layout = compute_layout(plan, idx, w)
    assert max(int(np.diff(c.chunk_starts).max(initial=0)) for c in layout.copies if c.step == "rdma") == 8
    x = [data.gen_rows(tokens, wl.hidden, "bf16", 1, r, 0, CPU) for r in range(2)]
    F = torch.stack([data.gen_features(x[r], wl.hidden, "bf16", 1, r, CPU) for r in range(2)])
    scale = data.expert_scale(wl.experts, CPU)
    got = emulate(manifest, layout, "dispatch", [v.numpy() for v in x])
    ys = [data.expert_outputs(F, torch.from_numpy(layout.entries[("output", r)]), scale).view(torch.int16).numpy()
          .view(np.uint16) for r in range(2)]
    comb = emulate(manifest, layout, "combine", ys)
    xs = torch.stack(x)
    for r in range(2):
        src = torch.from_numpy(data.recv_src(idx, wl.experts, wl.placement, r))
        data.check_rows(torch.from_numpy(got[("output", r)]), xs[src[:, 0], src[:, 1]], "dispatch")
        ref, mag = data.combine_reference(F[r], torch.from_numpy(idx[r]), torch.from_numpy(w[r]), scale)
        res = torch.from_numpy(oracle.f32_to_bf16(comb[("result", r)]).view(np.int16)).view(torch.bfloat16)
        data.check_combine(res, ref, mag, wl.topk, "combine", partial_rounding(manifest))


def test_epcc_sms_setting():
    cli = importlib.import_module("ep_bench.cli")
    assert cli.parse_epcc_sms("24, 48") == [24, 48] and cli.parse_epcc_sms("") == []
    for bad in ("0", "x", "-3"):
        with pytest.raises(ValueError, match=f"--epcc-sms: '{bad}' is not a positive number of SMs"):
            cli.parse_epcc_sms(bad)


def test_token_major_data_is_the_token_major_oracles():
    """token_data: the rows a rank receives (home, token), their recv_topk_idx and the combine
    reference are runtime/layout's token-major layout's (the oracle the cpu backend runs)."""
    from epcc import pipeline
    from epcc.passes import PassOptions
    plan = pipeline.run(str(Path(__file__).resolve().parents[2] / "schedules" / "h200x4.sched"),
                        options=PassOptions(layout="token", tokens=16)).passes.get("plan")
    wl, R, T = plan.workload, plan.num_ranks, 16
    idx = inputs.make_topk("uniform", R, T, wl.topk, wl.experts, wl.placement, seed=3).topk_idx.copy()
    idx[np.random.default_rng(3).random(idx.shape) < 0.3] = -1
    idx[1, 5] = -1  # a token with no expert at all
    lay = compute_layout(plan, idx, None)
    g = torch.Generator().manual_seed(0)
    F_all = torch.randn((R, T, wl.hidden), generator=g).to(torch.bfloat16)
    x_all = torch.randint(0, 255, (R, T, 8), generator=g, dtype=torch.uint8)
    scale = data.expert_scale(wl.experts, torch.device("cpu"))
    for me in range(R):
        topk = torch.from_numpy(idx[me])
        d = data.token_data(plan, idx, me, [x_all[me]], F_all[me], x_all, F_all, scale, topk, torch.ones(topk.shape))
        assert np.array_equal(d.src[:, :2].numpy(), lay.entries[("output", me)])
        assert np.array_equal(d.want_idx.numpy(), lay.recv_topk_idx[me])
        want = torch.zeros((T, wl.hidden))
        for r in range(R):  # every rank holding a row of the token (the layout's) adds bf16(F x scale[r])
            got = lay.entries[("output", r)]
            held = torch.zeros(T)
            held[got[got[:, 0] == me][:, 1]] = 1.0
            want += (F_all[me].float() * scale[r]).to(torch.bfloat16).float() * held[:, None]
        assert torch.equal(d.ref, want)
