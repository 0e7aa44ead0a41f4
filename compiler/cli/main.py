"""The `epcc` command: its parser (one subcommand per module of this package) and `main`, which
turns every error into its exit status and one message.

Exit status: 0 on success, 1 on a user error (a bad .sched file, an impossible topology, a
missing file), 2 on bad usage of the command itself, 3 on an internal compiler error.
Diagnostics go to stderr as `path:line:col: error: message` with the source line and a caret.
"""

from __future__ import annotations

import argparse
import os
import traceback

from .. import __version__
from ..diagnostics import CompileError, SourceMap, format_all
from ..files import FileError
from . import check, compile, run, simulate, tune, viz
from .common import EXIT_INTERNAL, EXIT_OK, EXIT_USER, say, say_lines

COMMANDS = (check, compile, viz, simulate, tune, run)  # in the order `epcc --help` lists them


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epcc",
        description="Compile MoE expert-parallel dispatch/combine schedules (.sched) for a described topology.",
        epilog="Language reference: docs/language.md.  Exit status: 0 ok, 1 error in the input, 2 bad usage.",
    )
    p.add_argument("--version", action="version", version=f"epcc {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sources = SourceMap()
    args.sources = sources
    try:
        return args.func(args)
    except CompileError as e:
        say_lines(format_all(e.diagnostics, sources), err=True)
        return EXIT_USER
    except FileError as e:  # a file the user named: missing, not a regular file, too large, an input as output
        say(f"epcc: error: {e}", err=True)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except OSError as e:  # a path the user gave cannot be read or written (-o /proc/x, -o FILE, ...)
        what = f"{e.filename}: " if e.filename else ""
        say(f"epcc: error: {what}{e.strerror or e}", err=True)
        return EXIT_USER
    except Exception as e:  # an epcc bug: say so, without a traceback unless asked for
        if os.environ.get("EPCC_DEBUG"):
            traceback.print_exc()
        where = getattr(args, "file", "")
        say(f"epcc: internal compiler error while processing {where}: {type(e).__name__}: {e}", err=True)
        say("epcc: please report this with the input file; set EPCC_DEBUG=1 for a traceback", err=True)
        return EXIT_INTERNAL
