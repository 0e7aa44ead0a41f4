"""What every command of the `epcc` command line shares: the exit statuses, terminal-safe
printing, user errors and the files a command reads."""

from __future__ import annotations

import sys

from .. import pipeline
from ..diagnostics import CompileError, Diagnostic, format_all
from ..textsafe import terminal

EXIT_OK, EXIT_USER, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def say(line: str, err: bool = False) -> None:
    """Print one line, terminal-safe: no escape sequence, control character, line break or
    bidirectional override from a file name, a plan or a file reaches the terminal (epcc.textsafe)."""
    print(terminal(line), file=sys.stderr if err else sys.stdout)


def say_lines(text: str, err: bool = False) -> None:
    """Print epcc's own multi-line text (diagnostics, tables, IR) with each line terminal-safe;
    user text inside must already be escaped, as format_all does."""
    print("\n".join(terminal(line) for line in str(text).split("\n")), file=sys.stderr if err else sys.stdout)


def warn(c: pipeline.Compilation) -> None:
    if c.warnings:
        say_lines(format_all(c.warnings, c.sources), err=True)


def user_error(msg: str) -> CompileError:
    """A user error without a location (a bad option, a file that is not what it should be): exit 1."""
    return CompileError([Diagnostic("error", msg, None)])


def inputs_of(args) -> list[str]:
    """The files a command reads: its FILE and a --routing .npy."""
    routing = getattr(args, "routing", "")
    return [args.file] + ([routing] if routing.endswith(".npy") else [])
