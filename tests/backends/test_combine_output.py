"""Where the combine's fp32 home partials become the caller's bf16 tokens (codegen.combine_output,
manifest `combine_output`): in the combine kernel where every contribution into a rank's `result`
is added on its own GPU (the warp adding a row's last contribution converts it; a count kernel
counts each row's contributions first), else a finish kernel after it, with the reason.  The
decision, its exact words, what the generated sources and the manifest say of it, and the
schema's check of the field."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from epcc.cli.main import main
from epcc.plan.cuda_manifest import check_cuda_manifest, converts_in_kernel
from epcc.plan.schema import SchemaError

REPO = Path(__file__).resolve().parents[2]
IN_KERNEL = "every contribution into a rank's result is added on its own GPU: the last one converts the row"


def _compile(tmp_path: Path, name: str, *opts: str, target: str = "cuda") -> tuple[dict, Path]:
    out = tmp_path / "b"
    assert main(["compile", str(REPO / "schedules" / f"{name}.sched"), "--target", target, *opts, "-o", str(out)]) == 0
    d = out / target
    return json.loads((d / "manifest.json").read_text()), d


@pytest.mark.parametrize("name,opts", [("h200x2_2vnode", ()), ("h200x2_2vnode", ("--rdma", "proxy")),
                                       ("h200x4_ubb2x2", ()), ("ubbv2_ep32", ())])
def test_plans_whose_result_is_written_on_its_own_gpu_convert_in_the_kernel(tmp_path, name, opts):
    m, d = _compile(tmp_path, name, *opts)
    assert m["combine_output"] == {"convert": "in-kernel", "why": IN_KERNEL}
    assert converts_in_kernel(m)
    kinds = [(k["kind"], k["name"]) for k in m["kernels"] if k["program"] == "combine"]
    assert kinds == [("main", f"epcc_{name}_combine_kernel"), ("count", f"epcc_{name}_combine_count_kernel")]
    src = (d / f"{name}_combine.cu").read_text()
    assert "_combine_finish_kernel" not in src
    assert f"epcc_{name}_combine_count_kernel(const uint8_t* __restrict__ tables" in src
    assert "epcc::finish_empty_rows(a);" in src
    writers = [r for r in m["kernels"][1]["roles"] if r["dst_buffer"] == "result" and "pack" not in r["lowered"]]
    assert writers
    for r in writers:  # each role adding into result counts its rows down and converts (run_role's kFinish)
        call = re.search(rf"run_(?:role|unpack)<[^;]*?>\(a, {r['index']}u, ", src).group(0)
        assert call.split(">(a,")[0].endswith(", true"), call
        # the row of result loaded beside the source at its unroll: a paced role reading its peer's rows
        # needs every load in flight (results/2026-11-27_4xH100_combine_in_kernel.md)
        assert r["unroll"] == m["options"]["accum_unroll"]
    others = [r for r in m["kernels"][1]["roles"] if r not in writers and "pack" not in r["lowered"]]
    for r in others:
        call = re.search(rf"run_(?:role|unpack)<[^;]*?>\(a, {r['index']}u, ", src).group(0)
        assert not call.split(">(a,")[0].endswith(", true"), call
    launcher = (d / f"{name}_launcher.cu").read_text()
    assert "constexpr bool kConvertInKernel = true;" in launcher
    assert "int epcc_cuda_combine_prepare(void* ctx, uint64_t stream)" in launcher
    check_cuda_manifest(m)


@pytest.mark.parametrize("name,opts,why", [
    ("dgx_h800_2node", (), "combine step 'rdma' is left to a proxy outside the kernels, which writes result itself: "
                           "the kernel cannot count its rows"),
    ("ocs_ep16", ("--rdma", "emulate"), "combine step 'pull_m2' (line 138) writes result of rank 8 from rank 0 (over "
                                        "rdma): the last contribution of a row may come from another GPU"),
    ("ocs_ep16", ("--rdma", "proxy"), "combine step 'pull_m1' (line 136) writes result of rank 5 from rank 0 (over "
                                      "p2p): the last contribution of a row may come from another GPU"),
])
def test_elsewhere_a_finish_kernel_converts_and_the_manifest_says_why(tmp_path, name, opts, why):
    m, d = _compile(tmp_path, name, *opts)
    assert m["combine_output"] == {"convert": "finish-kernel", "why": why}
    assert not converts_in_kernel(m)
    assert [k["kind"] for k in m["kernels"] if k["program"] == "combine"] == ["main", "finish"]
    src = (d / f"{name}_combine.cu").read_text()
    assert "_combine_count_kernel" not in src and "finish_empty_rows" not in src
    assert ", true>(a," not in src
    assert "constexpr bool kConvertInKernel = false;" in (d / f"{name}_launcher.cu").read_text()


def test_the_supa_target_converts_after_the_kernel(tmp_path):
    m, d = _compile(tmp_path, "h200x2_2vnode", target="supa")
    assert m["combine_output"] == {
        "convert": "finish-kernel",
        "why": "a finish kernel converts the rows after the combine kernel: the SUPA target's warps have no votes and "
               "shuffles the conversion in the kernel uses"}
    assert [k["kind"] for k in m["kernels"] if k["program"] == "combine"] == ["main", "finish"]
    assert "finish_empty_rows" not in (d / "h200x2_2vnode_combine.su").read_text()
    assert "constexpr bool kConvertInKernel = false;" in (d / "h200x2_2vnode_launcher.su").read_text()


def test_the_schema_checks_the_field_and_an_older_bundle_has_none(tmp_path):
    m, _ = _compile(tmp_path, "h200x2_2vnode")
    bad = copy.deepcopy(m)
    bad["combine_output"]["convert"] = "sometimes"
    with pytest.raises(SchemaError, match=r"combine_output\.convert"):
        check_cuda_manifest(bad)
    older = copy.deepcopy(m)
    del older["combine_output"]
    older["kernels"] = [k for k in older["kernels"] if k["kind"] != "count"]
    check_cuda_manifest(older)  # a bundle of an older epcc: its finish kernel converts
    assert not converts_in_kernel(older) and not converts_in_kernel(None)
