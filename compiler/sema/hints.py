"""Wording that sema's resolvers share: suggestions for misspelt names, the error for a name
declared twice, and a number written back the way the user gave it."""

from __future__ import annotations

from typing import Iterable

from ..diagnostics import DiagnosticBag, Note, did_you_mean
from ..frontend import ast
from .units import number_text


def suggestion(name: str, candidates: Iterable[str]) -> tuple[str, ...]:
    """The 'did you mean' note for a misspelt `name`, as a tuple to splat into an error's notes
    (empty when no candidate is close)."""
    hint = did_you_mean(name, candidates)
    return (hint,) if hint else ()


def report_duplicate(diags: DiagnosticBag, what: str, name: ast.Name, first: ast.Name) -> None:
    """`duplicate level 'gpu'`, pointing at the first declaration."""
    diags.error(name.span, f"duplicate {what} '{name.text}'", Note("first defined here", first.span))


def quantity_text(q: ast.Quantity) -> str:
    """A quantity's number as the user wrote it (`20`, `1.5`), for messages."""
    return number_text(q.value)
