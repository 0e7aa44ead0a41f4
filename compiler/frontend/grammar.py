"""The lark parser of `grammar.lark` (LALR, with positions), built once per process.

Both halves of the frontend need it: :mod:`epcc.frontend.parser` parses with it, and
:mod:`epcc.frontend.syntax_errors` asks it how a terminal is spelled.
"""

from __future__ import annotations

import functools
from importlib import resources

from lark import Lark


@functools.lru_cache(maxsize=1)
def lark_parser() -> Lark:
    text = resources.files(__package__).joinpath("grammar.lark").read_text(encoding="utf-8")
    return Lark(text, parser="lalr", propagate_positions=True, maybe_placeholders=False)
