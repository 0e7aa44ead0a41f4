"""Reading and parsing .sched files: the frontend's entry points.

The only boundary between lark and the rest of epcc: lark's exceptions become
:class:`~epcc.diagnostics.CompileError` with the expected tokens said in words
(:mod:`epcc.frontend.syntax_errors`), and lark trees become the frozen AST of
:mod:`epcc.frontend.ast` (:mod:`epcc.frontend.ast_builder`).
"""

from __future__ import annotations

from pathlib import Path

from lark.exceptions import UnexpectedInput

from ..diagnostics import CompileError, Diagnostic, SourceMap, Span
from . import ast
from .ast_builder import AstBuilder
from .grammar import lark_parser
from .syntax_errors import syntax_error


def read_source(path: str) -> str:
    """The text of a .sched file, or a CompileError naming the file."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise CompileError([Diagnostic("error", f"{path}: no such file", None)]) from None
    except IsADirectoryError:
        raise CompileError([Diagnostic("error", f"{path}: is a directory, not a .sched file", None)]) from None
    except OSError as e:
        raise CompileError([Diagnostic("error", f"{path}: cannot read: {e.strerror}", None)]) from None
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") and b"\x00" in data[2:64]:
        raise CompileError([Diagnostic("error", f"{path}: the file is UTF-16 encoded; save it as UTF-8", None)])
    if b"\x00" in data:
        at = data.index(b"\x00")
        line = data[:at].count(b"\n") + 1
        col = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise CompileError([Diagnostic("error", "NUL byte: a binary file? expected .sched text", Span.point(path, line, col))])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise CompileError(
            [Diagnostic("error", f"file is not valid UTF-8 (byte 0x{data[e.start]:02x})", Span.point(path, line, col))]
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return text


def parse_file(path: str, sources: SourceMap | None = None) -> ast.File:
    text = read_source(path)
    if sources is not None:
        sources.add(path, text)
    return parse_text(text, path)


def parse_text(text: str, path: str = "<input>") -> ast.File:
    if not text.strip() or all(_is_comment_or_blank(line) for line in text.splitlines()):
        raise CompileError(
            [
                Diagnostic(
                    "error",
                    "empty schedule: expected a 'topology', a 'workload' and 'dispatch'/'combine' programs",
                    Span.point(path, 1, 1),
                )
            ]
        )
    try:
        tree = lark_parser().parse(text)
    except UnexpectedInput as e:
        raise CompileError([syntax_error(e, text, path)]) from None
    return AstBuilder(path).file(tree, text)


def _is_comment_or_blank(line: str) -> bool:
    s = line.strip()
    return not s or s.startswith("#")
