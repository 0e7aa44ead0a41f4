"""`epcc viz FILE -o OUT`: the schedule's DAG with graphviz, or (--scheduled) the simulated plan."""

from __future__ import annotations

from .. import pipeline
from ..files import refuse_overwrite
from ..viz import render, render_scheduled
from .common import EXIT_OK, inputs_of, say, user_error, warn
from .options import kernel_options, pass_options, plan_options
from .simulate import simulation


def add_parser(sub) -> None:
    c = sub.add_parser("viz", help="draw the schedule DAG with graphviz",
                       description="Draw the dispatch DAG: steps grouped by the tier they run across, edges for "
                                   "data and order dependencies, colours for link kinds, expected volumes.")
    c.add_argument("file", metavar="FILE", help="the .sched file")
    c.add_argument("-o", "--output", metavar="OUT", required=True, help="picture to write: .svg, .png, .pdf or .dot")
    c.add_argument("--scheduled", action="store_true",
                   help="draw the scheduled plan instead, simulated as `epcc simulate` does (--kernels, --sms): "
                        "overlap groups from the simulation, pipelined dependencies and the critical path; per "
                        "program the direct kernels' SM pool where they run it, else per step its chunks and SM role")
    plan_options(c)
    kernel_options(c, only="with --scheduled: ")
    c.set_defaults(func=cmd_viz)


def cmd_viz(args) -> int:
    refuse_overwrite("-o", args.output, [args.output], inputs_of(args))
    if args.scheduled:
        built, res = simulation(args, pass_options(args))
        path = render_scheduled(built, res, args.output)
        say(f"{args.file}: scheduled DAG written to {path}")
        return EXIT_OK
    given = [f for f, v in (("--kernels", args.kernels), ("--sms", args.sms), ("--cached", args.cached),
                            ("--dealing", args.dealing))
             if v is not None]
    if given:
        raise user_error(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with "
                         f"--scheduled: the DAG without it is not simulated")
    c = pipeline.run(args.file, "model", args.sources, pass_options(args))
    warn(c)
    path = render(c.schedule, args.output)
    say(f"{args.file}: DAG written to {path}")
    return EXIT_OK
