"""The options several commands share: the plan's workload (--routing, --tokens, --dtype, --layout), the
kernels' SM model (--kernels, --sms), and how a positive whole number is read from the command line."""

from __future__ import annotations

import argparse

from ..diagnostics import did_you_mean
from ..passes import PassOptions
from ..sema.model import LAYOUTS
from ..sema.workload import LIMITS
from .common import user_error


def plan_options(c: argparse.ArgumentParser) -> None:
    c.add_argument("--routing", default="uniform", metavar="uniform|zipf:S|FILE.npy",
                   help="routing distribution: uniform (exact), zipf:S (expert popularity ~ 1/rank^S, sampled), "
                        "or a .npy file of top-k indices [N, k] or expert popularity [E] (default: uniform)")
    c.add_argument("--tokens", metavar="N", help="tokens per rank (default: the workload's)")
    c.add_argument("--dtype", choices=("bf16", "fp8"), help="dispatch dtype (default: the workload's)")
    c.add_argument("--layout", metavar="|".join(LAYOUTS),
                   help="dispatch output layout: expert (one row per token and local expert) or token (one row "
                        "per token and destination rank, DeepEP's) (default: the workload's)")


def kernel_options(c: argparse.ArgumentParser, only: str = "") -> None:
    """--kernels, --sms, --cached and --dealing: which kernels' SM model the simulation applies (resolved by
    simulate.simulation).  `only` prefixes the help of a command that simulates only with another
    option; there the default is None (not given, which means auto) so that giving them without it
    is an error."""
    c.add_argument("--kernels", choices=("auto", "direct", "table"), default=None if only else "auto",
                   help=only + "which CUDA kernels' SM model to apply: direct (the direct lowering of one-hop "
                        "plans: one pool of SMs per rank and program shared by its steps, and its kernel "
                        "launches), table (the table-driven kernels: one SM role per step), auto (what `epcc "
                        "compile --target cuda` runs: direct where it lowers the plan to direct kernels; the "
                        "default)")
    c.add_argument("--sms", metavar="N",
                   help=only + "with the direct kernels: SMs per program (default: the push step's `sms`, as the "
                        "CUDA target's default configuration)")
    c.add_argument("--cached", action="store_true", default=None if only else False,
                   help=only + "with the direct kernels: the dispatch of a cached handle (the routing of the last "
                        "dispatch again: no metadata kernel, no metadata pass)")
    c.add_argument("--dealing", choices=("round-robin", "free"), default=None,
                   help=only + "with the table-driven kernels: how each role's chunks go to its blocks, round-robin "
                        "(what the kernels do, the default: block b takes items b, b + N, ... and publishes each "
                        "in order before its next) or free (each item to the block free first, which does not wait "
                        "to publish: a kernel change, to see what it would gain)")


def positive(text, flag: str, expected: str, too_small: str, most: int | None = None) -> int | None:
    """A positive integer option (at most `most`), or a located-at-the-flag user error."""
    if text is None:
        return None
    try:
        v = int(text)
    except ValueError:
        raise user_error(f"{flag} {text}: expected {expected}") from None
    if v <= 0:
        raise user_error(f"{flag} {text}: {too_small}")
    if most is not None and v > most:
        raise user_error(f"{flag} {text}: out of range (at most {most}, as in a .sched file)")
    return v


def pass_options(args) -> PassOptions:
    """PassOptions from --routing/--tokens/--hidden; a bad value is a user error (exit 1)."""
    tokens = positive(args.tokens, "--tokens", "a whole number of tokens per rank, e.g. --tokens 4096",
                      "tokens per rank must be at least 1", LIMITS["tokens"])
    hidden = positive(getattr(args, "hidden", None), "--hidden", "a whole number of channels, e.g. --hidden 256",
                      "the hidden size must be at least 1", LIMITS["hidden"])
    return PassOptions(routing=args.routing, tokens=tokens, hidden=hidden, dtype=getattr(args, "dtype", None),
                       layout=layout_option(getattr(args, "layout", None)))


def layout_option(text: str | None) -> str | None:
    """--layout's value (None: the workload's), or a user error naming the flag."""
    if text is None or text in LAYOUTS:
        return text
    near = did_you_mean(text, LAYOUTS)
    raise user_error(f"--layout {text}: expected {' or '.join(LAYOUTS)} (expert: one row per token and local expert; "
                     f"token: one row per token and destination rank)" + (f"; {near}" if near else ""))
