"""The direct CUDA lowering's host-side decisions (plan/direct.py, backends/cuda/direct.py), no GPU,
no nvcc:

* match(): which plans are one-hop (h200x4 in bf16, fp8 and with few tokens; nvl8_hybrid), and
  for the others a reason that names the step and its .sched line (or the rank count);
* constants(): the peer region's offsets (increasing, 4096-aligned, no region overlapping the
  next), the receive capacity R*T*min(K, E/R) + (E/R)*(ALIGN_MAX-1) rows, fp8 scale bytes;
* DirectConfig.from_dict / check: errors name the key;
* `epcc compile --target cuda --dtype fp8`: the manifest's direct entry, and the one-line error
  for a hidden size fp8 cannot scale.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from epcc import pipeline
from epcc.backends.cuda import direct
from epcc.backends.cuda import codegen
from epcc.cli import main
from epcc.passes import PassOptions
from epcc.plan import direct as plan_direct
from epcc.plan.direct import DirectConfig, DirectError
from epcc.runtime.engines.cuda_direct.library import timeline_summary

REPO = Path(__file__).resolve().parents[2]
ALL = sorted(p.stem for p in (REPO / "schedules").glob("*.sched"))
ONE_HOP = ["h200x4", "nvl8_hybrid"]
VARIANTS = {"bf16": {}, "fp8": {"dtype": "fp8"}, "t128": {"tokens": 128}, "tok": {"layout": "token"},
            "tokfp8": {"layout": "token", "dtype": "fp8"}, "tokt128": {"layout": "token", "tokens": 128}}

_PLANS: dict = {}


def plan_of(name: str, variant: str = "bf16"):
    key = (name, variant)
    if key not in _PLANS:
        c = pipeline.run(str(REPO / "schedules" / f"{name}.sched"), options=PassOptions(**VARIANTS[variant]))
        _PLANS[key] = c.passes.get("plan")
    return _PLANS[key]


# --------------------------------------------------------------------------------------------
# match


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_h200x4_is_direct(variant):
    plan = plan_of("h200x4", variant)
    assert plan_direct.match(plan) is None
    if variant == "fp8":
        assert plan.workload.dtype == "fp8"
    if variant == "t128":
        assert plan.workload.tokens == 128


@pytest.mark.parametrize("name", [n for n in ALL if n not in ONE_HOP])
def test_other_shipped_plans_are_not_direct_and_say_where(name, monkeypatch):
    plan = plan_of(name)
    why = plan_direct.match(plan)
    assert why, f"{name} should not match the direct lowering"
    if plan.num_ranks > plan_direct.MAX_IPC_RANKS:
        assert why == f"{plan.num_ranks} ranks do not fit one CUDA IPC domain (at most {plan_direct.MAX_IPC_RANKS})"
        # beyond the rank limit, the shape itself is not one hop either: the reason names the step
        monkeypatch.setattr(plan_direct, "MAX_IPC_RANKS", 10_000)
        why = plan_direct.match(plan)
    m = re.fullmatch(r"step '([^']+)' \(line (\d+)\) .*not one hop.*", why)
    assert m, why
    lines = {s.line for s in plan.steps if s.name == m.group(1) and s.program == "dispatch"}
    assert int(m.group(2)) in lines, (why, lines)
    text = (REPO / "schedules" / f"{name}.sched").read_text().splitlines()
    assert f"step {m.group(1)}" in text[int(m.group(2)) - 1], "the line is the step's line in the .sched"


def test_h200x4_2vnode_names_its_rdma_step():
    why = plan_direct.match(plan_of("h200x4_2vnode"))
    assert why.startswith("step 'rdma' (line ") and "send over rdma" in why


def test_reasons_for_workloads_the_kernels_cannot_copy():
    plan = copy.deepcopy(plan_of("h200x4"))
    plan.workload.hidden = 7170
    assert "hidden 7170 is not a multiple of 8" in plan_direct.match(plan)
    plan = copy.deepcopy(plan_of("h200x4", "fp8"))
    plan.workload.hidden = 7296  # a multiple of 128 (fp8 scales), not of the 16-byte bulk copies of scales
    assert "hidden 7296" in plan_direct.match(plan)
    plan = copy.deepcopy(plan_of("h200x4"))
    plan.workload.experts = 254
    assert plan_direct.match(plan) == "254 experts cannot be divided among 4 ranks"
    plan = copy.deepcopy(plan_of("h200x4"))
    plan.workload.experts = 1360  # divisible by 4, but 9 x (E + R) ints of metadata masks exceed 48 KB
    assert plan_direct.match(plan) == ("1360 experts: the metadata kernel's per-expert masks do not fit in a block's "
                                  "shared memory (at most 1359)")
    plan.workload.experts = 1356
    assert plan_direct.match(plan) is None
    plan = copy.deepcopy(plan_of("h200x4"))
    plan.workload.topk = 13  # 64 experts per rank: up to 13 rows of one token on a rank, 2 x 13 > 24
    assert plan_direct.match(plan) == ("a token can have 13 rows to reduce on one rank: the combine's ring of 24 "
                                  "vectors per lane double-buffers at most 12")
    plan.workload.topk = 12
    assert plan_direct.match(plan) is None
    assert direct.ring_stages(12) == [24, 12, 8, 6, 4, 4, 3, 3, 2, 2, 2, 2]
    with pytest.raises(DirectError) as e:  # what match() keeps from generate
        direct.ring_stages(13)
    assert str(e.value) == "a combine ring of 24 vectors per lane cannot double-buffer 13 rows"
    plan = copy.deepcopy(plan_of("h200x4"))
    plan.workload = None
    assert plan_direct.match(plan) == "the plan has no workload"


def test_generate_refuses_a_plan_that_does_not_match():
    with pytest.raises(DirectError, match="step 'rdma'"):
        direct.generate(plan_of("h200x4_2vnode"), "x.sched", codegen._ENV, "0")


# --------------------------------------------------------------------------------------------
# constants


@pytest.mark.parametrize("name,variant", [("h200x4", "bf16"), ("h200x4", "fp8"), ("h200x4", "t128"),
                                          ("nvl8_hybrid", "bf16")])
def test_region_offsets_are_increasing_aligned_and_hold_the_capacity(name, variant):
    plan = plan_of(name, variant)
    c = direct.constants(plan)
    wl = plan.workload
    R, E, K, T, H = plan.num_ranks, wl.experts, wl.topk, wl.tokens, wl.hidden
    epr = E // R
    assert c["capacity"] == R * T * min(K, epr) + epr * (direct.ALIGN_MAX - 1) == R * T * min(K, epr) + epr * 127
    offs = [(n, v) for n, v in c["offsets"] if n.startswith("OFF_") and n != "OFF_END"]
    values = [v for _, v in offs]
    assert values == sorted(values), offs
    assert all(v % 4096 == 0 for v in values), offs
    named = dict(c["offsets"])
    end = named["OFF_END"]
    assert end == c["region_bytes"] and end % 4096 == 0 and end > values[-1]
    extent = {n: (offs[i + 1][1] if i + 1 < len(offs) else end) - v for i, (n, v) in enumerate(offs)}
    # only an empty region may share its offset with the next: the fp8 scales of a bf16 plan
    empty = {n for n, x in extent.items() if x == 0}
    assert empty <= ({"OFF_RECV_S"} if c["scale_bytes"] == 0 else set()), (empty, offs)
    cap = c["capacity"]
    assert extent["OFF_RECV_X"] >= cap * c["x_bytes"]
    assert extent["OFF_RECV_W"] >= cap * 4
    if "OFF_RECV_S" in extent:
        assert extent["OFF_RECV_S"] >= cap * c["scale_bytes"]
    assert extent["OFF_CSTAGE"] >= R * T * H * 2  # one bf16 partial per (source rank, token)
    assert extent["OFF_META"] >= 2 * named["META_STRIDE"]  # two parities
    # a meta area: flags, counts, channel ranges and the senders' shapes (channels, alignment), in order
    assert named["META_FLAGS"] + R * 8 <= named["META_COUNTS"]
    assert named["META_COUNTS"] + R * E * 4 <= named["META_CHANNELS"]
    assert named["META_CHANNELS"] + R * plan_direct.MAX_CHANNELS * 2 * 4 <= named["META_SENDERS"]
    assert named["META_SENDERS"] + R * direct.SENDER_INTS * 4 <= named["META_STRIDE"]
    if variant == "fp8" or wl.dtype == "fp8":
        assert (c["dtype"], c["x_bytes"], c["scale_bytes"]) == ("fp8", H, H // 128 * 4)
    else:
        assert (c["dtype"], c["x_bytes"], c["scale_bytes"]) == ("bf16", 2 * H, 0)
    assert c["x_bytes"] % 16 == 0 and c["scale_bytes"] % 16 == 0  # rows move as 16-byte vectors
    assert c["record_ints"] <= 32  # a warp reads a record with one load per lane


@pytest.mark.parametrize("variant", ["tok", "tokfp8", "tokt128"])
def test_token_major_region_holds_one_row_per_source_token_and_its_topk(variant):
    """The token-major kernels (epcc/direct/token.cuh): R x T rows (one per (source rank, token)), each
    with K weights (fp32) and K local expert ids (int64) and its token (int32); no records; the same
    staging; the tokens per (sender, destination) [R][R] fit in a meta area after the senders'
    shapes (common.cuh META_TOKENS); the expert-major constants carry no layout key."""
    plan = plan_of("h200x4", variant)
    c = direct.constants(plan)
    wl = plan.workload
    R, K, T, H = plan.num_ranks, wl.topk, wl.tokens, wl.hidden
    assert c["layout"] == "token" and "layout" not in direct.constants(plan_of("h200x4", "bf16"))
    assert c["capacity"] == R * T
    named = dict(c["offsets"])
    offs = [(n, v) for n, v in c["offsets"] if n.startswith("OFF_") and n != "OFF_END"]
    assert [v for _, v in offs] == sorted(v for _, v in offs)
    extent = {n: (offs[i + 1][1] if i + 1 < len(offs) else named["OFF_END"]) - v for i, (n, v) in enumerate(offs)}
    assert extent["OFF_RECORDS"] == 0
    assert extent["OFF_RECV_W"] >= R * T * K * 4
    assert extent["OFF_RECV_IDX"] >= R * T * K * 8
    assert extent["OFF_ROW_TOKEN"] >= R * T * 4
    assert extent["OFF_RECV_X"] >= R * T * c["x_bytes"]
    assert extent["OFF_CSTAGE"] >= R * T * H * 2
    assert named["META_SENDERS"] + R * direct.SENDER_INTS * 4 + R * R * 4 <= named["META_STRIDE"]
    assert direct.headers_of(plan) == (*direct.HEADERS, "epcc/direct/token.cuh")
    assert direct.headers_of(plan_of("h200x4", "bf16")) == direct.HEADERS


def test_token_major_steps_name_the_token_kernels():
    steps = direct.describe_steps(plan_of("h200x4", "tok"))
    lowered = " ".join(s["lowered"] for s in steps)
    assert "tok_dispatch_kernel" in lowered and "tok_combine_kernel" in lowered
    assert "replicate" not in lowered  # a token-major row is written once


def test_default_config_passes_its_own_check():
    for name, variant in [("h200x4", "bf16"), ("h200x4", "fp8"), ("h200x4", "t128"), ("nvl8_hybrid", "bf16")]:
        plan = plan_of(name, variant)
        cfg = plan_direct.default_config(plan)
        cfg.check()
        # no dedicated replicators or home reducers: every SM sends (reduces records) first
        assert (cfg.recv_blocks, cfg.combine_reduce_blocks) == (0, 0)
        push = next(s for s in plan.steps if s.program == "dispatch" and s.verb == "send")
        assert cfg.dispatch_sms == cfg.send_blocks == cfg.combine_sms == (push.sms or 24)
        assert 1 <= cfg.channels() <= plan_direct.MAX_CHANNELS


# --------------------------------------------------------------------------------------------
# DirectConfig


GOOD = dict(send_blocks=16, recv_blocks=8, warps=16, combine_send_blocks=16, combine_reduce_blocks=8)


def test_config_round_trip():
    cfg = DirectConfig.from_dict(dict(GOOD))
    cfg.check()
    assert (cfg.dispatch_sms, cfg.combine_sms) == (24, 24)
    # 4 channels per sender warp, at most MAX_CHANNELS (16 x 16 x 4 = 1024; 2 x 16 x 4 = 128)
    assert cfg.channels() == 1024
    assert DirectConfig.from_dict({**GOOD, "send_blocks": 2}).channels() == 128
    # never more channels than tokens (an empty one still costs a take and a queue), at least one
    assert (cfg.channels(4096), cfg.channels(128), cfg.channels(1), cfg.channels(0)) == (1024, 128, 1, 1)


def test_config_unknown_and_missing_keys_are_named():
    with pytest.raises(DirectError, match=r"^config: unknown key\(s\) send_block, stages$"):
        DirectConfig.from_dict({**GOOD, "send_block": 4, "stages": 2})
    d = dict(GOOD)
    del d["warps"], d["recv_blocks"]
    with pytest.raises(DirectError, match=r"^config: missing key\(s\) recv_blocks, warps$"):
        DirectConfig.from_dict(d)


@pytest.mark.parametrize("key", list(GOOD))
@pytest.mark.parametrize("value", [0, -3, "8", 2.5, None])
def test_config_values_are_checked_with_the_key_named(key, value):
    cfg = DirectConfig.from_dict({**GOOD, key: value})
    if key in ("recv_blocks", "combine_reduce_blocks"):  # dedicated replicators / home reducers: none is fine
        if value == 0:
            cfg.check()
            return
        want = "a whole number >= 0"
    else:
        want = "a positive integer"
    with pytest.raises(DirectError, match=rf"^config: {key} must be {want}, got {re.escape(repr(value))}$"):
        cfg.check()


def test_config_limits_name_the_key():
    # more sender warps than channels is fine: a warp with no channel goes straight to replicating
    many = DirectConfig.from_dict({**GOOD, "send_blocks": 96, "recv_blocks": 0})
    many.check()
    assert many.channels() == plan_direct.MAX_CHANNELS
    with pytest.raises(DirectError, match=rf"^config: warps must lie in \[1, {plan_direct.MAX_WARPS}\], got 17$"):
        DirectConfig.from_dict({**GOOD, "warps": 17}).check()
    assert issubclass(DirectError, ValueError)


# --------------------------------------------------------------------------------------------
# epcc compile --target cuda --dtype


def test_cli_fp8_bundle_has_fp8_direct_constants(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "b"
    rc = main(["compile", "schedules/h200x4.sched", "--target", "cuda", "--dtype", "fp8", "-o", str(out)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    m = json.loads((out / "cuda" / "manifest.json").read_text())
    assert m["lowering"] == "direct" and m["workload"]["dtype"] == "fp8"
    c = m["direct"]["constants"]
    hidden = m["workload"]["hidden"]
    assert (c["dtype"], c["hidden"], c["x_bytes"], c["scale_bytes"]) == ("fp8", hidden, hidden, hidden // 128 * 4)
    assert (out / "cuda" / m["direct"]["source"]).is_file()
    config = m["direct"]["headers"][0]
    assert config == "epcc_direct_config.cuh" and f'#include "{config}"' in (out / "cuda" / m["direct"]["source"]).read_text()
    text = (out / "cuda" / config).read_text()
    assert "constexpr bool FP8 = true; " in text and f"constexpr int SB = {hidden // 128 * 4}; " in text


def _sched_with_hidden(tmp_path: Path, hidden: int) -> Path:
    text = (REPO / "schedules" / "h200x4.sched").read_text()
    assert "hidden 7168" in text
    p = tmp_path / "h200x4_odd.sched"
    p.write_text(text.replace("hidden 7168", f"hidden {hidden}"))
    return p


def test_cli_fp8_needs_hidden_divisible_by_128(tmp_path, capsys):
    src = _sched_with_hidden(tmp_path, 7200)
    rc = main(["compile", str(src), "--target", "cuda", "--dtype", "fp8", "-o", str(tmp_path / "b")])
    out, err = capsys.readouterr()
    assert rc == 1
    assert err.strip() == ("epcc: error: --dtype fp8: h200x4 has hidden 7200, which fp8 dispatch needs divisible by "
                           "128 (one scale per 128 channels)")
    assert "Traceback" not in err and not (tmp_path / "b").exists()


def test_cli_one_rank_falls_back_to_tables_and_says_why(tmp_path, capsys):
    # One rank has no pair to push between: no send step, which the direct kernels are built
    # around (the compile stopped with an internal error when match() let it through).
    src = tmp_path / "one.sched"
    src.write_text("topology one { levels node 1, gpu 1  rank gpu  link hbm local { bandwidth 1000 GB/s } }\n"
                   "workload { tokens 16 per rank  hidden 64  dtype bf16  topk 2  experts 4 }\n"
                   "dispatch { step keep: permute input into output }\n"
                   "combine reverse of dispatch\n", encoding="utf-8")
    rc = main(["compile", str(src), "--target", "cuda", "-o", str(tmp_path / "b")])
    _, err = capsys.readouterr()
    assert rc == 0, err
    m = json.loads((tmp_path / "b" / "cuda" / "manifest.json").read_text())
    assert m["lowering"] == "tables" and "direct" not in m
    assert m["direct_not_used"] == ("one rank: no step sends, and the direct kernels are built around the push to "
                                    "the other ranks")


def test_cli_fp8_hidden_the_direct_copies_cannot_take_falls_back_to_tables(tmp_path, capsys):
    # 7296 = 57 x 128: fp8 scales work, but the direct kernels' 16-byte bulk copies of the scale
    # rows do not; the bundle keeps the table-driven kernels and says why.
    src = _sched_with_hidden(tmp_path, 7296)
    rc = main(["compile", str(src), "--target", "cuda", "--dtype", "fp8", "-o", str(tmp_path / "b")])
    _, err = capsys.readouterr()
    assert rc == 0, err
    m = json.loads((tmp_path / "b" / "cuda" / "manifest.json").read_text())
    assert m["lowering"] == "tables" and "direct" not in m and "hidden 7296" in m["direct_not_used"]
    assert not list((tmp_path / "b" / "cuda").glob("*_direct.cu"))


# --------------------------------------------------------------------------------------------
# role timeline of the direct kernels (direct_runtime.timeline_summary)


def test_timeline_summary_reads_roles_by_block_and_warp():
    cfg = DirectConfig(send_blocks=2, recv_blocks=1, warps=2, combine_send_blocks=1, combine_reduce_blocks=1)
    B, W = direct.TIMELINE_BLOCKS, direct.TIMELINE_WORDS
    raw = [0] * (2 * B * W)

    def put(kernel, block, start, *ends):
        raw[(kernel * B + block) * W] = start
        for w, e in enumerate(ends):
            raw[(kernel * B + block) * W + 1 + w] = e

    ms = 1_000_000  # ns
    put(0, 0, 10 * ms, 12 * ms, 13 * ms)  # sender block 0: warps end 2 and 3 ms after the first start
    put(0, 1, 11 * ms, 14 * ms, 12 * ms)  # sender block 1 starts 1 ms late
    put(0, 2, 10 * ms, 15 * ms, 15 * ms)  # receiver block
    put(1, 0, 20 * ms, 21 * ms, 22 * ms, *([21 * ms] * (W - 3)))  # combine: 16 warps per block
    tl = timeline_summary(raw, cfg, B, W)
    send, recv = tl["dispatch"]["roles"]
    assert (send["step"], send["start_ms"], send["median_end_ms"], send["end_ms"]) == ("send+replicate", 0.0, 3.0, 4.0)
    assert (recv["step"], recv["start_ms"], recv["end_ms"]) == ("replicate", 0.0, 5.0)
    assert tl["dispatch"]["end_ms"] == 5.0
    part, home = tl["combine"]["roles"]
    assert (part["start_ms"], part["end_ms"]) == (0.0, 2.0)
    assert home == {"step": "sum", "start_ms": None, "median_end_ms": None, "end_ms": None}  # never ran
    # the default has no dedicated replicators or home reducers: those roles are left out
    one = timeline_summary(raw, DirectConfig(send_blocks=3, recv_blocks=0, warps=2, combine_send_blocks=2,
                                             combine_reduce_blocks=0), B, W)
    assert [r["step"] for r in one["dispatch"]["roles"]] == ["send+replicate"]
    assert one["dispatch"]["end_ms"] == 5.0 and [r["step"] for r in one["combine"]["roles"]] == ["partial+sum"]
