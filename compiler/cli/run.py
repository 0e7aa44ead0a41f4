"""`epcc run FILE`: run a schedule's dispatch and combine on a backend and check them against the
oracle (runtime/testing): compile the schedule (or load a compiled plan.json), make seeded
inputs, lay the plan out, run every rank, and compare (runtime/testing/check.py says what
differs).  Prints one summary line; exit status 1 on a mismatch."""

from __future__ import annotations

import importlib
import os
import time
import traceback

import numpy as np

from .. import limits, pipeline
from ..plan import bundle as bundle_io
from ..plan import rdma as rdma_plan
from ..runtime.layout import compute_layout
from ..runtime.testing import check, inputs, oracle
from .common import EXIT_OK, EXIT_USER, say, user_error, warn
from .options import pass_options

# `epcc run` backends: name -> (module, description).  A backend module provides
#   run_dispatch(plan, layout, x_rows: list[np.ndarray [T, row_bytes] uint8]) -> list[np.ndarray [n_d, row_bytes] uint8]
#   run_combine(plan, layout, y: list[np.ndarray [n_d, hidden] uint16 (bf16)]) -> list[np.ndarray [T, hidden] float32]
RUN_BACKENDS = {
    "cpu": ("epcc.runtime.engines.cpu.threads", "the CPU backend (backends/cpu: the layout lowered to LLVM IR, "
                                                "JIT-compiled, every rank's roles as threads)"),
    "reference": ("epcc.runtime.testing.reference", "the NumPy reference executor (runtime/testing/reference.py: "
                                                    "copies applied one after another; a debugging backend)"),
}


def add_parser(sub) -> None:
    c = sub.add_parser("run", help="run a schedule's dispatch and combine on a backend; check them against the oracle",
                       description="Compile FILE (or load a compiled plan.json), build deterministic inputs (routing, "
                                   "weights, payload rows, expert outputs), compute the token-level layout "
                                   "(docs/runtime.md), execute dispatch and combine on the backend and compare with "
                                   "the NumPy oracle: dispatch bit-exact (rows, order, counts, weights), combine "
                                   "within bf16 tolerance.  Prints one summary line; exit status 1 on a mismatch, "
                                   "with the first differing rank, token and expert.",
                       epilog="Inputs are [ranks x tokens x row bytes] in memory: use --tokens and --hidden for "
                              "quick runs of the large schedules.")
    c.add_argument("file", metavar="FILE", help="the .sched file, or a plan.json written by 'epcc compile'")
    c.add_argument("--backend", default="cpu", choices=sorted(RUN_BACKENDS), metavar="|".join(sorted(RUN_BACKENDS)),
                   help="where to execute: " + "; ".join(f"{k}: {v[1]}" for k, v in sorted(RUN_BACKENDS.items()))
                        + " (default: cpu)")
    c.add_argument("--routing", default="uniform", metavar="uniform|zipf:S|one-hot|empty|no-remote|FILE.npy",
                   help="the tokens' top-k experts: uniform; zipf:S (expert popularity ~ 1/rank^S); one-hot (all "
                        "of a token's experts on one rank); empty (only the first half of the ranks receive); "
                        "no-remote (experts on the token's own rank); or a .npy file of top-k indices [R, T, k] or "
                        "[R*T, k] (-1: empty slot).  The compiler plans volumes with uniform routing unless zipf:S "
                        "(default: uniform)")
    c.add_argument("--tokens", metavar="N", help="tokens per rank (default: the workload's)")
    c.add_argument("--hidden", metavar="N", help="hidden size (default: the workload's; fp8 needs a multiple of 128)")
    c.add_argument("--layout", metavar="expert|token",
                   help="dispatch output layout: expert (one row per token and local expert) or token (one row per "
                        "token and destination rank, DeepEP's) (default: the workload's)")
    c.add_argument("--seed", metavar="N", default="0", help="seed of every random input (default: 0)")
    c.add_argument("--transport", default="inproc", metavar="inproc|libfabric-tcp",
                   help="how ranks run and RDMA steps move (cpu backend): inproc: every rank's roles as threads of "
                        "this process, RDMA copies as memory copies; libfabric-tcp: one process per rank "
                        "(torch.distributed gloo rendezvous), RDMA steps through the emitted proxy loop over "
                        "libfabric's tcp provider (docs/rdma.md) (default: inproc)")
    c.set_defaults(func=cmd_run)


def _load_plan_json(path: str):
    try:
        return bundle_io.read_plan(path)
    except bundle_io.BundleError as e:
        raise user_error(str(e)) from None


def _load_backend(name: str):
    module, _ = RUN_BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or the backend's own import-time failure
        return None, f"backend '{name}' is not available: importing {module} failed: {type(e).__name__}: {e}"
    missing = [f for f in ("run_dispatch", "run_combine") if not callable(getattr(mod, f, None))]
    if missing:
        return None, f"backend '{name}' ({module}) does not provide {' and '.join(missing)}"
    return mod, None


def _transport_backend(backend: str, transport: str):
    """The backend running one process per rank over `transport`, or a one-line error."""
    from ..runtime.engines import cpu_procs as procs  # llvmlite, jinja2: only `epcc run --transport` needs them

    if transport not in procs.TRANSPORTS:
        return f"--transport {transport}: unknown transport (choose from {', '.join(procs.TRANSPORTS)})"
    if backend != "cpu":
        return f"--transport {transport}: only the cpu backend runs over a transport (not '{backend}')"
    try:
        procs.check_transport(transport)
    except procs.TransportUnavailable as e:
        return str(e)
    return procs.ProcessBackend(transport)


def cmd_run(args) -> int:
    timings: dict[str, float] = {}

    def timed(name, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
        return out

    try:
        seed = int(args.seed)
    except ValueError:
        raise user_error(f"--seed {args.seed}: expected a whole number, e.g. --seed 0") from None
    if seed < 0:
        raise user_error(f"--seed {args.seed}: the seed must be >= 0")
    try:
        inputs.check_spec(args.routing)
    except ValueError as e:
        raise user_error(f"--{e}") from None
    options = pass_options(args)  # validates --tokens and --hidden
    if args.file.endswith(".json"):
        if options.hidden is not None:
            raise user_error(f"--hidden {args.hidden}: {args.file} is a compiled plan, whose hidden size is fixed; "
                             f"compile the .sched with --hidden instead")
        plan = timed("load", _load_plan_json, args.file)
        tokens = options.tokens if options.tokens is not None else plan.workload.tokens
        schedule = plan.schedule
    else:
        # The compiler models uniform and zipf routings; for the others its expected volumes
        # (which the layout does not use) are those of uniform routing.
        options.routing = args.routing if args.routing == "uniform" or args.routing.startswith("zipf:") else "uniform"
        c = timed("compile", pipeline.run, args.file, pipeline.STAGES[-1].name, args.sources, options)
        warn(c)
        plan = c.passes.get("plan")
        tokens = c.schedule.workload.tokens
        schedule = c.schedule.name
    wl = plan.workload
    R = plan.num_ranks
    need, avail = check.run_bytes(R, tokens, wl.hidden, wl.dtype, wl.topk), limits.available_memory()
    if avail is not None and need > avail:
        raise user_error(f"{R} ranks x {tokens} tokens x hidden {wl.hidden} ({wl.dtype}): the run needs about "
                         f"{limits.memory_text(need)} of memory (inputs, dispatched rows, expert outputs, combine "
                         f"results, the oracle's sums), {limits.memory_text(avail)} are available; use smaller "
                         f"--tokens or --hidden")
    names = list(plan.rank_names) or [f"rank {r}" for r in range(R)]
    try:
        routing = timed("inputs", inputs.make_topk, args.routing, R, tokens, wl.topk, wl.experts, wl.placement,
                        seed)
        weights = timed("inputs", inputs.make_weights, routing.topk_idx, seed)
        x = timed("inputs", inputs.make_x_rows, R, tokens, wl.hidden, wl.dtype, seed)
    except ValueError as e:
        raise user_error(f"--routing {args.routing}: {e}") from None
    transport = getattr(args, "transport", "inproc")
    if transport != "inproc":
        try:  # EPCC_RDMA_CHUNK_TOKENS / EPCC_RDMA_DEPTH re-chunk the RDMA steps (docs/rdma.md)
            plan = rdma_plan.with_overrides(plan)
        except rdma_plan.RdmaConfigError as e:
            raise user_error(str(e)) from None
    try:
        layout = timed("layout", compute_layout, plan, routing.topk_idx, weights)
    except ValueError as e:
        raise user_error(f"{args.file}: cannot lay out the plan: {e}") from None
    backend, why = _load_backend(args.backend)
    if backend is None:
        say(f"epcc: error: {why}", err=True)
        say("epcc: note: '--backend reference' runs the NumPy reference executor", err=True)
        return EXIT_USER
    if transport != "inproc":
        backend = _transport_backend(args.backend, transport)
        if isinstance(backend, str):
            say(f"epcc: error: {backend}", err=True)
            return EXIT_USER
    head = (f"{schedule}: {R} ranks x {tokens} tokens, hidden {wl.hidden} {wl.dtype}, top-{wl.topk} of {wl.experts}, "
            f"routing {routing.describe()}, seed {seed}, backend {args.backend}"
            + (f", transport {transport}" if transport != "inproc" else ""))

    def times() -> str:
        order = ["compile", "load", "inputs", "layout", "dispatch", "combine", "oracle"]
        return ", ".join(f"{k} {timings[k] * 1e3:.1f} ms" for k in order if k in timings)

    def backend_failed(phase: str, e: BaseException) -> int:
        if os.environ.get("EPCC_DEBUG"):
            traceback.print_exc()
        say(f"{head}: {phase} FAILED; {times()}")
        say(f"epcc: error: backend '{args.backend}' failed in {phase}: {type(e).__name__}: {e}", err=True)
        return EXIT_USER

    try:
        got = timed("dispatch", backend.run_dispatch, plan, layout, [x[r] for r in range(R)])
    except Exception as e:
        return backend_failed("dispatch", e)
    token_major = wl.layout == "token"
    want = timed("oracle", oracle.token_dispatch_oracle if token_major else oracle.dispatch_oracle,
                 routing.topk_idx, wl.experts, wl.placement, x, weights)
    rows = [int(w.rows.shape[0]) for w in want]
    recv = f"{sum(rows)} rows received ({min(rows)}..{max(rows)} per rank)" + (", token-major" if token_major else "")
    diff = (check.token_dispatch_difference if token_major else check.dispatch_difference)(layout, got, want, names)
    if diff is not None:
        say(f"{head}: {recv}; dispatch MISMATCH, combine not run; {times()}")
        say(f"epcc: error: dispatch differs from the oracle: {diff}", err=True)
        return EXIT_USER
    y = timed("inputs", inputs.make_expert_outputs, rows, wl.hidden, seed)
    try:
        res = timed("combine", backend.run_combine, plan, layout, y)
    except Exception as e:
        return backend_failed("combine", e)
    if token_major:  # the adjoint: a token's rows summed, unweighted
        ref, mag = timed("oracle", lambda: oracle.token_combine_oracle(routing.topk_idx, wl.experts, wl.placement, y,
                                                                       wl.hidden, return_abs=True))
    else:
        ref, mag = timed("oracle", lambda: oracle.combine_oracle(routing.topk_idx, wl.experts, wl.placement, weights,
                                                                 y, wl.hidden, return_abs=True))
    bad_shapes = check.combine_shapes_difference(res, R, (tokens, wl.hidden))
    if bad_shapes is not None:
        say(f"{head}: {recv}; dispatch OK; combine MISMATCH; {times()}")
        say(f"epcc: error: backend '{args.backend}' {bad_shapes}", err=True)
        return EXIT_USER
    got_all = np.stack([np.asarray(r, dtype=np.float32) for r in res])
    rounding = backend.partial_rounding(plan) if hasattr(backend, "partial_rounding") else 0.0
    comb = check.combine_difference(got_all, ref, mag, routing.topk_idx, wl.topk, rounding, names)
    if not comb.ok:
        say(f"{head}: {recv}; dispatch OK (bit-exact); combine MISMATCH ({comb.error}); {times()}")
        say(f"epcc: error: combine differs from the oracle: {comb.difference}", err=True)
        return EXIT_USER
    say(f"{head}: {recv}; dispatch OK (bit-exact); combine OK ({comb.error}); {times()}")
    if hasattr(backend, "summary") and backend.summary():
        say(f"transport: {backend.summary()}")
    return EXIT_OK
