"""`epcc compile FILE`: write the bundle (-o DIR), or print one stage of the compilation (--emit)."""

from __future__ import annotations

import sys
from pathlib import Path

from dataclasses import dataclass
from typing import Callable

from .. import pipeline
from ..backends.cuda.codegen import METADATA_EXCHANGES, CudaCodegenError, CudaOptions, metadata_exchange
from ..backends.cuda.codegen import generate as generate_cuda
from ..backends.target import TARGETS as BACKEND_TARGETS
from ..files import SCHED_MAX_BYTES, read_bytes, refuse_overwrite
from ..plan import Plan
from ..plan.bundle import MANIFEST_FILE, PLAN_FILE, write_bundle
from ..vendors import NO_TARGET, TargetChoice, choose_target
from .common import EXIT_OK, inputs_of, say, say_lines, user_error, warn
from .options import pass_options, plan_options


class TargetError(Exception):
    """A code generator cannot lower the plan; the bundle is still written, then this is the error."""


@dataclass
class Generated:
    """What a code generator made of a plan: its files, written into DIR/<name>/ by `write`, and
    the lines `epcc compile` says about them once they are written."""

    write: Callable  # (directory) -> list of the paths written, as write_bundle's backends take them
    report: Callable[[Path, str, list], list[str]]  # (bundle directory, FILE, paths) -> lines to say


def _generator(backend) -> Callable[[Plan, str, object], Generated]:
    """The code generator of one target (backends.target: cuda, supa): the same kernels, each in
    its target's language and against its runtime."""
    def generate(plan: Plan, source: str, args) -> Generated:
        try:
            gen = generate_cuda(plan, source=source, target=backend,
                                options=CudaOptions(rdma=args.rdma,
                                                    proxy_device_tables=args.proxy_tables != "host",
                                                    metadata_exchange=args.metadata_exchange))
        except CudaCodegenError as e:
            raise TargetError(str(e)) from None

        def report(out: Path, file: str, written: list) -> list[str]:
            names = ", ".join(p.relative_to(out / backend.name).as_posix() for p in written)
            cm = gen.manifest
            if cm.get("lowering") == "direct":
                how = f"lowering: direct kernels ({cm['direct']['source']}; the Buffer API runs them)"
            else:
                how = f"lowering: table-driven kernels (no direct lowering: {cm.get('direct_not_used', '?')})"
            meta = cm.get("metadata") or {}
            if cm.get("lowering") != "direct" and meta.get("lowering") == "host" and args.proxy_tables != "host":
                # not asked for (--proxy-tables host): a fresh routing pays a host layout on every dispatch
                say(f"{file}: warning: the host lays out the tables on every dispatch, not the GPU's metadata "
                    f"kernels ({meta.get('why', '?')}): a fresh routing costs milliseconds per call, and the "
                    f"low-latency mode is not available", err=True)
            return [f"{file}: {backend.language} sources in {out}/{backend.name}/ ({names})", f"{file}: {how}"]

        return Generated(gen.write, report)

    return generate


# The code generators `--target` names, each writing DIR/<target>/: (plan, FILE, args) -> Generated.
# A target a topology's vendor defaults to (epcc.vendors) that is not here is an error, not a
# silent plan-only bundle.
TARGETS: dict[str, Callable[[Plan, str, object], Generated]] = {n: _generator(t) for n, t in BACKEND_TARGETS.items()}


def resolve_target(c: pipeline.Compilation, requested: str | None) -> TargetChoice:
    """The code generator to run for the compiled schedule (epcc.vendors.choose_target), its note
    said on stderr; a user error where it is the vendor's default and this epcc lacks it."""
    topo = c.schedule.topology
    choice = choose_target(topo.vendor, topo.arch, requested)
    if choice.note:
        say(f"{c.path}: note: {choice.note}", err=True)
    if choice.target is not None and choice.target not in TARGETS:
        raise user_error(f"{c.path}: target {choice.target} ({choice.why}): this epcc has no {choice.target} code "
                         f"generator; --target {NO_TARGET} writes the plan alone, or name one of "
                         f"{', '.join(TARGETS)}")
    return choice


def add_parser(sub) -> None:
    c = sub.add_parser("compile", help="compile a schedule into a bundle, or print one stage (--emit)",
                       description="Compile a .sched file. With --emit STAGE, print that stage and stop; "
                                   "otherwise write the bundle into -o DIR.")
    c.add_argument("file", metavar="FILE", help="the .sched file")
    c.add_argument("-o", "--output", metavar="DIR", help="bundle directory (default: build/<schedule name>)")
    c.add_argument("--emit", choices=pipeline.stage_names(), metavar="STAGE",
                   help="print this stage and stop: " + ", ".join(
                       f"{s.name} ({s.help})" for s in pipeline.STAGES))
    c.add_argument("--print-ir-after-all", action="store_true",
                   help="print the IR after every pass (to stdout, each after a '// IR after <pass>' line)")
    c.add_argument("--target", choices=[*TARGETS, NO_TARGET], metavar="TARGET",
                   help="the device code to generate beside the plan: cuda (persistent sm_90a kernels, host "
                        "launcher and launch manifest in DIR/cuda/; see backends/cuda), supa (the same kernels as "
                        ".su sources for Biren's brcc, host launcher against epcc_supa_api.h, manifest in DIR/supa/; "
                        "see backends/supa), none (the plan alone). "
                        "Default: the topology's vendor's (`vendor` in the .sched file): the plan alone for "
                        "nvidia, supa for biren")
    c.add_argument("--rdma", choices=["auto", "emulate", "proxy", "external"], default="auto",
                   help="with target cuda or supa, how RDMA steps run: proxy (a pack role pushes chunks to the host proxy "
                        "loop, which writes them through a transport; an unpack role applies them), emulate (paced "
                        "SM roles over peer memory), external (left to the caller's proxy), auto (emulate up to 8 "
                        "ranks, else external; the default)")
    c.add_argument("--proxy-tables", choices=["host", "device"], default=None,
                   help="with --rdma proxy, where the proxy path's tables come from: device (written by the "
                        "metadata kernels per dispatch, the proxy set up once; both modes; the default) or host "
                        "(laid out on the host per routing, the proxy set up anew for each; normal mode only)")
    c.add_argument("--metadata-exchange", choices=list(METADATA_EXCHANGES), default="auto",
                   help="with target cuda or supa, how the metadata kernels' routing reaches every rank: ipc (each "
                        "rank writes it into every peer's gather area over CUDA IPC: one box), collective (the "
                        "process group's all-gather, e.g. NCCL over NVLink and the NIC: ranks in several boxes), "
                        "auto (ipc up to 8 ranks, else collective; the default)")
    plan_options(c)
    c.set_defaults(func=cmd_compile)


def _rdma_without_target(rdma: str) -> str:
    return (f"--rdma {rdma} chooses how a target's kernels run RDMA steps: add --target "
            f"{' or --target '.join(TARGETS)}")


def token_major_refusal(target: str, plan: Plan) -> str | None:
    """Why `target` cannot run `plan` token-major, or None: the CUDA target's direct kernels (one-hop
    plans, backends/cuda/include/epcc/direct/token.cuh) write DeepEP's token-major rows; its
    table-driven kernels and the SUPA target write expert-major output only."""
    if target != "cuda":
        return (f"the token-major layout runs on the CPU backend and the CUDA target's direct kernels: the {target} "
                f"target's kernels write expert-major output")
    if plan.direct is None:
        return (f"the CUDA target writes token-major output with its direct kernels only, and this plan is not "
                f"lowered to them ({plan.direct_not_used})")
    return None


def cmd_compile(args) -> int:
    until = args.emit or pipeline.STAGES[-1].name

    def print_after(name: str, text: str) -> None:
        sys.stdout.write(f"// IR after {name}\n{text}")

    c = pipeline.run(args.file, until, args.sources, pass_options(args),
                     print_after if args.print_ir_after_all else None)
    warn(c)
    if args.emit:
        if args.rdma != "auto" and args.target not in TARGETS:
            raise user_error(_rdma_without_target(args.rdma))
        if not args.print_ir_after_all:
            say_lines(pipeline.show(c, args.emit).rstrip("\n"))
        return EXIT_OK
    choice = resolve_target(c, args.target)
    if args.rdma != "auto" and choice.target not in TARGETS:
        raise user_error(_rdma_without_target(args.rdma))
    if args.metadata_exchange != "auto" and choice.target not in TARGETS:
        raise user_error(f"--metadata-exchange {args.metadata_exchange} chooses how a target's metadata kernels "
                         f"exchange the routing: add --target {' or --target '.join(TARGETS)}")
    if args.proxy_tables is not None and args.rdma != "proxy":
        raise user_error(f"--proxy-tables {args.proxy_tables} is for the GPU proxy path: add --rdma proxy")
    if choice.target is not None and c.schedule.workload.layout == "token":
        why = token_major_refusal(choice.target, c.passes.get("plan"))
        if why:
            raise user_error(f"{c.path}: {why}; use --target {NO_TARGET} (the CPU backend runs every plan "
                             f"token-major) or the expert layout")
    out = Path(args.output or Path("build") / c.schedule.name)
    ir_file = out / f"{c.schedule.name}.mlir"
    # the bundle directory is the compiler's: it writes NAME.mlir, plan.json, manifest.json and a
    # directory per target
    refuse_overwrite("-o", str(out), [out, ir_file, out / PLAN_FILE, out / MANIFEST_FILE], inputs_of(args),
                     dirs=[out])
    src = read_bytes(args.file, "a .sched file", SCHED_MAX_BYTES)
    plan = c.passes.get("plan")
    if choice.target is not None:  # an option the plan cannot have is the command's error: nothing written
        try:
            metadata_exchange(plan, args.metadata_exchange)
        except CudaCodegenError as e:
            raise user_error(f"--metadata-exchange {args.metadata_exchange}: {e}") from None
    # The device code is generated before anything is written; a plan the target cannot lower
    # still gets its bundle, and the error follows it.
    generated, target_error = None, None
    if choice.target is not None:
        try:
            generated = TARGETS[choice.target](plan, str(args.file), args)
        except TargetError as e:
            target_error = e
    written = write_bundle(out, plan, ir_name=ir_file.name, ir_text=pipeline.show(c, until), source=str(args.file),
                           source_bytes=src, stages=[s.name for s in pipeline.STAGES],
                           backends={choice.target: generated.write} if generated is not None else {})
    say(f"{args.file}: compiled to {out}/ ({ir_file.name}, plan.json, manifest.json)")
    if target_error is not None:
        raise user_error(f"--target {choice.target}: {target_error}")
    if generated is not None:
        for line in generated.report(out, str(args.file), written[choice.target]):
            say(line)
    return EXIT_OK
