"""How the engines are driven, and what they raise.

Two drivers, two protocols:

* `Engine`: one rank's dispatch and combine behind `epcc.runtime.Buffer`, over torch tensors
  and a torch.distributed group.  Buffer checks what every engine shares (the bundle, the group,
  the DeepEP arguments it ignores) and hands each call to the engine of the bundle's backend:
  cpu (cpu/engine.py) or cuda (cuda_direct/engine.py).  Made once per Buffer as
  `EngineClass(group, bundle, timeout_s=..., config=...)` (bundle: epcc.plan.bundle.Bundle).
* `Runner`: every rank of a plan in one call over NumPy arrays, as `epcc run` and the tests
  drive an executor: cpu/threads.py (threads), cpu_procs.ProcessBackend (a process per rank)
  and runtime/testing/reference.py (NumPy, copy by copy).

The table-driven kernels (cuda_table) and the GPU proxy path (gpu_proxy) are driven by
bench/ep_bench.py and the tests directly; they implement neither protocol yet.

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


class Engine(Protocol):
    """One rank's runner of a bundle behind Buffer."""

    device: Any  # torch.device where its tensors live: cpu, or this rank's GPU

    def dispatch(self, x, topk_idx, topk_weights, *, sync: bool, expert_alignment: int, handle) -> tuple:
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)."""

    def combine(self, x, handle, topk_weights=None) -> Any:
        """The combined tokens [tokens, hidden] bf16 of the dispatch `handle` came from."""

    def synchronize(self) -> None:
        """Wait for this rank's work; raise KernelTimeout with the report of a wait that gave up."""

    def close(self) -> None:
        """Release everything (collective: every rank closes)."""


class Runner(Protocol):
    """Every rank of a plan, in one call."""

    def run_dispatch(self, plan: Plan, layout: Layout, x_rows: list[np.ndarray]) -> list[np.ndarray]:
        """x_rows[r]: uint8 [T, row_bytes]; returns every rank's `output` rows (uint8 [n_d, row_bytes])."""

    def run_combine(self, plan: Plan, layout: Layout, y: list[np.ndarray]) -> list[np.ndarray]:
        """y[r]: bf16 bits (uint16) [n_d, hidden]; returns every rank's combined tokens (float32 [T, hidden])."""
