"""Continuous batching on the CPU: the KV pool (slots, prefix reuse, no leak under random arrivals
and departures) and the batched decoder against the one-sequence engine loop as the oracle (the
same tokens, greedy and seeded sampling, whatever else is in the batch; chunked prefill and prefix
reuse; length limits; graphs that cannot batch)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxgen.errors import InvalidInputError
from onnxgen.genai.batched import BatchedDecoder, BatchingNotSupportedError
from onnxgen.genai.engine import DecodeEngine, PromptTooLongError, engine_model
from onnxgen.genai.kv_pool import KVPool
from onnxgen.genai.package import load_package_config
from onnxgen.genai.sampling import SamplingParams
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime.model_io import load_model
from onnxgen.runtime.session import InferenceSession

VOCAB = TINY_CONFIGS["tiny-llama"].vocab_size


class _Config:
    """The few PackageConfig fields a KVPool (and a StaticKV) reads."""

    num_layers = 2
    num_kv_heads = 1
    head_size = 2
    kv_layer_ids = range(2)
    carried = ()

    @staticmethod
    def past_key_name(layer: int) -> str:
        return f"past.{layer}.key"

    @staticmethod
    def past_value_name(layer: int) -> str:
        return f"past.{layer}.value"

    @staticmethod
    def present_key_name(layer: int) -> str:
        return f"present.{layer}.key"

    @staticmethod
    def present_value_name(layer: int) -> str:
        return f"present.{layer}.value"


def _pool(slots: int = 4, capacity: int = 16) -> KVPool:
    return KVPool(_Config(), torch.float32, torch.device("cpu"), slots, capacity)  # type: ignore[arg-type]


def _write(pool: KVPool, slot: int, tokens: list[int]) -> None:
    """What a step would do: the rows of ``tokens`` (each row's values = its token id) after the held ones."""
    start = len(pool.contents[slot])
    for buffer in pool.buffers.values():
        buffer[slot, :, start : start + len(tokens)] = torch.tensor(tokens, dtype=torch.float32)[None, :, None]
    pool.contents[slot].extend(tokens)


def _rows_match(pool: KVPool, slot: int) -> bool:
    held = pool.contents[slot]
    want = torch.tensor(held, dtype=torch.float32)
    return all(torch.equal(b[slot, 0, : len(held), 0], want) for b in pool.buffers.values())


def test_pool_reuses_the_longest_held_prefix_then_least_recently_used() -> None:
    pool = _pool()
    a, reused = pool.acquire([1, 2, 3, 4])
    assert reused == 0
    _write(pool, a, [1, 2, 3, 4])
    pool.release(a)
    b, reused = pool.acquire([1, 2, 3, 9, 9])  # shares 3 tokens with slot a
    assert (b, reused) == (a, 3) and pool.contents[b] == [1, 2, 3]
    _write(pool, b, [9, 9])
    pool.release(b)
    same, reused = pool.acquire([1, 2, 3, 9, 9])  # the whole prompt is held: the last token is computed
    assert (same, reused) == (a, 4)
    pool.release(same)
    other, reused = pool.acquire([7, 7])  # nothing shared: a never-used slot, not the one holding a prefix
    assert other != a and reused == 0
    assert pool.reused_tokens == 7


def test_pool_copies_a_prefix_from_a_busy_slot_and_can_be_told_not_to_reuse() -> None:
    pool = _pool()
    a, _ = pool.acquire([5, 6, 7, 8, 9])
    _write(pool, a, [5, 6, 7, 8, 9])  # still running
    b, reused = pool.acquire([5, 6, 7, 1])
    assert b != a and reused == 3 and pool.copied_tokens == 3 and _rows_match(pool, b)
    plain = KVPool(_Config(), torch.float32, torch.device("cpu"), 2, 8, prefix_caching=False)  # type: ignore[arg-type]
    s, _ = plain.acquire([1, 2, 3])
    _write(plain, s, [1, 2, 3])
    plain.release(s)
    assert plain.acquire([1, 2, 3, 4])[1] == 0
    with pytest.raises(RuntimeError, match="no free KV slot"):
        plain.acquire([1])
        plain.acquire([1])


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_pool_under_random_arrivals_and_departures_keeps_its_invariants(seed: int) -> None:
    """1,000 random acquire / write / release operations: held rows always match their
    contents, no slot leaks (all free at the end), a held prefix is reused whenever one is free."""
    rng = random.Random(seed)
    pool = _pool(slots=4, capacity=12)
    busy: dict[int, int] = {}  # slot -> tokens still to write
    for _ in range(1000):
        action = rng.random()
        if action < 0.4 and pool.free:
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
            slot, reused = pool.acquire(prompt)
            assert slot not in busy and reused < len(prompt) and pool.contents[slot] == prompt[:reused]
            _write(pool, slot, prompt[reused:])
            busy[slot] = rng.randint(0, 12 - len(prompt) - 1)
        elif action < 0.8 and busy:
            slot = rng.choice(sorted(busy))
            if busy[slot]:
                _write(pool, slot, [rng.randrange(3)])
                busy[slot] -= 1
        elif busy:
            slot = rng.choice(sorted(busy))
            pool.release(slot)
            del busy[slot]
        for slot in range(pool.slots):
            assert len(pool.contents[slot]) <= pool.capacity and _rows_match(pool, slot)
        assert pool.free == pool.slots - len(busy)
    for slot in list(busy):
        pool.release(slot)
    assert pool.free == pool.slots and not any(pool.busy)


# -- the batched decoder over a real (tiny, random) model -------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """A 3-layer fp32 llama (GroupQueryAttention over shared buffers) and a fresh engine per call
    (keyword arguments go to DecodeEngine)."""
    config = replace(TINY_CONFIGS["tiny-llama"], max_position_embeddings=128)
    package = build_package(RandomSource(config, seed=3), tmp_path_factory.mktemp("batching") / "gqa")
    package_config = load_package_config(package)
    proto, base = load_model(package_config.model_file)
    session = InferenceSession(engine_model(proto, package_config), device="cpu", base_dir=base)

    def engine(**kwargs) -> DecodeEngine:
        return DecodeEngine(session, package_config, **kwargs)

    return engine


def _serial(engine: DecodeEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return list(engine.generate([engine.new_sequence(prompt, params)]))


def _run(decoder: BatchedDecoder, sequences: list, arrivals: dict[int, list] | None = None) -> None:
    """Iterate until every sequence is over; ``arrivals``: iteration -> sequences admitted then."""
    pending = dict(arrivals or {})
    for sequence in sequences:
        decoder.admit(sequence)
    tick = 0
    while decoder.admitted or pending:
        for sequence in pending.pop(tick, []):
            decoder.admit(sequence)
        decoder.iterate()
        tick += 1


def _run_as_room_allows(decoder: BatchedDecoder, sequences: list) -> None:
    """Admits the sequences in order as slots free up, iterating until every one is over."""
    queue = list(sequences)
    while queue or decoder.admitted:
        while queue and decoder.room:
            decoder.admit(queue.pop(0))
        decoder.iterate()


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def test_batched_greedy_equals_one_sequence_at_a_time(tiny_engine) -> None:
    engine = tiny_engine()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = _prompts(8)
    expected = [_serial(engine, p, params) for p in prompts]
    decoder = BatchedDecoder(engine, max_seqs=8, max_model_len=64)
    early = [engine.new_sequence(p, params) for p in prompts[:5]]
    late = {3: [engine.new_sequence(prompts[5], params)], 7: [engine.new_sequence(p, params) for p in prompts[6:]]}
    _run(decoder, early, late)
    got = early + late[3] + late[7]
    assert [s.generated for s in got] == expected
    assert all(s.done and s.stats.stop_reason == "length" and s.slot is None for s in got)
    assert decoder.steps < sum(len(e) for e in expected) / 2  # the steps really were shared
    assert decoder.pool.free == 8


def test_captured_batched_steps_per_bucket_give_the_same_tokens(tiny_engine) -> None:
    """The captured batched step (CPU stand-in recorder, verify mode: every step also run eagerly
    on copies and compared bit for bit): recorded per bucket over the pool, replayed, and the
    tokens of the eager one-sequence loop, greedy and seeded, with arrivals that change buckets."""
    from onnxgen.genai.batch_buckets import batch_buckets
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    plain = tiny_engine()
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.8, top_k=30, seed=7 + i, max_new_tokens=14, ignore_eos=True) for i in range(2)
    ]
    prompts = _prompts(6, seed=11)
    expected = [_serial(plain, p, q) for p, q in zip(prompts, params)]
    engine = tiny_engine(kv="static", capture="verify", recorder=ReplayRecorder(), verify_steps=10_000)
    decoder = BatchedDecoder(engine, max_seqs=6, max_model_len=48)
    assert decoder.buckets == batch_buckets(6) == [1, 2, 4, 6]
    sequences = [engine.new_sequence(p, q) for p, q in zip(prompts, params)]
    _run(decoder, sequences[:1], {6: sequences[1:3], 12: sequences[3:]})
    assert [s.generated for s in sequences] == expected
    stats = decoder.capture_stats
    assert stats.keys >= 3 and stats.replays > 0 and stats.verified_steps > 0
    assert stats.invalidations == 0 and not stats.unsupported and stats.steps == decoder.steps
    assert decoder.stepped_rows > sum(len(e) for e in expected) - len(expected)  # padded to buckets
    # the prompts: in groups (those arriving together, of one padded size, in one step), recorded
    # per (rows, size) and replayed, each verified
    assert decoder.grouped_prompts == len(prompts) and decoder.prompt_groups < len(prompts)
    assert decoder.prompt_capture_stats.steps == decoder.prompt_groups
    assert engine.prefill_capture_stats.steps == 0  # no prompt needed the engine's lone chunks
    # a next turn: the first prompt, its reply and more; the slot holds the reply's tokens that were
    # fed to steps before the host read them, so all of it but the new tokens is reused
    follow_up = prompts[0] + expected[0][:9] + [5, 6]
    again = engine.new_sequence(follow_up, params[0])
    _run(decoder, [again])
    assert again.stats.cached_tokens == len(prompts[0]) + 9
    assert again.generated == _serial(plain, follow_up, params[0])


def test_prompts_arriving_together_run_in_groups_with_the_tokens_of_one_at_a_time(tiny_engine) -> None:
    """Captured (CPU stand-in recorder, verify mode): prompts that wait together run as one step per
    group of one padded size, recorded per (rows, size), replayed and checked against eager; those
    reusing a prefix of different lengths, and a prompt longer than a chunk (alone, in chunks),
    still give the eager one-sequence loop's tokens, greedy and seeded."""
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    plain = tiny_engine()
    rng = random.Random(5)
    system = [rng.randrange(VOCAB) for _ in range(6)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(9, 16))] for _ in range(14)]
    prompts += [system + [1, 2, 3], system + [4, 5], system[:4] + [9] * 8, [7] * 40]  # reuse; a long one
    params = [
        SamplingParams(max_new_tokens=5, ignore_eos=True) if i % 3 else
        SamplingParams(temperature=0.9, top_k=40, seed=i, max_new_tokens=5, ignore_eos=True)
        for i in range(len(prompts))
    ]  # fmt: skip
    expected = [_serial(plain, p, q) for p, q in zip(prompts, params)]
    engine = tiny_engine(kv="static", capture="verify", recorder=ReplayRecorder(), verify_steps=10_000)
    decoder = BatchedDecoder(engine, max_seqs=4, max_model_len=64, prefill_chunk=32)
    sequences = [engine.new_sequence(p, q) for p, q in zip(prompts, params)]
    _run_as_room_allows(decoder, sequences)
    assert [s.generated for s in sequences] == expected
    assert decoder.grouped_prompts == len(prompts) - 1  # the long one ran alone, in chunks
    assert decoder.prompt_groups <= len(prompts) // 2
    groups = decoder.prompt_capture_stats
    assert groups.steps == decoder.prompt_groups and groups.replays > 0 and groups.verified_steps > 0
    assert groups.invalidations == 0 and not groups.unsupported
    assert engine.prefill_capture_stats.steps == 2  # the long prompt's two chunks
    assert sum(s.stats.cached_tokens for s in sequences) > 0
    assert sorted(decoder.pool.busy) == [False] * 4


def test_recording_every_shape_first_leaves_nothing_to_record_for_requests(tiny_engine) -> None:
    """record_shapes (the server's warm-up) records every decode bucket and prompt-group shape on
    dummy feeds; requests afterwards replay only, and get the one-at-a-time tokens."""
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    plain = tiny_engine()
    engine = tiny_engine(kv="static", capture="on", recorder=ReplayRecorder())
    decoder = BatchedDecoder(engine, max_seqs=5, max_model_len=40, prefill_chunk=32, prefill_budget=64)
    buckets, groups = decoder.shapes_to_record()
    assert buckets == [1, 2, 4, 5]
    assert groups == [(1, 16), (2, 16), (4, 16), (1, 32), (2, 32)]  # rows x size within the 64-token budget
    assert decoder.record_shapes() == len(buckets) + len(groups)
    # a chunk that is not a power of two: its prompts pad up to the next one, which is recorded too
    odd = BatchedDecoder(engine, max_seqs=5, max_model_len=40, prefill_chunk=24, prefill_budget=64)
    assert odd.shapes_to_record()[1] == groups
    steps, prompts = decoder.capture_stats, decoder.prompt_capture_stats
    assert (steps.keys, steps.captures) == (len(buckets), len(buckets))
    assert (prompts.keys, prompts.captures) == (len(groups), len(groups))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts_ids = _prompts(5, seed=9)
    sequences = [engine.new_sequence(p, params) for p in prompts_ids]
    _run(decoder, sequences[:2], {3: sequences[2:]})
    assert [s.generated for s in sequences] == [_serial(plain, p, params) for p in prompts_ids]
    assert (steps.captures, prompts.captures) == (len(buckets), len(groups)) and steps.replays > 0
    assert prompts.replays > 0 and not steps.invalidations and not prompts.invalidations
    with pytest.raises(RuntimeError, match="pool must hold nothing"):
        decoder.record_shapes()


def test_seeded_sampling_per_sequence_does_not_depend_on_the_batch(tiny_engine) -> None:
    engine = tiny_engine()
    prompts = _prompts(6, seed=1)
    params = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, max_new_tokens=10, ignore_eos=True,
                       repetition_penalty=1.0 + 0.1 * (i % 2))
        for i in range(len(prompts))
    ]  # fmt: skip
    expected = [_serial(engine, p, q) for p, q in zip(prompts, params)]
    for max_seqs in (6, 3):  # all at once; and three at a time, joining as others leave
        decoder = BatchedDecoder(engine, max_seqs=max_seqs, max_model_len=64)
        sequences = [engine.new_sequence(p, q) for p, q in zip(prompts, params)]
        _run_as_room_allows(decoder, sequences)
        assert [s.generated for s in sequences] == expected


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_chunked_prefill_and_prefix_reuse_give_the_same_tokens(tiny_engine, captured: bool) -> None:
    """Captured: the prompts run as the engine's captured chunks in a scratch cache, after the
    reused prefix copied in, and land in their slots (CPU stand-in recorder, verify mode)."""
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    serial = tiny_engine()
    engine = tiny_engine(kv="static", capture="verify", recorder=ReplayRecorder()) if captured else serial
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    system = _prompts(1, seed=2)[0] * 3  # a shared "system prompt"
    prompts = [system + [i + 1, i + 2] for i in range(4)]
    expected = [_serial(serial, p, params) for p in prompts]
    decoder = BatchedDecoder(engine, max_seqs=4, max_model_len=96, prefill_chunk=7)
    first = engine.new_sequence(prompts[0], params)
    _run(decoder, [first])  # alone: its prompt in chunks of 7, held afterwards
    rest = [engine.new_sequence(p, params) for p in prompts[1:]]
    _run(decoder, rest)
    assert [s.generated for s in [first, *rest]] == expected
    assert [s.stats.cached_tokens for s in [first, *rest]] == [0] + [len(system)] * 3
    assert decoder.pool.copied_tokens == 2 * len(system)  # the later two copied it from a running slot
    plain = BatchedDecoder(engine, max_seqs=4, max_model_len=96, prefix_caching=False)
    again = [engine.new_sequence(p, params) for p in prompts]
    _run(plain, again[:1])
    _run(plain, again[1:])
    assert [s.generated for s in again] == expected and plain.pool.reused_tokens == 0


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_stops_limits_and_cancels_free_their_slots(tiny_engine, captured: bool) -> None:
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    serial = tiny_engine()
    engine = tiny_engine(kv="static", capture="on", recorder=ReplayRecorder()) if captured else serial
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    greedy = _serial(serial, prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
    decoder = BatchedDecoder(engine, max_seqs=2, max_model_len=len(prompt) + 4)
    capped = engine.new_sequence(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
    stopped = engine.new_sequence(prompt, SamplingParams(max_new_tokens=50), stop_ids={greedy[2]})
    _run(decoder, [capped, stopped])
    assert capped.generated == greedy[:4] and capped.stats.stop_reason == "length"  # the slot's room
    assert stopped.generated == greedy[:2] and stopped.stats.stop_reason == "eos" and stopped.stats.new_tokens == 3
    with pytest.raises(PromptTooLongError, match="a sequence may hold 14"):
        decoder.admit(engine.new_sequence(list(range(1, 15)), SamplingParams()))
    running = engine.new_sequence(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
    decoder.admit(running)
    decoder.iterate()
    decoder.release(running)
    assert running.done and running.stats.stop_reason == "cancelled" and decoder.pool.free == 2
    assert not decoder.admitted


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_many_requests_with_random_cancels_leak_nothing(tiny_engine, captured: bool) -> None:
    """1,000 short requests arriving at random, some cancelled midway: every slot is free at the
    end, and the pool's buffers were never reallocated. Captured: cancels land while a step that
    includes the sequence is in flight (overlapped steps)."""
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    engine = tiny_engine(kv="static", capture="on", recorder=ReplayRecorder()) if captured else tiny_engine()
    rng = random.Random(5)
    decoder = BatchedDecoder(engine, max_seqs=4, max_model_len=40)
    pointers = [b.data_ptr() for b in decoder.pool.buffers.values()]
    queue = [
        engine.new_sequence(p[:4], SamplingParams(max_new_tokens=rng.randint(1, 4), ignore_eos=True))
        for p in _prompts(1000, seed=6)
    ]
    everyone = list(queue)
    while queue or decoder.admitted:
        while queue and decoder.room and rng.random() < 0.7:
            decoder.admit(queue.pop())
        decoder.iterate()
        admitted = [s for s in everyone if s.slot is not None and not s.done]  # any state, first token read or not
        if admitted and rng.random() < 0.2:
            decoder.release(rng.choice(admitted))
    reasons = {s.stats.stop_reason for s in everyone}
    assert all(s.done and s.slot is None for s in everyone) and reasons == {"length", "cancelled"}
    assert decoder.pool.free == 4 and not any(decoder.pool.busy)
    assert [b.data_ptr() for b in decoder.pool.buffers.values()] == pointers


def test_graphs_that_cannot_batch_are_refused(tmp_path) -> None:
    config = replace(TINY_CONFIGS["tiny-llama"], max_position_embeddings=64)
    package = build_package(RandomSource(config), tmp_path / "standard", attention="standard")
    package_config = load_package_config(package)
    proto, base = load_model(package_config.model_file)
    engine = DecodeEngine(InferenceSession(engine_model(proto, package_config), base_dir=base), package_config)
    with pytest.raises(BatchingNotSupportedError, match="concatenates its own KV cache"):
        BatchedDecoder(engine, max_seqs=2)
    with pytest.raises(InvalidInputError, match="max_seqs must be >= 1"):
        BatchedDecoder(engine, max_seqs=0)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_a_sequence_whose_logits_fail_ends_alone(tiny_engine, monkeypatch, captured: bool) -> None:
    """Captured: the NaN row comes from a step whose tokens are read after the next step was
    enqueued, fed the failed row's marker (the overlapped steps of batched.py)."""
    from onnxgen.genai.sampling import NonFiniteLogitsError
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    serial = tiny_engine()
    engine = tiny_engine(kv="static", capture="on", recorder=ReplayRecorder()) if captured else serial
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = _prompts(3, seed=8)
    expected = [_serial(serial, p, params) for p in prompts]
    decoder = BatchedDecoder(engine, max_seqs=3, max_model_len=64)
    sequences = [engine.new_sequence(p, params) for p in prompts]
    victim = sequences[1]
    owner, name = (decoder._runtime, "run") if captured else (engine.session, "run_torch")
    run = getattr(owner, name)

    def failing(feeds):  # the victim's row of its third step's logits turns NaN
        outputs = run(feeds)
        slots = [s.slot for s in decoder.running] or [0]
        lo = 0 if captured else min(slots)
        rows = outputs[engine.config.io.logits].shape[0]
        if victim in decoder.running and victim.sampled == 2 and rows >= max(slots) + 1 - lo > 1:
            outputs[engine.config.io.logits][victim.slot - lo] = float("nan")
        return outputs

    monkeypatch.setattr(owner, name, failing)
    for sequence in sequences:
        decoder.admit(sequence)
    errors = []
    while decoder.admitted:
        errors += [read for read in decoder.iterate() if read.error is not None]
    assert [read.sequence for read in errors] == [victim] and isinstance(errors[0].error, NonFiniteLogitsError)
    assert victim.stats.stop_reason == "error" and victim.generated == expected[1][:2]
    assert [sequences[0].generated, sequences[2].generated] == [expected[0], expected[2]]
    assert decoder.pool.free == 3


def test_a_prompt_computed_in_chunks_between_running_slots_keeps_its_rows(tiny_engine) -> None:
    """A long prompt taken in 3-token chunks in a slot between two running sequences: the decode
    steps in between span its slot (an idle row for them) and must not touch the rows it has."""
    engine = tiny_engine()
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    short = [[5, 6], [7], [8, 9]]
    long_prompt = _prompts(1, seed=9)[0] * 2  # longer than the running sequences get
    expected = [_serial(engine, p, params) for p in [short[0], short[2], long_prompt]]
    decoder = BatchedDecoder(engine, max_seqs=3, max_model_len=96, prefill_chunk=3, prefix_caching=False)
    first, brief, last = (engine.new_sequence(p, params) for p in short)
    brief.max_new_tokens = 1
    for sequence in (first, brief, last):
        decoder.admit(sequence)
    while not brief.done or last.slot is None:
        decoder.iterate()
    assert (first.slot, last.slot) == (0, 2)
    middle = engine.new_sequence(long_prompt, params)
    decoder.admit(middle)
    decoder.iterate()
    assert middle.slot == 1 and not middle.done
    while decoder.admitted:
        decoder.iterate()
    assert [first.generated, last.generated, middle.generated] == expected


def test_recorded_ops_off_cuda_run_the_function_every_time() -> None:
    from onnxgen.genai.recorded_ops import RecordedOps

    seen: list[int] = []
    ops = RecordedOps(lambda: seen.append(len(seen)), torch.device("cpu"))
    for _ in range(3):
        ops()
    assert seen == [0, 1, 2] and ops.graph is None


def test_group_feeds_place_each_row_at_its_own_length() -> None:
    """prompt_groups.GroupFeeds: row b's chunk at positions r_b .. r_b + S - 1, its mask r_b + S
    wide, its logits at its last real row, its slot; rows past the chunks idle (a one-token dummy
    at row 0); chunks longer than S or missing are refused."""
    from onnxgen.genai.kv_cache import StaticKV
    from onnxgen.genai.prompt_groups import GroupFeeds

    scratch = StaticKV(_Config(), torch.float32, torch.device("cpu"), capacity=12, batch=4)  # type: ignore[arg-type]
    feeds_of = GroupFeeds(
        scratch, 4, 4, input_ids="ids", attention_mask="mask", position_ids="pos", row_inputs=("row",)
    )
    feeds = feeds_of.fill([[5, 6, 7], [8], [9, 9, 9, 9]], starts=[0, 5, 2], slots=[3, 0, 1])
    assert feeds["ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [9, 9, 9, 9], [0, 0, 0, 0]]
    assert feeds["pos"].tolist() == [[0, 1, 2, 3], [5, 6, 7, 8], [2, 3, 4, 5], [0, 1, 2, 3]]
    assert feeds["mask"].sum(dim=1).tolist() == [4, 9, 6, 4] and feeds["mask"][1, :9].all()
    assert feeds["row"].tolist() == [2, 0, 3, 0] and feeds_of.slots[:3].tolist() == [3, 0, 1]
    assert (
        feeds["past.0.key"].shape[0] == 4 and feeds["past.0.key"].data_ptr() == scratch.buffers["past.0.key"].data_ptr()
    )
    with pytest.raises(ValueError, match="1 to 4 tokens"):
        feeds_of.fill([[1, 2, 3, 4, 5]], starts=[0], slots=[0])
    with pytest.raises(ValueError, match="got 5 chunks"):
        feeds_of.fill([[1]] * 5, starts=[0] * 5, slots=[0] * 5)
