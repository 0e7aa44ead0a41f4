"""The `epcc` command line.

Exit status: 0 on success, 1 on a user error (a bad .sched file, an impossible topology, a
missing file), 2 on bad usage of the command itself, 3 on an internal compiler error.
Diagnostics go to stderr as `path:line:col: error: message` with the source line and a caret.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from . import __version__, limits, pipeline
from .backends.cuda.codegen import CudaCodegenError, CudaOptions
from .backends.cuda.codegen import emit as emit_cuda
from .diagnostics import CompileError, Diagnostic, SourceMap, format_all
from .limits import MAX_RANKS
from .files import SCHED_MAX_BYTES, FileError, read_bytes, refuse_overwrite
from .passes import PassOptions
from .plan import bundle as bundle_io
from .plan import rdma as rdma_plan
from .runtime.layout import compute_layout
from .runtime.testing import inputs, oracle
from .sema.workload import LIMITS
from .sim import SimOptions, SimulationError, simulate
from .sim.build import build_plan
from .sim.gantt import write_svg
from .sim.report import table, to_dict
from .textsafe import terminal
from .viz import render, render_scheduled

EXIT_OK, EXIT_USER, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epcc",
        description="Compile MoE expert-parallel dispatch/combine schedules (.sched) for a described topology.",
        epilog="Language reference: docs/language.md.  Exit status: 0 ok, 1 error in the input, 2 bad usage.",
    )
    p.add_argument("--version", action="version", version=f"epcc {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("check", help="parse and check a schedule; print its errors and warnings",
                       description="Parse and check a .sched file. Prints every error with its location.")
    c.add_argument("file", metavar="FILE", help="the .sched file")
    c.set_defaults(func=cmd_check)

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
    c.add_argument("--target", choices=["cuda"], metavar="TARGET",
                   help="also generate device code: cuda (persistent sm_90a kernels, host launcher and launch "
                        "manifest in DIR/cuda/; see backends/cuda)")
    c.add_argument("--rdma", choices=["auto", "emulate", "proxy", "external"], default="auto",
                   help="with --target cuda, how RDMA steps run: proxy (a pack role pushes chunks to the host proxy "
                        "loop, which writes them through a transport; an unpack role applies them), emulate (paced "
                        "SM roles over peer memory), external (left to the caller's proxy), auto (emulate up to 8 "
                        "ranks, else external; the default)")
    _plan_options(c)
    c.set_defaults(func=cmd_compile)

    c = sub.add_parser("viz", help="draw the schedule DAG with graphviz",
                       description="Draw the dispatch DAG: steps grouped by the tier they run across, edges for "
                                   "data and order dependencies, colours for link kinds, expected volumes.")
    c.add_argument("file", metavar="FILE", help="the .sched file")
    c.add_argument("-o", "--output", metavar="OUT", required=True, help="picture to write: .svg, .png, .pdf or .dot")
    c.add_argument("--scheduled", action="store_true",
                   help="draw the scheduled plan instead, simulated as `epcc simulate` does (--kernels, --sms): "
                        "overlap groups from the simulation, pipelined dependencies and the critical path; per "
                        "program the direct kernels' SM pool where they run it, else per step its chunks and SM role")
    _plan_options(c)
    _kernel_options(c, only="with --scheduled: ")
    c.set_defaults(func=cmd_viz)

    c = sub.add_parser("simulate", help="simulate a schedule's plan: step times, link busy time, bottleneck",
                       description="Build the plan (the pass pipeline as far as its passes exist), run the fluid "
                                   "discrete-event simulator over it (max-min fair link sharing, chunk pipelining, "
                                   "latency; the model: compiler/sim/__init__.py) and print per-step start/end, "
                                   "busy time per link class, the bottleneck, the total with overlap and the serial "
                                   "sum, in ms.")
    c.add_argument("file", metavar="FILE", help="the .sched file")
    _plan_options(c)
    c.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    c.add_argument("--gantt", metavar="OUT.svg", help="also draw a Gantt chart of the steps into this SVG file")
    c.add_argument("--rdma", choices=("proxy", "emulate"), default="proxy",
                   help="how the RDMA steps run, as `epcc compile --target cuda --rdma`: proxy (default: credit "
                        "window, chunks staged and applied by one SM each) or emulate (paced SM roles); matters "
                        "only with the topology's `sm` rates")
    _kernel_options(c)
    c.set_defaults(func=cmd_simulate)

    c = sub.add_parser("tune", help="sweep a CUDA bundle's SMs and warps on the GPUs (torchrun); keep the best",
                       description="Start `torchrun --nproc-per-node N -m epcc.runtime.tune BUNDLE ...`: every "
                                   "configuration is checked against the first (bit-identical results) and timed; "
                                   "the fastest is written to BUNDLE/cuda/tuned.json, which the runtime reads.")
    c.add_argument("bundle", metavar="BUNDLE", help="a bundle written by `epcc compile FILE --target cuda -o BUNDLE`")
    c.add_argument("--nproc", type=int, help="GPUs (default: the plan's ranks)")
    c.add_argument("--sms", default="8,16,24,32,48", help="total SMs per kernel to try")
    c.add_argument("--warps", default="8,16", help="warps per dispatch block to try")
    c.add_argument("--iters", default="10", help="timed calls per configuration")
    c.set_defaults(func=cmd_tune)

    c = sub.add_parser("run", help="run a schedule's dispatch and combine on a backend; check them against the oracle",
                       description="Compile FILE (or load a compiled plan.json), build deterministic inputs (routing, "
                                   "weights, payload rows, expert outputs), compute the token-level layout "
                                   "(docs/runtime.md), execute dispatch and combine on the backend and compare with "
                                   "the NumPy oracle: dispatch bit-exact (rows, order, counts, weights), combine "
                                   "within bf16 tolerance.  Prints one summary line; exit status 1 on a mismatch, "
                                   "with the first differing rank, token and expert.",
                       epilog="Inputs are [ranks x tokens x row bytes] in memory: use --tokens and --hidden for "
                              "quick runs of the large schedules.")
    c.add_argument("file", metavar="FILE", help="the .sched file, or a plan.json written by 'epcc compile'")
    c.add_argument("--backend", default="cpu", choices=sorted(RUN_BACKENDS), metavar="|".join(sorted(RUN_BACKENDS)),
                   help="where to execute: " + "; ".join(f"{k}: {v[1]}" for k, v in sorted(RUN_BACKENDS.items()))
                        + " (default: cpu)")
    c.add_argument("--routing", default="uniform", metavar="uniform|zipf:S|one-hot|empty|no-remote|FILE.npy",
                   help="the tokens' top-k experts: uniform; zipf:S (expert popularity ~ 1/rank^S); one-hot (all "
                        "of a token's experts on one rank); empty (only the first half of the ranks receive); "
                        "no-remote (experts on the token's own rank); or a .npy file of top-k indices [R, T, k] or "
                        "[R*T, k] (-1: empty slot).  The compiler plans volumes with uniform routing unless zipf:S "
                        "(default: uniform)")
    c.add_argument("--tokens", metavar="N", help="tokens per rank (default: the workload's)")
    c.add_argument("--hidden", metavar="N", help="hidden size (default: the workload's; fp8 needs a multiple of 128)")
    c.add_argument("--seed", metavar="N", default="0", help="seed of every random input (default: 0)")
    c.add_argument("--transport", default="inproc", metavar="inproc|libfabric-tcp",
                   help="how ranks run and RDMA steps move (cpu backend): inproc: every rank's roles as threads of "
                        "this process, RDMA copies as memory copies; libfabric-tcp: one process per rank "
                        "(torch.distributed gloo rendezvous), RDMA steps through the emitted proxy loop over "
                        "libfabric's tcp provider (docs/rdma.md) (default: inproc)")
    c.set_defaults(func=cmd_run)
    return p


# `epcc run` backends: name -> (module, description).  A backend module provides
#   run_dispatch(plan, layout, x_rows: list[np.ndarray [T, row_bytes] uint8]) -> list[np.ndarray [n_d, row_bytes] uint8]
#   run_combine(plan, layout, y: list[np.ndarray [n_d, hidden] uint16 (bf16)]) -> list[np.ndarray [T, hidden] float32]
RUN_BACKENDS = {
    "cpu": ("epcc.runtime.engines.cpu.threads", "the CPU backend (backends/cpu: the layout lowered to LLVM IR, "
                                                "JIT-compiled, every rank's roles as threads)"),
    "reference": ("epcc.runtime.testing.reference", "the NumPy reference executor (runtime/testing/reference.py: "
                                                    "copies applied one after another; a debugging backend)"),
}


def _plan_options(c: argparse.ArgumentParser) -> None:
    c.add_argument("--routing", default="uniform", metavar="uniform|zipf:S|FILE.npy",
                   help="routing distribution: uniform (exact), zipf:S (expert popularity ~ 1/rank^S, sampled), "
                        "or a .npy file of top-k indices [N, k] or expert popularity [E] (default: uniform)")
    c.add_argument("--tokens", metavar="N", help="tokens per rank (default: the workload's)")
    c.add_argument("--dtype", choices=("bf16", "fp8"), help="dispatch dtype (default: the workload's)")


def _kernel_options(c: argparse.ArgumentParser, only: str = "") -> None:
    """--kernels and --sms: which kernels' SM model the simulation applies (resolved by _simulation).
    `only` prefixes the help of a command that simulates only with another option; there the
    default is None (not given, which means auto) so that giving them without it is an error."""
    c.add_argument("--kernels", choices=("auto", "direct", "table"), default=None if only else "auto",
                   help=only + "which CUDA kernels' SM model to apply: direct (the direct lowering of one-hop "
                        "plans: one pool of SMs per rank and program shared by its steps, and its kernel "
                        "launches), table (the table-driven kernels: one SM role per step), auto (what `epcc "
                        "compile --target cuda` runs: direct where it lowers the plan to direct kernels; the "
                        "default)")
    c.add_argument("--sms", metavar="N",
                   help=only + "with the direct kernels: SMs per program (default: the push step's `sms`, as the "
                        "CUDA target's default configuration)")


def _positive(text, flag: str, expected: str, too_small: str, most: int | None = None) -> int | None:
    """A positive integer option (at most `most`), or a located-at-the-flag user error."""
    if text is None:
        return None
    try:
        v = int(text)
    except ValueError:
        raise CompileError([Diagnostic("error", f"{flag} {text}: expected {expected}", None)]) from None
    if v <= 0:
        raise CompileError([Diagnostic("error", f"{flag} {text}: {too_small}", None)])
    if most is not None and v > most:
        raise CompileError([Diagnostic("error", f"{flag} {text}: out of range (at most {most}, as in a .sched file)",
                                       None)])
    return v


def _options(args):
    """PassOptions from --routing/--tokens/--hidden; a bad value is a user error (exit 1)."""
    tokens = _positive(args.tokens, "--tokens", "a whole number of tokens per rank, e.g. --tokens 4096",
                       "tokens per rank must be at least 1", LIMITS["tokens"])
    hidden = _positive(getattr(args, "hidden", None), "--hidden", "a whole number of channels, e.g. --hidden 256",
                       "the hidden size must be at least 1", LIMITS["hidden"])
    return PassOptions(routing=args.routing, tokens=tokens, hidden=hidden, dtype=getattr(args, "dtype", None))


def cmd_tune(args) -> int:
    bundle = Path(args.bundle)
    try:
        manifest = bundle_io.cuda_manifest(bundle)
    except bundle_io.BundleError as e:
        raise _user_error(str(e)) from None
    if "direct" not in manifest:
        why = manifest.get("direct_not_used")
        raise _user_error(f"{bundle}: nothing to tune: the plan is not one-hop "
                          f"({why if isinstance(why, str) else '?'})")
    nproc = manifest["num_ranks"] if args.nproc is None else args.nproc
    if nproc < 1:
        raise _user_error(f"--nproc {nproc}: expected a number of GPUs, at least 1")
    if nproc > MAX_RANKS:
        raise _user_error(f"--nproc {nproc}: more GPUs than epcc supports ranks ({MAX_RANKS})")
    try:
        import torch  # torch is the runtime extra: only `epcc tune` needs it here
    except ImportError as e:
        raise CompileError([Diagnostic("error", f"epcc tune: torch is not importable ({e}); run this on the GPU "
                                                f"machine, where torch is installed", None)]) from None
    # GPUs before torchrun: on a machine without them, that is the one thing to say
    if torch.cuda.device_count() < nproc:
        raise CompileError([Diagnostic("error", f"epcc tune: {nproc} GPUs needed, this machine has "
                                                f"{torch.cuda.device_count()}", None)])
    # torchrun comes with torch: beside this interpreter when the venv is not activated
    beside = Path(sys.executable).parent / "torchrun"
    torchrun = shutil.which("torchrun") or (str(beside) if beside.is_file() else None)
    if torchrun is None:
        raise CompileError([Diagnostic("error", "epcc tune: torchrun not found (it comes with torch); "
                                                "run this on the GPU machine", None)])
    cmd = [torchrun, "--nproc-per-node", str(nproc), "-m", "epcc.runtime.tune", str(bundle),
           "--sms", args.sms, "--warps", args.warps, "--iters", str(args.iters)]
    _say(" ".join(cmd))
    sys.stdout.flush()
    return subprocess.call(cmd)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sources = SourceMap()
    args.sources = sources
    try:
        return args.func(args)
    except CompileError as e:
        _say_lines(format_all(e.diagnostics, sources), err=True)
        return EXIT_USER
    except FileError as e:  # a file the user named: missing, not a regular file, too large, an input as output
        _say(f"epcc: error: {e}", err=True)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except OSError as e:  # a path the user gave cannot be read or written (-o /proc/x, -o FILE, ...)
        what = f"{e.filename}: " if e.filename else ""
        _say(f"epcc: error: {what}{e.strerror or e}", err=True)
        return EXIT_USER
    except Exception as e:  # an epcc bug: say so, without a traceback unless asked for
        if os.environ.get("EPCC_DEBUG"):
            traceback.print_exc()
        where = getattr(args, "file", "")
        _say(f"epcc: internal compiler error while processing {where}: {type(e).__name__}: {e}", err=True)
        _say("epcc: please report this with the input file; set EPCC_DEBUG=1 for a traceback", err=True)
        return EXIT_INTERNAL


def _say(line: str, err: bool = False) -> None:
    """Print one line, terminal-safe: no escape sequence, control character, line break or
    bidirectional override from a file name, a plan or a file reaches the terminal (epcc.textsafe)."""
    print(terminal(line), file=sys.stderr if err else sys.stdout)


def _say_lines(text: str, err: bool = False) -> None:
    """Print epcc's own multi-line text (diagnostics, tables, IR) with each line terminal-safe;
    user text inside must already be escaped, as format_all does."""
    print("\n".join(terminal(line) for line in str(text).split("\n")), file=sys.stderr if err else sys.stdout)


def _warn(c: pipeline.Compilation) -> None:
    if c.warnings:
        _say_lines(format_all(c.warnings, c.sources), err=True)


def _inputs(args) -> list[str]:
    """The files a command reads: its FILE and a --routing .npy."""
    routing = getattr(args, "routing", "")
    return [args.file] + ([routing] if routing.endswith(".npy") else [])


def cmd_check(args) -> int:
    c = pipeline.run(args.file, "model", args.sources)
    _warn(c)
    s = c.schedule
    combine = "derived from dispatch" if s.combine is None else f"{len(s.combine.steps)} steps"
    _say(f"{args.file}: ok: {s.topology.num_ranks} ranks, {len(s.dispatch.steps)} dispatch steps, combine {combine}")
    return EXIT_OK


def cmd_compile(args) -> int:
    until = args.emit or pipeline.STAGES[-1].name

    def print_after(name: str, text: str) -> None:
        sys.stdout.write(f"// IR after {name}\n{text}")

    if args.rdma != "auto" and getattr(args, "target", None) != "cuda":
        raise CompileError([Diagnostic("error", f"--rdma {args.rdma} chooses how the CUDA backend runs RDMA steps: "
                                                f"add --target cuda", None)])
    c = pipeline.run(args.file, until, args.sources, _options(args),
                     print_after if args.print_ir_after_all else None)
    _warn(c)
    if args.emit:
        if not args.print_ir_after_all:
            _say_lines(pipeline.show(c, args.emit).rstrip("\n"))
        return EXIT_OK
    out = Path(args.output or Path("build") / c.schedule.name)
    ir_file = out / f"{c.schedule.name}.mlir"
    # the bundle directory is the compiler's: it writes NAME.mlir, plan.json, manifest.json, cuda/
    refuse_overwrite("-o", str(out), [out, ir_file, out / "plan.json", out / "manifest.json"], _inputs(args),
                     dirs=[out])
    src = read_bytes(args.file, "a .sched file", SCHED_MAX_BYTES)
    out.mkdir(parents=True, exist_ok=True)
    ir_file.write_text(pipeline.show(c, until), encoding="utf-8")
    plan = c.passes.get("plan")
    (out / "plan.json").write_text(plan.to_json() + "\n", encoding="utf-8")
    manifest = {
        "epcc_version": __version__,
        "schedule": c.schedule.name,
        "source": str(args.file),
        "source_sha256": hashlib.sha256(src).hexdigest(),
        "num_ranks": c.schedule.topology.num_ranks,
        "routing": plan.routing,
        "stages": [s.name for s in pipeline.STAGES],
        "files": {"ir": ir_file.name, "plan": "plan.json"},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    _say(f"{args.file}: compiled to {out}/ ({ir_file.name}, plan.json, manifest.json)")
    if getattr(args, "target", None) == "cuda":
        try:
            written = emit_cuda(plan, out / "cuda", source=str(args.file), options=CudaOptions(rdma=args.rdma))
        except CudaCodegenError as e:
            raise CompileError([Diagnostic("error", f"--target cuda: {e}", None)]) from None
        _say(f"{args.file}: CUDA sources in {out}/cuda/ ({', '.join(p.relative_to(out / 'cuda').as_posix() for p in written)})")
        cm = json.loads((out / "cuda" / "manifest.json").read_text(encoding="utf-8"))
        if cm.get("lowering") == "direct":
            _say(f"{args.file}: lowering: direct kernels ({cm['direct']['source']}; the Buffer API runs them)")
        else:
            _say(f"{args.file}: lowering: table-driven kernels (no direct lowering: {cm.get('direct_not_used', '?')})")
    return EXIT_OK


def cmd_viz(args) -> int:
    refuse_overwrite("-o", args.output, [args.output], _inputs(args))
    if args.scheduled:
        built, res = _simulation(args, _options(args))
        path = render_scheduled(built, res, args.output)
        _say(f"{args.file}: scheduled DAG written to {path}")
        return EXIT_OK
    given = [f for f, v in (("--kernels", args.kernels), ("--sms", args.sms)) if v is not None]
    if given:
        raise _user_error(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with "
                          f"--scheduled: the DAG without it is not simulated")
    c = pipeline.run(args.file, "model", args.sources, _options(args))
    _warn(c)
    path = render(c.schedule, args.output)
    _say(f"{args.file}: DAG written to {path}")
    return EXIT_OK


def _simulation(args, options):
    """(the built plan, its simulation) under the SM model of the kernels that `--kernels` and `--sms`
    pick (`epcc simulate` and `epcc viz --scheduled`): auto (default) is what the CUDA target runs, the
    direct kernels where it lowers the plan to them (Plan.direct, plan/direct.py), else the
    table-driven kernels' SM roles.  Bad values and direct options on a plan without direct kernels
    are user errors (exit 1); the options are checked before the plan is built."""
    kernels = args.kernels or "auto"
    sms = _positive(args.sms, "--sms", "a whole number of SMs", "SMs must be at least 1")
    if sms is not None and kernels == "table":
        raise _user_error("--sms applies to the direct kernels, not to --kernels table (the plan's `sms` give the "
                          "roles)")
    built = build_plan(args.file, options, args.sources)
    _warn(built.compilation)
    direct = None
    if kernels != "table":  # kernel-formation recorded the CUDA target's choice (plan/direct.py)
        direct, why = built.plan.direct, built.plan.direct_not_used
        if direct is not None and sms is not None:
            direct = direct.with_sms(sms)
        if direct is None and (kernels == "direct" or sms is not None):
            flag = "--kernels direct" if kernels == "direct" else "--sms"
            raise _user_error(f"{flag}: the CUDA target does not lower {args.file} to direct kernels: {why}")
    try:
        res = simulate(built.plan, SimOptions(rdma_proxy=getattr(args, "rdma", "proxy") == "proxy", direct=direct))
    except SimulationError as e:
        raise _user_error(f"{args.file}: cannot simulate the plan: {e}") from None
    return built, res


def cmd_simulate(args) -> int:
    options = _options(args)
    tokens = options.tokens
    if args.gantt and not args.gantt.lower().endswith(".svg"):
        raise _user_error(f"--gantt {args.gantt}: the Gantt chart is written as SVG; name the file *.svg")
    if args.gantt:
        refuse_overwrite("--gantt", args.gantt, [args.gantt], _inputs(args))
    built, res = _simulation(args, options)
    if args.gantt:
        try:
            write_svg(res, args.gantt)
        except OSError as e:
            raise _user_error(f"--gantt {args.gantt}: cannot write the chart: {e.strerror or e}") from None
    if args.json:
        d = to_dict(res, built.passes_run, tokens if tokens is not None else built.schedule.workload.tokens)
        print(json.dumps(d, indent=1))
    else:
        _say_lines(table(res, built.passes_run))
        if args.gantt:
            _say(f"Gantt chart written to {args.gantt}")
    return EXIT_OK


# --------------------------------------------------------------------------- epcc run


def _user_error(msg: str) -> CompileError:
    return CompileError([Diagnostic("error", msg, None)])


def _load_plan_json(path: str):
    try:
        return bundle_io.read_plan(path)
    except bundle_io.BundleError as e:
        raise _user_error(str(e)) from None


def _run_bytes(R: int, tokens: int, hidden: int, dtype: str, topk: int) -> int:
    """About the most memory `epcc run` holds at once, in bytes: per token of every rank its
    payload row, its top-k dispatched rows (the backend's and the oracle's), their expert outputs
    (bf16), the combine results (fp32, the backend's and stacked) and the oracle's float64 sums,
    magnitudes and error terms."""
    row = hidden * 2 if dtype == "bf16" else hidden + (hidden // 128) * 4
    per_token = row + 2 * topk * row + 2 * topk * hidden + hidden * (2 * 4 + 5 * 8)
    return R * tokens * per_token


def _load_backend(name: str):
    module, _ = RUN_BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or the backend's own import-time failure
        return None, f"backend '{name}' is not available: importing {module} failed: {type(e).__name__}: {e}"
    missing = [f for f in ("run_dispatch", "run_combine") if not callable(getattr(mod, f, None))]
    if missing:
        return None, f"backend '{name}' ({module}) does not provide {' and '.join(missing)}"
    return mod, None


def _token_text(names: list[str], h: int, t: int) -> str:
    return f"token {t} of {names[h] if 0 <= h < len(names) else f'rank {h}'}"


def _dispatch_difference(layout, got_rows, want, names: list[str]) -> str | None:
    """The first difference between what the backend and layout delivered and the oracle, in words."""
    E = layout.experts
    for d, w in enumerate(want):
        rank = names[d]
        got_src = layout.entries.get(("output", d), np.zeros((0, 3), np.int64))
        if not np.array_equal(got_src, w.src):
            gk = got_src[:, 0] * (layout.tokens * E) + got_src[:, 1] * E + got_src[:, 2]
            wk = w.src[:, 0] * (layout.tokens * E) + w.src[:, 1] * E + w.src[:, 2]
            missing = np.flatnonzero(~np.isin(wk, gk))
            if missing.size:
                h, t, e = (int(v) for v in w.src[missing[0]])
                more = f" ({missing.size - 1} more rows missing)" if missing.size > 1 else ""
                return f"{rank} never receives {_token_text(names, h, t)} for expert {e}{more}"
            extra = np.flatnonzero(~np.isin(gk, wk))
            if extra.size:
                h, t, e = (int(v) for v in got_src[extra[0]])
                return f"{rank} receives {_token_text(names, h, t)} for expert {e}, which is not routed there"
            if gk.size != wk.size:
                u, cnt = np.unique(gk, return_counts=True)
                k = int(u[cnt > 1][0])
                h, t, e = k // (layout.tokens * E), (k // E) % layout.tokens, k % E
                return f"{rank} receives {_token_text(names, h, t)} for expert {e} {int(cnt[cnt > 1][0])} times"
            i = int(np.flatnonzero(gk != wk)[0])
            h, t, e = (int(v) for v in got_src[i])
            h2, t2, e2 = (int(v) for v in w.src[i])
            return (f"{rank}: output row {i} holds {_token_text(names, h, t)} for expert {e}; the documented order "
                    f"(local expert, home rank, token) puts {_token_text(names, h2, t2)} for expert {e2} there")
        if not np.array_equal(layout.recv_counts[d], w.counts):
            return f"{rank}: rows per local expert {layout.recv_counts[d].tolist()}, expected {w.counts.tolist()}"
        rows = np.asarray(got_rows[d]) if d < len(got_rows) else None
        if rows is None or rows.dtype != np.uint8 or rows.shape != w.rows.shape:
            what = "nothing" if rows is None else f"{rows.dtype} {list(rows.shape)}"
            return f"{rank}: the backend returned {what} for output, expected uint8 {list(w.rows.shape)}"
        bad = np.flatnonzero((rows != w.rows).any(axis=1))
        if bad.size:
            i = int(bad[0])
            h, t, e = (int(v) for v in w.src[i])
            byte = int(np.flatnonzero(rows[i] != w.rows[i])[0])
            more = f" ({bad.size - 1} more rows differ)" if bad.size > 1 else ""
            return (f"{rank}: output row {i} ({_token_text(names, h, t)}, expert {e}) differs from the token's "
                    f"payload from byte {byte} on{more}")
        gw = layout.output_weights[d] if d < len(layout.output_weights) else None
        if gw is None or gw.shape != w.weights.shape or \
                not np.array_equal(gw.astype(np.float32).view(np.uint32), w.weights.view(np.uint32)):
            i = 0 if gw is None or gw.shape != w.weights.shape else \
                int(np.flatnonzero(gw.astype(np.float32).view(np.uint32) != w.weights.view(np.uint32))[0])
            h, t, e = (int(v) for v in w.src[i]) if w.src.shape[0] else (0, 0, 0)
            return f"{rank}: output row {i} ({_token_text(names, h, t)}, expert {e}) carries the wrong routing weight"
    return None


def _transport_backend(backend: str, transport: str):
    """The backend running one process per rank over `transport`, or a one-line error."""
    from .runtime.engines import cpu_procs as procs  # llvmlite, jinja2: only `epcc run --transport` needs them

    if transport not in procs.TRANSPORTS:
        return f"--transport {transport}: unknown transport (choose from {', '.join(procs.TRANSPORTS)})"
    if backend != "cpu":
        return f"--transport {transport}: only the cpu backend runs over a transport (not '{backend}')"
    try:
        procs.check_transport(transport)
    except procs.TransportUnavailable as e:
        return str(e)
    return procs.ProcessBackend(transport)


def cmd_run(args) -> int:
    timings: dict[str, float] = {}

    def timed(name, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
        return out

    try:
        seed = int(args.seed)
    except ValueError:
        raise _user_error(f"--seed {args.seed}: expected a whole number, e.g. --seed 0") from None
    if seed < 0:
        raise _user_error(f"--seed {args.seed}: the seed must be >= 0")
    try:
        inputs.check_spec(args.routing)
    except ValueError as e:
        raise _user_error(f"--{e}") from None
    options = _options(args)  # validates --tokens and --hidden
    if args.file.endswith(".json"):
        if options.hidden is not None:
            raise _user_error(f"--hidden {args.hidden}: {args.file} is a compiled plan, whose hidden size is fixed; "
                              f"compile the .sched with --hidden instead")
        plan = timed("load", _load_plan_json, args.file)
        tokens = options.tokens if options.tokens is not None else plan.workload.tokens
        schedule = plan.schedule
    else:
        # The compiler models uniform and zipf routings; for the others its expected volumes
        # (which the layout does not use) are those of uniform routing.
        options.routing = args.routing if args.routing == "uniform" or args.routing.startswith("zipf:") else "uniform"
        c = timed("compile", pipeline.run, args.file, pipeline.STAGES[-1].name, args.sources, options)
        _warn(c)
        plan = c.passes.get("plan")
        tokens = c.schedule.workload.tokens
        schedule = c.schedule.name
    wl = plan.workload
    R = plan.num_ranks
    need, avail = _run_bytes(R, tokens, wl.hidden, wl.dtype, wl.topk), limits.available_memory()
    if avail is not None and need > avail:
        raise _user_error(f"{R} ranks x {tokens} tokens x hidden {wl.hidden} ({wl.dtype}): the run needs about "
                          f"{limits.memory_text(need)} of memory (inputs, dispatched rows, expert outputs, combine "
                          f"results, the oracle's sums), {limits.memory_text(avail)} are available; use smaller "
                          f"--tokens or --hidden")
    names = list(plan.rank_names) or [f"rank {r}" for r in range(R)]
    try:
        routing = timed("inputs", inputs.make_topk, args.routing, R, tokens, wl.topk, wl.experts, wl.placement,
                        seed)
        weights = timed("inputs", inputs.make_weights, routing.topk_idx, seed)
        x = timed("inputs", inputs.make_x_rows, R, tokens, wl.hidden, wl.dtype, seed)
    except ValueError as e:
        raise _user_error(f"--routing {args.routing}: {e}") from None
    if getattr(args, "transport", "inproc") != "inproc":
        try:  # EPCC_RDMA_CHUNK_TOKENS / EPCC_RDMA_DEPTH re-chunk the RDMA steps (docs/rdma.md)
            plan = rdma_plan.with_overrides(plan)
        except rdma_plan.RdmaConfigError as e:
            raise _user_error(str(e)) from None
    try:
        layout = timed("layout", compute_layout, plan, routing.topk_idx, weights)
    except ValueError as e:
        raise _user_error(f"{args.file}: cannot lay out the plan: {e}") from None
    backend, why = _load_backend(args.backend)
    if backend is None:
        _say(f"epcc: error: {why}", err=True)
        _say("epcc: note: '--backend reference' runs the NumPy reference executor", err=True)
        return EXIT_USER
    transport = getattr(args, "transport", "inproc")
    if transport != "inproc":
        backend = _transport_backend(args.backend, transport)
        if isinstance(backend, str):
            _say(f"epcc: error: {backend}", err=True)
            return EXIT_USER
    head = (f"{schedule}: {R} ranks x {tokens} tokens, hidden {wl.hidden} {wl.dtype}, top-{wl.topk} of {wl.experts}, "
            f"routing {routing.describe()}, seed {seed}, backend {args.backend}"
            + (f", transport {transport}" if transport != "inproc" else ""))

    def times() -> str:
        order = ["compile", "load", "inputs", "layout", "dispatch", "combine", "oracle"]
        return ", ".join(f"{k} {timings[k] * 1e3:.1f} ms" for k in order if k in timings)

    def backend_failed(phase: str, e: BaseException) -> int:
        if os.environ.get("EPCC_DEBUG"):
            traceback.print_exc()
        _say(f"{head}: {phase} FAILED; {times()}")
        _say(f"epcc: error: backend '{args.backend}' failed in {phase}: {type(e).__name__}: {e}", err=True)
        return EXIT_USER

    try:
        got = timed("dispatch", backend.run_dispatch, plan, layout, [x[r] for r in range(R)])
    except Exception as e:
        return backend_failed("dispatch", e)
    want = timed("oracle", oracle.dispatch_oracle, routing.topk_idx, wl.experts, wl.placement, x, weights)
    rows = [int(w.rows.shape[0]) for w in want]
    recv = f"{sum(rows)} rows received ({min(rows)}..{max(rows)} per rank)"
    diff = _dispatch_difference(layout, got, want, names)
    if diff is not None:
        _say(f"{head}: {recv}; dispatch MISMATCH, combine not run; {times()}")
        _say(f"epcc: error: dispatch differs from the oracle: {diff}", err=True)
        return EXIT_USER
    y = timed("inputs", inputs.make_expert_outputs, rows, wl.hidden, seed)
    try:
        res = timed("combine", backend.run_combine, plan, layout, y)
    except Exception as e:
        return backend_failed("combine", e)
    ref, mag = timed("oracle", lambda: oracle.combine_oracle(routing.topk_idx, wl.experts, wl.placement, weights, y,
                                                             wl.hidden, return_abs=True))
    shape = (tokens, wl.hidden)
    if len(res) != R or any(np.asarray(r).shape != shape for r in res):
        _say(f"{head}: {recv}; dispatch OK; combine MISMATCH; {times()}")
        _say(f"epcc: error: backend '{args.backend}' returned combine results of shapes "
             f"{[list(np.asarray(r).shape) for r in res]}, expected {R} x {list(shape)}", err=True)
        return EXIT_USER
    got_all = np.stack([np.asarray(r, dtype=np.float32) for r in res])
    rounding = backend.partial_rounding(plan) if hasattr(backend, "partial_rounding") else 0.0
    chk = oracle.compare_combine(got_all, ref, mag, wl.topk, rounding)
    rel_mag = np.abs(got_all.astype(np.float64) - ref) / np.where(mag > 0, mag, 1.0)
    err = f"max |error| {float(rel_mag.max()) if rel_mag.size else 0.0:.1e} of sum|w*y|, "
    err += f"max {chk.max_ulp} bf16 ulp" if chk.max_ulp <= oracle.MAX_ULP else (
        f"{chk.beyond_ulp} of {ref.size} values beyond {oracle.MAX_ULP} bf16 ulp (sums that cancel: within the fp32 "
        f"reordering bound" + (", plus one bf16 rounding of the partials that crossed an RDMA link)" if rounding else ")"))
    if not chk.ok:
        h, t, ch = chk.first_bad
        experts = [int(e) for e in routing.topk_idx[h, t] if e >= 0]
        _say(f"{head}: {recv}; dispatch OK (bit-exact); combine MISMATCH ({err}); {times()}")
        _say(f"epcc: error: combine differs from the oracle: {_token_text(names, h, t)} (experts {experts}), "
             f"channel {ch}: got {chk.got:.6g}, expected {chk.want:.6g}", err=True)
        return EXIT_USER
    _say(f"{head}: {recv}; dispatch OK (bit-exact); combine OK ({err}); {times()}")
    if hasattr(backend, "summary") and backend.summary():
        _say(f"transport: {backend.summary()}")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
