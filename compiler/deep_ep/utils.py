"""DeepEP's small types over epcc: `Config` (the launch knobs DeepEP code passes around) and
`EventOverlap` (what every call returns for stream overlap).

epcc runs every call on the current stream, so an event here marks the point on the current
stream after the call's kernels: waiting for it is always correct (and cheap); on the CPU
backend a call has finished when it returns and the event is a finished one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Config:
    """DeepEP's `deep_ep.Config`: SMs and chunk sizes of the normal-mode kernels.

    epcc uses `num_sms` (the SMs of the bundle's kernels, where its engine takes a launch
    configuration: epcc.deep_ep.buffer.launch_config) and checks the chunk sizes as DeepEP does;
    the chunk sizes do not change epcc's kernels, whose chunking is the schedule's."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Config: {name} must be an int, not {type(value).__name__}")
        if self.num_sms < 0:
            raise ValueError(f"Config: num_sms must be at least 0, not {self.num_sms}")
        for kind in ("nvl", "rdma"):
            send = getattr(self, f"num_max_{kind}_chunked_send_tokens")
            recv = getattr(self, f"num_max_{kind}_chunked_recv_tokens")
            if not 0 < send < recv:
                raise ValueError(f"Config: the {kind} chunk sizes must satisfy 0 < send < recv "
                                 f"(num_max_{kind}_chunked_send_tokens {send}, "
                                 f"num_max_{kind}_chunked_recv_tokens {recv})")


class _Done:
    """The event of a call that finished before it returned (the CPU backend)."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for."""


class _StreamEvent:
    """A CUDA event recorded on the current stream now."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record()

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


def stream_event(device: torch.device) -> Any:
    """The event after what is queued on `device`'s current stream (finished on the CPU)."""
    return _StreamEvent() if device.type == "cuda" else _Done()


class EventOverlap:
    """DeepEP's `deep_ep.EventOverlap`: an event (None when the call was not asked to finish
    asynchronously) and tensors to keep alive until it is waited for."""

    def __init__(self, event: Any = None, extra_tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event."""
        if self.event is None:
            raise ValueError("EventOverlap.current_stream_wait: this call returned no event (pass async_finish=True "
                             "to get one)")
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *_: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
