"""The CUDA backend's code generation (backends/cuda): emitted sources, launch manifest, tables.

No GPU here.  What runs:

* codegen for every schedule (both RDMA lowerings): step/title/line comments on every role's
  code path, the manifest's block tiling against the plan's SM ranges, what is not lowered;
* nvcc (sm_90a, `-Xptxas -v`) on the sources of the schedules that fit one NVLink domain
  (h200x4, h200x4_2vnode with its RDMA emulated over peer memory, nvl8_hybrid, ubbv2_ep16 on
  one node; ubbv2_ep16 once more with an odd hidden size for the narrow access paths): they
  compile, and the main kernels spill nothing; h200x4's library is built with the manifest's
  own nvcc command, loads with ctypes and fails cleanly without a GPU.  Each schedule is
  compiled once (module-scoped fixture, files in parallel); skipped when nvcc is missing; nvcc
  also asserts that the runtime's ctypes mirror of the metadata driver's EpccTableMeta
  (runtime/engines/cuda_table/meta.py) has the C struct's offsets and sizes;
* a golden of every generated file for h200x4 and h200x4 --dtype fp8, the direct lowering's
  (`<schedule>_direct.cu`, `epcc_direct_config.cuh`) and the manifest included
  (`.venv/bin/python tests/backends/regen_cuda_golden.py` rewrites them); the direct kernels'
  static headers a bundle carries are byte-identical to backends/cuda/include/, and each compiles
  by itself after one plan's config;
* the table blobs against the oracle: the NumPy emulator (runtime/testing/emulate.py) runs every
  rank's blocks over the same tables the GPU reads (item order, split over blocks, waits,
  ordered publication) and must reproduce dispatch_oracle / combine_oracle;
* `epcc compile FILE --target cuda -o DIR`.
"""

from __future__ import annotations

import copy
import ctypes
import difflib
import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from epcc import pipeline
from epcc.backends.cuda import abi, codegen, direct
from epcc.backends.rdma import emit as rdma_emit
from epcc.backends.rdma.sources import STATIC_SOURCES
from epcc.backends.target import CUDA, SUPA
from epcc.cli import main
from epcc.passes import PassOptions
from epcc.plan.rdma import rdma_steps
from epcc.runtime import build_cache
from epcc.runtime.engines.cuda_direct import library as direct_library
from epcc.runtime.engines.cuda_table import launcher, meta, tables
from epcc.runtime.layout import compute_layout
from epcc.runtime.testing import inputs, oracle
from epcc.runtime.testing.emulate import EmulationError, emulate

import regen_cuda_golden  # tests/backends/, on sys.path under pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden_cuda"
ALL = sorted(p.stem for p in (REPO / "schedules").glob("*.sched"))
ONE_DOMAIN = ["h200x4", "h200x4_2vnode", "nvl8_hybrid", "ubbv2_ep16"]  # compiled with nvcc
NVCC_FLAGS = ["-c", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC"]


def source_of(name: str) -> str:
    return f"schedules/{name}.sched"


_PLANS: dict[str, object] = {}


def plan_of(name: str):
    if name not in _PLANS:
        c = pipeline.run(str(REPO / source_of(name)))
        _PLANS[name] = c.passes.get("plan")
    return _PLANS[name]


# --------------------------------------------------------------------------------------------
# codegen: comments, manifest


@pytest.mark.parametrize("rdma", ["emulate", "external", "proxy"])
@pytest.mark.parametrize("name", ALL)
def test_every_role_carries_its_step_title_and_line(name, rdma):
    plan = plan_of(name)
    b = codegen.generate(plan, source_of(name), codegen.CudaOptions(rdma=rdma))
    for k in b.kernels:
        text = b.files[k.file]
        for r in k.roles:
            step = plan.step(r.step, k.program)
            title = f" ({step.title})" if step.title else ""
            line = f"// step '{r.step}'{title}, {source_of(name)}:{step.line}"
            # once above the role's function, once on its branch in the kernel (rdma="proxy":
            # an RDMA step is two roles, pack and unpack)
            n = 2 * sum(1 for x in k.roles if x.step == r.step)
            assert text.count(line) == n, f"{k.file}: '{line}' should appear {n} times"
            assert f"{r.fn}(a, b - {r.block_begin}u);" in text
        assert f'extern "C" __global__ void __launch_bounds__({k.block}, 1) {k.name}(' in text


@pytest.mark.parametrize("name", ALL)
def test_manifest_tiles_the_blocks_and_keeps_the_plans_sm_ranges(name):
    plan = plan_of(name)
    b = codegen.generate(plan, source_of(name))
    m = json.loads(b.files["manifest.json"])
    assert m == json.loads(json.dumps(b.manifest))
    assert m["table_version"] == abi.TABLE_VERSION and m["num_ranks"] == plan.num_ranks
    plan_roles = {(kp.program, r.step): (kp, r) for kp in plan.kernels for r in kp.roles}
    lowered = set()
    for k in (k for k in m["kernels"] if k["kind"] == "main"):
        ranges = [tuple(r["blocks"]) for r in k["roles"]]
        assert ranges[0][0] == 0 and ranges[-1][1] == k["grid"]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
        assert k["block"] == 512 and k["launch"] == "cooperative"
        for r in k["roles"]:
            kp, rp = plan_roles[(k["program"], r["step"])]
            lowered.add((k["program"], r["step"]))
            if kp.kind == "kernel":
                assert r["lowered"] == "sm" and r["plan_sms"] == [rp.sm_begin, rp.sm_end] == r["blocks"]
            else:
                assert r["lowered"] == {"dma": "dma-on-sm", "proxy": "rdma-on-sm"}[kp.kind]
            step = plan.step(r["step"], k["program"])
            assert r["op"] == ("copy" if k["program"] == "dispatch" else
                               "accum_weighted" if step.weighted else
                               "accum_bf16_wire" if step.link_kind == "rdma" else "accum")
    skipped = {(n["program"], n["step"]) for n in m["not_lowered"]}
    # the metadata step of a plan whose tables the GPU writes: the metadata kernels
    skipped |= {(n["program"], n["step"]) for n in m.get("metadata", {}).get("steps", [])}
    # every role of the plan is either in a kernel or said not to be: the metadata exchange,
    # and RDMA steps of plans beyond one box (rdma="auto": external above 8 ranks)
    assert lowered | skipped == set(plan_roles) and not lowered & skipped
    rdma = "emulate" if plan.num_ranks <= 8 else "external"
    assert m["options"]["rdma"] == rdma
    for n in m["not_lowered"]:
        kp, _ = plan_roles[(n["program"], n["step"])]
        assert (n["kind"], kp.kind) in {("metadata", "kernel"), *({("rdma", "proxy")} if rdma == "external" else ())}
    # the combine's conversion: a count kernel before it (the kernel writes the bf16 tokens) or a finish
    # kernel after it, as combine_output says
    after = [k for k in m["kernels"] if k["kind"] in ("finish", "count")]
    assert [(k["program"], k["kind"]) for k in after] == [
        ("combine", "count" if m["combine_output"]["convert"] == "in-kernel" else "finish")]


@pytest.mark.parametrize("rdma", ["emulate", "proxy"])
def test_role_warps_by_lowering(rdma):
    """SM roles keep the plan's warps (16); the proxy path's pack and unpack roles, which stage or
    apply one whole chunk per block inside every credit round trip, get 16 too; paced and DMA
    stand-in roles 8.  The kernel's block holds the widest role's warps."""
    plan = plan_of("h200x4_2vnode")
    b = codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma=rdma))
    m = json.loads(b.files["manifest.json"])
    want = {"sm": 16, "rdma-pack": 16, "rdma-unpack": 16, "rdma-on-sm": 8, "dma-on-sm": 8}
    seen = set()
    for k in (k for k in m["kernels"] if k["kind"] == "main"):
        assert k["block"] == 32 * max(r["warps"] for r in k["roles"])
        for r in k["roles"]:
            assert r["warps"] == want[r["lowered"]], (k["program"], r["step"], r["lowered"], r["warps"])
            seen.add(r["lowered"])
            if r["lowered"] in ("rdma-pack", "rdma-unpack"):
                assert f'{r["function"]}' in b.files[k["file"]]
                assert f'{r["warps"]}u' in b.files[k["file"]].split(f'void {r["function"]}(')[1].split("}")[0]
    assert {"sm", *(("rdma-pack", "rdma-unpack") if rdma == "proxy" else ("rdma-on-sm",))} <= seen, seen


@pytest.mark.parametrize("gbps,blocks,combine_blocks", [(13, 4, 4), (50, 4, 9), (100, 8, 16), (400, 16, 16)])
def test_emulated_rdma_role_gets_blocks_for_its_rate(gbps, blocks, combine_blocks):
    """A dispatch role copies (12.5 GB/s a block); a combine role adds with atomics, given half the
    topology's `add` rate a block (12 GB/s in h200x4_2vnode: 6 GB/s, 50 GB/s -> 9 blocks)."""
    plan = copy.deepcopy(plan_of("h200x4_2vnode"))
    assert plan.sm_rates["add"] == 12e9
    for k in [k for k in plan.resources if k.startswith("link:rdma:")]:
        plan.resources[k] = gbps * 1e9
    b = codegen.generate(plan)
    got = {(k.program, r.step): r.blocks for k in b.kernels for r in k.roles if r.lowered == "rdma-on-sm"}
    assert got == {("dispatch", "rdma"): blocks, ("combine", "rdma"): combine_blocks}


def test_emulated_rdma_combine_blocks_without_sm_rates():
    """Without an `sm` line a combine block is given half of PROXY_BLOCK_BPS: 50 GB/s -> 8 blocks."""
    plan = copy.deepcopy(plan_of("h200x4_2vnode"))
    plan.sm_rates = {}
    b = codegen.generate(plan)
    got = {(k.program, r.step): r.blocks for k in b.kernels for r in k.roles if r.lowered == "rdma-on-sm"}
    assert got == {("dispatch", "rdma"): 4, ("combine", "rdma"): 8}


def test_proxy_pack_and_unpack_blocks_are_the_plans():
    """rdma="proxy": the pack and unpack roles run on the blocks kernel-formation sized for the link
    (h200x4_2vnode at 50 GB/s: the combine's unpack adds at ~12 GB/s per SM, 5 blocks), and a plan
    written before it did (0) falls back to opts.proxy_blocks."""
    plan = plan_of("h200x4_2vnode")
    sized = {(k.program, r.step): (r.pack_sms, r.unpack_sms)
             for k in plan.kernels if k.kind == "proxy" for r in k.roles}
    assert sized == {("dispatch", "rdma"): (4, 4), ("combine", "rdma"): (4, 5)}
    b = codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="proxy"))
    got = {(k.program, r.step, r.lowered): r.blocks
           for k in b.kernels for r in k.roles if r.lowered.startswith("rdma-")}
    assert got == {("dispatch", "rdma", "rdma-pack"): 4, ("dispatch", "rdma", "rdma-unpack"): 4,
                   ("combine", "rdma", "rdma-pack"): 4, ("combine", "rdma", "rdma-unpack"): 5}
    assert "(the plan's unpack_sms)" in b.files["h200x4_2vnode_combine.cu"]
    old = copy.deepcopy(plan)
    for k in old.kernels:
        for r in k.roles:
            r.pack_sms = r.unpack_sms = 0
    b = codegen.generate(old, None, codegen.CudaOptions(rdma="proxy", proxy_blocks=3))
    assert {r.blocks for k in b.kernels for r in k.roles if r.lowered.startswith("rdma-")} == {3}


def test_rdma_roles_emulated_or_left_to_a_proxy():
    plan = plan_of("h200x4_2vnode")
    emu = codegen.generate(plan, source_of("h200x4_2vnode"))
    roles = {r.step: r for k in emu.kernels if k.program == "dispatch" for r in k.roles}
    assert roles["rdma"].lowered == "rdma-on-sm" and roles["rdma"].bytes_per_s == 50e9
    assert roles["rdma"].block_end - roles["rdma"].block_begin == emu.manifest["options"]["proxy_blocks"] == 4
    assert "RDMA emulated by SMs over peer memory, paced to one link of 50 GB/s, 5 us" in emu.files["h200x4_2vnode_dispatch.cu"]
    # the rdma role lands what later steps read: it publishes in chunk order
    assert re.search(r'\(a, 4u, "rdma", block, 4u, 50\.f, 5000u,\s+/\*ordered=\*/true\);',
                     emu.files["h200x4_2vnode_dispatch.cu"])
    assert emu.manifest["options"]["rdma"] == "emulate"  # auto: 4 ranks, one box
    ext = codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="external"))
    assert all(r.step != "rdma" for k in ext.kernels for r in k.roles)
    assert {(n["program"], n["step"], n["kind"]) for n in ext.manifest["not_lowered"]} >= {
        ("dispatch", "rdma", "rdma"), ("combine", "rdma", "rdma")}
    assert "Not in this kernel: step 'rdma' (RDMA: posted by a host proxy" in ext.files["h200x4_2vnode_dispatch.cu"]


def test_odd_hidden_sizes_get_narrow_accesses():
    ops = {(k.program, r.step): r.op_type for k in codegen.generate(odd_plan()).kernels for r in k.roles}
    assert ops[("dispatch", "fwd1")] == "epcc::CopyRows<2, 8>"  # 14342 B rows
    assert ops[("combine", "fwd1")] == "epcc::AccumF32<1, 8>"
    assert ops[("combine", "final.sendbuf")] == "epcc::AccumWeightedBf16<1, 8>"


def test_dma_roles_run_on_sms_and_access_widths_follow_the_row_size():
    plan = plan_of("ubbv2_ep16")
    b = codegen.generate(plan, source_of("ubbv2_ep16"))
    d = {r.step: r for k in b.kernels if k.program == "dispatch" for r in k.roles}
    assert d["d2d_near"].lowered == d["d2d_far"].lowered == "dma-on-sm"
    assert "copy-engine step run by SMs in this version" in b.files["ubbv2_ep16_dispatch.cu"]
    assert d["fwd1"].op_type == "epcc::CopyRows<16, 8>"
    fp8 = codegen.generate(plan_of("nvl8_hybrid"), source_of("nvl8_hybrid"))
    assert fp8.manifest["workload"]["row_bytes"] == 7168 + 56 * 4  # payload + scales: 7392 = 16 x 462
    assert all(r.access_bytes == 16 for k in fp8.kernels for r in k.roles)
    # a hidden size that is not a multiple of 8: narrower accesses, never a misaligned one
    odd = plan_of("h200x4")
    saved = odd.workload.hidden
    try:
        odd.workload.hidden = 7170
        ob = codegen.generate(odd, source_of("h200x4"))
        ops = {(k.program, r.step): r.op_type for k in ob.kernels for r in k.roles}
        assert ops[("dispatch", "push")] == "epcc::CopyRows<4, 8>"  # 14340 B rows
        assert ops[("combine", "push")] == "epcc::AccumWeightedBf16<2, 8>"
    finally:
        odd.workload.hidden = saved


def test_generate_refuses_plans_it_cannot_lower():
    plan = plan_of("h200x4")
    with pytest.raises(codegen.CudaCodegenError, match="rdma must be 'auto', 'emulate', 'external' or 'proxy', not 'nic'"):
        codegen.generate(plan, options=codegen.CudaOptions(rdma="nic"))
    saved = plan.kernels
    try:
        plan.kernels = []
        with pytest.raises(codegen.CudaCodegenError, match="no kernels"):
            codegen.generate(plan)
    finally:
        plan.kernels = saved


# --------------------------------------------------------------------------------------------
# golden


REGEN = ".venv/bin/python tests/backends/regen_cuda_golden.py"


def _golden_files(variant: str) -> list[str]:
    d = GOLDEN / variant
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


_BUNDLES: dict[str, object] = {}


def golden_bundle(variant: str):
    if variant not in _BUNDLES:
        _BUNDLES[variant] = regen_cuda_golden.generate(variant)
    return _BUNDLES[variant]


@pytest.mark.parametrize("variant", list(regen_cuda_golden.VARIANTS))
def test_golden_file_set(variant):
    b = golden_bundle(variant)
    assert sorted(b.files) == _golden_files(variant), f"regenerate: {REGEN}"
    schedule, _ = regen_cuda_golden.VARIANTS[variant]
    # the goldens cover the direct lowering: its source, its config and its manifest entry
    assert {f"{schedule}_direct.cu", direct.CONFIG_FILE} <= set(b.files)
    assert b.manifest["lowering"] == "direct" and b.manifest["direct"]["source"] == f"{schedule}_direct.cu"
    token = regen_cuda_golden.VARIANTS[variant][1].get("layout") == "token"
    assert b.manifest["direct"]["headers"] == [direct.CONFIG_FILE, *direct.HEADERS,
                                               *(direct.TOKEN_HEADERS if token else ())]


@pytest.mark.parametrize("variant", list(regen_cuda_golden.VARIANTS))
def test_bundle_carries_the_static_headers_unchanged(variant, tmp_path):
    """The static headers of the direct kernels and the device prelude of the table-driven ones
    have no golden: what a bundle carries is the repository's files, byte for byte, beside the
    generated ones (a GPU machine builds the bundle without epcc), and every header the source
    includes is in the bundle."""
    b = golden_bundle(variant)
    token = regen_cuda_golden.VARIANTS[variant][1].get("layout") == "token"
    headers = [*direct.HEADERS, *(direct.TOKEN_HEADERS if token else ())]
    # the table-driven kernels' metadata header too: the bundle's general path has its tables on the GPU
    assert sorted(b.static) == sorted([*headers, CUDA.prelude, codegen.META_HEADER])
    written = {p.relative_to(tmp_path).as_posix() for p in b.write(tmp_path)}
    assert set(b.manifest["direct"]["headers"]) <= written
    assert CUDA.prelude in b.manifest["build"]["headers"]
    for name in [*headers, CUDA.prelude]:
        assert (tmp_path / name).read_bytes() == (direct.INCLUDE_DIR / name).read_bytes(), name
    included = re.findall(r'^#include "([^"]+)"', (tmp_path / b.manifest["direct"]["source"]).read_text(), re.M)
    for name in headers:
        text = (tmp_path / name).read_text()
        if not token:  # what host.cuh includes for token-major bundles only (their config defines the macro)
            text = re.sub(r"#ifdef EPCC_DIRECT_TOKEN_MAJOR\n(#include [^\n]*\n)+#endif", "", text)
        included += [f"epcc/direct/{h}" for h in re.findall(r'^#include "([^"/]+)"', text, re.M)]
    assert set(included) == set(b.manifest["direct"]["headers"])
    # the token-major kernels come with the macro that selects them, and only then
    config = b.files[direct.CONFIG_FILE]
    assert ("#define EPCC_DIRECT_TOKEN_MAJOR 1" in config) == token


@pytest.mark.parametrize("variant,name", [(v, f) for v in regen_cuda_golden.VARIANTS for f in _golden_files(v)])
def test_golden(variant, name):
    text = golden_bundle(variant).files.get(name)
    assert text is not None, f"{variant}/{name} is no longer generated; regenerate: {REGEN}"
    golden = (GOLDEN / variant / name).read_text(encoding="utf-8")
    if text != golden:
        diff = list(difflib.unified_diff(golden.splitlines(), text.splitlines(), f"golden/{variant}/{name}",
                                         "generated", lineterm="", n=1))
        pytest.fail(f"{variant}/{name} differs from the golden ({len(diff)} diff lines; if intended, "
                    f"regenerate: {REGEN}):\n" + "\n".join(diff[:40]))


# --------------------------------------------------------------------------------------------
# nvcc

NVCC = build_cache.find_nvcc()


def _nvcc(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([NVCC, *args], cwd=cwd, capture_output=True, text=True)


LIBRARY = "h200x4"  # built with the manifest's own command (build_library), as on the GPU machine
ODD = "ubbv2_ep16@7171"  # a hidden size that is not a multiple of 8: 2-byte copies, scalar fp32 adds


def odd_plan():
    plan = copy.deepcopy(plan_of("ubbv2_ep16"))
    plan.workload.hidden = 7171
    return plan


# The direct lowering (direct.py, include/epcc/direct/): every shipped one-hop schedule, plus
# h200x4 with the options the GPU tests compile (tests/gpu/bundles.py): fp8 dispatch, 128 tokens.
# The token-major kernels (epcc/direct/token.cuh) with the same three: tok, tokfp8, tokt128.
DIRECT = ["h200x4", "nvl8_hybrid", "h200x4@fp8", "h200x4@t128", "h200x4@tok", "h200x4@tokfp8", "h200x4@tokt128"]
ALONE = "h200x4@fp8"  # the config each static header of the direct kernels is compiled alone with
ALONE_TOKEN = "h200x4@tokfp8"  # ... and token.cuh, which only token-major bundles carry
_DIRECT_OPTIONS = {"fp8": {"dtype": "fp8"}, "t128": {"tokens": 128}, "tok": {"layout": "token"},
                   "tokfp8": {"layout": "token", "dtype": "fp8"}, "tokt128": {"layout": "token", "tokens": 128}}


def direct_plan(name: str):
    if "@" not in name:
        return plan_of(name)
    base, variant = name.split("@")
    key = f"direct:{name}"
    if key not in _PLANS:
        _PLANS[key] = pipeline.run(str(REPO / source_of(base)),
                                   options=PassOptions(**_DIRECT_OPTIONS[variant])).passes.get("plan")
    return _PLANS[key]


def test_direct_list_is_every_one_hop_schedule():
    """DIRECT must follow the schedules: a new one-hop .sched gets its direct source compiled."""
    assert sorted(n for n in ALL if plan_of(n).direct is not None) == sorted(n for n in DIRECT if "@" not in n)
    assert all(direct_plan(n).direct is not None for n in DIRECT)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every ONE_DOMAIN schedule's sources compiled once, in parallel: each kernel file with
    `nvcc -c -Xptxas -v`, and LIBRARY's whole library with the manifest's build command; every
    DIRECT variant's `<schedule>_direct.cu` built into its library as the runtime builds it
    (direct_library.build: the manifest entry's command, here with `-Xptxas -v`, cached under a
    fresh $EPCC_CACHE)."""
    if NVCC is None:
        pytest.skip("nvcc not found (PATH, $NVCC, /usr/local/cuda*/bin): the CUDA sources are not compiled")
    root = tmp_path_factory.mktemp("cuda")
    jobs = []
    for name in DIRECT:
        d = root / "direct" / name
        b = codegen.generate(direct_plan(name), source_of(name.split("@")[0]))
        b.write(d)
        jobs.append((name, "direct", d, b.manifest))
        if name in (ALONE, ALONE_TOKEN):
            for h in (direct.HEADERS if name == ALONE else direct.TOKEN_HEADERS):  # alone, after the config only
                tu = f"alone_{Path(h).stem}.cu"
                (d / tu).write_text(f'#include "{direct.CONFIG_FILE}"\n#include "{h}"\n')
                jobs.append((name, f"alone:{h}", d, [*NVCC_FLAGS, "--Werror", "all-warnings", tu, "-o", tu[:-3] + ".o"]))
    for name in [*ONE_DOMAIN, ODD]:
        d = root / name
        b = codegen.generate(odd_plan() if name == ODD else plan_of(name), source_of(name.split("@")[0]))
        b.write(d)
        if name == LIBRARY:
            jobs.append((name, "library", d, None))
            continue
        for k in b.kernels:
            jobs.append((name, k.file, d, [*NVCC_FLAGS, "-Xptxas", "-v", k.file, "-o", k.file[:-3] + ".o"]))
        if name in ONE_DOMAIN and b.manifest.get("metadata", {}).get("lowering") == "device":
            jobs.append((name, codegen.META_SOURCE, d, [*NVCC_FLAGS, codegen.META_SOURCE, "-o", "meta.o"]))

    def run(job):
        name, what, d, args = job
        if what == "direct":
            log: list[str] = []
            try:
                lib = direct_library.build(d, args, nvcc=NVCC, extra_flags=("-Xptxas", "-v"), log=log)
                return name, what, subprocess.CompletedProcess([], 0, "".join(log), str(lib))
            except RuntimeError as e:
                return name, what, subprocess.CompletedProcess([], 1, "".join(log), str(e))
        if args is not None:
            return name, what, _nvcc(args, d)
        log: list[str] = []
        try:
            lib = launcher.build_library(d, nvcc=NVCC, extra_flags=("-Xptxas", "-v"), log=log)
            return name, what, subprocess.CompletedProcess([], 0, "".join(log), str(lib))
        except RuntimeError as e:
            return name, what, subprocess.CompletedProcess([], 1, "".join(log), str(e))

    saved = os.environ.get("EPCC_CACHE")
    os.environ["EPCC_CACHE"] = str(root / "cache")  # never a cached library: nvcc runs, ptxas reports
    try:
        with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
            results = {(n, w): r for n, w, r in ex.map(run, jobs)}
    finally:
        if saved is None:
            os.environ.pop("EPCC_CACHE", None)
        else:
            os.environ["EPCC_CACHE"] = saved
    lib = results[(LIBRARY, "library")]
    direct_libs = {n: Path(r.stderr) for (n, w), r in results.items() if w == "direct" and r.returncode == 0}
    return {"root": root, "results": results, "lib": Path(lib.stderr) if lib.returncode == 0 else None,
            "direct": direct_libs}


@pytest.mark.parametrize("name", [*ONE_DOMAIN, ODD])
def test_nvcc_compiles_for_sm90a(built, name):
    bad = {f: r.stdout + r.stderr for (n, f), r in built["results"].items()
           if n == name and f != "direct" and r.returncode != 0}
    assert not bad, "\n".join(f"--- {f}\n{out}" for f, out in bad.items())


def test_nvcc_compiles_the_metadata_driver(built):
    """The metadata kernels' driver (templates/table_meta.cu.j2) of a one-box plan (its routing over
    CUDA IPC; also the table-driven path of nvl8_hybrid's direct bundle) and of a plan beyond one
    box (the process group's all-gather between its entries)."""
    got = {n: r for (n, f), r in built["results"].items() if f == codegen.META_SOURCE}
    assert sorted(got) == ["h200x4_2vnode", "nvl8_hybrid", "ubbv2_ep16"]
    for n, r in got.items():
        assert r.returncode == 0, f"{n}:\n{r.stdout}{r.stderr}"
    assert (codegen.generate(plan_of("h200x4_2vnode")).manifest["metadata"]["exchange"],
            codegen.generate(plan_of("ubbv2_ep16")).manifest["metadata"]["exchange"]) == ("ipc", "collective")


def _c_fields(struct: type, prefix: str = "") -> list[tuple[str, int, int]]:
    """(member designator, offset, size) of every field of a ctypes Structure, nested ones'
    members too (offsetof takes `exchange.rank`)."""
    out = []
    for name, ctype, *_ in struct._fields_:
        f = getattr(struct, name)
        out.append((prefix + name, f.offset, f.size))
        if isinstance(ctype, type) and issubclass(ctype, ctypes.Structure):
            out += [(d, f.offset + off, size) for d, off, size in _c_fields(ctype, prefix + name + ".")]
    return out


def test_the_runtimes_ctypes_mirror_is_the_metadata_drivers_struct(tmp_path):
    """runtime/engines/cuda_table/meta.py writes EpccTableMeta (with its Exchange and Args) through
    the ctypes _Meta: nvcc, on the generated driver, asserts every field's offset and size and the
    struct's, the ABI number and the timeline's words per block the runtime reads."""
    if NVCC is None:
        pytest.skip("nvcc not found (PATH, $NVCC, /usr/local/cuda*/bin): the CUDA sources are not compiled")
    codegen.generate(plan_of("h200x4_2vnode"), source_of("h200x4_2vnode")).write(tmp_path)
    fields = _c_fields(meta._Meta)
    assert {"timeline", "exchange.rank", "args.lay"} <= {d for d, _, _ in fields}
    checks = [f"static_assert(sizeof(EpccTableMeta) == {ctypes.sizeof(meta._Meta)}, \"sizeof\");",
              f"static_assert(kMetaAbi == {meta.META_ABI}, \"kMetaAbi\");",
              f"static_assert(kMetaTimelineWords == {meta.TIMELINE_WORDS}, \"kMetaTimelineWords\");"]
    for d, off, size in fields:
        checks.append(f"static_assert(offsetof(EpccTableMeta, {d}) == {off}, \"offset of {d}\");")
        checks.append(f"static_assert(sizeof(std::declval<EpccTableMeta>().{d}) == {size}, \"size of {d}\");")
    (tmp_path / "mirror.cu").write_text(f'#include <cstddef>\n#include "{codegen.META_SOURCE}"\n' + "\n".join(checks)
                                        + "\n", encoding="utf-8")
    r = _nvcc([*NVCC_FLAGS, "mirror.cu", "-o", "mirror.o"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def ptxas_report(output: str) -> dict[str, dict]:
    """kernel -> {registers, stack, spill_stores, spill_loads} from `-Xptxas -v` output."""
    out = {}
    for m in re.finditer(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads\n(?:ptxas info\s*: Used (\d+) registers)?", output):
        out[m.group(1)] = {"stack": int(m.group(2)), "spill_stores": int(m.group(3)),
                           "spill_loads": int(m.group(4)), "registers": int(m.group(5) or 0)}
    return out


@pytest.mark.parametrize("name", [*ONE_DOMAIN, ODD])
def test_main_kernels_do_not_spill(built, name, record_property):
    report = {}
    for (n, f), r in built["results"].items():
        if n == name and f != "direct":
            report.update(ptxas_report(r.stdout if f == "library" else r.stdout + r.stderr))
    sched = name.split("@")[0]
    kernels = {k: v for k, v in report.items() if k.startswith(f"epcc_{sched}_") and k.endswith("_kernel")}
    assert len(kernels) == 3, report  # dispatch, combine, and the combine's count or finish kernel
    # A role converting the combine's rows in the kernel (run_role's rows_converting) holds a row of
    # `result` beside its source vectors where it adds a row's last contribution: beside a paced RDMA
    # role's link state that spills up to ~90 bytes (2 x H100, 2026-11-27, h200x2_2vnode_50: the
    # combine 1.354 -> 1.285 ms with it; a half unroll that spilled nothing took 4.3 ms, its peer
    # reads too few in flight).  Every other role spills nothing.
    b = codegen.generate(odd_plan() if name == ODD else plan_of(name), source_of(sched))
    converting = [r.fn + "E" for k in b.kernels for r in k.roles if r.finishes]  # as mangled: the name, then E
    assert converting, "no role of the combine converts its rows"
    roles = {k: v for k, v in report.items() if not k.startswith("epcc_") and f"_{sched}_" in k}
    for k, v in roles.items():
        bound = 96 if any(fn in k for fn in converting) else 0
        assert v["spill_stores"] <= bound and v["spill_loads"] <= bound, (k, v)
    for k, v in kernels.items():
        record_property(k, v)
        assert v["spill_stores"] == 0 and v["spill_loads"] == 0, (k, v)
        assert 0 < v["registers"] <= 128, (k, v)  # __launch_bounds__(512, 1) leaves room; keep it modest
        # the printf argument buffer of the timeout path (48 B), and a converting role's spills
        assert v["stack"] <= (64 if "_combine_" not in k else 160), (k, v)


@pytest.mark.parametrize("name", DIRECT)
def test_direct_source_compiles_for_sm90a_without_spills(built, name, record_property):
    r = built["results"][(name, "direct")]
    assert r.returncode == 0, f"{name}: the direct library did not build:\n{r.stderr}\n{r.stdout}"
    report = ptxas_report(r.stdout)
    kernels = {k: v for k, v in report.items() if k.endswith("_kernelENS_4ArgsE")}  # anonymous-namespace kernels
    assert any("dispatch_kernel" in k for k in kernels) and any("combine_kernel" in k for k in kernels), report
    # token-major bundles build the token-major kernels (their config's macro), the others do not
    token = "@tok" in name
    assert any("tok_dispatch_kernel" in k for k in kernels) == token, report
    assert any("tok_combine_kernel" in k for k in kernels) == token, report
    assert "ptxas info" in r.stdout and "bytes spill stores" in r.stdout
    for k, v in report.items():  # kernels and the non-inlined device functions (the timeout report)
        record_property(k, v)
        assert v["spill_stores"] == 0 and v["spill_loads"] == 0, (name, k, v)
    for k, v in kernels.items():
        assert 0 < v["registers"] <= 255, (name, k, v)


@pytest.mark.parametrize("header", [*direct.HEADERS, *direct.TOKEN_HEADERS])
def test_each_direct_header_compiles_alone_after_a_config(built, header):
    """A static header includes what it uses: after one plan's config and nothing else it compiles
    for sm_90a without a warning."""
    r = built["results"][(ALONE_TOKEN if header in direct.TOKEN_HEADERS else ALONE, f"alone:{header}")]
    assert r.returncode == 0, f"{header} alone:\n{r.stdout}{r.stderr}"


def test_a_direct_header_without_a_config_says_which_to_include(built, tmp_path):
    d = built["root"] / "direct" / ALONE
    r = _nvcc(["-E", "-x", "cu", "-o", os.devnull, "epcc/direct/dispatch.cuh"], d)
    assert r.returncode != 0
    assert "include the plan's epcc_direct_config.cuh (written by epcc compile --target cuda) first" in r.stderr


@pytest.mark.parametrize("name", ["h200x4", "h200x4@fp8", "h200x4@tok"])
def test_direct_library_loads_and_matches_its_manifest(built, name):
    """ctypes view of the library (direct_library.DirectLibrary): ABI, the Args layout and the
    peer region size agree with the manifest; host-side argument errors come back as messages."""
    if name not in built["direct"]:
        pytest.fail(f"the {name} direct library did not build: {built['results'][(name, 'direct')].stderr}")
    d = built["root"] / "direct" / name
    m = launcher.load_manifest(d)
    lib = direct_library.DirectLibrary(built["direct"][name], m)  # checks ABI, sizeof(Args), region bytes
    c = m["direct"]["constants"]
    assert lib.region_bytes == c["region_bytes"] == c["offsets_named"]["OFF_END"]
    for bad in (0, c["max_warps"] + 1):
        with pytest.raises(direct_library.DirectRuntimeError, match=rf"^init: warps must lie in \[1, 16\], got {bad}$"):
            lib.init(bad)
    lib.init(c["max_warps"])  # only checks; no CUDA call
    try:  # the first CUDA call: without a GPU or driver it says which call failed
        lib.prepare()
    except direct_library.DirectRuntimeError as e:
        assert re.match(r"^prepare: cudaFuncSetAttribute\(combine_kernel, max dynamic shared memory\): .*\(cuda\w+\)$",
                        str(e)), str(e)
    # a launch configuration the kernels cannot run is refused before anything is launched
    # (no metadata flags raised at the peers), so this needs no GPU either
    args = lib.Args()
    args.C, args.NSB, args.NR, args.W, args.NS, args.ND = 64, 1, 1, 0, 1, 1
    with pytest.raises(direct_library.DirectRuntimeError, match=r"^dispatch: bad launch configuration: 64 channels, "
                                                                r"1 sender and 1 replicator blocks of 0 warps$"):
        lib.dispatch(args, 0)
    args.W, args.NR = 1, -1  # no replicator blocks is fine (the default), fewer than none is not
    with pytest.raises(direct_library.DirectRuntimeError, match=r"^dispatch: bad launch configuration: 64 channels, "
                                                                r"1 sender and -1 replicator blocks of 1 warps$"):
        lib.dispatch(args, 0)
    # the peers lay out rows by every rank's token count and alignment: out of range, nothing is launched
    args.NR, args.T, args.align = 0, 0, 0
    with pytest.raises(direct_library.DirectRuntimeError, match=r"^dispatch: bad arguments: 0 tokens \(at most "
                                                                rf"{c['max_tokens']}\), expert alignment 0 \(1 to 128\)$"):
        lib.dispatch(args, 0)
    args.T, args.align = c["max_tokens"] + 1, 1
    with pytest.raises(direct_library.DirectRuntimeError, match=rf"^dispatch: bad arguments: {c['max_tokens'] + 1} "
                                                                r"tokens \(at most \d+\), expert alignment 1 "):
        lib.dispatch(args, 0)
    args.T, args.cached = 1, 2  # a cached dispatch is 0 or 1: anything else is refused before a launch
    with pytest.raises(direct_library.DirectRuntimeError, match=r"^dispatch: bad arguments: cached is 2 \(0 or 1\)$"):
        lib.dispatch(args, 0)
    args.NS = 0
    with pytest.raises(direct_library.DirectRuntimeError,
                       match=r"^combine: bad launch configuration: 0 partial and 1 home-only blocks$"):
        lib.combine(args, 0)
    # the host reads the token-major rows' source offsets from State (library.py state_offsets)
    assert lib.state_offsets["src_offset"] > lib.state_offsets["recv_offset"]


def test_launcher_library_loads_and_fails_cleanly_without_a_gpu(built):
    if built["lib"] is None:
        r = built["results"][(LIBRARY, "library")]
        pytest.fail(f"the {LIBRARY} library did not build: {r.stderr}")
    lib = launcher.Library(built["lib"])
    assert (lib.abi_version, lib.schedule, lib.num_ranks) == (abi.TABLE_VERSION, "h200x4", 4)
    m = launcher.load_manifest(built["root"] / LIBRARY)
    assert [lib.num_buffers(p) for p in abi.PROGRAMS] == [len(m["buffers"][p]) for p in abi.PROGRAMS]
    assert lib.has_program("dispatch") and lib.has_program("combine")
    with pytest.raises(launcher.CudaError, match="rank 9: these kernels were compiled for 4 ranks"):
        lib.create(0, 9, 64)
    grids = {k["program"]: k["grid"] for k in m["kernels"] if k["kind"] == "main"}
    assert [lib.lib.epcc_cuda_grid(i) for i in (0, 1, 2, -1)] == [grids["dispatch"], grids["combine"], -1, -1]
    # the metadata library's zero_partials refuses a grid it does not launch (no GPU needed)
    meta_lib = lib.lib
    meta.bind(meta_lib)  # the runtime's signatures (and its ABI check)
    for blocks in (0, 265):
        assert meta_lib.epcc_table_meta_zero(0, 0, 0, blocks) == 1
        assert meta_lib.epcc_table_meta_error().decode() == f"zero_partials: {blocks} blocks (1 to 264)"
    # the timeline calls refuse a missing context with their own message (no GPU needed)
    # the combine writes the bf16 tokens in its kernel (combine_output): the count ahead of it has its entry
    assert m["combine_output"]["convert"] == "in-kernel" and lib.has_combine_prepare
    for call, args, text in (("epcc_cuda_enable_timeline", (None, 0), "epcc_cuda_enable_timeline: NULL context"),
                             ("epcc_cuda_read_timeline", (None, 0, None, 0), "epcc_cuda_read_timeline: NULL argument"),
                             ("epcc_cuda_combine_prepare", (None, 0), "epcc_cuda_combine_prepare: NULL context")):
        assert getattr(lib.lib, call)(*args) != 0
        assert lib.lib.epcc_cuda_last_error(None).decode() == f"epcc cuda (h200x4): {text}"
    try:
        ctx = lib.create(0, 0, 64, 5.0)
    except launcher.CudaError as e:  # no GPU, or no driver: the launcher says which CUDA call failed
        assert e.rc == 1 and re.search(r"cuda\w+\(.*\) failed: .*\(cuda\w+\)", str(e)), str(e)
    else:  # pragma: no cover - only on a GPU machine
        with ctx:
            with pytest.raises(launcher.CudaError, match="upload_tables first"):
                ctx.set_flag_areas([ctx.flag_area] * 4)
                ctx.launch_dispatch()
            with pytest.raises(launcher.CudaError, match=r"\(h200x4\): combine_prepare: upload the combine's tables "
                                                         r"first$"):
                ctx.combine_prepare()


# --------------------------------------------------------------------------------------------
# tables: round trip, errors, and the emulator against the oracle

def small_case(name: str, tokens: int, chunk_tokens: int, hidden: int = 128, seed: int = 0):
    """The plan of `name` with a small hidden size and chunks of `chunk_tokens` tokens (so that
    copies have several chunks and chunk-level waits), its layout and payloads."""
    plan = copy.deepcopy(plan_of(name))
    plan.workload.hidden = hidden
    bpt = codegen.wire_row_bytes(plan)
    plan.bytes_per_token = bpt
    for s in plan.steps:
        if s.chunk_bytes:
            s.chunk_bytes = chunk_tokens * (bpt if s.program == "dispatch" else 2 * hidden)
    wl, R = plan.workload, plan.num_ranks
    idx = inputs.make_topk("uniform", R, tokens, wl.topk, wl.experts, wl.placement, seed=seed).topk_idx
    w = inputs.make_weights(idx, seed=seed + 1)
    layout = compute_layout(plan, idx, w)
    x = inputs.make_x_rows(R, tokens, hidden, wl.dtype, seed=seed + 2)
    return plan, layout, idx, w, x


def run_both(plan, layout, idx, w, x, manifest, blobs=None):
    wl, R = plan.workload, plan.num_ranks
    want = oracle.dispatch_oracle(idx, wl.experts, wl.placement, x, w)
    d = emulate(manifest, layout, "dispatch", list(x), blobs)
    for r in range(R):
        assert np.array_equal(d[("output", r)], want[r].rows), f"dispatch, rank {r}"
    y = inputs.make_expert_outputs([len(want[r].rows) for r in range(R)], wl.hidden, seed=9)
    c = emulate(manifest, layout, "combine", y)
    got = np.stack([c[("result", r)] for r in range(R)])
    ref, mag = oracle.combine_oracle(idx, wl.experts, wl.placement, w, y, wl.hidden, return_abs=True)
    chk = oracle.compare_combine(got, ref, mag, wl.topk, partial_rounding=tables.partial_rounding(manifest))
    assert chk.ok, chk
    return got, ref, mag


CASES = [("h200x4", 48, 5), ("h200x4_2vnode", 32, 3), ("nvl8_hybrid", 16, 2), ("ubbv2_ep16", 12, 3),
         ("dgx_h800_2node", 8, 2), ("ocs_ep16", 8, 2), ("ubbv2_ep32", 4, 1)]


@pytest.mark.parametrize("name,tokens,chunk", CASES)
def test_tables_reproduce_the_oracle_in_the_emulator(name, tokens, chunk):
    plan, layout, idx, w, x = small_case(name, tokens, chunk)
    assert any(len(c.chunk_starts) > 2 for c in layout.copies), "the case should have multi-chunk copies"
    # rdma="auto": RDMA emulated by SM roles up to 8 ranks; above, the emulator's proxy stand-in
    run_both(plan, layout, idx, w, x, codegen.generate(plan, source_of(name)).manifest)


def test_supa_dma_lanes_reproduce_the_oracle_in_the_emulator():
    """The SUPA target puts ubbv2_ep16's D2D dispatch steps on the DMA engine (one in-order lane per
    role instead of blocks round-robin): the same tables, run that way, still give the oracle's rows."""
    plan, layout, idx, w, x = small_case("ubbv2_ep16", 12, 3)
    m = codegen.generate(plan, source_of("ubbv2_ep16"), target=SUPA).manifest
    lanes = [r["step"] for k in m["kernels"] for r in k["roles"] if r["lowered"] == "dma-engine"]
    assert lanes == ["d2d_near", "d2d_far"]
    run_both(plan, layout, idx, w, x, m)


@pytest.mark.parametrize("name,tokens,chunk", [("h200x4_2vnode", 16, 3), ("dgx_h800_2node", 8, 2)])
@pytest.mark.parametrize("rdma", ["emulate", "external", "proxy"])
def test_every_rdma_lowering_reproduces_the_oracle(name, tokens, chunk, rdma):
    plan, layout, idx, w, x = small_case(name, tokens, chunk)
    run_both(plan, layout, idx, w, x, codegen.generate(plan, source_of(name), codegen.CudaOptions(rdma=rdma)).manifest)


def test_tables_round_trip_and_section_layout():
    plan, layout, *_ = small_case("ubbv2_ep16", 12, 3)
    m = codegen.generate(plan, source_of("ubbv2_ep16")).manifest
    for program in abi.PROGRAMS:
        t = tables.build_tables(m, layout, program, 5)
        p = tables.parse_tables(t.blob)
        h = p["header"]
        assert int(h["total_bytes"]) == t.nbytes and t.nbytes % abi.ALIGN == 0
        assert [int(h[f"off_{s}"]) % abi.ALIGN for s in ("roles", "copies", "items", "waits", "rows")] == [0] * 5
        kernel = next(k for k in m["kernels"] if k["program"] == program and k["kind"] == "main")
        assert [int(r["step_crc"]) for r in p["roles"]] == [abi.step_crc(r["step"]) for r in kernel["roles"]]
        mine = [c for c in layout.copies if c.program == program and c.rank == 5]
        assert int(h["num_copies"]) == len(mine)
        assert int(h["num_items"]) == sum(len(c.chunk_starts) - 1 for c in mine)
        names = [b["name"] for b in m["buffers"][program]]
        by_key = {(c.step, c.flow_index): c for c in mine}
        step_of_copy = [r["step"] for r, rd in zip(kernel["roles"], p["roles"]) for _ in range(int(rd["num_copies"]))]
        assert len(step_of_copy) == len(p["copies"])
        for i, cd in enumerate(p["copies"]):
            c = by_key[(step_of_copy[i], int(cd["flow_index"]))]
            bufs, slots, dst, wts = tables.copy_rows(p, i)
            assert [names[b] for b in bufs] == list(c.src_buffers)
            assert np.array_equal(slots, c.src_slots) and np.array_equal(dst, c.dst_slots)
            assert (wts is None) == (c.weights is None) or not len(c.src_slots)
            # items of a copy: chunk order, contiguous rows, waits as in the layout
            its = [it for it in p["items"] if int(it["copy"]) == i]
            assert [int(it["chunk"]) for it in its] == list(range(len(c.chunk_starts) - 1))
            for it in its:
                ch = int(it["chunk"])
                assert (int(it["row_begin"]), int(it["row_end"])) == (c.chunk_starts[ch], c.chunk_starts[ch + 1])
                ws = p["waits"][int(it["wait_begin"]): int(it["wait_begin"]) + int(it["wait_count"])]
                assert [(int(x["flag_id"]), int(x["value"])) for x in ws] == [tuple(v) for v in c.waits[ch]]
                assert all(int(x["flag_rank"]) == layout.flags[int(x["flag_id"])].rank for x in ws)
        if program == "combine":
            zero = dict(t.zero)
            assert zero["result"] == layout.tokens * 4 * layout.hidden
            assert set(zero) <= {b["name"] for b in m["buffers"]["combine"] if b["rows"] == "f32"}
        sizes = tables.buffer_sizes(m, layout, program, 5)
        assert len(sizes) == len(names) and all(s >= 0 for s in sizes)


def test_item_order_interleaves_copies_and_keeps_each_copys_chunks_in_order():
    order = tables.item_order([4, 2, 1])
    assert sorted(order) == sorted((c, k) for c, n in enumerate([4, 2, 1]) for k in range(n))
    for c in range(3):
        chunks = [k for cc, k in order if cc == c]
        assert chunks == sorted(chunks)
    # by progress through each copy: (chunk + 0.5) / chunks
    assert order == [(0, 0), (1, 0), (0, 1), (2, 0), (0, 2), (1, 1), (0, 3)]


def test_the_emulator_notices_missing_waits():
    # ubbv2_ep16 forwards tokens over up to three hops: without the waits, a chunk reads a
    # staging row before its producer wrote it, and the output is wrong.
    plan, layout, idx, w, x = small_case("ubbv2_ep16", 12, 3)
    m = codegen.generate(plan, source_of("ubbv2_ep16")).manifest
    blobs = []
    for r in range(plan.num_ranks):
        blob = tables.build_tables(m, layout, "dispatch", r).blob.copy()
        p = tables.parse_tables(blob)
        items = p["items"].copy()
        items["wait_count"] = 0
        off = int(p["header"]["off_items"])
        blob[off: off + items.nbytes] = np.frombuffer(items.tobytes(), dtype=np.uint8)
        blobs.append(blob)
    with pytest.raises(AssertionError, match="dispatch, rank"):
        run_both(plan, layout, idx, w, x, m, blobs)


def test_build_tables_rejects_layouts_of_other_plans():
    plan, layout, *_ = small_case("h200x4", 8, 2)
    m = codegen.generate(plan, source_of("h200x4")).manifest
    with pytest.raises(tables.TableError, match="the layout has 4 ranks, the kernels were compiled for 8"):
        tables.build_tables({**m, "num_ranks": 8}, layout, "dispatch", 0)
    with pytest.raises(tables.TableError, match="rank 4 is not in"):
        tables.build_tables(m, layout, "dispatch", 4)
    bad = json.loads(json.dumps(m))
    bad["buffers"]["dispatch"] = [b for b in bad["buffers"]["dispatch"] if b["name"] != "output"]
    with pytest.raises(tables.TableError, match="buffer 'output' is not one the kernels were compiled for"):
        tables.build_tables(bad, layout, "dispatch", 0)
    other = codegen.generate(plan_of("h200x4_2vnode"), source_of("h200x4_2vnode")).manifest
    with pytest.raises(tables.TableError, match="which the kernels do not know"):
        tables.build_tables(other, layout, "dispatch", 0)


def test_emulator_reports_a_deadlock():
    plan, layout, idx, w, x = small_case("h200x4_2vnode", 8, 2)
    m = codegen.generate(plan, source_of("h200x4_2vnode")).manifest
    blobs = []
    for r in range(plan.num_ranks):
        blob = tables.build_tables(m, layout, "dispatch", r).blob.copy()
        p = tables.parse_tables(blob)
        waits = p["waits"].copy()
        waits["value"] += 1000  # never reached
        off = int(p["header"]["off_waits"])
        blob[off: off + waits.nbytes] = np.frombuffer(waits.tobytes(), dtype=np.uint8)
        blobs.append(blob)
    assert any(len(tables.parse_tables(b)["waits"]) for b in blobs)
    with pytest.raises(EmulationError, match="deadlock"):
        emulate(m, layout, "dispatch", list(x), blobs)


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_says_why_a_plan_gets_no_direct_lowering(tmp_path, capsys):
    """fp8 with a hidden size that is a multiple of 128 but not of 512 compiles, to the
    table-driven kernels; the user is told so and why, not left to find it in the manifest."""
    src = tmp_path / "h7296.sched"
    src.write_text((REPO / "schedules" / "h200x4.sched").read_text().replace("hidden 7168", "hidden 7296"))
    assert main(["compile", str(src), "--target", "cuda", "--dtype", "fp8", "-o", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert (f"{src}: lowering: table-driven kernels (no direct lowering: hidden 7296 is not a multiple of 512 "
            f"(16-byte bulk copies of fp8 rows and their scales))") in out


def test_cli_compile_target_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rc = main(["compile", source_of("h200x4"), "--target", "cuda", "-o", str(tmp_path / "b")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"{source_of('h200x4')}: CUDA sources in {tmp_path / 'b'}/cuda/" in out
    assert f"{source_of('h200x4')}: lowering: direct kernels (h200x4_direct.cu; the Buffer API runs them)" in out
    cuda = tmp_path / "b" / "cuda"
    files = sorted(p.name for p in cuda.iterdir() if p.is_file())
    assert files == sorted(p.name for p in (GOLDEN / "h200x4").iterdir())
    for f in files:  # the same text as the golden: paths in comments are as given on the command line
        assert (cuda / f).read_text() == (GOLDEN / "h200x4" / f).read_text(), f
    assert sorted(p.relative_to(cuda).as_posix() for p in cuda.rglob("*") if p.is_file() and p.parent != cuda) \
        == sorted([*direct.HEADERS, CUDA.prelude, codegen.META_HEADER])  # and the static headers (direct
    # kernels, prelude, the metadata kernels of the table-driven path), nothing else
    assert (tmp_path / "b" / "plan.json").is_file()
    with pytest.raises(SystemExit) as e:
        main(["compile", source_of("h200x4"), "--target", "rocm", "-o", str(tmp_path / "c")])
    assert e.value.code == 2
    assert "--target" in capsys.readouterr().err


def test_cli_compile_writes_the_rdma_proxy_sources(tmp_path, capsys, monkeypatch):
    """A plan with RDMA steps gets the host proxy loop (backends/rdma, docs/rdma.md) in cuda/rdma/,
    listed in the manifest; a plan without them gets none."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "vnode"
    assert main(["compile", source_of("h200x4_2vnode"), "--target", "cuda", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    m = json.loads((out / "cuda" / "manifest.json").read_text())
    proxy = f"rdma/{rdma_emit.proxy_file_name(plan_of('h200x4_2vnode'))}"
    assert m["rdma"][0] == proxy == "rdma/h200x4_2vnode_proxy.c"
    assert m["rdma"] == [proxy, *(f"rdma/{n}" for n in STATIC_SOURCES)]
    assert sorted(p.relative_to(out / "cuda").as_posix() for p in (out / "cuda" / "rdma").iterdir()) == sorted(m["rdma"])
    assert (out / "cuda" / proxy).read_text() == rdma_emit.proxy_source(plan_of("h200x4_2vnode"))
    assert proxy in printed
    # the same from the API, and with the RDMA left to the proxy (rdma="external")
    b = codegen.generate(plan_of("h200x4_2vnode"), source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="external"))
    assert b.manifest["rdma"] == m["rdma"]
    written = b.write(tmp_path / "api")
    assert {p.relative_to(tmp_path / "api").as_posix() for p in written} >= set(m["rdma"])

    out = tmp_path / "h200x4"
    assert main(["compile", source_of("h200x4"), "--target", "cuda", "-o", str(out)]) == 0
    m = json.loads((out / "cuda" / "manifest.json").read_text())
    assert m["rdma"] == [] and not (out / "cuda" / "rdma").exists()


@pytest.mark.parametrize("name", ALL)
def test_manifest_lists_rdma_sources_exactly_for_plans_with_rdma_steps(name):
    m = codegen.generate(plan_of(name), source_of(name)).manifest
    assert bool(m["rdma"]) == bool(rdma_steps(plan_of(name)))


def test_cli_without_target_writes_no_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["compile", source_of("h200x4"), "-o", str(tmp_path / "b")]) == 0
    assert not (tmp_path / "b" / "cuda").exists()


def test_combine_partials_cross_the_rdma_link_as_bf16():
    """h200x4_2vnode's combine `rdma` step adds bf16(partial): the emulator's result then misses
    the fp32-only bound of the oracle somewhere and meets it once the bf16 rounding is admitted
    (run_both), and only RDMA-class steps round."""
    plan, layout, idx, w, x = small_case("h200x4_2vnode", 32, 3)
    b = codegen.generate(plan)
    ops = {(k["program"], r["step"]): r["op"] for k in b.manifest["kernels"] for r in k["roles"]}
    assert ops[("combine", "rdma")] == "accum_bf16_wire"
    assert {o for (p, s), o in ops.items() if p == "combine" and s != "rdma"} <= {"accum", "accum_weighted"}
    assert tables.partial_rounding(b.manifest) == 2.0 ** -8
    assert tables.partial_rounding(codegen.generate(plan_of("h200x4")).manifest) == 0.0
    got, ref, mag = run_both(plan, layout, idx, w, x, b.manifest)
    assert not oracle.compare_combine(got, ref, mag, plan.workload.topk).ok
    assert "AccumF32Bf16Wire" in b.files[f"{plan.schedule}_combine.cu"]


def test_role_timeline_from_block_stamps():
    """role_timeline turns a launch's per-block %globaltimer stamps into role start .. end (first
    block moving rows .. last block done), in ms after the earliest block past the entry barrier."""
    b = codegen.generate(plan_of("h200x4_2vnode"))
    k = next(k for k in b.manifest["kernels"] if k["program"] == "dispatch" and k["kind"] == "main")
    st = np.zeros((k["grid"], 4), dtype=np.uint64)
    base = 10**12
    st[:, 0] = base + 1000
    st[0, 0] = base
    for r in k["roles"]:
        b0, b1 = r["blocks"]
        if r["step"] == "keep":
            continue  # its blocks had no item: stamp 1 stays 0
        st[b0:b1, 1] = base + 2_000_000 + np.arange(b1 - b0) * 1000
        st[b0:b1, 2] = base + 5_000_000 + np.arange(b1 - b0) * 1000
    st[0, 3] = base + 9_000_000
    tl = launcher.role_timeline(b.manifest, "dispatch", st)
    by = {r["step"]: r for r in tl["roles"]}
    rdma = next(r for r in k["roles"] if r["step"] == "rdma")
    assert by["rdma"]["start_ms"] == 2.0
    assert by["rdma"]["end_ms"] == pytest.approx(5.0 + (rdma["blocks"][1] - rdma["blocks"][0] - 1) * 1e-3)
    assert by["keep"]["start_ms"] is None and by["keep"]["end_ms"] is None
    assert tl["end_ms"] == 9.0
    with pytest.raises(ValueError) as e:
        launcher.role_timeline(b.manifest, "dispatch", st[:-1])
    assert str(e.value) == (f"dispatch timeline: shape ({k['grid'] - 1}, 4), the kernel has {k['grid']} blocks "
                            f"x 4 stamps")


def test_median_timeline_of_several_launches():
    def tl(start, end, kernel):
        return {"roles": [{"step": "there (unpack)", "blocks": 4, "start_ms": start, "end_ms": end},
                          {"step": "keep", "blocks": 8, "start_ms": None, "end_ms": None}], "end_ms": kernel}

    # one slow launch (the 0.61 of a single-round check on 2 x H200) does not move the median
    got = launcher.median_timeline([tl(0.07, 1.25, 2.6), tl(0.06, 1.59, 2.7), tl(0.07, 1.28, 2.5),
                                    tl(0.08, 1.34, 2.6), tl(0.07, 1.29, 2.6)])
    assert got["roles"][0] == {"step": "there (unpack)", "blocks": 4, "start_ms": 0.07, "end_ms": 1.29}
    assert got["roles"][1]["start_ms"] is None and got["end_ms"] == 2.6 and got["launches"] == 5
    with pytest.raises(ValueError) as e:
        launcher.median_timeline([])
    assert str(e.value) == "median_timeline: no launches"


def test_timeline_stamps_emitted_and_launcher_exports_them():
    b = codegen.generate(plan_of("h200x4_2vnode"))
    src = b.files["h200x4_2vnode_dispatch.cu"]
    assert "epcc::stamp(a, 0);" in src and "epcc::stamp(a, 2);" in src and "epcc::stamp(a, 3);" in src
    launcher = b.files["h200x4_2vnode_launcher.cu"]
    assert "int epcc_cuda_enable_timeline(void* ctx, int program)" in launcher
    assert "int epcc_cuda_read_timeline(void* ctx, int program, uint64_t* out, uint64_t count)" in launcher


@pytest.mark.parametrize("name,tokens,chunk", CASES[:5])
def test_uneven_token_counts_reproduce_the_oracle_in_the_emulator(name, tokens, chunk):
    """Ranks dispatch different numbers of tokens (the last none): the routing of the missing
    tokens pads with -1, `input` holds each rank's own count, and the tables still give the
    oracle's rows and sums (rows past a rank's count stay zero in its result)."""
    plan, _, idx, w, x = small_case(name, tokens, chunk)
    R = plan.num_ranks
    counts = [max(0, tokens - 1 - 3 * r) for r in range(R - 1)] + [0]
    for r, n in enumerate(counts):
        idx[r, n:] = -1
        x[r, n:] = 0xEE  # never read
    layout = compute_layout(plan, idx, w, counts)
    assert [layout.rank_tokens(r) for r in range(R)] == counts
    assert [len(layout.entries[("input", r)]) for r in range(R)] == counts
    m = codegen.generate(plan, source_of(name)).manifest
    got, _, _ = run_both(plan, layout, idx, w, x, m)
    for r, n in enumerate(counts):
        assert not got[r, n:].any(), f"rank {r}: result rows past its {n} tokens"
        header = tables.parse_tables(tables.build_tables(m, layout, "combine", r).blob)["header"]
        assert int(header["tokens"]) == n
