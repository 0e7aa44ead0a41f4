"""How the engines are driven, and what they raise.

Two drivers, two protocols:

* `Engine`: one rank's dispatch and combine behind `epcc.runtime.Buffer`, over torch tensors
  and a torch.distributed group (what it holds is released by a construction that fails and
  before the interpreter's teardown: lifetime.py).  Buffer checks what every engine shares (the
  bundle, the group, the DeepEP arguments it ignores) and hands each call to the engine of the
  bundle's backend: cpu (cpu/engine.py) or cuda (cuda_direct/engine.py).  Made once per Buffer as
  `EngineClass(group, bundle, timeout_s=..., config=..., agree=...)` (bundle:
  epcc.plan.bundle.Bundle; agree: the Buffer's agree.Agreement, None: the engine makes one).
* `Runner`: every rank of a plan in one call over NumPy arrays, as `epcc run` and the tests
  drive an executor: cpu/threads.py (threads), cpu_procs.ProcessBackend (a process per rank)
  and runtime/testing/reference.py (NumPy, copy by copy).

The table-driven kernels (cuda_table) and the GPU proxy path (gpu_proxy) are driven by
bench/ep_bench.py and the tests directly; they implement neither protocol yet.

Failing together (agree.py): an engine's calls are collectives, so a failure on one rank must
reach every rank, promptly.  An Engine never waits for its peers in a torch collective: it runs
each call inside `agree.call(name)` (an exception there reaches every rank), meets its peers only
in the agreement's bounded rounds (`exchange`, `gather`, `barrier`), posts a failure its peers
cannot see otherwise (a kernel's report, a refusal before a launch) with `agree.fail`, and every
rank raises the same GroupError (below), naming the rank that failed and why.

No torch here: the runners run without it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ...plan import Plan
from ..layout import Layout


class EngineError(RuntimeError):
    """An engine could not run a call (the message says which step of it and why)."""


class KernelTimeout(EngineError):
    """A kernel (or a driver or proxy loop standing in for one) gave up waiting: the message names
    the rank, the wait and the values it saw.  `rc`: the launcher's return code, where one gave it."""

    def __init__(self, message: str, rc: int | None = None):
        super().__init__(message)
        self.rc = rc


class GroupError(EngineError):
    """A collective call failed on some rank of the group: raised on every rank, with the same
    message, naming the rank that failed first and why ("dispatch #3 failed on rank 1: ...").

    `call`: the call ("dispatch #3"); `rank`: the rank the message names (the lowest of the ranks
    that failed for the same reason, `ranks`); `reason`: why; `failures`: {rank: reason} of every
    rank this rank heard of; `rebuild`: True when the Buffer cannot be used again (make a new
    one), False when every rank refused the call before any data moved (its arguments).

    The subclasses tell the kind of the root cause, so `except ValueError` still catches a
    refused argument and `except KernelTimeout` a wait that gave up, on every rank."""

    def __init__(self, message: str, *, call: str = "", rank: int = -1, ranks: tuple[int, ...] = (),
                 reason: str = "", failures: dict[int, str] | None = None, rebuild: bool = True):
        super().__init__(message)
        self.call, self.rank, self.ranks, self.reason = call, rank, tuple(ranks), reason
        self.failures = dict(failures or {})
        self.rebuild = rebuild

    def retold(self, message: str, **changes) -> "GroupError":
        """A new error of this class saying `message`, with this one's fields but `changes` (no
        traceback, no cause: a copy to keep, or to raise again in another call)."""
        fields = dict(call=self.call, rank=self.rank, ranks=self.ranks, reason=self.reason, failures=self.failures,
                      rebuild=self.rebuild)
        return type(self)(message, **{**fields, **changes})


class GroupTypeError(GroupError, TypeError):
    """A rank refused an argument of the wrong type."""


class GroupValueError(GroupError, ValueError):
    """A rank refused an argument's value (or a bundle that does not fit)."""


class GroupTimeout(GroupError, KernelTimeout):
    """A wait gave up: a rank's kernel or driver, or a rank that never answered (stalled or dead)."""


class Engine(Protocol):
    """One rank's runner of a bundle behind Buffer."""

    device: Any  # torch.device where its tensors live: cpu, or this rank's GPU
    agree: Any  # the agree.Agreement its calls fail through (Buffer passes its own)

    def dispatch(self, x, topk_idx, topk_weights, *, sync: bool, expert_alignment: int, handle) -> tuple:
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)."""

    def combine(self, x, handle, topk_weights=None) -> Any:
        """The combined tokens [tokens, hidden] bf16 of the dispatch `handle` came from."""

    def synchronize(self) -> None:
        """Wait for this rank's work; raise KernelTimeout with the report of a wait that gave up."""

    def close(self) -> None:
        """Release everything (collective: every rank closes)."""

    def release_locally(self) -> list[str]:
        """Release what it holds on this rank alone, last acquired first, without meeting the peers
        (a construction that failed: lifetime.py); what could not be released, one line each."""

    def release_at_exit(self) -> None:
        """The interpreter exits with it open (lifetime.py's atexit hook): stop what runs (proxy
        threads) and release what it safely can on this rank alone."""


class Runner(Protocol):
    """Every rank of a plan, in one call."""

    def run_dispatch(self, plan: Plan, layout: Layout, x_rows: list[np.ndarray]) -> list[np.ndarray]:
        """x_rows[r]: uint8 [T, row_bytes]; returns every rank's `output` rows (uint8 [n_d, row_bytes])."""

    def run_combine(self, plan: Plan, layout: Layout, y: list[np.ndarray]) -> list[np.ndarray]:
        """y[r]: bf16 bits (uint16) [n_d, hidden]; returns every rank's combined tokens (float32 [T, hidden])."""
