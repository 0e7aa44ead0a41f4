"""The SUPA target (backends/supa, backends/target.py): the table-driven kernels as `.su` sources.

No Biren machine and no brcc here.  What runs:

* codegen for the Biren schedules and the EP4 plans: every role's code path cites its step, title
  and DSL line, the manifest (format epcc-supa-manifest) passes its checker, the brcc steps name
  every source, and what only CUDA can do is refused (the GPU proxy path);
* the name check (backends/supa/names.py): the emitted sources use no CUDA name, no raw SUPA
  runtime name, only the epcc_rt_* names epcc_supa_api.h declares; the SUPA headers use only
  names docs/supa.md lists with their sources; and the check catches each kind of leak;
* nvcc through the SUPA-on-CUDA shim (epcc_supa_shim.cuh): every emitted file of every plan,
  in both runtime generations (su* with -DEPCC_SUPA_API_V1, supa* without), built into the
  library with the manifest's shim command (skipped when nvcc is missing);
* the launcher honours the plan's engine choice and duplicate pairs: a dispatch step the plan puts on
  the DMA engine is no block of the kernel but a copy lane of the launcher (stream-ordered copies
  between gate kernels on the same counters), and a duplicate pair has one launch call per card;
* `epcc compile FILE --target supa -o DIR`: the bundle's supa/ directory and its manifest.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from epcc import pipeline
from epcc.backends.cuda import codegen
from epcc.backends.supa import build, names
from epcc.backends.target import SUPA
from epcc.cli import main
from epcc.plan import bundle as bundle_io
from epcc.plan.cuda_manifest import check_supa_manifest
from epcc.plan.schema import SchemaError
from epcc.runtime import build_cache
from epcc.runtime.engines.cuda_table import launcher

REPO = Path(__file__).resolve().parents[2]
#: every shipped Biren schedule and the EP4 plans: all compiled through the shim
SCHEDULES = ["ubbv2_card", "ubbv2_ep16", "ubbv2_ep32", "ubbv2_ep32_port10", "ocs_ep16", "h200x4", "h200x4_2vnode",
             "h200x4_ubb2x2"]
NVCC = build_cache.find_nvcc()


def source_of(name: str) -> str:
    return f"schedules/{name}.sched"


_BUNDLES: dict[str, codegen.CudaBundle] = {}


def supa_bundle(name: str) -> codegen.CudaBundle:
    if name not in _BUNDLES:
        plan = pipeline.run(str(REPO / source_of(name))).passes.get("plan")
        _BUNDLES[name] = codegen.generate(plan, source_of(name), target=SUPA)
    return _BUNDLES[name]


def static_text(name: str) -> str:
    return (build.INCLUDE_DIR / name).read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# codegen


@pytest.mark.parametrize("name", SCHEDULES)
def test_sources_cite_each_roles_step_and_line(name):
    b = supa_bundle(name)
    plan = b.plan
    assert set(b.files) >= {SUPA.device_header, f"{name}_launcher.su", "manifest.json"}
    for k in b.kernels:
        assert k.file == f"{name}_{k.program}.su"
        text = b.files[k.file]
        for r in k.roles:
            step = plan.step(r.step, k.program)
            title = f" ({step.title})" if step.title else ""
            line = f"// step '{r.step}'{title}, {source_of(name)}:{step.line}"
            assert text.count(line) == 2 * sum(1 for x in k.roles if x.step == r.step), (k.file, line)
        assert k.block == SUPA.warp_size * max(r.warps for r in k.roles) <= SUPA.max_block_threads
        assert f'#include "{SUPA.device_header}"' in text and f'#include "{build.API_HEADER}"' in text


@pytest.mark.parametrize("name", SCHEDULES)
def test_manifest_is_a_supa_manifest_with_brcc_and_shim_commands(name):
    b = supa_bundle(name)
    m = json.loads(b.files["manifest.json"])
    assert (m["format"], m["version"]) == ("epcc-supa-manifest", 1)
    check_supa_manifest(m)
    assert m["lowering"] == "tables" and "direct" not in m
    assert all(k["launch"] == "plain" for k in m["kernels"])
    assert m["machine"]["warp_size"] == SUPA.warp_size and m["machine"]["kernel_writes_host_memory"] is False
    bd = m["build"]
    assert set(bd["sources"]) == {f for f in b.files if f.endswith(".su")}
    assert set(bd["headers"]) == {SUPA.device_header, *build.HEADERS} | (
        {codegen.META_HEADER} if m["metadata"]["lowering"] == "device" else set())
    for gen, g in bd["brcc"].items():
        compiled = [s[s.index("-c") + 1] for s in g["steps"][:-1]]
        assert compiled == bd["sources"], gen
        assert g["steps"][-1][:2] == ["brcc", "--supa-link"] and bd["library"] in g["steps"][-1]
    assert bd["shim"]["command"][0] == "nvcc" and "-DEPCC_SUPA_SHIM" in bd["shim"]["command"]
    assert bd["shim"]["command"][-len(bd["sources"]):] == bd["sources"]
    broken = json.loads(b.files["manifest.json"])
    broken["lowering"] = "direct"
    with pytest.raises(SchemaError, match="table-driven kernels only"):
        check_supa_manifest(broken)


def test_the_gpu_proxy_path_is_refused_for_supa():
    plan = pipeline.run(str(REPO / source_of("h200x4_2vnode"))).passes.get("plan")
    with pytest.raises(codegen.CudaCodegenError, match="SUPA kernels may not write"):
        codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="proxy"), target=SUPA)


def test_a_one_hop_plan_gets_the_table_kernels_and_says_why():
    m = supa_bundle("h200x4").manifest
    assert m["lowering"] == "tables" and "written for CUDA only" in m["direct_not_used"]


# --------------------------------------------------------------------------------------------
# names


def emitted_sources(b: codegen.CudaBundle) -> dict[str, str]:
    files = {n: t for n, t in b.files.items() if n.endswith((".su", ".suh"))}
    if codegen.META_HEADER in b.static:
        files[codegen.META_HEADER] = b.static[codegen.META_HEADER].read_text(encoding="utf-8")
    return files


@pytest.mark.parametrize("name", SCHEDULES)
def test_emitted_sources_name_only_epccs_supa_headers(name):
    problems = names.check_sources(emitted_sources(supa_bundle(name)), static_text(build.API_HEADER),
                                   static_text(build.PRELUDE))
    assert problems == []


@pytest.mark.parametrize("line,kind", [
    ("  cudaMalloc(&p, 8);", "CUDA name or construct 'cudaMalloc'"),
    ("  const uint32_t t = threadIdx.x;", "CUDA name or construct 'threadIdx'"),
    ("  v = __ldg(p);", "CUDA name or construct '__ldg'"),
    ('  asm volatile("trap;");', "CUDA name or construct 'asm'"),
    ("  k<<<1, 32>>>(x);", "a <<<...>>> launch"),
    ("  suMallocDevice(&p, 8);", "SUPA runtime name 'suMallocDevice' used directly"),
    ("  epcc_rt_prefetch(p);", "'epcc_rt_prefetch' is not declared by epcc_supa_api.h"),
    ("  x = EPCC_LANE;", "macro 'EPCC_LANE' is defined by no SUPA header"),
])
def test_the_name_check_catches_each_leak(line, kind):
    b = supa_bundle("h200x4_2vnode")
    files = emitted_sources(b)
    launcher = "h200x4_2vnode_launcher.su"
    text = files[launcher].replace("namespace {\n", "namespace {\n" + line + "\n", 1)
    problems = names.check_sources({**files, launcher: text}, static_text(build.API_HEADER),
                                   static_text(build.PRELUDE))
    at = text[:text.index(line)].count("\n") + 1
    assert any(p.startswith(f"{launcher}:{at}:") and kind in p for p in problems), problems
    # the same text in a comment or a string is not a use
    quiet = files[launcher].replace("namespace {\n", f"namespace {{\n// {line}\nconst char* s = {json.dumps(line)};\n", 1)
    assert names.check_sources({**files, launcher: quiet}, static_text(build.API_HEADER),
                               static_text(build.PRELUDE)) == []


def test_supa_headers_use_only_surveyed_names():
    surveyed = names.surveyed_names((REPO / "docs" / "supa.md").read_text(encoding="utf-8"))
    headers = {n: static_text(n) for n in (build.PRELUDE, build.API_HEADER)}
    assert names.check_headers(headers, surveyed) == []
    used = set()
    for t in headers.values():
        used.update(re.findall(r"\b(?:su[A-Z]\w*|supa[A-Z]\w*|supa::\w+)", names.blank(t)))
    assert {"suMallocDevice", "suMemcpyAsync", "supaMalloc", "supaMemcpyAsync", "suLaunchKernel",
            "supaLaunchKernel"} <= used
    # every name the headers use is one the shim defines (so nvcc checks its use against the signature)
    shim = names.blank(static_text(build.SHIM_HEADER))
    assert sorted(n for n in used if not re.search(rf"\b{re.escape(n.split('::')[-1])}\b", shim)) == []
    bad = names.check_headers({"x.h": "cudaStream_t s; suMagic(1);"}, surveyed)
    assert any("CUDA name 'cudaStream_t'" in p for p in bad) and any("'suMagic' is not in" in p for p in bad)


# --------------------------------------------------------------------------------------------
# nvcc through the shim


@pytest.fixture(scope="module")
def shim_built(tmp_path_factory):
    """Every plan's bundle written and its library built through the shim: with the supa* runtime
    names by the runtime's own builder (launcher.build_shim_library: the manifest's shim command,
    into a fresh $EPCC_CACHE), and with the su* ones (-DEPCC_SUPA_API_V1 added); in parallel."""
    if NVCC is None:
        pytest.skip("nvcc not found (PATH, $NVCC, /usr/local/cuda*/bin): the SUPA sources are not compiled")
    root = tmp_path_factory.mktemp("supa")
    jobs = []
    for name in SCHEDULES:
        d = root / name
        b = supa_bundle(name)
        b.write(d)
        cmd = list(b.manifest["build"]["shim"]["command"])
        assert b.manifest["build"]["shim"]["api"] == "supa"
        jobs.append((name, "supa", d, b.manifest))
        full = [NVCC, *cmd[1:cmd.index("-shared")], *build.SHIM_API_FLAGS["su"], *cmd[cmd.index("-shared"):]]
        full[full.index("-o") + 1] = "lib_su.so"
        jobs.append((name, "su", d, full))

    def run(job):
        name, api, d, what = job
        if api == "su":
            r = subprocess.run(what, cwd=d, capture_output=True, text=True)
            return (name, api), (r.returncode, r.stdout + r.stderr, d / "lib_su.so")
        log: list[str] = []
        try:
            lib = launcher.build_shim_library(d, what, nvcc=NVCC, log=log)
            return (name, api), (0, "".join(log), lib)
        except RuntimeError as e:
            return (name, api), (1, "".join(log) + str(e), None)

    saved = os.environ.get("EPCC_CACHE")
    os.environ["EPCC_CACHE"] = str(root / "cache")  # never a cached library: nvcc runs
    try:
        with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as ex:
            return {"root": root, "results": dict(ex.map(run, jobs))}
    finally:
        if saved is None:
            os.environ.pop("EPCC_CACHE", None)
        else:
            os.environ["EPCC_CACHE"] = saved


@pytest.mark.parametrize("api", list(build.SHIM_API_FLAGS))
@pytest.mark.parametrize("name", SCHEDULES)
def test_nvcc_compiles_every_supa_source_through_the_shim(shim_built, name, api):
    rc, out, lib = shim_built["results"][(name, api)]
    assert rc == 0, out
    assert lib.is_file()


@pytest.mark.parametrize("api", list(build.SHIM_API_FLAGS))
def test_shim_library_loads_with_the_supa_prefix_and_fails_cleanly_without_a_gpu(shim_built, api):
    """The SUPA launcher's C ABI is the CUDA launcher's under epcc_supa_: the runtime's Library
    drives it unchanged; its refusals carry the SUPA target's prefix."""
    rc, out, path = shim_built["results"][("h200x4_2vnode", api)]
    assert rc == 0, out
    lib = launcher.Library(path, SUPA.abi_prefix)
    assert (lib.abi_version, lib.schedule, lib.num_ranks) == (codegen.abi.TABLE_VERSION, "h200x4_2vnode", 4)
    assert lib.has_program("dispatch") and lib.has_program("combine")
    with pytest.raises(launcher.CudaError, match=r"^epcc supa \(h200x4_2vnode\): rank 9: these kernels were compiled "
                                                 r"for 4 ranks"):
        lib.create(0, 9, 64)
    m = supa_bundle("h200x4_2vnode").manifest
    grids = {k["program"]: k["grid"] for k in m["kernels"] if k["kind"] == "main"}
    assert [lib.lib.epcc_cuda_grid(i) for i in (0, 1, 2)] == [grids["dispatch"], grids["combine"], -1]
    assert lib.lib.epcc_table_meta_area is not None  # the metadata driver is in the same library


# --------------------------------------------------------------------------------------------
# the plan's engine choice and duplicate pairs in the launcher


def card_dma_bundle(tmp_path: Path) -> codegen.CudaBundle:
    """ubbv2_card with its D2D link driven by the DMA engine (as tests/gpu/bundles.py derives it)."""
    text = (REPO / source_of("ubbv2_card")).read_text(encoding="utf-8")
    link = text.index("link d2d d2d {")
    at = text.index("engine spc", link)
    src = tmp_path / "ubbv2_card_dma.sched"
    src.write_text(text[:at] + "engine dma" + text[at + len("engine spc"):], encoding="utf-8")
    plan = pipeline.run(str(src)).passes.get("plan")
    return codegen.generate(plan, "ubbv2_card_dma.sched", target=SUPA)


def _function(text: str, signature: str) -> str:
    """The body of the C function whose definition starts with `signature` (to its closing brace)."""
    at = text.index(signature)
    end = text.index("\n}\n", at)
    return text[at:end]


@pytest.mark.parametrize("name", ["ubbv2_ep16", "card_dma"])
def test_dma_engine_steps_are_the_launchers_copy_lanes(name, tmp_path):
    b = card_dma_bundle(tmp_path) if name == "card_dma" else supa_bundle(name)
    plan = b.plan
    m = b.manifest
    sched = codegen.ident(plan.schedule)
    dma_steps = {r.step for k in plan.kernels if k.kind == "dma" for r in k.roles}
    assert dma_steps
    for k in m["kernels"]:
        if k["kind"] != "main":
            continue
        for r in k["roles"]:
            if r["step"] not in dma_steps:
                assert r["lowered"] != "dma-engine"
                continue
            # dispatch copies rows: the DMA engine; combine adds partials: stays on the compute units
            want = "dma-engine" if k["program"] == "dispatch" else "dma-on-sm"
            assert r["lowered"] == want, (k["program"], r)
            if want == "dma-engine":
                assert r["blocks"] == [k["grid"], k["grid"]] and r["sms"] == 0
    disp = next(k for k in m["kernels"] if k["kind"] == "main" and k["program"] == "dispatch")
    lanes = [r["index"] for r in disp["roles"] if r["lowered"] == "dma-engine"]
    assert disp["dma_lanes"]["roles"] == lanes and disp["dma_lanes"]["gate"] == f"epcc_{sched}_dispatch_dma_gate"
    assert m["metadata"]["lowering"] == "host"
    if name == "card_dma":  # the plan's tables could come from the GPU but for the DMA lanes
        assert "DMA engine" in m["metadata"]["why"]
    # the kernel: no block branch for a DMA role, the gate kernel names each lane's step
    kern = b.files[f"{plan.schedule}_dispatch.su"]
    main_body = _function(kern, f'extern "C" __global__ void __launch_bounds__({disp["block"]}, 1) {disp["name"]}(')
    for r in disp["roles"]:
        assert (r["function"] in main_body) == (r["lowered"] != "dma-engine"), r
    gate = _function(kern, f"static __device__ const char* epcc_{sched}_dispatch_dma_gate_step(")
    assert all(f"case {i}u:" in gate for i in lanes)
    assert f"epcc::dma_gate(a, role, epcc_{sched}_dispatch_dma_gate_step(role), done, next, entry);" in kern
    # the launcher: the lanes' roles, the copies between gates on each lane's stream, fork and join
    launcher_text = b.files[f"{plan.schedule}_launcher.su"]
    assert "constexpr uint32_t kDispatchDmaRoles[] = {" + ", ".join(f"{i}u" for i in lanes) + "};" in launcher_text
    run = _function(launcher_text, "int run_lanes(")
    assert run.index("info.gate(&a, lane.role, done, k, k == 0 ? 1u : 0u, lane.stream)") < \
        run.index("epcc_rt_memcpy_async(") < run.index("info.gate(&a, lane.role, done, kNoItem, 0u, lane.stream)")
    assert "epcc_rt_stream_wait_event(stream, lane.done)" in run
    fork = _function(launcher_text, "int fork_lanes(")
    assert "epcc_rt_stream_create_nonblocking(&lane.stream)" in fork and \
        "epcc_rt_stream_wait_event(lane.stream, p.fork)" in fork
    launch = _function(launcher_text, "int launch_main(")
    assert launch.index("fork_lanes(c, program, stream)") < launch.index("info.launch(&a, stream)") < \
        launch.index("run_lanes(c, program, a, stream)")
    assert "return fail(c, EPCC_RC_USAGE, \"%s: %u steps run on the DMA engine" in launcher_text  # use_tables refuses
    # the gate is loaded when the context is created (a lazy load behind the running kernel deadlocks)
    create = _function(launcher_text, "int epcc_supa_create(")
    assert "kPrograms[p].gate(&none, epcc::kNoRole, kNoItem, kNoItem, 0u, nullptr)" in create
    # the device side of the gate: the entry barrier, publication in chunk order, the producers' waits
    dev = b.files[SUPA.device_header]
    gate_fn = _function(dev, "__device__ __forceinline__ void dma_gate(")
    assert gate_fn.index("barrier_word(a, a.rank)") < gate_fn.index("red_release_sys_add(flag, 1)") < \
        gate_fn.index("waits[it.wait_begin + j]")
    assert names.check_sources(emitted_sources(b), static_text(build.API_HEADER), static_text(build.PRELUDE)) == []


def test_a_plan_without_dma_steps_has_no_lanes():
    b = supa_bundle("ubbv2_card")
    assert all(r["lowered"] == "sm" for k in b.manifest["kernels"] for r in k["roles"])
    assert not any("dma_lanes" in k for k in b.manifest["kernels"])
    assert "DmaRoles" not in b.files["ubbv2_card_launcher.su"]
    assert "dma_gate" not in b.files["ubbv2_card_dispatch.su"]


@pytest.mark.parametrize("name", ["ubbv2_card", "ubbv2_ep16", "ubbv2_ep32_port10", "ocs_ep16"])
def test_duplicate_pairs_are_one_launch_call_per_card(name):
    b = supa_bundle(name)
    plan = b.plan
    pairs = [list(p) for p in plan.launch.duplicate]
    assert b.manifest["duplicate"]["pairs"] == pairs and b.manifest["duplicate"]["why"] == plan.launch.why
    twin, die = [-1] * plan.num_ranks, [-1] * plan.num_ranks
    for d0, d1 in pairs:
        twin[d0], twin[d1], die[d0], die[d1] = d1, d0, 0, 1
    text = b.files[f"{plan.schedule}_launcher.su"]
    assert "constexpr int32_t kTwin[kNumRanks] = {" + ", ".join(map(str, twin)) + "};" in text
    assert "constexpr int32_t kDie[kNumRanks] = {" + ", ".join(map(str, die)) + "};" in text
    card = _function(text, "static int launch_card(")
    # both dies' arguments first, then one call that queues the kernel on both dies
    assert card.index("launch_main(c0, program, s0, &a0)") < card.index("launch_main(c1, program, s1, &a1)") < \
        card.index("kPrograms[program].launch_dies(c0->device, s0, &a0, c1->device, s1, &a1)")
    assert card.count("launch_dies(") == 1 and "info.launch(" not in card
    assert "launch_card(c0, c1, 0," in _function(text, "int epcc_supa_launch_dispatch_card(")
    assert "launch_card(c0, c1, 1, s0, s1)" in _function(text, "int epcc_supa_launch_combine_card(")
    assert "kDie[c0->rank] != 0 || kTwin[c0->rank] != static_cast<int32_t>(c1->rank)" in \
        _function(text, "static int check_card(")
    for program in ("dispatch", "combine"):
        kern = b.files[f"{plan.schedule}_{program}.su"]
        assert (f"return epcc_rt_launch_dies(epcc_{codegen.ident(plan.schedule)}_{program}_kernel, " in kern)
    if name == "ubbv2_card":
        assert pairs == [[0, 1]]
    if name in ("ubbv2_ep32_port10", "ocs_ep16"):
        assert pairs == [] and b.manifest["duplicate"]["why"]


def test_the_duplicate_launch_is_one_isolated_hook_the_shim_implements():
    """epcc_rt_launch_dies goes through EPCC_SUPA_LAUNCH_DIES where it is defined (the shim: each die
    a GPU), else one launch per die through the verified launch; nothing else names the hook."""
    api = names.blank(static_text(build.API_HEADER))
    body = _function(api, "static inline epcc_rt_status_t epcc_rt_launch_dies(")
    assert "#if defined(EPCC_SUPA_LAUNCH_DIES)" in body and body.count("epcc_rt_launch(kernel,") == 2
    assert api.count("EPCC_SUPA_LAUNCH_DIES") == 2
    shim = names.blank(static_text(build.SHIM_HEADER))
    assert "#define EPCC_SUPA_LAUNCH_DIES epcc_shim_launch_dies" in shim
    assert "suLaunchKernel2DieDup" not in api  # documented only for dies that exchange no data (docs/supa.md)


# --------------------------------------------------------------------------------------------
# the CLI


def test_cli_compile_target_supa(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "b"
    rc = main(["compile", source_of("ubbv2_ep32"), "--target", "supa", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert f"{source_of('ubbv2_ep32')}: SUPA sources in {out}/supa/" in text
    supa = out / "supa"
    assert sorted(p.name for p in supa.glob("*.su")) == ["ubbv2_ep32_combine.su", "ubbv2_ep32_dispatch.su",
                                                         "ubbv2_ep32_launcher.su"]
    for h in build.HEADERS:
        assert (supa / h).read_bytes() == (build.INCLUDE_DIR / h).read_bytes(), h
    m = bundle_io.supa_manifest(out)
    assert m["rdma"] and all((supa / f).is_file() for f in m["rdma"])  # the RDMA post loop, as for CUDA
    assert not (out / "cuda").exists()
    with pytest.raises(bundle_io.BundleError, match="no cuda/manifest.json"):
        bundle_io.cuda_manifest(out)
    plain = tmp_path / "plain"
    assert main(["compile", source_of("ubbv2_ep16"), "--target", "none", "-o", str(plain)]) == 0
    with pytest.raises(bundle_io.BundleError, match=r"no supa/manifest.json; write the bundle with `epcc compile FILE "
                                                    r"--target supa"):
        bundle_io.supa_manifest(plain)
    rc = main(["compile", source_of("h200x4_2vnode"), "--target", "supa", "--rdma", "proxy", "-o",
               str(tmp_path / "p")])
    assert rc == 1 and "--target supa: rdma 'proxy'" in capsys.readouterr().err
