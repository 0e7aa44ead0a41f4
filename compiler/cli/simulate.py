"""`epcc simulate FILE`: the plan's simulated step times, link busy time and bottleneck; and the
simulation `epcc viz --scheduled` draws."""

from __future__ import annotations

import json

from ..backends.cuda.codegen import METADATA_EXCHANGES, CudaCodegenError, CudaOptions
from ..backends.cuda.codegen import metadata_exchange as check_exchange
from ..backends.cuda.codegen import generate as generate_cuda
from ..files import refuse_overwrite
from ..plan import Plan
from ..plan.cuda_manifest import PROGRAMS
from ..plan.rdma import rdma_steps
from ..sim import SimOptions, SimulationError, simulate
from ..sim.base import DeviceMetadata
from ..sim.build import build_plan
from ..plan.cuda_manifest import converts_in_kernel
from ..sim.calls import reads_caller_rows
from ..sim.gantt import write_svg
from ..sim.meta import from_manifest
from ..sim.report import table, to_dict
from ..runtime.layout import LayoutError, compute_layout
from ..runtime.testing.inputs import make_topk
from .compile import token_major_refusal
from .common import EXIT_OK, inputs_of, say, say_lines, user_error, warn
from .options import kernel_options, pass_options, plan_options, positive


def add_parser(sub) -> None:
    c = sub.add_parser("simulate", help="simulate a schedule's plan: step times, link busy time, bottleneck",
                       description="Build the plan (the pass pipeline as far as its passes exist), run the fluid "
                                   "discrete-event simulator over it (max-min fair link sharing, chunk pipelining, "
                                   "latency; the model: compiler/sim/__init__.py) and print per-step start/end, "
                                   "busy time per link class, the bottleneck, the total with overlap and the serial "
                                   "sum, in ms.")
    c.add_argument("file", metavar="FILE", help="the .sched file")
    plan_options(c)
    c.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    c.add_argument("--gantt", metavar="OUT.svg", help="also draw a Gantt chart of the steps into this SVG file")
    c.add_argument("--rdma", choices=("proxy", "emulate"), default="proxy",
                   help="how the RDMA steps run, as `epcc compile --target cuda --rdma`: proxy (default: credit "
                        "window, chunks staged and applied by one SM each) or emulate (paced SM roles); matters "
                        "only with the topology's `sm` rates")
    c.add_argument("--proxy-tables", choices=("device", "host"), default=None,
                   help="with --rdma proxy, as `epcc compile --proxy-tables`: device (default: the metadata kernels "
                        "run before the dispatch) or host (the tables laid out on the host: no metadata kernels)")
    c.add_argument("--metadata-exchange", choices=METADATA_EXCHANGES, default="auto",
                   help="as `epcc compile --metadata-exchange`: how the metadata kernels' routing reaches every "
                        "rank, ipc (CUDA IPC, one box) or collective (the process group's all-gather); auto (the "
                        "default): ipc up to 8 ranks, else collective")
    c.add_argument("--copy-inputs", metavar="PROGRAMS", default=None,
                   help="dispatch, combine or both (comma-separated): charge the Buffer's copy of the program's "
                        "rows into its input buffer although the bundle's kernels read them where the caller has "
                        "them (manifest dispatch_input / combine_input): a bundle of an older epcc, or rows the "
                        "kernel cannot read in place (not 16-byte aligned, strided)")
    c.add_argument("--clear-partials", choices=("beside-dispatch", "in-combine"), default="beside-dispatch",
                   help="where the Buffer clears the combine's fp32 partial buffers, for tables the GPU writes: "
                        "beside the dispatch kernel (the default: on a stream of its own, under the dispatch) or "
                        "in the combine call (a combine with no dispatch since the last combine, or an earlier "
                        "epcc's runtime); host-built tables clear them in the combine call")
    c.add_argument("--combine-output", choices=("auto", "in-kernel", "finish-kernel"), default="auto",
                   help="where the combine's fp32 sums become bf16 tokens, for the table-driven kernels: auto (the "
                        "default: as `epcc compile --target cuda` lowers the plan, manifest combine_output), in the "
                        "combine kernel, or a finish kernel after it (a bundle of an older epcc)")
    kernel_options(c)
    c.set_defaults(func=cmd_simulate)


def copy_inputs(text: str | None) -> frozenset[str]:
    """--copy-inputs: the programs named, or a user error naming the one that is not a program."""
    if text is None:
        return frozenset()
    names = [t.strip() for t in text.split(",")]
    for n in names:
        if n not in PROGRAMS:
            raise user_error(f"--copy-inputs: {n!r} is not a program (dispatch, combine)")
    return frozenset(names)


def simulation(args, options):
    """(the built plan, its simulation) under the SM model of the kernels that `--kernels`, `--sms` and
    `--cached` pick (`epcc simulate` and `epcc viz --scheduled`): auto (default) is what the CUDA target runs, the
    direct kernels where it lowers the plan to them (Plan.direct, plan/direct.py), else the
    table-driven kernels' SM roles.  A token-major plan (`--layout token`) runs as the token-major
    direct kernels (sim/token_major.py); one the CUDA target does not lower to them, or with
    `--kernels table`, has no token-major kernels to simulate.  Bad values and direct options on a
    plan without direct kernels are user errors (exit 1); the options are checked before the plan
    is built."""
    kernels = args.kernels or "auto"
    sms = positive(args.sms, "--sms", "a whole number of SMs", "SMs must be at least 1")
    if sms is not None and kernels == "table":
        raise user_error("--sms applies to the direct kernels, not to --kernels table (the plan's `sms` give the "
                         "roles)")
    cached = bool(getattr(args, "cached", False))
    if cached and kernels == "table":
        raise user_error("--cached applies to the direct kernels, not to --kernels table (a cached handle of the "
                         "table-driven kernels runs the same kernels)")
    rdma = getattr(args, "rdma", "proxy")
    copied = copy_inputs(getattr(args, "copy_inputs", None))
    beside = getattr(args, "clear_partials", "beside-dispatch") == "beside-dispatch"
    output = getattr(args, "combine_output", "auto")
    tables = getattr(args, "proxy_tables", None)
    if tables is not None and rdma != "proxy":
        raise user_error(f"--proxy-tables {tables} is for the GPU proxy path: use it with --rdma proxy")
    built = build_plan(args.file, options, args.sources)
    warn(built.compilation)
    if built.schedule.workload.layout == "token":  # what `epcc compile --target cuda --layout token` runs
        why = ("--kernels table: the table-driven kernels write expert-major output" if kernels == "table"
               else token_major_refusal("cuda", built.plan))
        if why:
            raise user_error(f"{args.file}: cannot simulate the token-major layout: {why}")
    direct = None
    if kernels != "table":  # kernel-formation recorded the CUDA target's choice (plan/direct.py)
        direct, why = built.plan.direct, built.plan.direct_not_used
        if direct is not None and sms is not None:
            direct = direct.with_sms(sms)
        if direct is not None and cached:
            direct = direct.cached()
        if direct is None and (kernels == "direct" or sms is not None or cached):
            flag = "--kernels direct" if kernels == "direct" else "--sms" if sms is not None else "--cached"
            raise user_error(f"{flag}: the CUDA target does not lower {args.file} to direct kernels: {why}")
    dealing = getattr(args, "dealing", None)
    if dealing is not None and direct is not None:
        raise user_error(f"--dealing {dealing}: the table-driven kernels' blocks; {args.file} runs as direct kernels "
                         f"(use --kernels table)")
    try:
        exchange = getattr(args, "metadata_exchange", "auto")
        res = simulate(built.plan, sim_options(built.plan, direct, rdma, tables, exchange, options.routing, dealing,
                                               copied, beside, output))
    except SimulationError as e:
        raise user_error(f"{args.file}: cannot simulate the plan: {e}") from None
    return built, res


def sim_options(plan: Plan, direct, rdma: str = "proxy", proxy_tables: str | None = None,
                metadata_exchange: str = "auto", routing: str | None = None,
                dealing: str | None = None, copied: frozenset[str] = frozenset(),
                zero_beside: bool = True, combine_output: str = "auto") -> SimOptions:
    """What `epcc simulate` runs the model with: the direct kernels' (`direct`: plan.direct or a
    variant of it), else the table-driven kernels' -- their metadata kernels where the bundle has
    them, the Buffer's calls where the CUDA target lowers the plan (host-built tables too), the
    roles' blocks dealt from a routing drawn from `routing`; `copied`: the programs whose rows the
    Buffer copies in although the kernels could read them in place (--copy-inputs); `zero_beside`:
    with tables the GPU writes, the combine's partials cleared beside the dispatch (--clear-partials);
    `combine_output`: where the combine's sums become bf16 (--combine-output; auto: as the manifest
    says)."""
    layout = block_layout(plan, routing) if direct is None and plan.sm_rates else None
    manifest = table_manifest(plan, rdma, proxy_tables != "host", metadata_exchange) if direct is None else None
    metadata = from_manifest(manifest.get("metadata")) if manifest is not None else None
    # the Buffer's copies run around the table-driven kernels whether the GPU or the host writes their
    # tables (runtime/engines/cuda_table: the combine's clearing, rows and conversion in both; the rows
    # not where the combine reads the caller's in place; the dispatch's x likewise)
    return SimOptions(rdma_proxy=rdma == "proxy", direct=direct, metadata=metadata, calls=manifest is not None,
                      caller_rows=reads_caller_rows(manifest) - copied,
                      convert_in_kernel=(converts_in_kernel(manifest) if combine_output == "auto"
                                         else combine_output == "in-kernel"),
                      zero_beside=zero_beside and metadata is not None, layout=layout, dealing=dealing or "round-robin")


def block_layout(plan: Plan, routing: str | None):
    """The layout the per-block model deals each role's chunks from (sim/blocks.py): `plan` laid out
    for one routing drawn from `routing` (uniform, zipf:S: sampled with seed 0, as ep_bench draws
    its routing; FILE.npy: the file's), or None, with a warning, where the plan cannot be laid out
    (the fluid model alone then)."""
    wl = plan.workload
    if wl is None:
        return None
    try:
        topk = make_topk(routing or "uniform", plan.num_ranks, wl.tokens, wl.topk, wl.experts, wl.placement,
                         seed=0).topk_idx
        return compute_layout(plan, topk)
    except (LayoutError, ValueError) as e:
        say(f"warning: the roles' blocks are not modelled (no layout of the plan: {e}); the fluid model alone",
            err=True)
        return None


def table_metadata(plan: Plan, rdma: str, proxy_device_tables: bool = True,
                   metadata_exchange: str = "auto") -> DeviceMetadata | None:
    """The metadata kernels the CUDA target's table-driven bundle of `plan` runs before each dispatch
    (its manifest's "metadata", as `epcc compile --target cuda --rdma RDMA [--proxy-tables host]
    [--metadata-exchange HOW]` writes it where the plan has RDMA steps, and with the default --rdma
    where it has none: the option then only says whether the plan leaves one box; a plan with direct
    kernels: its table-driven path's), or None where it runs none (the host lays the routing out; a
    plan the backend cannot lower).  A
    metadata exchange the plan cannot have (ipc beyond one box) is a user error."""
    manifest = table_manifest(plan, rdma, proxy_device_tables, metadata_exchange)
    return from_manifest(manifest.get("metadata")) if manifest is not None else None


def table_manifest(plan: Plan, rdma: str, proxy_device_tables: bool = True,
                   metadata_exchange: str = "auto") -> dict | None:
    """The CUDA manifest of `plan`'s table-driven bundle, as table_metadata compiles it, or None
    where the backend cannot lower the plan.  A metadata exchange the plan cannot have is a user
    error."""
    try:
        check_exchange(plan, metadata_exchange)
    except CudaCodegenError as e:
        raise user_error(f"--metadata-exchange {metadata_exchange}: {e}") from None
    try:
        options = CudaOptions(rdma=rdma if rdma_steps(plan) else "auto", proxy_device_tables=proxy_device_tables,
                              metadata_exchange=metadata_exchange)
        return generate_cuda(plan, options=options).manifest
    except CudaCodegenError:
        return None


def cmd_simulate(args) -> int:
    options = pass_options(args)
    tokens = options.tokens
    if args.gantt and not args.gantt.lower().endswith(".svg"):
        raise user_error(f"--gantt {args.gantt}: the Gantt chart is written as SVG; name the file *.svg")
    if args.gantt:
        refuse_overwrite("--gantt", args.gantt, [args.gantt], inputs_of(args))
    built, res = simulation(args, options)
    if args.gantt:
        try:
            write_svg(res, args.gantt)
        except OSError as e:
            raise user_error(f"--gantt {args.gantt}: cannot write the chart: {e.strerror or e}") from None
    if args.json:
        d = to_dict(res, built.passes_run, tokens if tokens is not None else built.schedule.workload.tokens)
        print(json.dumps(d, indent=1))
    else:
        say_lines(table(res, built.passes_run))
        if args.gantt:
            say(f"Gantt chart written to {args.gantt}")
    return EXIT_OK
