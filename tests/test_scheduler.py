"""genai/scheduler.py: SerialScheduler over a fake Generator (no model): order, the bounded queue,
cancellation (queued and running), errors, load failure, the engine-failed probe, and coalescing
(a loop that is behind gets many tokens per wake-up; the engine never waits for it)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from onnxgen.errors import InvalidInputError
from onnxgen.genai.events import GenerationEvent
from onnxgen.genai.sampling import SamplingParams
from onnxgen.genai.scheduler import (
    FAILED,
    READY,
    Job,
    QueueFullError,
    RequestCancelledError,
    SchedulerUnavailableError,
    SerialScheduler,
)
from onnxgen.genai.sequence import GenerationStats


class FakeGenerator:
    """Yields one event per prompt id (its text the id), then a final one; ``gate`` (an Event)
    holds every token until set; ``fail`` raises at the first token; records closed iterators."""

    def __init__(self, delay_s: float = 0.0, gate: threading.Event | None = None) -> None:
        self.delay_s = delay_s
        self.gate = gate
        self.fail: Exception | None = None
        self.closed = 0
        self.tokens_made = 0
        self.last_stats = GenerationStats()

    def encode(self, text: str) -> list[int]:
        return [1]

    def events(self, prompt_ids, params):
        def run():
            self.last_stats = GenerationStats()
            try:
                for token in prompt_ids:
                    if self.gate is not None:
                        assert self.gate.wait(10)
                    if self.fail is not None:
                        raise self.fail
                    time.sleep(self.delay_s)
                    self.tokens_made += 1
                    self.last_stats.new_tokens += 1
                    yield GenerationEvent(token, str(token))
                yield GenerationEvent(None, "", finish_reason="length")
            finally:
                self.closed += 1

        return run()


def job(*ids: int) -> Job:
    return Job(list(ids), SamplingParams())


def started(fake: FakeGenerator, **kw) -> SerialScheduler:
    kw.setdefault("warm", lambda generator: None)
    scheduler = SerialScheduler(lambda: fake, **kw).start()
    assert scheduler.wait_loaded(10) and scheduler.state == READY
    return scheduler


async def drain(handle) -> list:
    outputs = []
    async for batch in handle.batches():
        outputs += batch
    return outputs


def test_requests_run_in_order_with_their_events_and_usage() -> None:
    fake = FakeGenerator()
    scheduler = started(fake)

    async def main():
        loop = asyncio.get_running_loop()
        first = scheduler.submit([job(5, 6), job(7)], loop)
        second = scheduler.submit([job(8)], loop)
        return await drain(first), await drain(second)

    first, second = asyncio.run(main())
    assert [(o.index, o.event.token_id, o.event.text) for o in first] == [
        (0, 5, "5"), (0, 6, "6"), (0, None, ""), (1, 7, "7"), (1, None, ""),
    ]  # fmt: skip
    assert [o.completion_tokens for o in first if o.event.finish_reason] == [2, 1]
    assert [o.event.token_id for o in second] == [8, None]
    assert all(a.at <= b.at for a, b in zip(first, first[1:]))
    scheduler.close()
    assert scheduler.state == "closed"


def test_the_queue_is_bounded_and_a_cancelled_request_frees_its_place() -> None:
    gate = threading.Event()
    fake = FakeGenerator(gate=gate)
    scheduler = started(fake, max_queue=2)

    async def main():
        loop = asyncio.get_running_loop()
        running = scheduler.submit([job(1)], loop)
        for _ in range(100):  # the engine thread takes the first request
            if scheduler.running:
                break
            await asyncio.sleep(0.01)
        queued = [scheduler.submit([job(2)], loop), scheduler.submit([job(3)], loop)]
        assert scheduler.queue_depth == 2
        with pytest.raises(QueueFullError, match="2 requests are waiting"):
            scheduler.submit([job(4)], loop)
        queued[0].cancel()  # the client went away: off the queue at once
        assert scheduler.queue_depth == 1
        assert await drain(queued[0]) == []
        late = scheduler.submit([job(4)], loop)
        gate.set()
        return [await drain(h) for h in (running, queued[1], late)]

    outputs = asyncio.run(main())
    assert [[o.event.token_id for o in out] for out in outputs] == [[1, None], [3, None], [4, None]]
    assert fake.tokens_made == 3  # the cancelled request never ran
    scheduler.close()


def test_a_cancel_stops_the_running_generation_at_its_next_token() -> None:
    fake = FakeGenerator(delay_s=0.01)
    scheduler = started(fake)

    async def main():
        handle = scheduler.submit([job(*range(1000)), job(1)], asyncio.get_running_loop())
        seen = []
        async for batch in handle.batches():
            seen += batch
            if len(seen) >= 3:
                handle.cancel()
        return seen

    seen = asyncio.run(main())
    time.sleep(0.05)
    assert fake.tokens_made < 20, "the engine kept decoding for a client that had gone"
    assert fake.closed == 1  # the iterator was closed (the engine's loop ended), the second job never ran
    assert all(o.error is None and o.event.finish_reason is None for o in seen)
    assert scheduler.running == 0
    scheduler.close()


def test_cancel_all_cuts_with_the_reason_running_and_queued() -> None:
    gate = threading.Event()
    scheduler = started(FakeGenerator(gate=gate))

    async def main():
        loop = asyncio.get_running_loop()
        handles = [scheduler.submit([job(1, 2)], loop) for _ in range(3)]
        await asyncio.sleep(0.05)
        scheduler.cancel_all("the server is shutting down")
        gate.set()
        return [await drain(h) for h in handles]

    for outputs in asyncio.run(main()):
        assert isinstance(outputs[-1].error, RequestCancelledError)
        assert "shutting down" in str(outputs[-1].error)
    scheduler.close()


def test_errors_end_their_request_only_and_a_broken_engine_is_failed() -> None:
    fake = FakeGenerator()
    probes = []

    def warm(generator):
        probes.append(1)
        if len(probes) > 2:
            raise RuntimeError("CUDA error: an illegal memory access")

    scheduler = started(fake, warm=warm)

    async def one(*ids):
        return await drain(scheduler.submit([job(*ids)], asyncio.get_running_loop()))

    fake.fail = InvalidInputError("bad input")  # a user error: no probe, the engine goes on
    (out,) = asyncio.run(one(1))
    assert isinstance(out.error, InvalidInputError) and len(probes) == 1
    fake.fail = KeyError("a bug")  # an internal error: a probe runs, succeeds, the engine goes on
    (out,) = asyncio.run(one(1))
    for _ in range(500):  # the probe runs on the engine thread after the request has ended
        if len(probes) == 2:
            break
        time.sleep(0.01)
    assert isinstance(out.error, KeyError) and len(probes) == 2 and scheduler.state == READY
    fake.fail = None
    assert [o.event.token_id for o in asyncio.run(one(3))] == [3, None]
    fake.fail = KeyError("again")  # the probe fails too: FAILED, further requests refused
    asyncio.run(one(1))
    for _ in range(100):
        if scheduler.state == FAILED:
            break
        time.sleep(0.01)
    assert scheduler.state == FAILED and "probe generation failed" in scheduler.failure
    with pytest.raises(SchedulerUnavailableError, match="the engine has failed"):
        asyncio.run(one(1))
    scheduler.close()


def test_a_load_failure_is_the_failed_state_with_its_reason() -> None:
    def broken():
        raise InvalidInputError("no such package")

    scheduler = SerialScheduler(broken).start()
    assert scheduler.wait_loaded(10)
    assert scheduler.state == FAILED and scheduler.failure == "no such package" and scheduler.generator is None
    with pytest.raises(SchedulerUnavailableError):
        scheduler.submit([job(1)], asyncio.new_event_loop())


def test_outputs_coalesce_when_the_loop_is_behind() -> None:
    """The engine pushes every token without waiting for the loop; a blocked loop then gets them in a
    few batches, with few wake-ups scheduled (not one per token)."""
    fake = FakeGenerator()
    scheduler = started(fake)

    async def main():
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting
        handle = scheduler.submit([job(*range(500))], loop)
        # the loop is busy (blocked) while the engine runs ahead to the end (waited for, not timed: a
        # fixed sleep was too short on a loaded 2-core machine)
        deadline = time.monotonic() + 30
        while fake.tokens_made < 500 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # the last token's push after its count
        batches = [batch async for batch in handle.batches()]
        return batches, calls

    batches, calls = asyncio.run(main())
    assert sum(len(b) for b in batches) == 501
    assert fake.tokens_made == 500
    assert len(batches) <= 3 and calls <= 3, (len(batches), calls)
    scheduler.close()


def test_a_paced_reader_gets_few_batches_and_wakes_the_loop_rarely() -> None:
    """batches(min_interval_s): the first batch at once, then at most one per interval; while the
    reader sleeps out its interval the engine schedules no wake-ups."""
    fake = FakeGenerator(delay_s=0.001)
    scheduler = started(fake)

    async def main():
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting
        handle = scheduler.submit([job(*range(300))], loop)
        start = time.perf_counter()
        batches = [(time.perf_counter() - start, batch) async for batch in handle.batches(0.05)]
        return batches, calls

    batches, calls = asyncio.run(main())
    assert sum(len(b) for _, b in batches) == 301 and len(batches[0][1]) <= 2
    gaps = [b[0] - a[0] for a, b in zip(batches, batches[1:])]
    assert min(gaps) >= 0.045 and len(batches) <= 12, (len(batches), gaps)
    assert calls <= len(batches) + 1, (calls, len(batches))
    scheduler.close()
