"""User text in what epcc writes: one escaping function per output language.

Text that comes from the user -- file names and paths, schedule and step titles, names, and
anything read back from a plan.json -- reaches generated C/C++/CUDA sources, LLVM IR, MLIR,
DOT and SVG pictures, and the terminal.  Every writer passes it through the function of its
language below, which returns text that cannot end the comment, string literal or line it is
placed in, and that shows each control, format or otherwise invisible character (newline,
carriage return, NUL, ESC, the bidirectional overrides of "Trojan Source", lone surrogates
from undecodable file names) as a visible escape instead of emitting it:

    c_comment(s)     inside a // or /* */ comment of C, C++ or CUDA: one line of printable ASCII
    c_string(s)      a C/C++/CUDA string literal, quotes included
    llvm_comment(s)  inside a `;` comment of LLVM IR: one line of printable ASCII
    mlir_text(s)     a string attribute or location handed to the MLIR bindings, whose printer
                     quotes it (it must be valid Unicode: no lone surrogates)
    dot_text(s)      inside a quoted DOT string or label, as the graphviz package quotes it
    svg_text(s)      SVG/XML character data or a quoted attribute value
    terminal(s)      a line of diagnostic or report output

Escapes read as in Python: `\\n`, `\\t`, `\\x1b`, `\\u202e`, `\\U0001f600`; a backslash typed by the
user shows as `\\\\` (in C comments as `\\x5c`: a comment may not end in a backslash).

Each function returns :class:`Escaped` (a ``str``), so that a template engine can tell escaped
text from text a template forgot to escape: :func:`c_template_value` is the ``finalize`` hook
of the Jinja environments that write C and CUDA, and refuses plain text that could leave its
comment or string.
"""

from __future__ import annotations

import re
import unicodedata

# Unicode categories never written as they are: controls, formats (the bidirectional controls,
# zero-width characters), surrogates, private use, unassigned, line and paragraph separators.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

# The bidirectional controls of "Trojan Source" (CVE-2021-42574): embeddings, overrides, isolates
# and the invisible marks.  In a .sched file they only ever stand in comments and strings, where
# they can make a line display in an order other than the one epcc reads (frontend/parser.py).
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


class Escaped(str):
    """Text made safe for one output language by a function of this module."""

    __slots__ = ()


class UnsafeText(ValueError):
    """A template was about to write plain (unescaped) text that could leave its context: an
    epcc bug, a missing escape in a template."""


def hidden(ch: str) -> bool:
    """Whether `ch` is written as an escape (by every function here)."""
    return unicodedata.category(ch) in _HIDDEN


def _escape_char(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def _visible(text: str, *, ascii_only: bool, backslash: str = "\\\\") -> str:
    out = []
    for ch in str(text):
        if ch == "\\":
            out.append(backslash)
        elif hidden(ch) or (ascii_only and not " " <= ch <= "~"):
            out.append(_escape_char(ch))
        else:
            out.append(ch)
    return "".join(out)


def terminal(text: str) -> Escaped:
    """`text` for one line of terminal output: no ANSI escape sequence, control character,
    bidirectional override or line break reaches the terminal; printable Unicode stays."""
    return Escaped(_visible(text, ascii_only=False, backslash="\\"))


def terminal_width(ch: str) -> int:
    """Columns `ch` takes on a terminal as :func:`terminal` writes it: its escape's length if it
    is hidden, 2 for a wide (East Asian) character, 0 for a combining mark, else 1."""
    if hidden(ch):
        return len(_escape_char(ch))
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def c_comment(text: str) -> Escaped:
    """`text` inside a C, C++ or CUDA comment (`//` or `/* */`): printable ASCII on one line,
    no `*/` or `/*`, no trigraph (`??/` would splice lines), never a backslash at its end."""
    s = _visible(text, ascii_only=True, backslash="\\x5c")
    s = s.replace("*/", "*\\/").replace("/*", "/\\*")
    while "??" in s:
        s = s.replace("??", "?\\?")
    return Escaped(s)


def c_string(text: str) -> Escaped:
    """`text` as a C/C++/CUDA string literal, with its quotes: printable ASCII as it is (`"`, `\\`
    and `?` escaped), every other byte of its UTF-8 as a three-digit octal escape."""
    out = ['"']
    for b in str(text).encode("utf-8", "surrogatepass"):
        ch = chr(b)
        if ch in '"\\?':
            out.append("\\" + ch)
        elif 0x20 <= b <= 0x7E:
            out.append(ch)
        else:
            out.append(f"\\{b:03o}")
    out.append('"')
    return Escaped("".join(out))


def llvm_comment(text: str) -> Escaped:
    """`text` inside a `;` comment of LLVM IR: printable ASCII on one line."""
    return Escaped(_visible(text, ascii_only=True))


def mlir_text(text: str | None) -> Escaped:
    """`text` as the value of an MLIR string attribute or file location: the bindings' printer
    quotes and escapes it, so this only makes it printable and valid Unicode (hidden characters,
    lone surrogates included, become visible escapes; printable Unicode stays)."""
    return Escaped(_visible("" if text is None else text, ascii_only=False, backslash="\\"))


def dot_text(text: str) -> Escaped:
    """`text` inside a quoted DOT string (a label, a tooltip), as the graphviz package writes it:
    quotes and backslashes escaped (no escString such as `\\N` or `\\l` can form), hidden
    characters as visible escapes; printable Unicode stays."""
    shown = _visible(text, ascii_only=False, backslash="\\")  # then every backslash doubled: `\\` shows one
    return Escaped(shown.replace("\\", "\\\\").replace('"', '\\"'))


_XML = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&apos;"}


def svg_text(text: str) -> Escaped:
    """`text` as SVG/XML character data or a quoted attribute value: markup characters as
    entities, hidden characters (most of which XML forbids) as visible escapes."""
    return Escaped("".join(_XML.get(ch, ch) for ch in _visible(text, ascii_only=False, backslash="\\")))


# Plain text a C template may write without an escape: printable ASCII that can neither end a
# comment or string (no quote, backslash, `*/`, `/*`) nor form a trigraph.
_PLAIN_C = re.compile(r"[ !#-\[\]-~]*")


def c_template_value(value):
    """The ``finalize`` hook of a Jinja environment writing C, C++ or CUDA: numbers and escaped
    text pass; plain text passes only if no character of it could leave a comment or string.
    Anything else raises :class:`UnsafeText` (a missing `| c_comment` or `| c_string`)."""
    if isinstance(value, str) and not isinstance(value, Escaped):
        if not _PLAIN_C.fullmatch(value) or "*/" in value or "/*" in value or "??" in value:
            raise UnsafeText(f"a template of generated code writes {value!r} without escaping it "
                             f"(c_comment or c_string)")
    return value


def for_c_templates(env):
    """Set up a Jinja environment that writes C, C++ or CUDA: the `c_comment` and `c_string`
    filters, and :func:`c_template_value` as its finalize hook."""
    env.filters["c_comment"] = c_comment
    env.filters["c_string"] = c_string
    env.finalize = c_template_value
    return env


__all__ = ["BIDI_CONTROLS", "Escaped", "UnsafeText", "c_comment", "c_string", "c_template_value", "dot_text",
           "for_c_templates", "hidden", "llvm_comment", "mlir_text", "svg_text", "terminal", "terminal_width"]
