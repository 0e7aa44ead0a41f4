"""A Gantt chart of a simulation as plain SVG (no plotting library).

Rows are steps, grouped by program.  A bar runs from the step's first byte to its end, coloured
by link kind (the colours of `epcc viz`); a pale band before it spans ready..start (waiting for a
resource, an order hint, or a pipelined producer's first chunk); white ticks inside the bar mark
chunk boundaries (the step's bytes crossing k/num_chunks); a thick black outline marks the critical
path.  The time axis is in ms, shared by every program (each starts at 0).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..palette import KIND_COLOR, KIND_FILL
from ..textsafe import svg_text
from .simulate import SimResult

LABEL_W = 250
PLOT_W = 820
RIGHT_W = 90
ROW_H = 24
BAR_H = 14
TOP = 64
FONT = "font-family='Helvetica, Arial, sans-serif'"


def _nice_step(span: float, target: int = 10) -> float:
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def render_svg(res: SimResult, title: str | None = None) -> str:
    programs = list(res.programs.values())
    t_max = max((p.makespan_s for p in programs), default=0.0) * 1e3 or 1.0
    step_ms = _nice_step(t_max)
    t_axis = math.ceil(t_max / step_ms - 1e-9) * step_ms
    scale = PLOT_W / t_axis

    rows: list[tuple[str, object]] = []
    for p in programs:
        rows.append(("header", p))
        for s in p.steps:
            rows.append(("step", s))
    height = TOP + ROW_H * len(rows) + 70
    width = LABEL_W + PLOT_W + RIGHT_W
    x0 = LABEL_W

    def x(ms: float) -> float:
        return x0 + ms * scale

    o: list[str] = []
    o.append(f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"viewBox='0 0 {width} {height}' {FONT} font-size='11'>")
    o.append(f"<rect x='0' y='0' width='{width}' height='{height}' fill='white'/>")
    head = title or f"{res.schedule}: {res.num_ranks} ranks, {res.routing}"
    o.append(f"<text x='10' y='20' font-size='14' font-weight='bold'>{svg_text(head)}</text>")
    summary = "; ".join(f"{p.program} {p.makespan_s * 1e3:.3f} ms (serial {p.serial_s * 1e3:.3f} ms)"
                        for p in programs)
    if res.bottleneck:
        summary += f"; bottleneck {res.bottleneck.link_class} {res.bottleneck.utilisation * 100:.0f} % busy"
    o.append(f"<text x='10' y='38' fill='#333'>{svg_text(summary)}</text>")

    # Grid and axis.
    plot_top = TOP - 6
    plot_bot = TOP + ROW_H * len(rows)
    k = 0
    while k * step_ms <= t_axis + 1e-9:
        ms = k * step_ms
        xx = x(ms)
        o.append(f"<line x1='{xx:.1f}' y1='{plot_top}' x2='{xx:.1f}' y2='{plot_bot}' stroke='#e3e3e3'/>")
        o.append(f"<line x1='{xx:.1f}' y1='{plot_bot}' x2='{xx:.1f}' y2='{plot_bot + 5}' stroke='#555'/>")
        o.append(f"<text x='{xx:.1f}' y='{plot_bot + 17}' text-anchor='middle' fill='#333'>{ms:g}</text>")
        k += 1
    o.append(f"<line x1='{x0}' y1='{plot_bot}' x2='{x(t_axis):.1f}' y2='{plot_bot}' stroke='#555'/>")
    o.append(f"<text x='{x0 + PLOT_W / 2:.1f}' y='{plot_bot + 33}' text-anchor='middle' fill='#333'>time (ms)</text>")

    y = TOP
    for kind, item in rows:
        if kind == "header":
            p = item
            o.append(f"<rect x='0' y='{y}' width='{width}' height='{ROW_H}' fill='#f4f4f4'/>")
            o.append(f"<text x='10' y='{y + 16}' font-weight='bold'>{svg_text(p.program)}</text>")
            xm = x(p.makespan_s * 1e3)
            o.append(f"<line x1='{xm:.1f}' y1='{y}' x2='{xm:.1f}' y2='{y + ROW_H * (len(p.steps) + 1)}' "
                     f"stroke='#000' stroke-dasharray='4,3'/>")
            o.append(f"<text x='{xm + 3:.1f}' y='{y + 16}' fill='#000'>end {p.makespan_s * 1e3:.3f} ms</text>")
            y += ROW_H
            continue
        s = item
        color = KIND_COLOR.get(s.link_kind, KIND_COLOR[None])
        fill = KIND_FILL.get(s.link_kind, KIND_FILL[None])
        weight = " font-weight='bold'" if s.critical else ""
        label = f"{s.name} ({s.link or 'no link'})"
        o.append(f"<text x='10' y='{y + 16}'{weight}>{svg_text(label)}</text>")
        o.append(f"<text x='{LABEL_W - 8}' y='{y + 16}' text-anchor='end' fill='#666'>"
                 f"{s.max_rank_bytes / 1e6:.1f} MB</text>")
        by = y + (ROW_H - BAR_H) / 2
        if s.start_s > s.ready_s:
            o.append(f"<rect x='{x(s.ready_s * 1e3):.2f}' y='{by + 4}' width='{(s.start_s - s.ready_s) * 1e3 * scale:.2f}' "
                     f"height='{BAR_H - 8}' fill='{fill}' stroke='{color}' stroke-width='0.5' stroke-dasharray='2,2'>"
                     f"<title>{svg_text(s.name)}: ready {s.ready_s * 1e3:.3f} ms, first byte {s.start_s * 1e3:.3f} ms</title></rect>")
        w = max((s.end_s - s.start_s) * 1e3 * scale, 1.0)
        stroke = "stroke='#000' stroke-width='2.2'" if s.critical else f"stroke='{color}' stroke-width='0.8'"
        gbps = f", {s.achieved_bps / 1e9:.1f} GB/s per rank" if s.achieved_bps else ""
        o.append(f"<rect x='{x(s.start_s * 1e3):.2f}' y='{by}' width='{w:.2f}' height='{BAR_H}' fill='{color}' "
                 f"fill-opacity='0.85' {stroke}><title>{svg_text(s.name)} over {svg_text(s.link or 'no link')}: "
                 f"{s.start_s * 1e3:.3f} .. {s.end_s * 1e3:.3f} ms{gbps}; alone {s.alone_s * 1e3:.3f} ms"
                 f"</title></rect>")
        for ct in s.chunk_times_s:
            xc = x(ct * 1e3)
            o.append(f"<line x1='{xc:.2f}' y1='{by + 2}' x2='{xc:.2f}' y2='{by + BAR_H - 2}' stroke='white' "
                     f"stroke-width='0.8' stroke-opacity='0.9'/>")
        o.append(f"<text x='{x(s.end_s * 1e3) + 4:.1f}' y='{y + 16}' fill='#333'>{(s.end_s - s.start_s) * 1e3:.3f}</text>")
        y += ROW_H

    # Legend.
    ly = height - 18
    lx = 10
    for kind in ("p2p", "d2d", "rdma", "local"):
        o.append(f"<rect x='{lx}' y='{ly - 10}' width='14' height='10' fill='{KIND_COLOR[kind]}'/>")
        o.append(f"<text x='{lx + 18}' y='{ly}'>{kind}</text>")
        lx += 70
    o.append(f"<rect x='{lx}' y='{ly - 10}' width='14' height='10' fill='#ccc' stroke='#000' stroke-width='2.2'/>")
    o.append(f"<text x='{lx + 18}' y='{ly}'>critical path</text>")
    lx += 110
    o.append(f"<rect x='{lx}' y='{ly - 7}' width='14' height='5' fill='#eee' stroke='#999' stroke-dasharray='2,2'/>")
    o.append(f"<text x='{lx + 18}' y='{ly}'>ready, waiting</text>")
    lx += 115
    o.append(f"<line x1='{lx + 7}' y1='{ly - 11}' x2='{lx + 7}' y2='{ly + 1}' stroke='#555'/>")
    o.append(f"<text x='{lx + 14}' y='{ly}'>chunk boundaries (white ticks); numbers right of bars: duration, ms</text>")
    o.append("</svg>")
    return "\n".join(o) + "\n"


def write_svg(res: SimResult, path: str | Path, title: str | None = None) -> Path:
    p = Path(path)
    p.write_text(render_svg(res, title), encoding="utf-8")
    return p
