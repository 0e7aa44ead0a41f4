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
    c.set_defaults(func=cmd_compile)

    c = sub.add_parser("viz", help="draw the schedule DAG with graphviz",
                       description="Draw the dispatch DAG: steps grouped by the tier they run across, edges for "
                                   "data and order dependencies, colours for link kinds, expected volumes.")
    c.add_argument("file", metavar="FILE", help="the .sched file")
    c.add_argument("-o", "--output", metavar="OUT", required=True, help="picture to write: .svg, .png, .pdf or .dot")
    c.set_defaults(func=cmd_viz)
    return p


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
    c = pipeline.run(args.file, until, args.sources)
    _warn(c)
    if args.emit:
        sys.stdout.write(pipeline.show(c, args.emit).rstrip("\n") + "\n")
        return EXIT_OK
    out = Path(args.output or Path("build") / c.schedule.name)
    out.mkdir(parents=True, exist_ok=True)
    ir_text = pipeline.show(c, "mlir")
    ir_file = out / f"{c.schedule.name}.mlir"
    ir_file.write_text(ir_text, encoding="utf-8")
    src = Path(args.file).read_bytes()
    manifest = {
        "epcc_version": __version__,
        "schedule": c.schedule.name,
        "source": str(args.file),
        "source_sha256": hashlib.sha256(src).hexdigest(),
        "num_ranks": c.schedule.topology.num_ranks,
        "stages": [s.name for s in pipeline.STAGES],
        "files": {"ir": ir_file.name},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    print(f"{args.file}: compiled to {out}/ ({ir_file.name}, manifest.json)")
    return EXIT_OK


def cmd_viz(args) -> int:
    from .viz import render

    c = pipeline.run(args.file, "model", args.sources)
    _warn(c)
    path = render(c.schedule, args.output)
    print(f"{args.file}: DAG written to {path}")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
