"""The token-major direct kernels in the cost model (the workload's `layout token`, DeepEP's
intranode output; backends/cuda/include/epcc/direct/token.cuh).

They run as the expert-major direct kernels do (sim/direct.py: one pool of SMs per rank and
program, the same launches and metadata), but write one row per (token, destination GPU) instead
of one per (token, local expert), so the plan's flows (which count expert rows) are charged
otherwise.  With e = the expected expert rows of a token on a GPU it hits and h = the expected GPUs
a token hits (uniform routing, costmodel/uniform.py):

* Bytes.  A dispatch row carries the token's payload (bf16 row; fp8 row and its scales) and its
  side data: the top-k local expert ids (int64 each, DeepEP's recv_topk_idx), the top-k weights
  (fp32) and the row's token (int32), token_row_bytes.  A send's flow (one copy per token) keeps
  its tokens; the permute's flow (its rows, `PlanStep.rows`) becomes one row per token: 1/e of
  its rows.  A combine row is the bf16 row of one (token, GPU), its partial: the reverse of the
  send keeps its bytes, the reverse of the permute is 1/e of its rows.
* SM work (copy-equivalent bytes on the pools, as sim/direct.py):
  - dispatch: the sender loads the row once for the h GPUs it goes to and stores it into each,
    its own GPU's included: 1/copy + 1/(h read) per row; the receiver does nothing (no
    replication: the row is written once);
  - combine from the expert GPU to the home GPU: the expert GPU copies the row (load, store),
    1/read + 1/copy; the home GPU sums it, 1/reduce, and stores the output row once per token,
    1/(h copy).  A token's row on its own GPU is summed in place (no copy): 1/reduce + 1/(h copy).
* `hbm:<rank>`: the rows written into the rank's memory: one per dispatch row (not e); in combine
  the staged row and 1/h of the output row, the row summed in place 1/h.
* Links.  Where the receiving GPU does nothing while the rows land (the dispatch), a peer link
  moves what the SMs' stores reach, STORE_ONLY_GAIN x the link's declared rate
  (costmodel/rates.py says from what); the combine, whose home GPU reads the staged rows as they
  land, moves at the declared rate, as the expert-major kernels do.
* Drain (sim/direct.py): the dispatch has no second phase (a row is done when it lands): none.
  In the combine the link flows end when the last copied rows land; their tokens are then still
  to be summed at the home GPU: one wave of sums per SM, min(warps, tokens per SM) tokens, each h
  rows reduced and one row stored at the SM's rates.
"""

from __future__ import annotations

from ..costmodel.rates import STORE_ONLY_GAIN
from ..plan import DirectKernels, Plan, PlanStep
from ..plan.check import FP8_SCALE_GROUP

TOPK_ID_BYTES = 8  # int64 local expert id per top-k slot (token.cuh OFF_RECV_IDX)
TOPK_WEIGHT_BYTES = 4  # fp32 weight per top-k slot (OFF_RECV_W)
ROW_TOKEN_BYTES = 4  # int32: the row's token at its home rank, what the combine reads (OFF_ROW_TOKEN)


def is_token_major(plan: Plan) -> bool:
    return plan.workload is not None and plan.workload.layout == "token"


def payload_bytes(plan: Plan) -> int:
    """Bytes of one token's hidden state in a dispatch row (fp8: plus one fp32 scale per 128)."""
    wl = plan.workload
    return wl.hidden * 2 if wl.dtype == "bf16" else wl.hidden + wl.hidden // FP8_SCALE_GROUP * 4


def token_row_bytes(plan: Plan, program: str) -> int:
    """Bytes of one token-major row: dispatch, the payload and its side data (top-k ids and weights,
    the token); combine, the bf16 row."""
    wl = plan.workload
    if program == "combine":
        return wl.hidden * 2
    return payload_bytes(plan) + wl.topk * (TOPK_ID_BYTES + TOPK_WEIGHT_BYTES) + ROW_TOKEN_BYTES


def row_bytes(plan: Plan, step: PlanStep, flow_bytes: float, e: float) -> float:
    """The token-major bytes of one of `step`'s flows: its tokens (the rows of a flow counting
    expert rows, 1/e of them) x token_row_bytes."""
    per_token = plan.bytes_per_token if step.program == "dispatch" else plan.workload.hidden * 2
    tokens = flow_bytes / per_token / (e if step.rows else 1.0)
    return tokens * token_row_bytes(plan, step.program)


def sm_seconds(program: str, src: int, dst: int, h: float, rates: dict[str, float]) -> list[tuple[int, float]]:
    """(rank, SM-seconds) per byte of row a token-major flow from `src` to `dst` costs each rank's
    pool (the module docstring), the first phase's rank first."""
    copy = rates["copy"]
    load = 1.0 / rates["read"] if "read" in rates else 0.0
    if program == "combine":
        home = 1.0 / rates.get("reduce", copy) + 1.0 / (h * copy)
        return [(dst, home)] if src == dst else [(src, load + 1.0 / copy), (dst, home)]
    return [(src, 1.0 / copy + load / h)]


def hbm_bytes(program: str, local: bool, h: float) -> float:
    """Bytes written into the destination's memory per byte of row (the module docstring)."""
    if program == "combine":
        return 1.0 / h if local else 1.0 + 1.0 / h
    return 1.0


def link_weight(program: str) -> float:
    """What one byte of a token-major flow takes of a peer link's declared rate."""
    return 1.0 / STORE_ONLY_GAIN if program == "dispatch" else 1.0


def drain_s(plan: Plan, program: str, kernels: DirectKernels, h: float) -> float:
    """The combine's last wave of home sums on one SM (the module docstring); 0 for the dispatch
    and without the `sm` line's rates."""
    wl, rates, n = plan.workload, plan.sm_rates, kernels.sms.get(program, 0)
    if program != "combine" or wl is None or not n or "copy" not in rates:
        return 0.0
    per_token = h / rates.get("reduce", rates["copy"]) + 1.0 / rates["copy"]  # h rows summed, one stored
    return min(float(kernels.warps.get(program, 16)), wl.tokens / n) * token_row_bytes(plan, program) * per_token


__all__ = ["drain_s", "hbm_bytes", "is_token_major", "link_weight", "row_bytes", "sm_seconds", "token_row_bytes"]
