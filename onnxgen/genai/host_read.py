"""A sampled token's way from the device to the host, one pending at a time: what lets the pipelined
decode loop (engine.py) enqueue step N+1 before it waits for token N."""

from __future__ import annotations

import torch


class HostRead:
    """One sampled token on its way to the host: ``start(token)`` enqueues the read of the 0-d device
    tensor, ``wait()`` blocks until that token (not later work) is there and returns it. One read
    is pending at a time; the pipelined decode loop starts it before it enqueues the next step.
    ``start(token, at)``: the step that made the token also stored it in the reader's pinned
    ``host_tokens`` at index ``at`` (GreedyTail), so only the step's end is waited for."""

    def start(self, token: torch.Tensor, at: int | None = None) -> None:
        raise NotImplementedError

    def wait(self) -> int:
        raise NotImplementedError


class CpuHostRead(HostRead):
    """CPU: nothing runs ahead of the host, so the value is taken at start time and handed out at
    wait time (this is what lets the tests run the pipelined loop on the CPU)."""

    def __init__(self) -> None:
        self.token: torch.Tensor | None = None

    def start(self, token: torch.Tensor, at: int | None = None) -> None:
        # the value now, as the CUDA read copies it in stream order: the caller may reuse the tensor
        self.token = token.clone()

    def wait(self) -> int:
        assert self.token is not None, "wait() without start()"
        token, self.token = self.token, None
        return int(token.item())


class CudaHostRead(HostRead):
    """CUDA: a non-blocking copy into pinned memory with an event recorded right after it. Both are
    enqueued before the next step, so ``wait`` waits for this token's kernels only, while the next
    step runs; ``int(token)`` there would wait for everything enqueued so far."""

    def __init__(self, device: torch.device, host_tokens: torch.Tensor | None = None):
        self.device = device
        self.buffer = torch.empty((), dtype=torch.int64, pin_memory=True)  # reused: one read pending at a time
        self.host_tokens = host_tokens
        self.at: int | None = None
        self.event = torch.cuda.Event()

    def start(self, token: torch.Tensor, at: int | None = None) -> None:
        if at is None or self.host_tokens is None:
            self.buffer.copy_(token.reshape(()), non_blocking=True)
            at = None
        self.at = at
        self.event.record(torch.cuda.current_stream(self.device))

    def wait(self) -> int:
        self.event.synchronize()
        if self.at is not None:
            return int(self.host_tokens[self.at])  # type: ignore[index]
        return int(self.buffer.item())


def host_read(device: torch.device, host_tokens: torch.Tensor | None = None) -> HostRead:
    """The pending token read for ``device``; ``host_tokens``: the pinned tokens a step tail writes
    (HostRead.start's ``at``)."""
    return CudaHostRead(device, host_tokens) if device.type == "cuda" else CpuHostRead()
