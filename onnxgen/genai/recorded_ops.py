"""A few device ops around a batched step, recorded into a CUDA graph of their own.

The batched decoder prepares each step's feeds and reads its tokens with a handful of small torch
ops (batch_buckets.py, batched.py). Each torch call releases the interpreter lock and takes it
back, and the engine thread shares that lock with the server's event loop: under load every call
is a chance to wait for the loop. Recorded, the ops are one call (a graph replay).

``RecordedOps(fn, device)`` runs ``fn()`` eagerly the first time (a warm-up, as torch's CUDA graph
capture needs), records it into a CUDA graph the second time (then replays that graph, since a
capture does not execute), and replays the graph afterwards. Off CUDA it always runs ``fn()``.
Invariant the caller keeps: ``fn`` reads and writes only tensors that keep their addresses from
call to call, and does nothing on the host that depends on tensor values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class RecordedOps:
    def __init__(self, fn: Callable[[], None], device: torch.device) -> None:
        self.fn = fn
        self.cuda = device.type == "cuda"
        self.graph: Any = None
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if not self.cuda or self.calls == 1:
            self.fn()
            return
        if self.graph is None:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, stream=side):
                self.fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = graph
        self.graph.replay()
