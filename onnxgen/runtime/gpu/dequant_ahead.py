"""A long prompt's 4-bit weights dequantized one chunk ahead, on a second stream (option
``q4_dequant_ahead``).

Past the split-K GEMM's rows a prompt's 4-bit product dequantizes its weight into the session's
scratch and multiplies it with cuBLAS (linear_q4._dequant_matmul). The dequantization is memory
bound; the GEMMs, attention and norms of a long prompt are mostly compute bound or leave SMs idle,
so the dequantization of the *next* chunk can run beside them. DequantAhead splits the scratch in
two halves: while the main stream multiplies the chunk in one half, the side stream writes the
next chunk into the other.

Which chunk comes next is learned, not planned: every chunk (a weight's storage and a row range)
records the chunk that followed it within the same unit of work, and on later executions the
successor it recorded is dequantized ahead. A wrong guess is only waste: the chunk that is really
asked for is then dequantized on the main stream, as without this option.

Invariants (``join`` keeps them at every boundary of a unit: a whole run, an eager unit of a
captured step, a recorded segment):
- a half is written only after every GEMM that read it before (its ``gemm_done`` event, or the
  fork from the main stream at the unit's first prefetch);
- a GEMM reads a half only after the write of its chunk (its ``written`` event, or the main
  stream's own order);
- no work is left on the side stream when a unit ends: the main stream waits for the last
  prefetch, so a CUDA graph recorded over the unit joins every stream it forked, and the next
  unit (which may be a replayed graph whose Python never ran) starts from an empty state.

The stream operations go through ``StreamOps`` so that tests can check the ordering on a
simulated timeline without a GPU (and run the pipeline on one stream under Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple, Protocol

import torch


class StreamOps(Protocol):
    """The stream and event operations DequantAhead needs (CudaStreams on a GPU)."""

    def current(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def use(self, stream: Any) -> AbstractContextManager[Any]: ...
    def event(self) -> Any: ...
    def record(self, stream: Any, event: Any) -> Any: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def wait_stream(self, stream: Any, other: Any) -> None: ...


class CudaStreams:
    """StreamOps on torch.cuda, for one device (the scratch's, whichever is current)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def use(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> torch.cuda.Event:
        event.record(stream)
        return event

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        stream.wait_stream(other)


class OneStream:
    """StreamOps where there is one stream (CPU tensors under Triton's interpreter): the work meant
    for the side stream runs in issue order, so the pipeline's bookkeeping and results can be
    checked where there is no GPU."""

    def current(self) -> None:
        return None

    def new_stream(self) -> None:
        return None

    def use(self, stream: None) -> AbstractContextManager[Any]:
        return nullcontext()

    def event(self) -> None:
        return None

    def record(self, stream: None, event: None) -> None:
        return None

    def wait_event(self, stream: None, event: None) -> None:
        pass

    def wait_stream(self, stream: None, other: None) -> None:
        pass


class Chunk(NamedTuple):
    """Rows lo..hi of one weight: ``weight`` identifies it (the address of its first code: weights are
    the session's, never freed or moved), ``make`` writes the chunk's dense rows into a [hi - lo, k] tensor."""

    weight: int
    lo: int
    hi: int
    k: int
    make: Callable[[torch.Tensor], Any]

    @property
    def key(self) -> tuple[int, int, int, int]:
        return self.weight, self.lo, self.hi, self.k


class _Prefetch(NamedTuple):
    key: tuple[int, int, int, int]
    half: int  # its write is the written[half] record in force


class DequantAhead:
    """Two halves of the session's scratch, the side stream, and what was learned of the order."""

    def __init__(self, buffer: torch.Tensor, streams: StreamOps | None = None) -> None:
        half = buffer.numel() // 2
        self.halves = (buffer[:half], buffer[half : 2 * half])
        self.streams = streams or (CudaStreams(buffer.device) if buffer.is_cuda else OneStream())
        self.side = self.streams.new_stream()
        self.successor: dict[tuple[int, int, int, int], Chunk] = {}
        # per half, recorded again at each use (a wait takes the record in force when it is issued):
        # its chunk written (side stream), its latest GEMM issued (main stream)
        self.written = (self.streams.event(), self.streams.event())
        self.gemm_done = (self.streams.event(), self.streams.event())
        self.prefetches = 0  # chunks made on the side stream so far (tests and benches read it)
        self._reset()

    def _reset(self) -> None:
        self.last: tuple[int, int, int, int] | None = None  # the unit's previous chunk
        self.pending: _Prefetch | None = None
        self.read: list[bool] = [False, False]  # per half: a GEMM of this unit has read it (gemm_done holds)
        self.forked = False  # the side stream has waited for the main stream in this unit
        self.next_half = 0  # where a chunk made on the main stream goes; the current chunk is in the other

    def rows_for(self, k: int) -> int:
        """Weight rows of K elements that fit one half."""
        return self.halves[0].numel() // k

    def weight(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's dense rows in a half, ready on the main stream; the chunk learned to come next
        is set going on the side stream into the other half. Call ``read_done`` after the GEMM."""
        ops, main = self.streams, self.streams.current()
        key = chunk.key
        if self.last is not None:
            self.successor[self.last] = chunk
        self.last = key
        pending, self.pending = self.pending, None
        if pending is not None:  # used or not, its half is written before anyone reuses it
            ops.wait_event(main, self.written[pending.half])
        if pending is not None and pending.key == key:
            half = pending.half
        else:
            half = self.next_half if pending is None else pending.half
            chunk.make(self._view(half, chunk))
        other = 1 - half
        ahead = self.successor.get(key)
        if ahead is not None:
            if not self.forked:
                ops.wait_stream(self.side, main)
                self.forked = True
            if self.read[other]:
                ops.wait_event(self.side, self.gemm_done[other])
            with ops.use(self.side):
                ahead.make(self._view(other, ahead))
                ops.record(self.side, self.written[other])
            self.pending = _Prefetch(ahead.key, other)
            self.prefetches += 1
        self.next_half = other
        return self._view(half, chunk)

    def read_done(self) -> None:
        """The main stream has issued the GEMM that reads the current chunk."""
        half = 1 - self.next_half
        self.streams.record(self.streams.current(), self.gemm_done[half])
        self.read[half] = True

    def join(self) -> None:
        """End of a unit: the main stream waits for any prefetch left, and the order starts afresh.
        A prefetch left means the unit's last chunk had learned a successor from a unit that went
        on past it (a whole run, where a captured step now runs in segments): that link is
        unlearned, so later executions of this unit do not repeat the waste. (A CUDA graph recorded
        before it was unlearned keeps the wasted prefetch.)"""
        pending = self.pending
        try:
            if pending is not None:
                self.successor.pop(self.last, None)  # type: ignore[arg-type]
                self.streams.wait_event(self.streams.current(), self.written[pending.half])
        finally:
            self._reset()

    def _view(self, half: int, chunk: Chunk) -> torch.Tensor:
        rows = chunk.hi - chunk.lo
        return self.halves[half][: rows * chunk.k].view(rows, chunk.k)
