"""`epcc check FILE`: parse and check a schedule; print its errors and warnings."""

from __future__ import annotations

from .. import pipeline
from .common import EXIT_OK, say, warn


def add_parser(sub) -> None:
    c = sub.add_parser("check", help="parse and check a schedule; print its errors and warnings",
                       description="Parse and check a .sched file. Prints every error with its location.")
    c.add_argument("file", metavar="FILE", help="the .sched file")
    c.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    c = pipeline.run(args.file, "model", args.sources)
    warn(c)
    s = c.schedule
    combine = "derived from dispatch" if s.combine is None else f"{len(s.combine.steps)} steps"
    say(f"{args.file}: ok: {s.topology.num_ranks} ranks, {len(s.dispatch.steps)} dispatch steps, combine {combine}")
    return EXIT_OK
