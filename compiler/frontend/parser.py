"""Reading and parsing .sched files: the frontend's entry points.

The only boundary between lark and the rest of epcc: lark's exceptions become
:class:`~epcc.diagnostics.CompileError` with the expected tokens said in words
(:mod:`epcc.frontend.syntax_errors`), and lark trees become the frozen AST of
:mod:`epcc.frontend.ast` (:mod:`epcc.frontend.ast_builder`).
"""

from __future__ import annotations

import dataclasses
import unicodedata

from lark.exceptions import UnexpectedInput

from ..diagnostics import CompileError, Diagnostic, SourceMap, Span, source_lines
from ..files import SCHED_MAX_BYTES, FileError, read_bytes
from ..textsafe import BIDI_CONTROLS
from . import ast
from .ast_builder import AstBuilder
from .grammar import lark_parser
from .syntax_errors import syntax_error

MAX_BIDI_WARNINGS = 8


def read_source(path: str) -> str:
    """The text of a .sched file, or a CompileError naming the file.  The file is read as
    epcc.files reads every input (a regular file, at most SCHED_MAX_BYTES); CR LF and lone CR
    line endings become LF, so that lines are counted as the editor shows them."""
    try:
        data = read_bytes(path, "a .sched file", SCHED_MAX_BYTES)
    except FileError as e:
        raise CompileError([Diagnostic("error", str(e), None)]) from None
    for bom, enc in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
                     (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16")):
        if data.startswith(bom) and (enc == "UTF-32" or b"\x00" in data[2:64]):
            raise CompileError([Diagnostic("error", f"{path}: the file is {enc} encoded; save it as UTF-8", None)])
    if b"\x00" in data:
        at = data.index(b"\x00")
        line = data[:at].count(b"\n") + 1
        col = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise CompileError([Diagnostic("error", "NUL byte: a binary file? expected .sched text", Span.point(path, line, col))])
    data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
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


def bidi_warnings(text: str, path: str) -> list[Diagnostic]:
    """A located warning for each bidirectional control character ("Trojan Source"): in a
    comment or a string it can make a line display in an order other than the one epcc reads.
    (Elsewhere the lexer refuses it.)  At most MAX_BIDI_WARNINGS, the last one counting the rest."""
    found = [i for i, ch in enumerate(text) if ch in BIDI_CONTROLS]
    out = []
    for n, i in enumerate(found[:MAX_BIDI_WARNINGS]):
        line = text.count("\n", 0, i) + 1
        col = i - (text.rfind("\n", 0, i) + 1) + 1
        ch = text[i]
        more = len(found) - MAX_BIDI_WARNINGS
        rest = f" ({more} more in this file)" if n == MAX_BIDI_WARNINGS - 1 and more > 0 else ""
        out.append(Diagnostic("warning", f"bidirectional control character U+{ord(ch):04X} "
                                         f"({unicodedata.name(ch, 'BIDI CONTROL')}): the line may display in an order "
                                         f"other than the one epcc reads{rest}", Span.point(path, line, col)))
    return out


def parse_file(path: str, sources: SourceMap | None = None) -> ast.File:
    text = read_source(path)
    if sources is not None:
        sources.add(path, text)
    return parse_text(text, path)


def parse_text(text: str, path: str = "<input>") -> ast.File:
    warnings = bidi_warnings(text, path)
    if not text.strip() or all(_is_comment_or_blank(line) for line in source_lines(text)):
        raise CompileError(
            [
                Diagnostic(
                    "error",
                    "empty schedule: expected a 'topology', a 'workload' and 'dispatch'/'combine' programs",
                    Span.point(path, 1, 1),
                )
            ] + warnings
        )
    try:
        tree = lark_parser().parse(text)
    except UnexpectedInput as e:
        raise CompileError(warnings + [syntax_error(e, text, path)]) from None
    try:
        f = AstBuilder(path).file(tree, text)
    except CompileError as e:
        raise CompileError(warnings + e.diagnostics) from None
    return dataclasses.replace(f, warnings=tuple(warnings)) if warnings else f


def _is_comment_or_blank(line: str) -> bool:
    s = line.strip()
    return not s or s.startswith("#")
