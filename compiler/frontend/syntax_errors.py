"""Lark's syntax errors as epcc diagnostics.

A lark exception becomes one located :class:`~epcc.diagnostics.Diagnostic` whose message says,
in words, what was found and what the grammar expected there ("unexpected name 'sned'; expected
one of ..."), with a did-you-mean note for a misspelt keyword, and with targeted messages for
the common slips (a decimal where a whole number belongs, an unterminated string).
"""

from __future__ import annotations

import re

from lark import Token
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from ..diagnostics import Diagnostic, Note, Span, did_you_mean, source_lines
from .grammar import lark_parser

# How a terminal is named in "expected ..." lists.
TOKEN_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "DECIMAL": "a decimal number",
    "STRING": "a quoted string",
    "ALL_TOKENS": "'all tokens'",
    "$END": "end of file",
}


def _word(term: str) -> str:
    if term in TOKEN_WORDS:
        return TOKEN_WORDS[term]
    try:
        t = lark_parser().get_terminal(term)
    except KeyError:
        return term.lower()
    if t.pattern.type == "str":
        return f"'{t.pattern.value}'"
    return term.lower()


def _expected_words(expected: set[str]) -> list[str]:
    words = {_word(t) for t in expected}
    if {"an integer", "a decimal number"} <= words:
        words -= {"an integer", "a decimal number"}
        words.add("a number")
    words = sorted(words)
    # Keywords first, then classes ('a name', ...), end of file last.
    return sorted(words, key=lambda w: (w == "end of file", not w.startswith("'"), w))


def _keywords(expected: set[str]) -> list[str]:
    out = []
    for t in expected:
        w = _word(t)
        if w.startswith("'") and w[1:-1].replace("_", "").isalpha():
            out.append(w[1:-1])
    return out


def syntax_error(e: UnexpectedInput, text: str, path: str) -> Diagnostic:
    """The diagnostic for lark's exception `e` while parsing `text` (the file `path`)."""
    notes: list[Note] = []
    if isinstance(e, UnexpectedToken) and e.token.type == "$END":
        expected = _expected_words(set(e.expected))
        line, col = _end_position(text)
        msg = f"unexpected end of file; expected {_one_of(expected)}"
        return Diagnostic("error", msg, Span.point(path, line, col))
    if isinstance(e, UnexpectedEOF):
        line, col = _end_position(text)
        return Diagnostic("error", f"unexpected end of file; expected {_one_of(_expected_words(set(e.expected)))}",
                          Span.point(path, line, col))
    if isinstance(e, UnexpectedToken) and e.token.start_pos is not None and (
            str(e.token) == "." or (e.token.type == "NAME" and str(e.token)[0] in "eE")):
        dec = _decimal_at(text, e.token.start_pos, e.token.line, e.token.column, path)
        if dec is not None:
            return dec
    if isinstance(e, UnexpectedToken):
        tok = e.token
        expected_terms = set(e.accepts or e.expected) if getattr(e, "accepts", None) else set(e.expected)
        expected = _expected_words(expected_terms)
        shown = _show_token(tok)
        span = Span(path, tok.line, tok.column, tok.end_line or tok.line, tok.end_column or tok.column + 1)
        if tok.type == "NAME" or _word(tok.type).startswith("'"):
            hint = did_you_mean(str(tok), _keywords(expected_terms))
            if hint:
                notes.append(Note(hint))
        return Diagnostic("error", f"unexpected {shown}; expected {_one_of(expected)}", span, tuple(notes))
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        span = Span.point(path, e.line, e.column)
        # What the parser (not just the lexer state) accepts here.
        allowed = set(e.allowed or ())
        ip = getattr(e, "interactive_parser", None)
        if ip is not None:
            try:
                allowed = {t for t in ip.accepts() if t != "$END"} or allowed
            except Exception:  # the lexer's list is still a fine answer
                pass
        expected = _expected_words(allowed)
        dec = _decimal_at(text, e.pos_in_stream, e.line, e.column, path)
        if dec is not None:
            return dec
        if ch == '"':
            return Diagnostic("error", "unterminated string: a quoted string must end on the same line", span)
        what = f"character {ch!r}" if ch.isprintable() else f"character U+{ord(ch):04X}"
        msg = f"unexpected {what}"
        if expected:
            msg += f"; expected {_one_of(expected)}"
        return Diagnostic("error", msg, span)
    return Diagnostic("error", f"syntax error: {e}", Span.point(path, getattr(e, "line", 1), getattr(e, "column", 1)))


_EXPONENT = re.compile(r"[eE][+-]?[0-9]+")


def _decimal_at(text: str, pos: int, line: int, col: int, path: str) -> Diagnostic | None:
    """`topk 2.5`, `tokens 1e3`: a decimal point or an exponent inside a number (at `pos`) where
    the grammar wants a whole number."""
    if not (0 < pos < len(text) - 1 and text[pos - 1].isdigit()):
        return None
    if text[pos] == "." and text[pos + 1].isdigit():
        end = pos + 1
        while end < len(text) and text[end].isdigit():
            end += 1
        m = _EXPONENT.match(text, end)
        end = m.end() if m else end
    else:
        m = _EXPONENT.match(text, pos)
        if m is None:
            return None
        end = m.end()
    start = pos
    while start > 0 and text[start - 1].isdigit():
        start -= 1
    c0 = col - (pos - start)
    return Diagnostic("error", f"'{text[start:end]}' is not a whole number; a whole number is expected here",
                      Span(path, line, c0, line, c0 + end - start))


def _show_token(tok: Token) -> str:
    if tok.type == "NAME":
        return f"name '{tok}'"
    if tok.type in ("INT", "DECIMAL"):
        return f"number {tok}"
    if tok.type == "STRING":
        return f"string {tok}"
    return f"'{tok}'"


def _one_of(words: list[str]) -> str:
    if not words:
        return "nothing more"
    if len(words) == 1:
        return words[0]
    if len(words) <= 14:
        return "one of " + ", ".join(words[:-1]) + " or " + words[-1]
    return "one of " + ", ".join(words[:14]) + ", ..."


def _end_position(text: str) -> tuple[int, int]:
    lines = source_lines(text) or [""]
    # Point just after the last non-blank line.
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].strip():
            return i + 1, len(lines[i].rstrip()) + 1
    return 1, 1
