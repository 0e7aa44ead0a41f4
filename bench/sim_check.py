"""`epcc simulate` against the recorded measurements: for every epcc row of ep_bench reports
(results/raw/*.json by default), the bundle's schedule is simulated here, on the CPU, with the
options tests/gpu/bundles.py compiled it with, and the measured time (median over the timed
iterations of the maximum over ranks) is printed beside the prediction with the error; where
the report carries the kernels' role timeline, the kernel's end beside the simulated kernel too.
Rows `epcc@N` / `epcc_cached@N` (ep_bench --epcc-sms N: the direct kernels on N SMs, every block
sending first and reducing first) are simulated with `--sms N`, the direct kernels' cached rows
with `--cached` (no metadata); the token-major bundles (`--layout token`) as the token-major direct
kernels (compiler/sim/token_major.py), with the same options.  A direct-kernel row whose report
records the launch configuration it ran (per rank `config`: an `epcc tune` pick carried in the
bundle's cuda/tuned.json) is simulated on that configuration's SMs per program, each program with
`--sms N`, where `--sms N` reproduces it (every block sending first and reducing first, 16 warps);
a configuration with dedicated replicating or reducing blocks, or fewer warps, is not one the model
has: its records are skipped, with the reason printed.  The dispatch of a bundle with
host-built tables is compared by its kernel alone (KERNEL_ONLY says why).

    .venv/bin/python bench/sim_check.py                        # every report in results/raw/
    .venv/bin/python bench/sim_check.py REPORT.json --steps    # and each role's end, measured vs simulated
    .venv/bin/python bench/sim_check.py --json                 # one JSON object

Exit status 0; 1 with --strict where a current record misses by more than --tolerance (10 %), or on
a report that cannot be read.  Records that timed code since changed are listed in SUPERSEDED
(tests/sim/test_sim_check.py holds the others within 10 %).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))  # bundles.py: how each bundle is compiled
import bundles  # noqa: E402

from epcc.cli.main import parser as epcc_parser  # noqa: E402
from epcc.cli.options import pass_options  # noqa: E402
from epcc.cli.simulate import simulation  # noqa: E402
from epcc.diagnostics import CompileError, SourceMap  # noqa: E402
from epcc.plan.direct import MAX_WARPS  # noqa: E402
from epcc.runtime.engines.cuda_table.launcher import role_step  # noqa: E402
from epcc.sim.report import to_dict  # noqa: E402

PROGRAMS = ("dispatch", "combine")
# ep_bench's epcc rows: fresh routing (epcc), cached handle (epcc_cached); `@N` with --epcc-sms N
ROW = re.compile(r"(epcc|epcc_cached)(?:@([1-9][0-9]*))?")
TOLERANCE = 0.10

# program -> why its records of bundles with host-built tables (`--proxy-tables host`) compare the
# kernel's end in the role timeline with the simulated kernel, not the timed call with the prediction
KERNEL_ONLY = {
    "dispatch": "host-built tables: the Buffer's normal mode, whose timed dispatch holds host work the model does "
                "not have: the fresh row lays out every rank's routing on the host (the report's host_ms: 77 and "
                "153 ms of layout and tables on one rank, of 156 and 181 timed), the cached row (the layout and "
                "tables of one earlier dispatch, not uploaded again) waits for the kernels on the host, then builds "
                "the outputs' expert ids and weights from the host's layout and copies them up; 4 x H100, "
                "2026-11-27: the cached call 2.28 ms against its kernel's end 1.42 (h200x4_2vnode_50_proxy; 2.68 "
                "against 1.78, h200x4_ubb2x2_50_proxy), where the GPU-table twins spend 0.17 ms beside the kernel",
}

# the fresh 128-token dispatches timed before the direct kernels' metadata raised the peers' flags in
# parallel (backends/cuda/include/epcc/direct/meta.cuh meta_publish, 2026-11-27)
SERIAL_FLAGS = ("the fresh dispatch before the peers' flags were raised in parallel (one thread raised them in turn, "
                "each release a system fence: ~2 us per peer, 9.6 us of metadata on 2 x H100, 14 on 4 x H100; since: "
                "6-7 us on both)")
# the same at 4096 tokens, where the old flags' 2-7 us is 1-2 % of the call, stays a record (the fit in
# compiler/sim/direct.py lies under these gaps, as the test of the metadata says)
FRESH_128_BEFORE = [("2026-11-26_2xH100_ep_bench.json", "h200x2_t128", "epcc"),
                    ("2026-11-26_2xH100_ep_bench_76c2fc7.json", "h200x2_t128", "epcc"),
                    ("2026-11-26_4xH100_ep_bench.json", "h200x4_t128", "epcc"),
                    ("2026-11-26_4xH100_ep_bench_b.json", "h200x4_t128", "epcc"),
                    ("2026-11-27_2xH100_ep_bench_token.json", "h200x2_tok_t128", "epcc"),
                    ("2026-11-27_4xH100_ep_bench.json", "h200x4_t128", "epcc@24"),
                    ("2026-11-27_4xH100_ep_bench.json", "h200x4_t128", "epcc@64"),
                    ("2026-11-27_4xH100_ep_bench_token.json", "h200x4_tok_t128", "epcc")]

# the combines timed before the table-driven combine read the caller's expert outputs in place (manifest
# combine_input caller_rows, 2026-11-27): of plans that allow it, where the Buffer had copied y into its
# input buffer first and the model no longer charges that copy; 2 x H200 the same day, one device call:
# 0.29 ms less per combine (h200x2_2vnode_50: 1.898 -> 1.603 ms, its kernel's end 1.482 -> 1.477)
COPIED_ROWS = ("the combine before it read the caller's expert outputs in place (the Buffer copied them into its input "
               "buffer first: 4096 x 8 bf16 rows, ~0.3 ms; since: no copy where the manifest's combine_input allows it)")
COMBINES_BEFORE_CALLER_ROWS = [
    ("2026-11-26_2xH200_ep_bench_multihop.json", "h200x2_2vnode_50", "epcc"),
    ("2026-11-26_2xH200_ep_bench_multihop.json", "h200x2_2vnode_50", "epcc_cached"),
    ("2026-11-26_2xH200_ep_bench_multihop.json", "h200x2_2vnode_13", "epcc"),
    ("2026-11-26_2xH200_ep_bench_multihop.json", "h200x2_2vnode_13", "epcc_cached"),
    ("2026-11-26_4xH100_ep_bench_b.json", "h200x4_ubb2x2_50", "epcc"),
    ("2026-11-26_4xH100_ep_bench_b.json", "h200x4_ubb2x2_50", "epcc_cached"),
    ("2026-11-27_2xH100_ep_bench_multihop.json", "h200x2_2vnode_50", "epcc"),
    ("2026-11-27_2xH100_ep_bench_multihop.json", "h200x2_2vnode_50", "epcc_cached"),
    ("2026-11-27_2xH100_ep_bench_multihop.json", "h200x2_2vnode_13", "epcc"),
    ("2026-11-27_2xH100_ep_bench_multihop.json", "h200x2_2vnode_13", "epcc_cached"),
    ("2026-11-27_2xH100_ep_bench_multihop.json", "h200x2_2vnode_50_proxy_dev", "epcc"),
    ("2026-11-27_2xH100_ep_bench_multihop.json", "h200x2_2vnode_50_proxy_dev", "epcc_cached"),
    ("2026-11-27_4xH100_ep_bench_multihop.json", "h200x4_ubb2x2_50", "epcc"),
    ("2026-11-27_4xH100_ep_bench_multihop.json", "h200x4_ubb2x2_50", "epcc_cached"),
    ("2026-11-27_4xH100_ep_bench_multihop.json", "h200x4_ubb2x2_50_proxy", "epcc"),
    ("2026-11-27_4xH100_ep_bench_multihop.json", "h200x4_ubb2x2_50_proxy", "epcc_cached"),
]
# those runs' dispatches are not superseded by this: the metadata's refit after meta_rows read
# meta_count's records (sim/meta.py, 2026-11-27) moved their predictions by 7-9 us, under 1 % of the
# call (most are superseded for another reason: SIX_LAUNCHES, PER_BLOCK_PACING)

# the dispatches of bundles whose RDMA steps run as paced SM roles (rdma="emulate"), timed while each
# block kept to a share of the link (device.cu.j2 PacedLink since)
PER_BLOCK_PACING = ("the RDMA step's paced SM roles before they replayed one serial link: each block kept to its "
                    "share of the rate from its own last publication, so the stream paid the chain of in-order "
                    "publications every round (h200x2_2vnode_50 on 2 x H200, 2026-11-27: 58.8 MB in 1.262 ms, 93 % "
                    "of the link) and landed chunks in bursts of one per block (keep_far ended 80 us after it).  "
                    "The combine's RDMA step is such a role too: its link ran at ~44 GB/s of 50 (h200x2_2vnode_50's "
                    "combine rdma role 0.135-1.472 ms before, 0.138-1.313 after, the same device call, 2 x H200, "
                    "2026-11-27), so its combines are superseded with its dispatches")
EMULATED_RDMA_BEFORE = [("2026-11-26_2xH200_ep_bench_multihop.json", "h200x2_2vnode_50"),
                        ("2026-11-26_2xH200_ep_bench_multihop.json", "h200x2_2vnode_13"),
                        ("2026-11-26_4xH100_ep_bench_b.json", "h200x4_2vnode_50"),
                        ("2026-11-26_4xH100_ep_bench_b.json", "h200x4_ubb2x2_50"),
                        ("2026-11-27_2xH100_ep_bench_multihop.json", "h200x2_2vnode_50"),
                        ("2026-11-27_2xH100_ep_bench_multihop.json", "h200x2_2vnode_13"),
                        ("2026-11-27_4xH100_ep_bench_multihop.json", "h200x4_2vnode_50"),
                        ("2026-11-27_4xH100_ep_bench_multihop.json", "h200x4_ubb2x2_50"),
                        *[(r, b) for r in ("2026-11-27_2xH200_ep_bench_multihop_zcopy.json",
                                           "2026-11-27_2xH100_ep_bench_multihop_metafused_before.json",
                                           "2026-11-27_2xH100_ep_bench_multihop_metafused.json",
                                           "2026-11-27_2xH200_ep_bench_multihop_paced_before.json")
                          for b in ("h200x2_2vnode_50", "h200x2_2vnode_13")],
                        # the 4 x H200 run before the change (its _proxy and _proxy_dev twins run the GPU proxy
                        # path, which the change left as it was: they stay records)
                        *[("2026-11-27_4xH200_ep_bench_multihop_before.json", b)
                          for b in ("h200x4_2vnode_50", "h200x4_ubb2x2_50")]]

# the dispatches with tables from the GPU timed before their metadata ran as one cooperative launch
# (meta_fused, 2026-11-27), where the refit to it (sim/meta.py: 73 us for h200x2_2vnode_50 where the six
# launches were charged 113) moved the prediction by 40-55 us, 3 % of the call: 2 x H100 the same day, one
# device call, bench/meta_time.py: 91.2 -> 68.2 us per dispatch, the dispatch 1.536 -> 1.527 ms.  The
# 13 GB/s bundle's dispatches (the same 40 us, under 1 % of its 4.8 ms) are not superseded by this (they
# are by PER_BLOCK_PACING, their RDMA step being paced SM roles)
SIX_LAUNCHES = ("the dispatch before its metadata ran as one cooperative launch (six launches: gather_copy, the flag "
                "wait, count, scan, rows, items; 91.2 us per dispatch on 2 x H100 where meta_fused takes 68.2, the "
                "same device call, 2026-11-27; the model now charges the one launch)")
DISPATCHES_BEFORE_META_FUSED = [
    *[("2026-11-26_2xH200_ep_bench_multihop.json", "h200x2_2vnode_50", row) for row in ("epcc", "epcc_cached")],
    *[("2026-11-26_4xH100_ep_bench_b.json", b, row) for b in ("h200x4_2vnode_50", "h200x4_ubb2x2_50")
      for row in ("epcc", "epcc_cached")],
    *[("2026-11-27_2xH100_ep_bench_multihop.json", b, row) for b in ("h200x2_2vnode_50", "h200x2_2vnode_50_proxy_dev")
      for row in ("epcc", "epcc_cached")],
    *[("2026-11-27_2xH100_ep_bench_multihop_metafused_before.json", "h200x2_2vnode_50", row)
      for row in ("epcc", "epcc_cached")],
    *[("2026-11-27_2xH200_ep_bench_multihop_zcopy.json", "h200x2_2vnode_50", row) for row in ("epcc", "epcc_cached")],
    *[("2026-11-27_4xH100_ep_bench_multihop.json", b, row) for b in ("h200x4_2vnode_50", "h200x4_ubb2x2_50")
      for row in ("epcc", "epcc_cached")],
]

# the h200x2_2vnode bundles timed before its keep_far ran on 16 SMs with ramped ends (the schedule,
# 2026-11-27) and before roles no step reads published out of order: each run's plan is not the one the
# model builds from the schedule now (2 x H100, the same day, one device call, the schedule before and
# after: the dispatch 1.304 -> 1.288 ms, the combine 1.397 -> 1.352; results/2026-11-27_2xH100_multihop.md)
KEEP_FAR_8_SMS = ("h200x2_2vnode's keep_far on 8 SMs with whole chunks at its head, and its roles publishing in chunk "
                  "order (since: 16 SMs, ramp 3, and the roles no step reads publishing each chunk once written)")
TWO_VNODE_BEFORE_16_SMS = [
    (r, b) for r in ("2026-11-26_2xH100_ep_bench.json", "2026-11-26_2xH100_ep_bench_76c2fc7.json",
                     "2026-11-26_2xH200_ep_bench_multihop.json", "2026-11-27_2xH100_ep_bench_multihop.json",
                     "2026-11-27_2xH100_ep_bench_multihop_metafused.json",
                     "2026-11-27_2xH100_ep_bench_multihop_metafused_before.json",
                     "2026-11-27_2xH200_ep_bench_multihop_paced.json",
                     "2026-11-27_2xH200_ep_bench_multihop_paced_before.json",
                     "2026-11-27_2xH200_ep_bench_multihop_zcopy.json")
    for b in ("h200x2_2vnode_50", "h200x2_2vnode_13", "h200x2_2vnode_50_proxy_dev")]


def _reasons(*groups: tuple) -> dict[tuple, tuple[str, ...]]:
    """(keys, why) groups as one table: key -> every reason given for it, in the order given (a record
    that predates two changes keeps both)."""
    table: dict[tuple, list[str]] = {}
    for keys, why in groups:
        for key in keys:
            whys = table.setdefault(key, [])
            if why not in whys:
                whys.append(why)
    return {key: tuple(whys) for key, whys in table.items()}


ROWS = ("epcc", "epcc_cached")
# (report file name, bundle) -> why its epcc rows do not time the code as it is now; (report, bundle,
# row, program) -> why that one record does not
SUPERSEDED = _reasons(
    ([(*key, "dispatch") for key in FRESH_128_BEFORE], SERIAL_FLAGS),
    ([(*key, "combine") for key in COMBINES_BEFORE_CALLER_ROWS], COPIED_ROWS),
    (TWO_VNODE_BEFORE_16_SMS, KEEP_FAR_8_SMS),
    ([(*key, "dispatch") for key in DISPATCHES_BEFORE_META_FUSED], SIX_LAUNCHES),
    ([(*key, row, p) for key in EMULATED_RDMA_BEFORE for row in ROWS for p in ("dispatch", "combine")],
     PER_BLOCK_PACING),
    ([("2026-11-26_2xH100_ep_bench_76c2fc7.json", "h200x2_2vnode_50")],
     "the bench before the one-way-layers restructure: the host layout and the inputs outside the timing"),
    ([("2026-11-26_2xH100_ep_bench.json", "h200x2_2vnode_50"), ("2026-11-26_2xH100_ep_bench.json", "h200x2_2vnode_13")],
     "the combine then copied the whole receive buffer in (since: only the rows received)"),
    ([("2026-11-26_4xH100_ep_bench.json", "h200x4_2vnode_50")],
     "the combine then copied the whole receive buffer in, the metadata before its rework (eleven launches)"),
)


def superseded(report: str, bundle: str, row: str, program: str) -> str | None:
    """Why a record does not time the code as it is now (SUPERSEDED: this one's reasons, then its bundle's
    rows'), every reason that applies; None where none does."""
    whys = SUPERSEDED.get((report, bundle, row, program), ()) + SUPERSEDED.get((report, bundle), ())
    return "; ".join(whys) or None


@dataclass
class Record:
    report: str
    device: str
    bundle: str
    row: str
    program: str
    dtype: str
    tokens: int
    measured_ms: float
    predicted_ms: float
    kernel_ms: float | None = None  # the kernel's end in the role timeline (max over ranks)
    sim_kernel_ms: float | None = None  # the simulated kernel: the program's makespan less its launch
    superseded: str | None = None
    steps: dict = field(default_factory=dict)  # step -> [measured end, simulated end] (ms, from the kernel's start)
    kernel_only: str | None = None  # why `error` is the kernel's (KERNEL_ONLY), not the call's

    @property
    def error(self) -> float:
        """The error compared: the call's, or the kernel's where `kernel_only`."""
        if self.kernel_only:
            return self.kernel_error
        return self.predicted_ms / self.measured_ms - 1.0

    @property
    def kernel_error(self) -> float | None:
        if self.kernel_ms and self.sim_kernel_ms is not None:
            return self.sim_kernel_ms / self.kernel_ms - 1.0
        return None


@dataclass
class Skipped:
    """A record sim_check does not compare, and why (the model cannot run the row's configuration)."""

    report: str
    bundle: str
    row: str
    program: str
    reason: str


def configured_sms(config: dict | None, program: str) -> int | str | None:
    """The SMs `epcc simulate --sms N` runs `program` of the direct kernels on to reproduce the launch
    configuration a report recorded for its row (DirectConfig's fields, plan/direct.py): None without one;
    a reason (str) where `--sms N` cannot reproduce it (every block of `--sms N` sends first and then
    replicates, reduces first and then sums, with MAX_WARPS warps)."""
    if not config:
        return None
    send, only = (("send_blocks", "recv_blocks") if program == "dispatch"
                  else ("combine_send_blocks", "combine_reduce_blocks"))
    if config.get(only):
        what = "replicate" if program == "dispatch" else "sum partials"
        return (f"its {program} ran {config[send]} + {config[only]} SMs, {config[only]} of them blocks that only "
                f"{what} ({only}): epcc simulate --sms N runs every block {'sending' if program == 'dispatch' else 'reducing'} "
                f"first, and the direct kernels' model has no dedicated blocks")
    if program == "dispatch" and config.get("warps") != MAX_WARPS:
        return (f"its dispatch ran {config.get('warps')} warps per block: epcc simulate --sms N runs {MAX_WARPS}, "
                f"and the direct kernels' model has no warp count")
    return int(config[send])


class CheckError(Exception):
    """A report this tool cannot read, or a bundle it cannot rebuild."""


def bundle_source(name: str, out_dir: Path) -> tuple[Path, list[str]]:
    """(the .sched file, the `epcc simulate` options) tests/gpu/bundles.py compiles bundle `name` with."""
    # NAME_proxy: the GPU proxy path with host-built tables; NAME_proxy_dev: with tables from the GPU
    tables = next((t for suffix, t in (("_proxy_dev", "device"), ("_proxy", "host")) if name.endswith(suffix)), None)
    base = name[: name.rindex("_proxy")] if tables else name
    if (base in bundles.VARIANTS or base in bundles.SCHEDULE_VARIANTS) and tables is None:
        extra = bundles.VARIANTS[base][1] if base in bundles.VARIANTS else []
        return bundles.variant_source(out_dir, base), [*extra, "--rdma", "proxy"]
    if base in bundles.RDMA_VARIANTS and (tables != "device" or base in bundles.PROXY_DEVICE_VARIANTS):
        if tables is None:
            return bundles.rdma_source(out_dir, base), ["--rdma", "emulate"]
        return bundles.rdma_source(out_dir, base), ["--rdma", "proxy", "--proxy-tables", tables]
    raise CheckError(f"bundle '{name}': not one tests/gpu/bundles.py builds")


def host_tables(name: str, out_dir: Path) -> bool:
    """Whether bundle `name` runs with host-built tables (the Buffer's normal mode: KERNEL_ONLY)."""
    opts = bundle_source(name, out_dir)[1]
    return any(a == "--proxy-tables" and b == "host" for a, b in zip(opts, opts[1:]))


def simulate_bundle(name: str, tokens: int | None, out_dir: Path, sms: int | None = None, cached: bool = False,
                    copied: frozenset[str] = frozenset(), zero_beside: bool = True,
                    convert_in_kernel: bool = True) -> dict:
    """`epcc simulate --json` of bundle `name` (at `tokens` per rank where given; its direct kernels
    on `sms` SMs where given, as ep_bench --epcc-sms runs them; their cached-handle dispatch with
    `cached`; the Buffer copying the rows of the programs in `copied` into their input buffers,
    --copy-inputs; the combine's partials cleared in the combine call unless `zero_beside`,
    --clear-partials; the bf16 tokens written by a finish kernel unless `convert_in_kernel`,
    --combine-output)."""
    src, opts = bundle_source(name, out_dir)
    argv = ["simulate", str(src), "--json", *opts]
    if tokens is not None and "--tokens" not in opts:
        argv += ["--tokens", str(tokens)]
    if sms is not None:
        argv += ["--sms", str(sms)]
    if cached:
        argv += ["--cached"]
    if copied:
        argv += ["--copy-inputs", ",".join(sorted(copied))]
    if not zero_beside:
        argv += ["--clear-partials", "in-combine"]
    if not convert_in_kernel:
        argv += ["--combine-output", "finish-kernel"]
    args = epcc_parser().parse_args(argv)
    args.sources = SourceMap()
    try:
        built, res = simulation(args, pass_options(args))
    except CompileError as e:
        raise CheckError(f"bundle '{name}': {src.name} does not compile: {e}") from None
    except SystemExit:  # the CLI's refusal (said on stderr): `--sms` on a bundle without direct kernels
        raise CheckError(f"bundle '{name}': epcc simulate {' '.join(argv[2:])} refused") from None
    return to_dict(res, built.passes_run, tokens)


def _timeline(per_rank: list[dict], program: str) -> tuple[float | None, dict[str, float]]:
    """(the kernel's end, each step's end), ms, the maximum over ranks: a role of several steps
    ("a+b") ends each of them; a proxy-path step's two roles ("rdma (pack)", "rdma (unpack)") end
    their step where the later one ends."""
    ends, roles = [], {}
    for r in per_rank:
        t = (r.get("timeline") or {}).get(program)
        if not t:
            continue
        ends.append(float(t["end_ms"]))
        for role in t.get("roles", []):
            for step in role_step(str(role["step"])).split("+"):
                roles[step] = max(roles.get(step, 0.0), float(role["end_ms"]))
    return (max(ends) if ends else None), roles


def records_of(path: Path, out_dir: Path, cache: dict, skipped: list | None = None) -> list[Record]:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        bundle_list = report["bundles"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckError(f"{path}: not an ep_bench report: {e}") from None
    out = []
    for b in bundle_list:
        groups: dict[int | None, list] = {}  # SMs (--epcc-sms; None: the bundle's own) -> [(row, result)]
        for row, m in (b.get("methods") or {}).items():
            hit = ROW.fullmatch(row)
            if hit and isinstance(m, dict) and "summary" in m:
                groups.setdefault(int(hit.group(2)) if hit.group(2) else None, []).append((row, m))
        if not groups:
            continue
        for sms, rows in groups.items():
            out += _records(path.name, str(report.get("device", "?")), b, rows, sms, out_dir, cache,
                            skipped if skipped is not None else [])
    return out


def _records(report: str, device: str, b: dict, rows: list, sms: int | None, out_dir: Path, cache: dict,
             skipped: list) -> list:
    """The records of bundle `b`'s epcc `rows` of one SM count (`sms`: ep_bench --epcc-sms; None: the
    bundle's own, or the configuration the row recorded); `skipped` gets the records not compared."""
    name, wl = b["name"], b.get("workload") or {}
    tokens = wl.get("tokens")
    copied, beside, converted = copied_inputs(rows), zero_beside(rows), convert_in_kernel(rows)

    def simulated(cached: bool, n: int | None = sms) -> dict:
        key = (name, tokens, n, cached, copied, beside, converted)
        if key not in cache:
            cache[key] = simulate_bundle(name, tokens, out_dir, n, cached, copied, beside, converted)
        return cache[key]

    fresh = simulated(False)
    # a cached handle of the direct kernels: the dispatch without metadata (epcc simulate --cached); of
    # the table-driven ones: the same kernels (the GPU's tables written again, or the host's kept)
    direct = fresh["model"]["sm"].get("model") == "direct"
    # the timeline: the direct kernels stamp the fresh row, the table-driven ones the cached row
    stamped = next((m["per_rank"] for _, m in rows if any(r.get("timeline") for r in m.get("per_rank", []))), [])
    host = host_tables(name, out_dir)
    out = []
    for row, m in rows:
        config = next((r.get("config") for r in m.get("per_rank", []) if r.get("config")), None)
        for p in PROGRAMS:
            n = sms
            if direct and sms is None and config:  # the row's own configuration (an `epcc tune` pick)
                n = configured_sms(config, p)
                if isinstance(n, str):
                    if p in m["summary"]:
                        skipped.append(Skipped(report, name, row, p, n))
                    continue
                if n == fresh["model"]["sm"].get("sms", {}).get(p):
                    n = None
            cached = direct and row.startswith("epcc_cached")
            sim = simulated(cached, n) if (cached or n != sms) else fresh
            sim_steps = {p: {s["name"]: s["end_ms"] for s in sim["steps"] if s["program"] == p} for p in PROGRAMS}
            if p not in m["summary"] or p not in sim["programs"]:
                continue
            prog = sim["programs"][p]
            launch = prog.get("launch_ms", 0.0)  # kernel launches, metadata, the call's copies
            kernel, roles = _timeline(stamped, p)
            why = KERNEL_ONLY.get(p) if host else None
            if why and kernel is None:
                raise CheckError(f"{report}: bundle '{name}' {row}: its {p} is compared by the kernel (host-built "
                                 f"tables), but the report has no role timeline")
            steps = {s: [roles[s], sim_steps[p][s] - launch] for s in roles if s in sim_steps[p]}
            out.append(Record(report, device, name, row, p, str(wl.get("dtype", "?")), int(tokens or 0),
                              float(m["summary"][p]["median_ms"]), prog["total_ms"], kernel, prog["total_ms"] - launch,
                              superseded(report, name, row, p), steps, why))
    return out


def copied_inputs(rows: list) -> frozenset[str]:
    """The programs whose rows the Buffer copied into their input buffers in a bundle's epcc rows
    although the bundle's kernels read them in place now: none where the report recorded which
    programs read the caller's rows (ep_bench's `caller_rows`, since the dispatch read x in place:
    what it did not record it copied); else the dispatch (no dispatch read x in place before that,
    and the combine's copies the report predates are superseded: COMBINES_BEFORE_CALLER_ROWS)."""
    for _, m in rows:
        for r in m.get("per_rank", []):
            if "caller_rows" in r:
                return frozenset(PROGRAMS) - frozenset(r["caller_rows"])
    return frozenset({"dispatch"})


def zero_beside(rows: list) -> bool:
    """Whether a bundle's epcc rows ran with the combine's partials cleared beside the dispatch
    kernel: as ep_bench recorded it (`zero_beside`, since that change); in the combine call for the
    reports before that field."""
    return any(r.get("zero_beside") for _, m in rows for r in m.get("per_rank", []))


def convert_in_kernel(rows: list) -> bool:
    """Whether a bundle's epcc rows ran with the combine kernel writing the bf16 tokens itself: as
    ep_bench recorded it (`convert_in_kernel`, since that change); a finish kernel after the combine
    kernel for the reports before that field."""
    return any(r.get("convert_in_kernel") for _, m in rows for r in m.get("per_rank", []))


def collect(paths: list[Path], skipped: list | None = None) -> list[Record]:
    """The records of every report in `paths`; `skipped` (where given) gets those not compared (Skipped)."""
    cache: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        return [r for p in paths for r in records_of(p, Path(tmp), cache, skipped)]


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:+.0f} %"


def table(records: list[Record], tolerance: float, steps: bool, skipped: list | None = None) -> list[str]:
    head = (f"{'report':38} {'bundle':18} {'row':11} {'program':8} {'dtype':5} {'tokens':>6} {'measured':>9} "
            f"{'predicted':>9} {'error':>6}  {'kernel':>7} {'sim':>7} {'error':>6}")
    lines = [head, "-" * len(head)]
    for r in records:
        flag = " OLD" if r.superseded else (" MISS" if abs(r.error) > tolerance else "")
        flag += " KERNEL" if r.kernel_only else ""
        k = f"{r.kernel_ms:7.3f} {r.sim_kernel_ms:7.3f} {_pct(r.kernel_error):>6}" if r.kernel_ms else ""
        lines.append(f"{r.report:38} {r.bundle:18} {r.row:11} {r.program:8} {r.dtype:5} {r.tokens:6d} "
                     f"{r.measured_ms:9.3f} {r.predicted_ms:9.3f} {_pct(r.error):>6}  {k}{flag}")
        if steps and r.row.split("@")[0] == "epcc" and r.steps:
            for s, (meas, sim) in r.steps.items():
                lines.append(f"{'':40}{s:24} role end {meas:7.3f}  simulated {sim:7.3f}  {_pct(sim / meas - 1):>6}")
    for k in skipped or []:
        lines.append(f"SKIPPED {k.report} {k.bundle} {k.row} {k.program}: not simulated: {k.reason}")
    current = [r for r in records if not r.superseded]
    miss = [r for r in current if abs(r.error) > tolerance]
    lines.append(f"{len(current)} current records, {len(miss)} beyond {tolerance * 100:.0f} %; "
                 f"{len(records) - len(current)} superseded, {len(skipped or [])} skipped"
                 + (f" (OLD: {', '.join(sorted({r.superseded for r in records if r.superseded}))})"
                    if len(records) > len(current) else ""))
    for p, why in KERNEL_ONLY.items():
        if any(r.kernel_only and r.program == p for r in records):
            lines.append(f"KERNEL ({p}): the error is the kernel's: {why}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("reports", nargs="*", type=Path, help="ep_bench.json reports (default: results/raw/*.json)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="flag errors beyond this fraction (0.10)")
    ap.add_argument("--steps", action="store_true", help="also each role's end, measured (timeline) vs simulated")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--strict", action="store_true", help="exit 1 where a current record misses")
    args = ap.parse_args(argv)
    paths = args.reports or sorted((ROOT / "results" / "raw").glob("*.json"))
    skipped: list[Skipped] = []
    try:
        records = collect(paths, skipped)
    except CheckError as e:
        print(f"sim_check: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"tolerance": args.tolerance,
                          "records": [{**asdict(r), "error": r.error, "kernel_error": r.kernel_error} for r in records],
                          "skipped": [asdict(k) for k in skipped]}, indent=1))
    else:
        print("\n".join(table(records, args.tolerance, args.steps, skipped)))
    bad = [r for r in records if not r.superseded and abs(r.error) > args.tolerance]
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
