"""Located diagnostics: one error type, one printer.

Every user-facing problem in epcc is a :class:`Diagnostic` with a :class:`Span` into the source
file.  Phases collect diagnostics in a :class:`DiagnosticBag` and raise :class:`CompileError` once
the phase is done, so a user sees every semantic error of a file in one run.  The printer formats

    path:line:col: error: message
      <the source line>
      ^~~~~~
    path:line:col: note: ...

which is what editors and CI log parsers understand.  Everything printed passes through
:func:`epcc.textsafe.terminal` (no escape sequence or control character of the input reaches the
terminal), and the caret counts display columns: an escaped character takes its escape's width, a
wide (East Asian) character two columns.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .textsafe import terminal, terminal_width


@dataclass(frozen=True, order=True)
class Span:
    """A half-open region of a source file; lines and columns are 1-based."""

    path: str
    line: int
    col: int
    end_line: int
    end_col: int

    @staticmethod
    def point(path: str, line: int, col: int) -> "Span":
        return Span(path, line, col, line, col + 1)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Note:
    message: str
    span: Span | None = None


@dataclass(frozen=True)
class Diagnostic:
    severity: str  # "error" | "warning"
    message: str
    span: Span | None
    notes: tuple[Note, ...] = ()


class CompileError(Exception):
    """Raised with every diagnostic of the failing phase.  The CLI prints them and exits 1."""

    def __init__(self, diagnostics: Sequence[Diagnostic]):
        self.diagnostics = list(diagnostics)
        super().__init__("\n".join(d.message for d in self.diagnostics))


class DiagnosticBag:
    def __init__(self) -> None:
        self.items: list[Diagnostic] = []

    def error(self, span: Span | None, message: str, *notes: Note | str) -> None:
        self.items.append(Diagnostic("error", message, span, _notes(notes)))

    def warning(self, span: Span | None, message: str, *notes: Note | str) -> None:
        self.items.append(Diagnostic("warning", message, span, _notes(notes)))

    @property
    def has_errors(self) -> bool:
        return any(d.severity == "error" for d in self.items)

    def raise_if_errors(self) -> None:
        if self.has_errors:
            raise CompileError(sorted(self.items, key=_order))

    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "warning"]


def _notes(notes: Iterable[Note | str]) -> tuple[Note, ...]:
    return tuple(n if isinstance(n, Note) else Note(n) for n in notes)


def _order(d: Diagnostic):
    s = d.span
    return (0, s.path, s.line, s.col) if s else (1, "", 0, 0)


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """A 'did you mean' note for a misspelled name, or None."""
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None


class SourceMap:
    """Source text by path, for printing the offending line under a diagnostic."""

    def __init__(self) -> None:
        self._lines: dict[str, list[str]] = {}

    def add(self, path: str, text: str) -> None:
        self._lines[path] = source_lines(text)

    def line(self, path: str, line: int) -> str | None:
        lines = self._lines.get(path)
        if lines is None or not (1 <= line <= len(lines)):
            return None
        return lines[line - 1]


def source_lines(text: str) -> list[str]:
    """The lines of a source text as the parser counts them: split at LF only (the frontend has
    turned CR LF and lone CR into LF), so that form feeds, NEL or U+2028 inside a line do not
    shift the lines a diagnostic points at."""
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def format_diagnostic(d: Diagnostic, sources: SourceMap | None = None) -> str:
    out: list[str] = []
    head = f"{terminal(str(d.span))}: " if d.span else "epcc: "
    out.append(f"{head}{d.severity}: {terminal(d.message)}")
    if d.span is not None and sources is not None:
        out.extend(_excerpt(d.span, sources))
    for n in d.notes:
        where = f"{terminal(str(n.span))}: " if n.span else ""
        out.append(f"{where}note: {terminal(n.message)}")
        if n.span is not None and sources is not None:
            out.extend(_excerpt(n.span, sources))
    return "\n".join(out)


def _excerpt(span: Span, sources: SourceMap) -> list[str]:
    """The source line (terminal-safe, a tab shown as one space) and a caret line under the span,
    aligned by display columns."""
    text = sources.line(span.path, span.line)
    if text is None:
        return []
    text = text.replace("\t", " ")
    cols = [0]  # cols[i]: the display column where character i starts
    for ch in text:
        cols.append(cols[-1] + terminal_width(ch))
    first = min(max(span.col - 1, 0), len(text))
    last = min(max(span.end_col - 1, first + 1), len(text)) if span.end_line == span.line else len(text)
    width = max(cols[last] - cols[first], 1) if last > first else 1
    return ["  " + terminal(text), "  " + " " * cols[first] + "^" + "~" * (width - 1)]


def format_all(diags: Sequence[Diagnostic], sources: SourceMap | None = None) -> str:
    body = "\n".join(format_diagnostic(d, sources) for d in diags)
    n_err = sum(d.severity == "error" for d in diags)
    if n_err > 1:
        body += f"\n{n_err} errors generated."
    return body


@dataclass
class Reporter:
    """What the CLI hands to phases: collects warnings that must be shown even on success."""

    sources: SourceMap = field(default_factory=SourceMap)
    warnings: list[Diagnostic] = field(default_factory=list)
