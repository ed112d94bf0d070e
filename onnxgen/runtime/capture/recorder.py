"""Recorders: turn one segment's work into something that can be replayed.

``CudaGraphRecorder`` records a torch.cuda.CUDAGraph (the segments of one binding key share one
memory pool). ``ReplayRecorder`` is its CPU stand-in for tests: "recording" runs the segment once
and keeps its outputs as the persistent output tensors; "replaying" runs the same kernels again,
from the same bindings, with the host-read arguments frozen at recording time (a CUDA graph bakes
them too), and copies the results into those same output tensors. So the whole binding / phase /
guard machinery runs on CPU; what only CUDA can show (a kernel that syncs or allocates during
stream capture) is the CUDA recorder's business.

A segment function (``SegmentFn``) runs the segment's steps and returns its external outputs; with
``replay=True`` it reuses the host arguments frozen by its recording run. With ``commit=True`` it
also runs the step's once-only work (a step tail, tail.py, which advances state the next step
reads): a recorder passes it only to the run it records (the CUDA capture; the replays of the CPU
stand-in), never to a warm-up run, so that work happens once per executed step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

SegmentFn = Callable[[bool, bool], dict[str, Any]]  # (replay, commit) -> outputs


class RecordingFailed(Exception):
    """A recording could not be made. ``op_type``: the op that broke it (None: not attributable)."""

    def __init__(self, message: str, op_type: str | None = None, node: str | None = None):
        super().__init__(message)
        self.op_type = op_type
        self.node = node


class Recording(Protocol):
    outputs: dict[str, Any]  # the persistent output tensors, rewritten by each replay

    def replay(self) -> None: ...


class Recorder(Protocol):
    name: str

    def begin_key(self) -> None:
        """A new set of recordings (one binding key, one memory pool) starts."""

    def record(self, fn: SegmentFn, label: str) -> Recording: ...


class ReplayRecording:
    def __init__(self, fn: SegmentFn, outputs: dict[str, Any]):
        self.fn = fn
        self.outputs = outputs

    def replay(self) -> None:
        fresh = self.fn(True, True)
        for name, out in self.outputs.items():
            value = fresh[name]
            if isinstance(out, torch.Tensor) and isinstance(value, torch.Tensor):
                if value.data_ptr() == out.data_ptr():
                    continue  # written in place (a KV buffer the segment updates)
                if tuple(value.shape) != tuple(out.shape) or value.dtype != out.dtype:
                    # a CUDA graph cannot change its output shapes: the output keeps its recorded
                    # shape and holds whatever fits (here: stale data), as on the GPU
                    continue
                out.copy_(value)
            else:
                self.outputs[name] = value


class ReplayRecorder:
    """CPU stand-in for CUDA graphs (tests): replays by re-running the recorded steps."""

    name = "replay"

    def begin_key(self) -> None:
        pass

    def record(self, fn: SegmentFn, label: str) -> Recording:
        outputs = dict(fn(False, False))  # the replay right after the recording commits the step
        # a CUDA capture computes nothing: poison what the recording run allocated, so that a
        # caller who forgets the replay after recording reads garbage here too (outputs that are
        # input bindings written in place, like a static KV buffer, are left alone)
        inputs = getattr(fn, "input_storages", set())
        for value in outputs.values():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in inputs:
                _poison(value)
        return ReplayRecording(fn, outputs)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).max)


class CudaRecording:
    def __init__(self, graph: Any, outputs: dict[str, Any]):
        self.graph = graph
        self.outputs = outputs

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphRecorder:
    """torch.cuda.CUDAGraph per segment; one memory pool per binding key (segments replay in the
    order they were recorded, which is what makes sharing the pool safe)."""

    name = "cuda-graph"

    def __init__(self, device: torch.device, warmup_runs: int = 1):
        if device.type != "cuda":
            raise ValueError("CudaGraphRecorder needs a CUDA device")
        self.device = device
        self.warmup_runs = warmup_runs
        self.pool: Any = None
        self.stream: Any = None

    def begin_key(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def record(self, fn: SegmentFn, label: str) -> Recording:
        if self.pool is None:
            self.begin_key()
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream
        # torch: warm up on the side stream the capture will use (lazy library init, workspaces)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        _release_cached_blocks()
        try:
            with torch.cuda.stream(stream):
                for _ in range(self.warmup_runs):
                    fn(False, False)
        except RecordingFailed:
            raise
        except Exception as exc:
            raise RecordingFailed(f"{label}: warm-up before capture failed: {exc}") from exc
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()  # torch.cuda.graph empties the cache again as the capture starts
        try:
            # thread_local: an illegal call in this thread invalidates this capture only
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                outputs = fn(False, True)  # recorded, not run: each replay commits its step
        except Exception as exc:
            self._after_failure()
            # a step that raised inside the capture names the op; ending the invalidated capture
            # may raise again on top of it, so look for it along the exception chain
            cause = _attributed(exc)
            if cause is not None:
                raise cause from exc
            raise RecordingFailed(f"{label}: capture failed: {exc}") from exc
        return CudaRecording(graph, outputs)

    def _after_failure(self) -> None:
        # torch.cuda.graph's __exit__ has ended the stream capture; drop the pool of this key
        # (its recordings are discarded) and make sure nothing of the aborted capture is pending
        self.pool = None
        try:
            torch.cuda.synchronize(self.device)
        except Exception:
            pass


def _release_cached_blocks() -> None:
    """Give torch's cached free blocks back to the device before the recorder's warm-up. A key's step
    runs eagerly first (the runtime's warm-up steps, on the current stream), then once more on the
    capture's side stream: torch's caching allocator keeps free blocks per stream, so without this
    the side stream's run makes a second copy of the step's intermediates beside the first one's
    cached blocks, a transient peak of free device memory. (torch.cuda.graph empties the cache
    itself as the capture starts, so the capture's pool meets neither.) Once per recorded segment;
    the device synchronizes here, as the capture does anyway."""
    torch.cuda.empty_cache()


def _attributed(exc: BaseException | None) -> RecordingFailed | None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RecordingFailed) and exc.op_type is not None:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
