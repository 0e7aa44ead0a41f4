"""Whose machine a topology is: the vendors and architectures a `.sched` file may name
(`vendor biren arch br166` inside `topology { }`), what epcc knows of each, and which code
generator `epcc compile` runs for it when no --target is given.

One table (VENDORS) and one decision (choose_target): the CLI, sema and the plan read them, none
re-derives them.  A topology that names no vendor is nvidia hopper, what every schedule was
before vendors were named.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    name: str
    dies_per_card: int  # dies of one card (a BR166 card has two, joined by D2D)
    about: str  # one line for messages and docs


@dataclass(frozen=True)
class Vendor:
    name: str
    archs: tuple[Arch, ...]  # the first is the default where a topology names no arch
    # `epcc compile` without --target: the code generator for this vendor's machines, or None
    # for the plan alone.  NVIDIA stays the plan alone (`--target cuda` adds the kernels), as it
    # was before topologies named a vendor; a Biren topology gets the SUPA kernels.
    target: str | None

    def arch(self, name: str) -> Arch | None:
        return next((a for a in self.archs if a.name == name), None)


VENDORS: dict[str, Vendor] = {
    "nvidia": Vendor("nvidia", (Arch("hopper", 1, "H100 / H200 / H800 (sm_90a)"),), None),
    "biren": Vendor("biren", (Arch("br166", 2, "BR166: two dies per card joined by D2D, BLink between cards"),),
                    "supa"),
}
DEFAULT_VENDOR = "nvidia"
DEFAULT_ARCH = "hopper"

# The vendor each code generator emits for (a target of another vendor's topology gets a note).
TARGET_VENDOR = {"cuda": "nvidia", "supa": "biren"}
NO_TARGET = "none"  # --target none: the plan alone, whatever the vendor


@dataclass(frozen=True)
class TargetChoice:
    target: str | None  # the code generator to run, None for the plan alone
    why: str  # how it was chosen, for messages
    note: str | None = None  # said on stderr: a target emitting for another vendor's topology


def choose_target(vendor: str, arch: str, requested: str | None) -> TargetChoice:
    """The code generator `epcc compile` runs for a topology of `vendor` / `arch`: the requested
    one (--target; `none` for the plan alone), else the vendor's default (Vendor.target).  A
    requested target of another vendor is honoured, with a note saying so."""
    where = f"a {vendor} {arch} topology"
    if requested is None:
        target = VENDORS[vendor].target
        return TargetChoice(target, f"the default for {where}" if target else f"{where} compiles to the plan alone "
                                                                               f"by default")
    if requested == NO_TARGET:
        return TargetChoice(None, "--target none")
    other = TARGET_VENDOR.get(requested)
    note = None
    if other is not None and other != vendor:
        note = f"--target {requested}: emitting {requested.upper()} code for {where}"
    return TargetChoice(requested, f"--target {requested}", note)


__all__ = ["Arch", "DEFAULT_ARCH", "DEFAULT_VENDOR", "NO_TARGET", "TARGET_VENDOR", "TargetChoice", "VENDORS",
           "Vendor", "choose_target"]
