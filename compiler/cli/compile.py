"""`epcc compile FILE`: write the bundle (-o DIR), or print one stage of the compilation (--emit)."""

from __future__ import annotations

import sys
from pathlib import Path

from .. import pipeline
from ..backends.cuda.codegen import CudaCodegenError, CudaOptions
from ..backends.cuda.codegen import generate as generate_cuda
from ..backends.target import TARGETS
from ..files import SCHED_MAX_BYTES, read_bytes, refuse_overwrite
from ..plan.bundle import MANIFEST_FILE, PLAN_FILE, write_bundle
from .common import EXIT_OK, inputs_of, say, say_lines, user_error, warn
from .options import pass_options, plan_options


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
    c.add_argument("--target", choices=list(TARGETS), metavar="TARGET",
                   help="also generate device code: cuda (persistent sm_90a kernels, host launcher and launch "
                        "manifest in DIR/cuda/; see backends/cuda) or supa (the same kernels as .su sources for "
                        "Biren's brcc, host launcher against epcc_supa_api.h, manifest in DIR/supa/; see "
                        "backends/supa)")
    c.add_argument("--rdma", choices=["auto", "emulate", "proxy", "external"], default="auto",
                   help="with --target cuda or supa, how RDMA steps run: proxy (a pack role pushes chunks to the host proxy "
                        "loop, which writes them through a transport; an unpack role applies them), emulate (paced "
                        "SM roles over peer memory), external (left to the caller's proxy), auto (emulate up to 8 "
                        "ranks, else external; the default)")
    plan_options(c)
    c.set_defaults(func=cmd_compile)


def cmd_compile(args) -> int:
    until = args.emit or pipeline.STAGES[-1].name

    def print_after(name: str, text: str) -> None:
        sys.stdout.write(f"// IR after {name}\n{text}")

    if args.rdma != "auto" and getattr(args, "target", None) not in TARGETS:
        raise user_error(f"--rdma {args.rdma} chooses how the CUDA backend runs RDMA steps: add --target cuda")
    c = pipeline.run(args.file, until, args.sources, pass_options(args),
                     print_after if args.print_ir_after_all else None)
    warn(c)
    if args.emit:
        if not args.print_ir_after_all:
            say_lines(pipeline.show(c, args.emit).rstrip("\n"))
        return EXIT_OK
    out = Path(args.output or Path("build") / c.schedule.name)
    ir_file = out / f"{c.schedule.name}.mlir"
    # the bundle directory is the compiler's: it writes NAME.mlir, plan.json, manifest.json, cuda/
    refuse_overwrite("-o", str(out), [out, ir_file, out / PLAN_FILE, out / MANIFEST_FILE], inputs_of(args),
                     dirs=[out])
    src = read_bytes(args.file, "a .sched file", SCHED_MAX_BYTES)
    plan = c.passes.get("plan")
    # The device code is generated before anything is written; a plan the CUDA backend cannot
    # lower still gets its bundle, and the error follows it.
    cuda, cuda_error = None, None
    target = TARGETS.get(getattr(args, "target", None) or "")
    if target is not None:
        try:
            cuda = generate_cuda(plan, source=str(args.file), options=CudaOptions(rdma=args.rdma), target=target)
        except CudaCodegenError as e:
            cuda_error = e
    written = write_bundle(out, plan, ir_name=ir_file.name, ir_text=pipeline.show(c, until), source=str(args.file),
                           source_bytes=src, stages=[s.name for s in pipeline.STAGES],
                           backends={target.name: cuda.write} if cuda is not None else {})
    say(f"{args.file}: compiled to {out}/ ({ir_file.name}, plan.json, manifest.json)")
    if cuda_error is not None:
        raise user_error(f"--target {target.name}: {cuda_error}")
    if cuda is not None:
        names = ", ".join(p.relative_to(out / target.name).as_posix() for p in written[target.name])
        say(f"{args.file}: {target.language} sources in {out}/{target.name}/ ({names})")
        cm = cuda.manifest
        if cm.get("lowering") == "direct":
            say(f"{args.file}: lowering: direct kernels ({cm['direct']['source']}; the Buffer API runs them)")
        else:
            say(f"{args.file}: lowering: table-driven kernels (no direct lowering: {cm.get('direct_not_used', '?')})")
    return EXIT_OK
