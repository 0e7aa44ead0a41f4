"""Units of the .sched language, converted to SI base units (bytes, bytes/s, seconds).

Decimal prefixes are powers of 1000 (GB/s as vendors quote link rates); binary prefixes (GiB/s,
KiB, MiB) are powers of 1024; `Gb/s` is gigabits.
"""

from __future__ import annotations

from ..diagnostics import DiagnosticBag
from ..frontend import ast
from ..limits import MAX_SIZE

BANDWIDTH = {
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30,
    "Kb/s": 1e3 / 8, "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8, "Tb/s": 1e12 / 8,
}
TIME = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
SIZE = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
TOKENS = ("token", "tokens")

_TABLES = {"bandwidth": BANDWIDTH, "latency": TIME, "time": TIME}
_LIMIT = {"bandwidth": 1e15, "latency": 3600.0, "time": 3600.0}  # 1 PB/s; an hour
# Below this a positive rate is a typo (a step would take longer than any timeout can say)
_LOW = {"bandwidth": 1.0}  # 1 B/s
_RANGE_TEXT = {"bandwidth": "at least 1 B/s, at most 1000 TB/s", "latency": "at most 3600 s", "time": "at most 3600 s"}


def number_text(v: int | float) -> str:
    """A number as written, shortened when it is absurdly long."""
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return "(a number too large to represent)"
    s = str(v) if isinstance(v, int) else (str(int(v)) if v.is_integer() else str(v))
    return s if len(s) <= 24 else f"{s[:6]}...({len(s)} digits)"


def _finite(v: float, limit: float) -> bool:
    return v == v and v <= limit
_EXAMPLE = {"bandwidth": "20 GB/s", "latency": "2 us", "time": "5 us"}


def parse_quantity(q: ast.Quantity, kind: str, diags: DiagnosticBag) -> float | None:
    """A bandwidth (bytes/s), latency or time (s); reports a missing or wrong unit."""
    table = _TABLES[kind]
    if q.unit is None:
        diags.error(q.span, f"{kind} needs a unit, e.g. '{_EXAMPLE[kind]}'",
                    f"units: {', '.join(table)}")
        return None
    if q.unit in table:
        v = q.value * table[q.unit] if q.value < 1e300 else float("inf")
        if not _finite(v, _LIMIT[kind]) or 0 < v < _LOW.get(kind, 0.0):
            diags.error(q.span, f"{kind} {number_text(q.value)} {q.unit} is out of range ({_RANGE_TEXT[kind]})")
            return None
    if q.unit not in table:
        fix = _case_fix(q.unit, table)
        what = _unit_kind(q.unit)
        msg = f"'{q.unit}' is not a {kind} unit" + (f" (it is a {what} unit)" if what else "")
        notes = [f"did you mean '{fix}'?"] if fix else []
        notes.append(f"{kind} units: {', '.join(table)}")
        diags.error(q.unit_span or q.span, msg, *notes)
        return None
    return q.value * table[q.unit]


def parse_size(q: ast.Quantity, what: str, diags: DiagnosticBag) -> tuple[int | None, int | None] | None:
    """A chunk or capacity: (tokens, None) or (None, bytes).  None after an error."""
    if q.unit is None:
        diags.error(q.span, f"{what} needs a unit: tokens or bytes, e.g. '128 tokens' or '4 MiB'")
        return None
    if q.value > MAX_SIZE:
        diags.error(q.span, f"{what} of {number_text(q.value)} {q.unit or ''} is out of range (at most {MAX_SIZE})")
        return None
    if q.unit in TOKENS:
        if not q.is_int:
            diags.error(q.span, f"{what} must be a whole number of tokens")
            return None
        if q.value < 1:
            diags.error(q.span, f"{what} must be at least 1 token")
            return None
        return int(q.value), None
    if q.unit in SIZE:
        b = q.value * SIZE[q.unit]
        if b < 1 or b != int(b):
            diags.error(q.span, f"{what} must be a positive whole number of bytes")
            return None
        return None, int(b)
    fix = _case_fix(q.unit, list(SIZE) + list(TOKENS))
    notes = [f"did you mean '{fix}'?"] if fix else []
    notes.append("sizes are given in tokens or bytes (B, KB, MB, GB, KiB, MiB, GiB)")
    diags.error(q.unit_span or q.span, f"'{q.unit}' is not a size unit", *notes)
    return None


def _case_fix(unit: str, table) -> str | None:
    low = {u.lower(): u for u in table}
    if unit.lower() in low:
        return low[unit.lower()]
    if unit.lower() + "/s" in low:
        return low[unit.lower() + "/s"]
    return None


def _unit_kind(unit: str) -> str | None:
    if unit in BANDWIDTH:
        return "bandwidth"
    if unit in TIME:
        return "time"
    if unit in SIZE or unit in TOKENS:
        return "size"
    return None
