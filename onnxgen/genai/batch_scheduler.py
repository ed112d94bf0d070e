"""The batching runner behind the scheduler protocol (scheduler.py): requests are admitted between
steps while the KV pool has a free slot, every admitted job decodes in the same batched step
(batched.py), and each job's tokens become text through its own TextStream.

Order and fairness: requests start in arrival order; a request's jobs (its n choices) are admitted
one by one as slots free up, before any later request's. Prompts are computed one chunk per
iteration, oldest first, between the decode steps of the running jobs. A job ends at a stop id, a
stop string, its length, or when its request is cancelled; its slot is free for the next job at
once. An error in a batched step ends every request that had a job in it (the step is shared);
an internal one is followed by the probe generation, as in SerialScheduler.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onnxgen.errors import OnnxgenError
from onnxgen.genai.batched import BatchedDecoder
from onnxgen.genai.sampling import SamplingParams
from onnxgen.genai.scheduler import READY, EngineThreadScheduler, Output, RequestHandle, SerialScheduler
from onnxgen.genai.sequence import Sequence
from onnxgen.genai.text_stream import TextStream

if TYPE_CHECKING:
    from onnxgen.genai.generator import Generator


@dataclass
class _Job:
    handle: RequestHandle
    index: int
    text: TextStream


class BatchScheduler(EngineThreadScheduler):
    """Continuous batching over ``max_seqs`` KV slots of ``max_model_len`` tokens each (default: the
    model's context), prompts in chunks of ``prefill_chunk`` tokens, at most ``prefill_budget`` prompt
    tokens per iteration (BatchedDecoder's default when None), prompt prefixes reused from the
    slots unless ``prefix_caching`` is False, with up to ``state_snapshots`` snapshots of a hybrid
    decoder's states (KVPool's default when None). The default ``warm`` runs one
    short generation through the batched decoder (it is built there, on the engine thread)."""

    delivers_per_step = True

    def __init__(
        self,
        make_generator: Callable[[], Generator],
        *,
        max_seqs: int = 8,
        max_model_len: int | None = None,
        prefill_chunk: int = 256,
        prefix_caching: bool = True,
        prefill_budget: int | None = None,
        state_snapshots: int | None = None,
        warm: Callable[[Generator], None] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(self._make_with_decoder, warm=warm or self._warm_batched, **kwargs)
        self._make_plain = make_generator
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk
        self.prefix_caching = prefix_caching
        self.prefill_budget = prefill_budget
        self.state_snapshots = state_snapshots
        self.decoder: BatchedDecoder | None = None
        self._jobs: dict[Sequence, _Job] = {}
        self._active: list[RequestHandle] = []  # started, not ended (engine thread; read under the lock)
        self._partial: deque[RequestHandle] = deque()  # started, with jobs still to admit

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def sequence_limit(self) -> int | None:
        """Tokens (prompt and new ones) one job may hold: a KV slot's capacity (None until loaded)."""
        return self.decoder.capacity if self.decoder is not None else None

    def _started(self) -> list[RequestHandle]:
        return list(self._active)

    def describe(self) -> str:
        decoder = self.decoder
        if decoder is None:
            return f"up to {self.max_seqs} sequences at once"
        return f"up to {decoder.max_seqs} sequences at once, {decoder.capacity} tokens each"

    # -- load ------------------------------------------------------------------------------

    def _make_with_decoder(self) -> Generator:
        generator = self._make_plain()
        self.decoder = BatchedDecoder(
            generator.engine, self.max_seqs, self.max_model_len, self.prefill_chunk,
            prefix_caching=self.prefix_caching, prefill_budget=self.prefill_budget,
            state_snapshots=self.state_snapshots,
        )  # fmt: skip
        return generator

    def _warm_batched(self, generator: Generator) -> None:
        """Where steps are captured, every decode bucket and prompt-group shape recorded first
        (BatchedDecoder.record_shapes: the first requests would pay for it otherwise); then one
        short greedy generation through the batched decoder (its step and prompt paths)."""
        decoder = self.decoder
        assert decoder is not None
        if decoder.captured:
            buckets, groups = decoder.shapes_to_record()
            print(f"recording the batched steps: {len(buckets)} decode buckets, {len(groups)} prompt-group shapes",
                  file=sys.stderr, flush=True)  # fmt: skip
            start = time.perf_counter()
            decoder.record_shapes()
            print(f"recorded in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        sequence = generator.engine.new_sequence(
            generator.encode("Hello"), SamplingParams(max_new_tokens=2, ignore_eos=True), generator.eos_ids
        )
        decoder.admit(sequence)
        while decoder.admitted:
            decoder.iterate()

    # -- the engine thread -------------------------------------------------------------------

    def _serve(self, generator: Generator) -> None:
        decoder = self.decoder
        assert decoder is not None
        while True:
            with self._lock:
                while not self._queue and not self._partial and not self._jobs and self._state == READY:
                    self._lock.wait()
                if self._state != READY and not self._jobs:
                    return  # closed: close() cut the queued and started requests
                starting = self._take_started(decoder.room)
            internal = False
            for handle in starting:
                internal |= self._admit(generator, decoder, handle)
            if internal and not self._still_works(generator):
                return
            self._drop_cancelled(decoder)
            if not decoder.admitted:
                continue
            try:
                reads = decoder.iterate()
            except Exception as exc:  # noqa: BLE001 - the step is shared: its requests end with the error
                internal = not isinstance(exc, OnnxgenError)
                if internal:
                    print("onnxgen serve: internal error in a batched step:", file=sys.stderr)
                    traceback.print_exc(file=sys.stderr)
                for handle in list(self._active):
                    self._fail(decoder, handle, exc)
                if internal and not self._still_works(generator):
                    return
                continue
            now = time.perf_counter()
            for read in reads:
                if read.error is not None:  # that sequence's own failure: its request ends with it
                    job = self._jobs.get(read.sequence)
                    if job is not None:
                        self._fail(decoder, job.handle, read.error)
                    continue
                self._deliver(decoder, read.sequence, read.token_id, now)
            if self.after_step is not None:
                self.after_step()

    def _take_started(self, room: int) -> list[RequestHandle]:
        """Under the lock: the requests whose next jobs fit in ``room`` slots, partial ones first,
        then the queue's head (moved to the started ones, so a cancel no longer dequeues it)."""
        starting: list[RequestHandle] = []
        for handle in self._partial:
            if room <= 0:
                return starting
            starting.append(handle)
            room -= len(handle.jobs) - handle.jobs_started
        while room > 0 and self._queue:
            handle = self._queue.popleft()
            self._active.append(handle)
            self._partial.append(handle)
            starting.append(handle)
            room -= len(handle.jobs)
        return starting

    def _admit(self, generator: Generator, decoder: BatchedDecoder, handle: RequestHandle) -> bool:
        """The request's next jobs, while the decoder has room; a job refused (its prompt too long
        for a slot) ends the request with that error. True when that was an internal error."""
        while decoder.room > 0 and handle.jobs_started < len(handle.jobs) and not handle.cancelled:
            index = handle.jobs_started
            job = handle.jobs[index]
            try:
                sequence = generator.engine.new_sequence(job.prompt_ids, job.params, generator.eos_ids)
                decoder.admit(sequence)
            except Exception as exc:  # noqa: BLE001 - the request's error, handed to its caller
                internal = not isinstance(exc, OnnxgenError)
                if internal:
                    print(f"onnxgen serve: internal error in a request (job {index}):", file=sys.stderr)
                    traceback.print_exc(file=sys.stderr)
                self._fail(decoder, handle, exc)
                return internal
            handle.jobs_started += 1
            self._jobs[sequence] = _Job(handle, index, TextStream(generator.tokenizer, job.params))
        if handle.jobs_started == len(handle.jobs) or handle.cancelled:
            with self._lock:
                if handle in self._partial:
                    self._partial.remove(handle)
        return False

    def _deliver(self, decoder: BatchedDecoder, sequence: Sequence, token_id: int | None, now: float) -> None:
        job = self._jobs.get(sequence)
        if job is None:
            return
        handle = job.handle
        if token_id is not None:  # the job's next token (a sequence may hand out two in one iteration)
            logprobs = sequence.logprobs if sequence.sampler.params.logprobs is not None else None
            logprob = logprobs[job.text.tokens] if logprobs is not None else None
            handle._push(Output(job.index, job.text.push(token_id, logprob), now))
            if job.text.stopped and not sequence.done:
                decoder.release(sequence, "stop string")
        if not sequence.done:
            return
        stats = sequence.stats
        final = job.text.final(stats.stop_reason)
        handle._push(
            Output(
                job.index, final, now, completion_tokens=stats.new_tokens, cached_tokens=stats.cached_tokens,
                snapshot_hits=stats.snapshot_hits, snapshot_takes=stats.snapshot_takes,
            )
        )  # fmt: skip
        handle.jobs_done += 1
        del self._jobs[sequence]
        if handle.jobs_done == len(handle.jobs):
            self._close(handle)

    def _drop_cancelled(self, decoder: BatchedDecoder) -> None:
        """Jobs of cancelled requests leave the batch (their slots free); the requests end."""
        for sequence, job in list(self._jobs.items()):
            if job.handle.cancelled:
                decoder.release(sequence)
                del self._jobs[sequence]
        for handle in list(self._active):
            if handle.cancelled:
                self._close(handle)

    def _fail(self, decoder: BatchedDecoder, handle: RequestHandle, exc: BaseException) -> None:
        """``handle`` ends with ``exc``: its jobs leave the batch."""
        for sequence, job in list(self._jobs.items()):
            if job.handle is handle:
                decoder.release(sequence, "error")
                del self._jobs[sequence]
        if handle in self._active:
            handle._push(Output(0, None, time.perf_counter(), error=exc))
            handle.cancelled = True  # the request is over; no further job starts
            self._close(handle)

    def _close(self, handle: RequestHandle) -> None:
        with self._lock:
            if handle not in self._active:
                return
            self._active.remove(handle)
            if handle in self._partial:
                self._partial.remove(handle)
        self._end(handle)


@dataclass(frozen=True)
class RunnerOptions:
    """Which runner decodes the requests: one at a time (``max_seqs`` 1, SerialScheduler) or
    continuous batching of ``max_seqs`` sequences (BatchScheduler, with its ``max_model_len``,
    ``prefix_caching``, ``prefill_budget`` and ``state_snapshots``). The one choice for a runner on the server's
    thread and one in an engine process (engine_process.py)."""

    max_seqs: int = 1
    max_model_len: int | None = None
    prefix_caching: bool = True
    prefill_budget: int | None = None
    state_snapshots: int | None = None

    def make(self, make_generator: Callable[[], Generator], *, max_queue: int) -> EngineThreadScheduler:
        if self.max_seqs > 1:
            return BatchScheduler(
                make_generator, max_queue=max_queue, max_seqs=self.max_seqs, max_model_len=self.max_model_len,
                prefix_caching=self.prefix_caching, prefill_budget=self.prefill_budget,
                state_snapshots=self.state_snapshots,
            )  # fmt: skip
        return SerialScheduler(make_generator, max_queue=max_queue)
