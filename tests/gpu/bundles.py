"""The bundles the GPU tests and bench/ep_bench.py run, compiled on a CPU machine (MLIR is not on
the GPU machine) into one directory that travels with the tree:

    .venv/bin/python tests/gpu/bundles.py .gpu/bundles

h200x4 (EP4, 4096 tokens, bf16), h200x4_fp8 (--dtype fp8), h200x4_t128 (128 tokens: decode /
low-latency shape), and the same one-hop schedule on two GPUs (h200x2, h200x2_fp8, h200x2_t128):
h200x4.sched with `gpu 4` replaced by `gpu 2`, written next to the bundles.  The same six with
`--layout token` (h200x4_tok, h200x4_tok_fp8, h200x4_tok_t128, h200x2_tok, ...): DeepEP's
token-major output, from the direct kernels of epcc/direct/token.cuh.

Emulated-RDMA bundles (the GPU proxy path; bench/ep_bench.py --methods epcc): the two 2-virtual-node plans
on 4 GPUs, h200x4_2vnode (DeepEP internode style: RDMA once per vnode, then NVLink forward) and
h200x4_ubb2x2 (seed 000 style: reorder, NIC, hand-over to the twin, final permute), each with its
RDMA-class link at 50 GB/s (the shipped files), at 13 GB/s (the seed's RoCE NIC) and at
400 GB/s (so that the rest of the schedule shows what it takes by itself); the link's `bandwidth`
line is replaced and the derived file written next to the bundles.  Every bundle gets
`simulate.json` (`epcc simulate --json` of the same file and options), which ep_bench prints
beside the measured times.  On two GPUs: h200x2_2vnode (one RDMA step per program),
h200x2_2vnode_relay (two, over one link) and h200x2_2vnode_mixed (two, over links of 50 and
25 GB/s).  Each also as `NAME_proxy` (`--rdma proxy --proxy-tables host`: the RDMA steps through the
GPU proxy path, tables laid out on the host per routing, as the bench's proxy timings were taken),
and h200x2_2vnode_50 and h200x4_2vnode_50 as `NAME_proxy_dev` (the proxy path with its tables
written on the GPU, `--rdma proxy`'s default: tests/gpu/proxy_worker.py).  h200x2_2vnode_50 also as
`h200x2_2vnode_50_collective` (`--metadata-exchange collective`: the metadata kernels' routing
all-gathered by the process group, the exchange of plans beyond one box, on one box of 2 GPUs),
and as `h200x2_2vnode_50_proxy_collective` (`--rdma proxy --proxy-tables device
--metadata-exchange collective`: what runs across CUDA IPC domains, each rank a box of its own).

SUPA bundles (`--target supa`; test_gpu.py runs them through the SUPA-on-CUDA shim): supa_h200x4
and supa_h200x2 (the one-hop plan, which the SUPA target lowers to the table-driven kernels),
supa_h200x4_2vnode_50, supa_h200x4_ubb2x2_50 and supa_h200x2_2vnode_50 (RDMA emulated over peer
memory; metadata on the GPU); supa_ubbv2_card (schedules/ubbv2_card.sched: one BR166 card, its two
dies as 2 ranks over D2D, a duplicate-mode pair) and supa_ubbv2_card_dma (the same card with its D2D
link driven by the DMA engine, `engine dma`: the dispatch's hand-over runs on the launcher's DMA
lane, the derived schedule written next to the bundles).

Eight GPUs (one box of 8 through NVSwitch), from the shipped schedules whose shape carries over to
8 ranks: h200x8, h200x8_fp8, h200x8_t128 and h200x8_tok* (h200x4.sched with `gpu 8`, as for two);
nvl8_hybrid (schedules/nvl8_hybrid.sched as shipped: the Hybrid-EP-style one-hop fp8 plan of 8
GPUs, the direct kernels); h200x8_2vnode_50 (h200x4_2vnode.sched as 2 vnodes x 4 GPUs, DeepEP
internode's shape: `levels vnode 2, gpu 4`) and h200x8_ubb4x2_50 (h200x4_ubb2x2.sched as 4 vnodes
of 2 twins: `levels node 4, die 2`), each also `_proxy`, and h200x8_2vnode_50_proxy_dev.  The
derived schedules are written next to the bundles.  (schedules/dgx_h800_2node.sched and the ubbv2
plans have 16 or more ranks: not one box of 8.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H200X4 = ROOT / "schedules" / "h200x4.sched"

# Per box size, the same six variants of h200x4.sched (its `gpu` level set to the size): bf16,
# fp8, 128 tokens, and the same token-major (DeepEP's intranode output, the direct kernels of
# epcc/direct/token.cuh, which `epcc simulate --layout token` models: compiler/sim/token_major.py)
SUFFIXES = {"": [], "_fp8": ["--dtype", "fp8"], "_t128": ["--tokens", "128"]}
VARIANTS = {  # name -> (ranks, extra compile options)
    f"h200x{g}{tok}{suffix}": (g, [*(["--layout", "token"] if tok else []), *opts])
    for g in (4, 2, 8) for tok in ("", "_tok") for suffix, opts in SUFFIXES.items()
}

# shipped schedules compiled as they are: bundle name -> schedule
SCHEDULE_VARIANTS = {
    "nvl8_hybrid": "nvl8_hybrid",  # 8 GPUs, Hybrid-EP-style one-hop, fp8 (the direct kernels)
}

# multi-hop schedules of another size, from a shipped one: name -> (shipped schedule, its levels
# line, the derived levels line)
DERIVED_SCHEDULES = {
    "h200x8_2vnode": ("h200x4_2vnode", "levels vnode 2, gpu 2", "levels vnode 2, gpu 4"),
    "h200x8_ubb4x2": ("h200x4_ubb2x2", "levels node 2, die 2", "levels node 4, die 2"),
}


RDMA_VARIANTS = {  # name -> (schedule, RDMA link name, GB/s)
    "h200x4_2vnode_50": ("h200x4_2vnode", "rdma", 50),
    "h200x4_2vnode_13": ("h200x4_2vnode", "rdma", 13),
    "h200x4_ubb2x2_50": ("h200x4_ubb2x2", "nic", 50),
    "h200x4_ubb2x2_13": ("h200x4_ubb2x2", "nic", 13),
    # the smallest plan with an RDMA step (2 GPUs as 2 vnodes): the proxy path on a 2-GPU machine
    "h200x2_2vnode_50": ("h200x2_2vnode", "rdma", 50),
    "h200x2_2vnode_13": ("h200x2_2vnode", "rdma", 13),
    # the RDMA link nearly as fast as NVLink: what the rest of the schedule takes by itself, to
    # show how much of it hides under the RDMA stream at 50 and 13 GB/s
    "h200x4_2vnode_400": ("h200x4_2vnode", "rdma", 400),
    "h200x4_ubb2x2_400": ("h200x4_ubb2x2", "nic", 400),
    # the proxy path with the nvshmem transport runs at NVLink speed, not at a paced link's
    "h200x2_2vnode_400": ("h200x2_2vnode", "rdma", 400),
    # two RDMA steps per program (a staged relay: `relay` sends on what `there` landed): the proxy
    # path with two pack roles and two FIFOs per rank and program, on a 2-GPU machine
    "h200x2_2vnode_relay_50": ("h200x2_2vnode_relay", "rdma", 50),
    # the same relay with its two steps on links of different speeds (`there` over rdma at 50 GB/s,
    # `relay` over rdma_slow at 25): the emulated transport paces each step on its own link
    "h200x2_2vnode_mixed_50": ("h200x2_2vnode_mixed", "rdma", 50),
    # one box of 8 GPUs as 2 vnodes x 4 (DeepEP internode's shape) and as 4 vnodes of 2 twins
    "h200x8_2vnode_50": ("h200x8_2vnode", "rdma", 50),
    "h200x8_ubb4x2_50": ("h200x8_ubb4x2", "nic", 50),
}


def schedule_text(sched: str) -> tuple[Path, str, str]:
    """(the shipped file, the text of schedule `sched`, the header a file derived from it starts
    with): a shipped schedule, or a DERIVED_SCHEDULES one made from its shipped file."""
    if sched not in DERIVED_SCHEDULES:
        path = ROOT / "schedules" / f"{sched}.sched"
        return path, path.read_text(encoding="utf-8"), f"# derived from schedules/{sched}.sched by tests/gpu/bundles.py"
    base, levels, derived = DERIVED_SCHEDULES[sched]
    path = ROOT / "schedules" / f"{base}.sched"
    text = path.read_text(encoding="utf-8")
    if levels not in text or f'schedule {base} "' not in text:
        raise SystemExit(f"{path}: cannot derive {sched} (levels line or name changed)")
    text = text.replace(levels, derived).replace(f'schedule {base} "', f'schedule {sched} "')
    return path, text, f"# derived from schedules/{base}.sched by tests/gpu/bundles.py: {derived}"


def rdma_source(out_dir: Path, name: str) -> Path:
    """The schedule of an RDMA variant, with its RDMA link's bandwidth set (a derived file when it
    differs from the shipped one)."""
    sched, link, gbps = RDMA_VARIANTS[name]
    path, text, header = schedule_text(sched)
    head = f"link {link} rdma {{"
    at = text.find(head)
    bw = text.find("bandwidth ", at)
    end = text.find("\n", bw)
    if at < 0 or bw < 0 or text.find("}", at) < bw:
        raise SystemExit(f"{path}: cannot find the bandwidth line of link '{link}'")
    line = text[bw:end].split("#")[0].strip()
    if line == f"bandwidth {gbps} GB/s" and sched not in DERIVED_SCHEDULES:
        return path
    text = text[:bw] + f"bandwidth {gbps} GB/s" + text[end:]
    out = out_dir / f"{name}.sched"
    out.write_text(f"{header}: link '{link}' at {gbps} GB/s\n" + text, encoding="utf-8")
    return out


def sized_source(out_dir: Path, ranks: int) -> Path:
    """The one-hop schedule on `ranks` GPUs: schedules/h200x4.sched itself for 4, else a file
    derived with `gpu N`, written into out_dir."""
    if ranks == 4:
        return H200X4
    text = H200X4.read_text(encoding="utf-8")
    if "levels node 1, gpu 4" not in text or 'schedule h200x4 "' not in text:
        raise SystemExit(f"{H200X4}: cannot derive the EP{ranks} schedule (levels line or name changed)")
    text = (text.replace("levels node 1, gpu 4", f"levels node 1, gpu {ranks}")
            .replace('schedule h200x4 "', f'schedule h200x{ranks} "'))
    path = out_dir / f"h200x{ranks}.sched"
    path.write_text(f"# derived from schedules/h200x4.sched by tests/gpu/bundles.py: {ranks} GPUs\n" + text,
                    encoding="utf-8")
    return path


def ep2_source(out_dir: Path) -> Path:
    return sized_source(out_dir, 2)


def variant_source(out_dir: Path, name: str) -> Path:
    """The schedule of a VARIANTS or SCHEDULE_VARIANTS bundle."""
    if name in SCHEDULE_VARIANTS:
        return ROOT / "schedules" / f"{SCHEDULE_VARIANTS[name]}.sched"
    return sized_source(out_dir, VARIANTS[name][0])


SUPA_VARIANTS = {  # name -> the CUDA variant whose source and options it compiles with --target supa
    "supa_h200x4": "h200x4",
    "supa_h200x2": "h200x2",
    "supa_h200x4_2vnode_50": "h200x4_2vnode_50",
    "supa_h200x4_ubb2x2_50": "h200x4_ubb2x2_50",
    "supa_h200x2_2vnode_50": "h200x2_2vnode_50",
}

# SUPA bundles of the Biren schedules: name -> (schedule, link, engine that drives it: None keeps the file's)
SUPA_SCHEDULES = {
    "supa_ubbv2_card": ("ubbv2_card", "d2d", None),
    "supa_ubbv2_card_dma": ("ubbv2_card", "d2d", "dma"),
}


def engine_source(out_dir: Path, name: str) -> Path:
    """The schedule of a SUPA_SCHEDULES bundle, with its link's `engine` line set (a derived file
    when it differs from the shipped one)."""
    sched, link, engine = SUPA_SCHEDULES[name]
    path = ROOT / "schedules" / f"{sched}.sched"
    if engine is None:
        return path
    text = path.read_text(encoding="utf-8")
    at = text.find(f"link {link} ")
    eng = text.find("engine ", at)
    end = text.find("\n", eng)
    if at < 0 or eng < 0 or text.find("}", at) < eng:
        raise SystemExit(f"{path}: cannot find the engine line of link '{link}'")
    text = text[:eng] + f"engine {engine}" + text[end:]
    out = out_dir / f"{name}.sched"
    out.write_text(f"# derived from schedules/{sched}.sched by tests/gpu/bundles.py: link '{link}' driven by "
                   f"engine {engine}\n" + text, encoding="utf-8")
    return out


# the GPU proxy path with its tables from the GPU (`--proxy-tables device`, the default), on 2, 4
# and 8 GPUs (tests/gpu/proxy_worker.py)
PROXY_DEVICE_VARIANTS = ["h200x2_2vnode_50", "h200x4_2vnode_50", "h200x4_ubb2x2_50", "h200x8_2vnode_50", "h200x8_ubb4x2_50"]
# the metadata kernels' routing through the process group's all-gather, as across boxes, on one box
# (`--metadata-exchange collective`; test_gpu.py test_collective_metadata_exchange)
COLLECTIVE_VARIANTS = ["h200x2_2vnode_50"]
# what runs across CUDA IPC domains (boxes): the RDMA steps on the GPU proxy path with its tables
# from the GPU and the routing all-gathered by the process group (`--rdma proxy --proxy-tables device
# --metadata-exchange collective`); test_gpu.py runs it with every rank in its own IPC domain
PROXY_COLLECTIVE_VARIANTS = ["h200x2_2vnode_50"]


def build(epcc: Path, out: Path, name: str, src: Path, extra: list[str], compile_extra: tuple[str, ...] = (),
          rdma: str = "proxy", target: str = "cuda") -> bool:
    """Compile `src` into out/name (a `target` bundle) and store its `epcc simulate --json` beside it
    (`--rdma`: how the bundle runs its RDMA steps, which the simulator's SM terms model)."""
    cmds = [[str(epcc), "compile", str(src), "--target", target, "-o", str(out / name), *extra, *compile_extra],
            [str(epcc), "simulate", str(src), "--json", "--rdma", rdma, *extra]]
    for cmd in cmds:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stdout + res.stderr, file=sys.stderr)
            return False
    (out / name / "simulate.json").write_text(res.stdout, encoding="utf-8")
    print(f"{name}: {out / name} (with simulate.json)")
    return True


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else ".gpu/bundles")
    out.mkdir(parents=True, exist_ok=True)
    epcc = Path(sys.executable).parent / "epcc"
    for name, (_, extra) in VARIANTS.items():
        if not build(epcc, out, name, variant_source(out, name), extra):
            return 1
    for name in SCHEDULE_VARIANTS:
        if not build(epcc, out, name, variant_source(out, name), []):
            return 1
    for name in RDMA_VARIANTS:
        if not build(epcc, out, name, rdma_source(out, name), [], rdma="emulate"):
            return 1
        # the same plan with the RDMA step through the host proxy loop (copy-engine transport), its
        # tables laid out on the host per routing: the path the bench's proxy timings were taken on
        if not build(epcc, out, f"{name}_proxy", rdma_source(out, name), ["--proxy-tables", "host"],
                     ("--rdma", "proxy")):
            return 1
    for name in PROXY_DEVICE_VARIANTS:  # the proxy path with its tables written on the GPU (the default)
        if not build(epcc, out, f"{name}_proxy_dev", rdma_source(out, name), ["--proxy-tables", "device"],
                     ("--rdma", "proxy")):
            return 1
    for name in COLLECTIVE_VARIANTS:
        if not build(epcc, out, f"{name}_collective", rdma_source(out, name), ["--metadata-exchange", "collective"],
                     rdma="emulate"):
            return 1
    for name in PROXY_COLLECTIVE_VARIANTS:
        if not build(epcc, out, f"{name}_proxy_collective", rdma_source(out, name),
                     ["--proxy-tables", "device", "--metadata-exchange", "collective"], ("--rdma", "proxy")):
            return 1
    for name, base in SUPA_VARIANTS.items():
        if base in VARIANTS:
            src, extra = variant_source(out, base), VARIANTS[base][1]
        else:
            src, extra = rdma_source(out, base), []
        if not build(epcc, out, name, src, extra, rdma="emulate", target="supa"):
            return 1
    for name in SUPA_SCHEDULES:
        if not build(epcc, out, name, engine_source(out, name), [], rdma="emulate", target="supa"):
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
