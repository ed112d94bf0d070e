"""genai/batch_scheduler.py over the tiny package (SmolLM2's tokenizer, random weights): requests
submitted together decode in shared steps and each gets exactly what the one-at-a-time Generator
gives it (text, finish reason, usage, logprobs); stop strings, cancels and refused jobs end their
own request only; the queue is bounded the same way as SerialScheduler's."""

from __future__ import annotations

import asyncio

import pytest

from onnxgen.genai.batch_scheduler import BatchScheduler
from onnxgen.genai.engine import PromptTooLongError
from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import SamplingParams
from onnxgen.genai.scheduler import FAILED, READY, Job, QueueFullError
from tests.server_helpers import tiny_package


@pytest.fixture(scope="module")
def generator() -> Generator:
    return Generator(tiny_package(), device="cpu")


def started(generator: Generator, **kw) -> BatchScheduler:
    scheduler = BatchScheduler(lambda: generator, **kw).start()
    assert scheduler.wait_loaded(60) and scheduler.state == READY, scheduler.failure
    return scheduler


async def drain(handle) -> list:
    outputs = []
    async for batch in handle.batches():
        outputs += batch
    return outputs


def alone(generator: Generator, job: Job) -> tuple[str, str, int, list]:
    """(text, finish reason, completion tokens, logprob token ids) of the job run by itself."""
    events = list(generator.events(job.prompt_ids, job.params))
    logprobs = [e.logprob.token_id for e in events if e.logprob is not None]
    return "".join(e.text for e in events), events[-1].finish_reason, generator.last_stats.new_tokens, logprobs


def summary(outputs: list, index: int) -> tuple[str, str, int, list]:
    mine = [o for o in outputs if o.index == index]
    assert all(o.error is None for o in mine), mine
    final = mine[-1]
    logprobs = [o.event.logprob.token_id for o in mine if o.event.logprob is not None]
    return "".join(o.event.text for o in mine), final.event.finish_reason, final.completion_tokens, logprobs


def test_requests_together_get_what_they_get_alone(generator) -> None:
    prompts = ["one two three", "Hello there", "a", "The capital of France is", "x y z w", "def f():"]
    jobs = [
        Job(generator.encode(p), SamplingParams(max_new_tokens=5 + 3 * i, temperature=0.8 * (i % 2), seed=i,
                                                logprobs=2 if i % 3 == 0 else None, stop=[" the"] if i == 4 else []))
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    expected = [alone(generator, job) for job in jobs]
    scheduler = started(generator, max_seqs=4)

    async def main():
        loop = asyncio.get_running_loop()
        requests = [scheduler.submit([job, job], loop) for job in jobs[:3]]  # n=2: two jobs each
        requests += [scheduler.submit([job], loop) for job in jobs[3:]]
        return await asyncio.gather(*(drain(r) for r in requests))

    results = asyncio.run(main())
    for number, outputs in enumerate(results):
        indexes = (0, 1) if number < 3 else (0,)
        for index in indexes:
            assert summary(outputs, index) == expected[number], (number, index)
    decoder = scheduler.decoder
    assert decoder.steps < sum(e[2] for e in expected) + sum(e[2] for e in expected[:3])  # shared steps
    assert decoder.pool.free == 4 and scheduler.running == 0
    scheduler.close()


def test_cancels_and_refused_jobs_end_their_own_request_only(generator) -> None:
    scheduler = started(generator, max_seqs=2, max_model_len=24)
    long = Job(generator.encode("a b"), SamplingParams(max_new_tokens=20, ignore_eos=True))
    short = Job(generator.encode("c"), SamplingParams(max_new_tokens=3, ignore_eos=True))
    too_long = Job(list(range(100, 130)), SamplingParams(max_new_tokens=2))

    async def main():
        loop = asyncio.get_running_loop()
        cancelled = scheduler.submit([long], loop)
        refused = scheduler.submit([too_long], loop)
        fine = scheduler.submit([short], loop)
        first = await anext(cancelled.batches())
        cancelled.cancel()
        return first, await drain(cancelled), await drain(refused), await drain(fine)

    first, rest, refused, fine = asyncio.run(main())
    assert first and all(o.error is None for o in first + rest) and len(first + rest) < 20
    assert len(refused) == 1 and isinstance(refused[0].error, PromptTooLongError)
    assert "a sequence may hold 24" in str(refused[0].error)
    assert summary(fine, 0)[1:3] == ("length", 3)
    assert scheduler.decoder.pool.free == 2 and scheduler.running == 0
    scheduler.close()


def test_the_queue_is_bounded_and_bad_settings_are_refused(generator) -> None:
    scheduler = started(generator, max_seqs=1, max_queue=1)
    job = Job(generator.encode("a"), SamplingParams(max_new_tokens=40, ignore_eos=True))

    async def main():
        loop = asyncio.get_running_loop()
        running = scheduler.submit([job], loop)
        await anext(running.batches())  # started: off the queue
        waiting = scheduler.submit([job], loop)
        with pytest.raises(QueueFullError, match="1 requests are waiting"):
            scheduler.submit([job], loop)
        waiting.cancel()
        running.cancel()
        return await drain(waiting)

    assert asyncio.run(main()) == []
    scheduler.close()
    broken = BatchScheduler(lambda: generator, max_seqs=0).start()
    assert broken.wait_loaded(30) and broken.state == FAILED and broken.failure == "max_seqs must be >= 1, got 0"
