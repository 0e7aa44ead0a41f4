"""Bounds on values users give epcc outside a .sched file, shared by every command and the runtime.

One check per value, so that `epcc compile`, `epcc simulate` and `epcc run` (and the runtime's
Buffer) accept and refuse the same things with the same words:

* the largest values a schedule, a plan.json or an option may give (ranks, SMs, depth, ramp
  halvings, sizes, the workload's fields);
* :func:`zipf_exponent` -- the S of a `zipf:S` routing: finite, 0..MAX_ZIPF_EXPONENT;
* :func:`timeout_seconds` -- a wait's timeout: positive, finite, at most a day (its nanoseconds
  fit the 64-bit deadlines of the engines);
* :func:`available_memory` -- what this process may still allocate (`epcc run` estimates its
  arrays against it before it allocates them).
"""

from __future__ import annotations

import math
import os

# What a .sched file (sema), a plan.json (plan.check) and the command line may give.
MAX_RANKS = 4096
MAX_DEPTH = 1 << 16  # chunks in flight on one step
MAX_SMS = 4096
MAX_RAMP = 8  # halvings: a chunk of 256 tokens ramps from 1
MAX_SIZE = 1 << 40  # tokens or bytes in a chunk or capacity
# Characters of a schedule's name: it names the bundle's files (NAME.mlir, libepcc_NAME_supa.so, ...),
# and a file name may have at most 255 bytes on the common file systems.
MAX_SCHEDULE_NAME = 200
# Rows a layout of a plan (runtime/layout) may hold, by the upper bound plan/invariants.py's
# layout_rows gives: beyond it the layout's index arrays alone would outgrow a machine's memory.
MAX_LAYOUT_ROWS = 1 << 32
# (flow, home rank) pairs the load-time delivery check (plan/invariants.py) may visit, some tens
# of seconds of Python at most: a one-hop EP256 plan visits 65536 of them.
MAX_REACH_WORK = 1 << 26
WORKLOAD_LIMITS = {"tokens": 1 << 24, "hidden": 1 << 20, "topk": 1024, "experts": 1 << 16, "node_limit": 1 << 16}

MAX_ZIPF_EXPONENT = 16.0  # 65536 experts at popularity rank^-16: the coldest still above 1e-77
MAX_TIMEOUT_S = 86400.0  # one day


def zipf_exponent(spec: str) -> float:
    """S of the routing spec `zipf:S`; ValueError (saying what is wrong, not where) otherwise."""
    text = spec[5:] if spec.startswith("zipf:") else spec
    try:
        s = float(text)
    except ValueError:
        raise ValueError("the Zipf exponent must be a number, e.g. zipf:1.2") from None
    if not (math.isfinite(s) and 0.0 <= s <= MAX_ZIPF_EXPONENT):
        raise ValueError(f"the Zipf exponent must be a finite number in 0..{MAX_ZIPF_EXPONENT:g}, not {text}")
    return s


def timeout_seconds(value, who: str, *, allow_zero: bool = False) -> float:
    """`value` as a timeout in seconds: a real number (not a bool), finite, positive (or zero
    where `allow_zero`), at most MAX_TIMEOUT_S.  ValueError naming `who` otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value >= 0 if allow_zero else value > 0) and value <= MAX_TIMEOUT_S
    if not ok:
        low = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{who}: timeout_s must be a number of seconds {low} and at most {MAX_TIMEOUT_S:g} "
                         f"(one day), not {value!r}")
    return float(value)


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as fh:
                text = fh.read(64).strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, under the cgroup's memory
    limit where there is one; None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        avail = None
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            avail = None
    limit = _cgroup_limit()
    if limit is not None:
        avail = limit if avail is None else min(avail, limit)
    return avail


GiB = float(1 << 30)


def memory_text(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


__all__ = ["MAX_TIMEOUT_S", "MAX_ZIPF_EXPONENT", "available_memory", "memory_text", "timeout_seconds",
           "zipf_exponent"]
