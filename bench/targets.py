"""The GPU targets against bench/ep_bench.py's report: what was reached, and whether it meets them.

    python bench/targets.py OUT/ep_bench.json [TUNED_OUT/ep_bench.json]

The first report is the default configuration's run (the plan's SMs), the optional second the run
after `epcc tune` wrote cuda/tuned.json into the bundles.  Each report must hold the three shapes
the targets name, found by their workload, not their names: 4096 tokens BF16 and FP8 with all three
methods (epcc, torch_megatron, nccl_a2a), and 128 tokens.  Prints a Markdown table (the README's
"against the targets" table), one row per target; a report's column gives the figure that decides
the target and whether it is met.

The targets are stated for 4x H200 (all pairs NVLink4, 450 GB/s per GPU per direction); a report
from another machine is judged by the same numbers, and the heading says which machine it was.
Times are ep_bench's medians of the per-iteration maximum over ranks; GB/s is deduplicated remote
NVLink bytes (a token counted once per destination GPU, self traffic not counted).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TOKENS_NORMAL, TOKENS_DECODE = 4096, 128
METHODS = ("epcc", "torch_megatron", "nccl_a2a")


class ReportError(Exception):
    """A report that cannot be judged: the message names the file and what is missing."""


@dataclass(frozen=True)
class Shapes:
    """The epcc, torch_megatron and nccl_a2a results of one report, per shape (bf16, fp8, decode)."""

    path: str
    device: str
    bundles: dict[str, dict]  # shape -> the bundle's entry in the report

    def result(self, shape: str, method: str = "epcc") -> dict:
        b = self.bundles[shape]
        r = b.get("methods", {}).get(method, {})
        if not isinstance(r.get("summary"), dict):
            why = r.get("error") or r.get("skipped") or "not run"
            raise ReportError(f"{self.path}: bundle '{b['name']}' has no {method} result ({why})")
        return r

    def summary(self, shape: str, program: str, key: str, method: str = "epcc") -> float:
        s = self.result(shape, method)["summary"].get(program) or {}
        if not isinstance(s.get(key), (int, float)):
            raise ReportError(f"{self.path}: bundle '{self.bundles[shape]['name']}': {method} {program} has no {key}")
        return float(s[key])

    def ms(self, shape: str, program: str, method: str = "epcc") -> float:
        return self.summary(shape, program, "median_ms", method)

    def sms(self, shape: str, program: str) -> int | None:
        s = self.result(shape).get("sms") or {}
        return s.get(program)


def _shape_of(workload) -> str | None:
    if not isinstance(workload, dict):
        return None
    if workload.get("tokens") == TOKENS_NORMAL:
        return {"bf16": "bf16", "fp8": "fp8"}.get(workload.get("dtype"))
    return "decode" if workload.get("tokens") == TOKENS_DECODE else None


def load(path: str | Path) -> Shapes:
    """The report at `path`, its bundles sorted into the three shapes; ReportError if it is not an
    ep_bench report or a shape is missing or given twice."""
    p = Path(path)
    try:
        rep = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ReportError(f"{p}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{p}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from None
    if not isinstance(rep, dict) or not isinstance(rep.get("bundles"), list):
        raise ReportError(f"{p}: not a bench/ep_bench.py report (no 'bundles' list)")
    found: dict[str, dict] = {}
    for b in rep["bundles"]:
        if not isinstance(b, dict) or "error" in b:
            continue
        shape = _shape_of(b.get("workload"))
        if shape is None:
            continue
        if shape in found:
            raise ReportError(f"{p}: two bundles of the {shape} shape ('{found[shape].get('name', '?')}' and "
                              f"'{b.get('name', '?')}'); give a report with one of each")
        found[shape] = dict(b, name=str(b.get("name", "?")))
    missing = [s for s in ("bf16", "fp8", "decode") if s not in found]
    if missing:
        raise ReportError(f"{p}: no bundle of the {', '.join(missing)} shape(s) (4096 tokens bf16 and fp8, "
                          f"128 tokens); it has {', '.join(b.get('name', '?') for b in rep['bundles']) or 'none'}")
    world = rep.get("world")
    device = f"{world} x {rep.get('device', '?')}" if world else str(rep.get("device", "?"))
    return Shapes(str(p), device, found)


@dataclass(frozen=True)
class Target:
    text: str
    judge: Callable[[Shapes], tuple[str, bool]]  # -> (the deciding figure, met)


def _within(r: Shapes, shape: str, program: str, limit_ms: float, max_sms: int | None = None) -> tuple[str, bool]:
    ms, sms = r.ms(shape, program), r.sms(shape, program)
    ok = ms <= limit_ms and (max_sms is None or (sms is not None and sms <= max_sms))
    scale, unit = (1e3, "us") if limit_ms < 0.1 else (1.0, "ms")
    return f"{ms * scale:.{0 if unit == 'us' else 3}f} {unit} at {sms if sms is not None else '?'} SMs", ok


def _gbps(r: Shapes) -> tuple[str, bool]:
    g = r.summary("bf16", "dispatch", "gbps_remote_dedup")
    return f"{g:.0f} GB/s", g >= 360.0


def _speedup(r: Shapes) -> tuple[str, bool]:
    x = r.ms("bf16", "dispatch", "torch_megatron") / r.ms("bf16", "dispatch")
    return f"{x:.1f}x ({r.ms('bf16', 'dispatch', 'torch_megatron'):.3f} / {r.ms('bf16', 'dispatch'):.3f} ms)", x >= 4.0


def _vs_a2a(r: Shapes) -> tuple[str, bool]:
    cells, ok = [], True
    for p in ("dispatch", "combine"):
        e, n = r.ms("bf16", p), r.ms("bf16", p, "nccl_a2a")
        cells.append(f"{p} {e:.3f} vs {n:.3f} ms")
        ok = ok and e < n
    return "; ".join(cells), ok


def _sms_text(sms: dict) -> str:
    return f"{sms.get('dispatch', '-')}/{sms.get('combine', '-')}"


def _simulated(r: Shapes) -> tuple[str, bool]:
    """Each shape's measured medians against its bundle's simulate.json, where that prediction was
    made for the SMs the run used (a tuned run's are usually others: not compared)."""
    cells, ok, compared = [], True, 0
    for shape in ("bf16", "fp8", "decode"):
        b = r.bundles[shape]
        sim = b.get("simulate") or {}
        run_sms, sim_sms = r.result(shape).get("sms"), sim.get("sms")
        if isinstance(run_sms, dict) and isinstance(sim_sms, dict) and \
                any(run_sms.get(p) != n for p, n in sim_sms.items()):
            cells.append(f"{shape} not compared (simulated on {_sms_text(sim_sms)} SMs, run on {_sms_text(run_sms)})")
            continue
        compared += 1
        errs = []
        for p in ("dispatch", "combine"):
            if not isinstance((sim.get(p) or {}).get("total_ms"), (int, float)):
                raise ReportError(f"{r.path}: bundle '{b['name']}' has no simulated {p} (simulate.json)")
            e = r.ms(shape, p) / float(sim[p]["total_ms"]) - 1
            errs.append(f"{e * 100:+.0f} %")
            ok = ok and abs(e) <= 0.15
        cells.append(f"{shape} {' / '.join(errs)}")
    if not compared:
        raise ReportError(f"{r.path}: every prediction is for other SMs than the run's: " + "; ".join(cells))
    return "; ".join(cells), ok


TARGETS = (
    Target("dispatch 4096 tokens BF16 (fused permute) <= 0.42 ms with <= 24 SMs",
           lambda r: _within(r, "bf16", "dispatch", 0.42, 24)),
    Target(">= 360 GB/s remote NVLink (that dispatch, deduplicated, self not counted)", _gbps),
    Target("combine 4096 tokens <= 0.45 ms", lambda r: _within(r, "bf16", "combine", 0.45)),
    Target(">= 4x faster than the torch+NCCL dispatcher (4096 BF16)", _speedup),
    Target("faster than bare NCCL all_to_all (4096 BF16)", _vs_a2a),
    Target("128-token dispatch <= 40 us", lambda r: _within(r, "decode", "dispatch", 0.040)),
    Target("128-token combine <= 50 us", lambda r: _within(r, "decode", "combine", 0.050)),
    Target("`epcc simulate` within 15 % (dispatch / combine)", _simulated),
)


def table(reports: list[Shapes], names: list[str]) -> str:
    """The Markdown table: a column per report (`names`), each cell 'figure: yes|no'."""
    head = "| target | " + " | ".join(names) + " |"
    out = [head, "|---" * (1 + len(reports)) + "|"]
    for t in TARGETS:
        cells = []
        for r in reports:
            try:
                fig, ok = t.judge(r)
                cells.append(f"{fig}: **{'yes' if ok else 'no'}**")
            except ReportError as e:  # this target's figures are not in this report
                cells.append(f"not measured ({str(e).removeprefix(r.path + ': ')})")
        out.append(f"| {t.text} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("default", help="ep_bench.json of the run with the bundles' default configuration")
    ap.add_argument("tuned", nargs="?", help="ep_bench.json of the run after `epcc tune`")
    args = ap.parse_args(argv)
    try:
        reports = [load(p) for p in (args.default, args.tuned) if p]
        names = ["default"] + (["after `epcc tune`"] if args.tuned else [])
        text = table(reports, names)
    except ReportError as e:
        print(f"bench/targets.py: {e}", file=sys.stderr)
        return 1
    devices = sorted({r.device for r in reports})
    print(f"The targets (stated for 4x H200) on {', '.join(devices)}:\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
