"""The `epcc` command line.

Exit status: 0 on success, 1 on a user error (a bad .sched file, an impossible topology, a
missing file), 2 on bad usage of the command itself, 3 on an internal compiler error.
Diagnostics go to stderr as `path:line:col: error: message` with the source line and a caret.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

from . import __version__
from .diagnostics import CompileError, SourceMap, format_all
from . import pipeline

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
    _plan_options(c)
    c.set_defaults(func=cmd_compile)

    c = sub.add_parser("viz", help="draw the schedule DAG with graphviz",
                       description="Draw the dispatch DAG: steps grouped by the tier they run across, edges for "
                                   "data and order dependencies, colours for link kinds, expected volumes.")
    c.add_argument("file", metavar="FILE", help="the .sched file")
    c.add_argument("-o", "--output", metavar="OUT", required=True, help="picture to write: .svg, .png, .pdf or .dot")
    c.add_argument("--scheduled", action="store_true",
                   help="draw the scheduled plan instead: overlap groups from the simulation, chunks, SM roles, "
                        "pipelined dependencies and the critical path")
    _plan_options(c)
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
    c.set_defaults(func=cmd_simulate)
    return p


def _plan_options(c: argparse.ArgumentParser) -> None:
    c.add_argument("--routing", default="uniform", metavar="uniform|zipf:S|FILE.npy",
                   help="routing distribution: uniform (exact), zipf:S (expert popularity ~ 1/rank^S, sampled), "
                        "or a .npy file of top-k indices [N, k] or expert popularity [E] (default: uniform)")
    c.add_argument("--tokens", metavar="N", help="tokens per rank (default: the workload's)")


def _options(args):
    """PassOptions from --routing/--tokens; a bad value is a user error (exit 1)."""
    from .diagnostics import Diagnostic
    from .passes import PassOptions

    tokens = None
    if args.tokens is not None:
        try:
            tokens = int(args.tokens)
        except ValueError:
            raise CompileError([Diagnostic("error", f"--tokens {args.tokens}: expected a whole number of tokens per "
                                                    f"rank, e.g. --tokens 4096", None)]) from None
        if tokens <= 0:
            raise CompileError([Diagnostic("error", f"--tokens {args.tokens}: tokens per rank must be at least 1",
                                           None)])
    return PassOptions(routing=args.routing, tokens=tokens)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sources = SourceMap()
    args.sources = sources
    try:
        return args.func(args)
    except CompileError as e:
        print(format_all(e.diagnostics, sources), file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # an epcc bug: say so, without a traceback unless asked for
        if os.environ.get("EPCC_DEBUG"):
            traceback.print_exc()
        where = getattr(args, "file", "")
        print(f"epcc: internal compiler error while processing {where}: {type(e).__name__}: {e}\n"
              f"epcc: please report this with the input file; set EPCC_DEBUG=1 for a traceback", file=sys.stderr)
        return EXIT_INTERNAL


def _warn(c: pipeline.Compilation) -> None:
    if c.warnings:
        print(format_all(c.warnings, c.sources), file=sys.stderr)


def cmd_check(args) -> int:
    c = pipeline.run(args.file, "model", args.sources)
    _warn(c)
    s = c.schedule
    combine = "derived from dispatch" if s.combine is None else f"{len(s.combine.steps)} steps"
    print(f"{args.file}: ok: {s.topology.num_ranks} ranks, {len(s.dispatch.steps)} dispatch steps, combine {combine}")
    return EXIT_OK


def cmd_compile(args) -> int:
    until = args.emit or pipeline.STAGES[-1].name

    def print_after(name: str, text: str) -> None:
        sys.stdout.write(f"// IR after {name}\n{text}")

    c = pipeline.run(args.file, until, args.sources, _options(args),
                     print_after if args.print_ir_after_all else None)
    _warn(c)
    if args.emit:
        if not args.print_ir_after_all:
            sys.stdout.write(pipeline.show(c, args.emit).rstrip("\n") + "\n")
        return EXIT_OK
    out = Path(args.output or Path("build") / c.schedule.name)
    out.mkdir(parents=True, exist_ok=True)
    ir_file = out / f"{c.schedule.name}.mlir"
    ir_file.write_text(pipeline.show(c, until), encoding="utf-8")
    plan = c.passes.get("plan")
    (out / "plan.json").write_text(plan.to_json() + "\n", encoding="utf-8")
    src = Path(args.file).read_bytes()
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
    print(f"{args.file}: compiled to {out}/ ({ir_file.name}, plan.json, manifest.json)")
    return EXIT_OK


def cmd_viz(args) -> int:
    from .viz import render, render_scheduled

    if args.scheduled:
        from .sim import build_plan, simulate

        built = build_plan(args.file, _options(args), args.sources)
        _warn(built.compilation)
        path = render_scheduled(built, simulate(built.plan), args.output)
        print(f"{args.file}: scheduled DAG written to {path}")
        return EXIT_OK
    c = pipeline.run(args.file, "model", args.sources, _options(args))
    _warn(c)
    path = render(c.schedule, args.output)
    print(f"{args.file}: DAG written to {path}")
    return EXIT_OK


def cmd_simulate(args) -> int:
    from .diagnostics import Diagnostic
    from .sim import SimulationError, build_plan, simulate
    from .sim.gantt import write_svg
    from .sim.report import table, to_dict

    def bad(msg: str) -> CompileError:
        return CompileError([Diagnostic("error", msg, None)])

    options = _options(args)
    tokens = options.tokens
    if args.gantt and not args.gantt.lower().endswith(".svg"):
        raise bad(f"--gantt {args.gantt}: the Gantt chart is written as SVG; name the file *.svg")
    built = build_plan(args.file, options, args.sources)
    _warn(built.compilation)
    try:
        res = simulate(built.plan)
    except SimulationError as e:
        raise bad(f"{args.file}: cannot simulate the plan: {e}") from None
    if args.gantt:
        try:
            write_svg(res, args.gantt)
        except OSError as e:
            raise bad(f"--gantt {args.gantt}: cannot write the chart: {e.strerror or e}") from None
    if args.json:
        d = to_dict(res, built.passes_run, tokens if tokens is not None else built.schedule.workload.tokens)
        print(json.dumps(d, indent=1))
    else:
        print(table(res, built.passes_run))
        if args.gantt:
            print(f"Gantt chart written to {args.gantt}")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
