"""Quantized weights computed ahead of an int4 build by a pool of worker processes.

The builder reads, converts and writes one weight at a time, in build order, in one process; for
an int4 model of billions of weights nearly all of that time is drawing (or decoding) the float
weights and quantizing them. A BuildPool does that part in worker processes, each with its own copy
of the weight source (it must pickle), for the quantized weights the builder will ask for next, in
the order it will ask for them (plan_jobs) and at most `lookahead` weight elements ahead of it; the
builder writes each result when it gets there. The workers run the very functions a serial build
runs (q4_tensors, quantize_experts) on the same weights, and the builder writes in the same order,
so the package is byte for byte a serial build's. The workers start from a fresh interpreter
(forkserver, or spawn), so the program's main module must be safe to import (the
``if __name__ == "__main__"`` idiom).

Memory: the workers hold one job's float weights each (a run of experts, or one matrix); the
results of at most `lookahead` elements of jobs wait for the builder, about 0.6 bytes per element
(half a byte of code, a float32 scale and half a byte of zero point per block of 32), plus the LM
head's, which is started first: the builder asks for it last, and alone at the end it would keep
one worker busy while the rest wait.

Results travel as files in a RAM file system (SPILL_DIR) where there is one: a worker writes a
result's arrays into a file of its own, and the builder reads it whole and removes it. Through
the executor's pipe a result's bytes are copied several times in the builder's process, in small
reads, and that one process, which also writes the package, would set the pace of a many-core
build. A result whose file cannot be written (no such directory, or it is full) takes the pipe;
close() removes what is left, and only a build killed outright leaves files behind
(onnxgen-build-*).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import itertools
import multiprocessing
import os
import re
import secrets
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from onnxgen.models.builder_hybrid import quantize_experts
from onnxgen.models.builder_parts import BuildOptions, Q4Tensors, checked_weight, q4_tensors
from onnxgen.models.config import DecoderConfig, WeightSource, weight_shapes

# experts per job: enough float weights that a job's start and its result's trip are small
# beside its work, few enough that a layer's experts spread over the workers
EXPERT_RUN_ELEMENTS = 48 << 20
# default look-ahead, in float weight elements (their results take about 0.6 bytes each): enough to
# keep the workers busy while the builder draws and writes a float embedding table of a large
# vocabulary on its own
LOOKAHEAD = 12 << 30

SPILL_DIR = "/dev/shm"

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


@dataclass(frozen=True)
class Job:
    """What a worker computes: key ("linear", weight name, packed zero points) -> q4_tensors of
    it, or ("experts", layer, first expert) -> quantize_experts of the run of `count` experts."""

    key: tuple
    elements: int  # float weight elements read
    count: int = 0  # experts in the run
    early: bool = False  # submitted when the pool starts, outside the look-ahead


def plan_jobs(config: DecoderConfig, options: BuildOptions, shares_q4_table: bool) -> list[Job]:
    """The quantized weights of an int4 gqa build, in the order DecoderGraph asks for them: every
    matrix read by a linear (MatMulNBits), the embedding table where it is the head's 4-bit table
    too, and the routed experts in runs. A weight planned but not asked for costs only its work."""
    if options.precision != "int4" or options.attention != "gqa":
        return []
    jobs = []
    moe = config.moe
    per_run = max(1, EXPERT_RUN_ELEMENTS // (3 * moe.expert_intermediate * config.hidden_size)) if moe else 0
    for name, shape in weight_shapes(config).items():
        elements = shape[0] * shape[1] if len(shape) == 2 else 0
        if name == "model.embed_tokens.weight":
            if shares_q4_table:
                jobs.append(Job(("linear", name, options.zero_point_form(table=True)), elements))
            continue
        expert = _EXPERT.fullmatch(name)
        if expert:
            layer, first = int(expert[1]), int(expert[2])
            if expert[3] == "gate" and first % per_run == 0:
                assert moe is not None
                count = min(per_run, moe.num_experts - first)
                jobs.append(Job(("experts", layer, first), 3 * count * elements, count))
            continue
        if len(shape) == 2:
            jobs.append(Job(("linear", name, options.zero_point_form()), elements, early=name == "lm_head.weight"))
    return jobs


_source: WeightSource | None = None  # a worker's copy of the weight source
_spill_prefix: str | None = None  # where a worker writes its results (None: the pipe)
_spill_count = itertools.count()


def _start_worker(source: WeightSource, spill_prefix: str | None) -> None:
    global _source, _spill_prefix
    _source, _spill_prefix = source, spill_prefix


def _run(job: Job, block_size: int) -> Any:
    assert _source is not None
    if job.key[0] == "linear":
        _, name, form = job.key
        result = q4_tensors(checked_weight(_source, name), block_size, form)
    else:
        _, layer, first = job.key
        result = quantize_experts(partial(checked_weight, _source), layer, range(first, first + job.count), block_size)
    return result if _spill_prefix is None else _spill(result, f"{_spill_prefix}{os.getpid()}-{next(_spill_count)}")


def _arrays(result: Any) -> list[np.ndarray]:
    return [result.b, result.scales, result.zero_points] if isinstance(result, Q4Tensors) else list(result)


def _with_arrays(result: Any, arrays: list) -> Any:
    if isinstance(result, Q4Tensors):
        return dataclasses.replace(result, b=arrays[0], scales=arrays[1], zero_points=arrays[2])
    return tuple(arrays)


@dataclass
class _Spilled:
    """A result whose arrays are in the file `path`: (dtype, shape, byte offset) each, in order."""

    path: str
    layout: list[tuple[str, tuple[int, ...], int]]
    template: Any  # the result, its arrays left out


def _spill(result: Any, path: str) -> Any:
    """Write the result's arrays into `path` (offsets aligned to 64 bytes); the result itself where that fails."""
    arrays = [np.ascontiguousarray(array) for array in _arrays(result)]
    layout, offset = [], 0
    try:
        with open(path, "wb") as f:
            for array in arrays:
                pad = -offset % 64
                f.write(b"\0" * pad)
                offset += pad
                f.write(memoryview(array.reshape(-1).view(np.uint8)))
                layout.append((array.dtype.str, array.shape, offset))
                offset += array.nbytes
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return result
    return _Spilled(path, layout, _with_arrays(result, [None] * len(arrays)))


def _unspill(result: Any) -> Any:
    if not isinstance(result, _Spilled):
        return result
    try:  # mapped, not read: the pages are the file system's, and go with the last view of them
        size = os.stat(result.path).st_size
        data = np.memmap(result.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    finally:
        os.unlink(result.path)
    arrays = []
    for dtype, shape, offset in result.layout:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        arrays.append(data[offset : offset + size].view(dtype).reshape(shape))
    return _with_arrays(result.template, arrays)


class BuildPool:
    """Runs `jobs` on `workers` processes ahead of the builder; take(key) gives a job's result.

    The builder takes results in plan order; a job passed over (planned, never asked for) is
    dropped when a later one is taken. take() of a key not planned, or already taken, is None:
    the builder then computes that weight itself.
    """

    def __init__(
        self, source: WeightSource, jobs: list[Job], workers: int, block_size: int, lookahead: int | None = None
    ) -> None:
        # forkserver (spawn where there is none): the workers start from a fresh interpreter, not
        # from a fork of a process that may hold threads (torch's, CUDA's) and their locks
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        spill = os.path.isdir(SPILL_DIR) and os.access(SPILL_DIR, os.W_OK)
        self._spill_prefix = f"{SPILL_DIR}/onnxgen-build-{os.getpid()}-{secrets.token_hex(4)}-" if spill else None
        self._executor = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context(method),
            initializer=_start_worker,
            initargs=(source, self._spill_prefix),
        )
        self._jobs = jobs
        self._block_size = block_size
        self._index = {job.key: i for i, job in enumerate(jobs)}
        self._lookahead = LOOKAHEAD if lookahead is None else lookahead
        self._futures: dict[int, Future] = {}  # submitted, not yet taken
        self._done = [False] * len(jobs)  # taken, or passed over
        self._next = 0  # jobs before it are submitted, taken or passed over
        self._cursor = 0  # jobs before it (early ones aside) are taken or passed over
        self._ahead = 0  # elements of submitted jobs not yet taken (early ones aside)
        for i, job in enumerate(jobs):
            if job.early:
                self._submit(i)
        self._fill(-1)

    def _submit(self, i: int) -> None:
        self._futures[i] = self._executor.submit(_run, self._jobs[i], self._block_size)
        if not self._jobs[i].early:
            self._ahead += self._jobs[i].elements

    def _fill(self, through: int) -> None:
        """Submit jobs in plan order up to the look-ahead, and at least through job `through`."""
        while self._next < len(self._jobs):
            i = self._next
            if not self._done[i] and i not in self._futures:
                if i > through and self._ahead >= self._lookahead:
                    break
                self._submit(i)
            self._next += 1

    def _finish(self, i: int) -> Future | None:
        self._done[i] = True
        future = self._futures.pop(i, None)
        if future is not None and not self._jobs[i].early:
            self._ahead -= self._jobs[i].elements
        return future

    def take(self, key: tuple) -> Any:
        i = self._index.get(key)
        if i is None or self._done[i]:
            return None  # not planned, or taken already
        if not self._jobs[i].early:
            for passed in range(self._cursor, i):
                if not self._jobs[passed].early and not self._done[passed]:
                    future = self._finish(passed)
                    if future is not None:
                        future.cancel()
            self._cursor = i + 1
        self._fill(i)
        future = self._finish(i)
        assert future is not None
        self._fill(-1)  # the look-ahead it held goes to the next jobs before this one's result is waited for
        return _unspill(future.result())

    def close(self) -> None:
        """Stop the workers (jobs not started are dropped) and remove the results never taken."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._spill_prefix is not None:
            for path in glob.glob(glob.escape(self._spill_prefix) + "*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
