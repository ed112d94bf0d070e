"""Prefix reuse across conversations for hybrid decoders (Gated DeltaNet + full attention) through
state snapshots (genai/state_snapshots.py, genai/kv_pool.py): the second prompt with a shared
system prompt leaves a snapshot of its carried states after the shared part, and later prompts
start there, their KV rows taken or copied from a slot that still holds them.

The pool's choices are checked on a stand-in config (no model); the decoder's tokens against the
one-sequence engine loop on the same package (the oracle of tests/test_batching_hybrid.py), eager
and captured (the CPU stand-in recorder in verify mode: every replay also run eagerly on copies
and compared bit for bit).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from onnxgen.genai.batched import BatchedDecoder
from onnxgen.genai.engine import DecodeEngine
from onnxgen.genai.kv_pool import MIN_SNAPSHOT_TOKENS, KVPool
from onnxgen.genai.package import CarriedState
from onnxgen.genai.sampling import SamplingParams
from onnxgen.genai.sequence import Sequence
from tests.test_batching import _Config, _rows_match, _write

VOCAB = 128
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=11, max_new_tokens=5, ignore_eos=True)


# -- the pool's choices, on a stand-in config ------------------------------------------------------


class _HybridConfig(_Config):
    carried = (CarriedState("past.conv", "present.conv", (3,)),)


def _hybrid_pool(slots: int = 3, snapshots: int | None = None) -> KVPool:
    return KVPool(_HybridConfig(), torch.float32, torch.device("cpu"), slots, 64, state_snapshots=snapshots)  # type: ignore[arg-type]


def _prefill(pool: KVPool, slot: int, prompt: list[int]) -> None:
    """What the decoder does with a prompt: its rows written after the reused ones, and its states
    (here: the sum of the ids so far, in every element) kept at ``snapshot_at`` on the way."""
    point = pool.snapshot_at[slot]
    state = pool.states["past.conv"][slot]
    for token in prompt[len(pool.contents[slot]) :]:
        _write(pool, slot, [token])
        state += token
        if len(pool.contents[slot]) == point:
            pool.keep_snapshot(slot, prompt[:point], {"past.conv": state})


def test_pool_takes_a_snapshot_where_prompts_diverge_and_reuses_it_with_held_rows() -> None:
    system = list(range(1, MIN_SNAPSHOT_TOKENS + 5))
    pool = _hybrid_pool()
    prompts = [system + [100 + i, 7] for i in range(4)]
    got = []
    for prompt in prompts:
        slot, reused = pool.acquire(prompt)
        got.append((reused, pool.snapshot_at[slot]))
        assert _rows_match(pool, slot) and float(pool.states["past.conv"][slot, 0]) == sum(prompt[:reused])
        _prefill(pool, slot, prompt)
        pool.release(slot)
    n = len(system)
    assert got == [(0, 0), (0, n), (n, 0), (n, 0)]
    assert (pool.snapshot_takes, pool.snapshot_hits, pool.reused_tokens) == (1, 2, 2 * n)
    # a conversation's next turn still reuses its slot whole, states included, when that is longer
    turn = prompts[3] + [9, 9]
    slot, reused = pool.acquire(turn)
    assert reused == len(prompts[3]) and pool.snapshot_hits == 2
    pool.release(slot)


def test_pool_copies_a_snapshots_rows_from_a_busy_slot() -> None:
    system = list(range(1, MIN_SNAPSHOT_TOKENS + 1))
    pool = _hybrid_pool()
    a, _ = pool.acquire(system + [50])
    _prefill(pool, a, system + [50])
    b, _ = pool.acquire(system + [60])  # both stay busy
    _prefill(pool, b, system + [60])
    c, reused = pool.acquire(system + [70])
    assert c not in (a, b) and reused == len(system) and pool.copied_tokens == len(system)
    assert _rows_match(pool, c) and float(pool.states["past.conv"][c, 0]) == sum(system)


def test_pool_the_same_prompt_again_leaves_a_snapshot_before_its_last_token() -> None:
    """A request's n choices, or one prompt sent again: the second computes it and leaves a
    snapshot of all but its last token (at least one prompt token is always computed); the third
    starts there."""
    prompt = list(range(1, MIN_SNAPSHOT_TOKENS + 3))
    pool = _hybrid_pool()
    got = []
    for _ in range(3):
        slot, reused = pool.acquire(prompt)
        got.append((reused, pool.snapshot_at[slot]))
        _prefill(pool, slot, prompt)  # all three stay busy
    n = len(prompt) - 1
    assert got == [(0, 0), (0, n), (n, 0)] and pool.copied_tokens == n


def test_pool_snapshots_off_or_without_rows_are_not_used() -> None:
    system = list(range(1, MIN_SNAPSHOT_TOKENS + 1))
    off = _hybrid_pool(snapshots=0)
    plain = KVPool(_HybridConfig(), torch.float32, torch.device("cpu"), 2, 64, prefix_caching=False)  # type: ignore[arg-type]
    assert off.snapshots is None and plain.snapshots is None
    pool = _hybrid_pool(slots=2)
    for prompt in (system + [1], system + [2], [90] * 3, [91] * 3):  # the last two overwrite both slots
        slot, _ = pool.acquire(prompt)
        _prefill(pool, slot, prompt)
        pool.release(slot)
    assert pool.snapshot_takes == 1
    slot, reused = pool.acquire(system + [3])  # its snapshot exists, but no slot holds its rows
    assert reused == 0 and pool.snapshot_at[slot] == 0  # and it is not taken again
    _prefill(pool, slot, system + [3])
    pool.release(slot)
    assert pool.acquire(system + [4])[1] == len(system)  # the rows are back: the old snapshot serves


# -- the decoder's tokens against the one-sequence loop --------------------------------------------


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from onnxgen.models.builder import build_package
    from onnxgen.models.hf_source import HFSource
    from tests.test_builder_hybrid import tiny_checkpoint

    root = tmp_path_factory.mktemp("hybrid-snapshots")
    checkpoint = tiny_checkpoint(root / "hf", value_heads=4, tied=False)
    return build_package(HFSource(checkpoint), root / "pkg", precision="fp32")


@pytest.fixture(scope="module")
def oracle(package: Path):  # noqa: ANN201 - (prompt, params) -> (tokens, states), memoised
    """The one-sequence engine loop's tokens for a prompt, and its carried states at the end (after
    the prompt and every generated token but the last, which is never fed)."""
    from tests.conftest import make_engine

    engine = make_engine(package)
    memo: dict[tuple, tuple[list[int], dict[str, torch.Tensor]]] = {}

    def run(prompt: list[int], params: SamplingParams) -> tuple[list[int], dict[str, torch.Tensor]]:
        key = (tuple(prompt), repr(params))
        if key not in memo:
            sequence = engine.new_sequence(prompt, params)
            tokens = list(engine.generate([sequence]))
            assert sequence.kv is not None
            memo[key] = tokens, {k: v[0].clone() for k, v in sequence.kv.states.buffers.items()}
        return memo[key]

    return run


def _check(decoder: BatchedDecoder, sequence: Sequence, oracle, slot: int) -> None:  # noqa: ANN001
    """The sequence's tokens are the one-sequence loop's, and the states its slot kept after it are
    that loop's (to rounding: its prompt ran in other chunks), which a wrong restored state that
    happened to give the same few tokens would not be."""
    tokens, states = oracle(sequence.prompt_ids, sequence.sampler.params)
    assert sequence.generated == tokens
    pool = decoder.pool
    assert pool.state_held[slot] and pool.contents[slot] == sequence.prompt_ids + tokens[:-1]
    for name, state in states.items():
        torch.testing.assert_close(pool.states[name][slot], state, rtol=1e-4, atol=1e-5)


def _engine(package: Path, captured: bool) -> DecodeEngine:
    from onnxgen.runtime.capture.recorder import ReplayRecorder
    from tests.conftest import make_engine

    if captured:
        return make_engine(package, kv="static", capture="verify", recorder=ReplayRecorder(), verify_steps=10_000)
    return make_engine(package)


def _serve(decoder: BatchedDecoder, sequences: list[Sequence]) -> list[int]:
    """Admits ``sequences`` at once and iterates until every one is over; the slots they had."""
    for sequence in sequences:
        decoder.admit(sequence)
    slots: dict[int, int] = {}
    while decoder.admitted:
        decoder.iterate()
        slots.update({i: s.slot for i, s in enumerate(sequences) if s.slot is not None})
    return [slots[i] for i in range(len(sequences))]


def _random(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


CAPTURED = pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])


@CAPTURED
def test_a_shared_system_prompt_is_computed_twice_then_started_after(package, oracle, captured: bool) -> None:
    """One conversation after another, each a shared 40-token system prompt and its own question
    (the last one sampled, seeded), prompts in chunks of 16: the second leaves a snapshot after the
    shared part (its chunk ending there), the later ones reuse it; every one gets the one-sequence
    loop's tokens."""
    engine = _engine(package, captured)
    system = _random(40, seed=3)
    prompts = [system + [10 + i, *_random(3 + i, seed=20 + i)] for i in range(4)]
    params = [GREEDY, GREEDY, GREEDY, SEEDED]
    decoder = BatchedDecoder(engine, max_seqs=4, max_model_len=96, prefill_chunk=16)
    sequences = []
    for prompt, param in zip(prompts, params):
        sequence = engine.new_sequence(prompt, param)
        _check(decoder, sequence, oracle, *_serve(decoder, [sequence]))
        sequences.append(sequence)
    stats = [(s.stats.cached_tokens, s.stats.snapshot_takes, s.stats.snapshot_hits) for s in sequences]
    assert stats == [(0, 0, 0), (0, 1, 0), (40, 0, 1), (40, 0, 1)]
    if captured:
        steps = decoder.capture_stats
        assert steps.verified_steps > 0 and steps.invalidations == 0 and not steps.unsupported


@CAPTURED
def test_prompts_with_one_prefix_in_flight_at_once(package, oracle, captured: bool) -> None:
    """Three prompts admitted together: the second shares the first's system prompt while the first
    decodes, the third starts from the second's snapshot with the rows copied from a busy slot."""
    engine = _engine(package, captured)
    system = _random(24, seed=4)
    prompts = [system + _random(2 + i, seed=30 + i) for i in range(3)]
    decoder = BatchedDecoder(engine, max_seqs=3, max_model_len=64, prefill_chunk=16)
    sequences = [engine.new_sequence(p, GREEDY) for p in prompts]
    for sequence, slot in zip(sequences, _serve(decoder, sequences)):
        _check(decoder, sequence, oracle, slot)
    assert [s.stats.cached_tokens for s in sequences] == [0, 0, 24]
    assert decoder.pool.copied_tokens == 24 and decoder.pool.snapshot_takes == 1


def test_a_full_snapshot_store_drops_the_least_recently_used(package, oracle) -> None:
    """One snapshot entry, two system prompts taking turns: the second's snapshot evicts the
    first's, which is then taken again (and serves once more)."""
    engine = _engine(package, False)
    first, second = _random(20, seed=5), _random(20, seed=6)
    order = [first, first, first, second, second, first, first]
    prompts = [system + [i, *_random(2, seed=40 + i)] for i, system in enumerate(order)]
    decoder = BatchedDecoder(engine, max_seqs=4, max_model_len=48, prefill_chunk=16, state_snapshots=1)
    sequences = [engine.new_sequence(p, GREEDY) for p in prompts]
    for sequence in sequences:
        _check(decoder, sequence, oracle, *_serve(decoder, [sequence]))
    assert [s.stats.cached_tokens for s in sequences] == [0, 0, 20, 0, 0, 0, 20]
    assert [s.stats.snapshot_takes for s in sequences] == [0, 1, 0, 0, 1, 1, 0]


def test_a_snapshot_whose_rows_were_overwritten_is_not_used(package, oracle) -> None:
    """Two slots: after the shared prompt's snapshot, two unrelated prompts take both slots; the
    next prompt with the shared prefix finds the snapshot but no rows and computes it all (its slot
    then holds the rows again, and the one after it is served from the snapshot)."""
    engine = _engine(package, False)
    system = _random(20, seed=7)
    prompts = [system + [1, 2], system + [3], _random(6, seed=8), _random(7, seed=9), system + [4], system + [5, 6]]
    decoder = BatchedDecoder(engine, max_seqs=2, max_model_len=48, prefill_chunk=16)
    sequences = [engine.new_sequence(p, GREEDY) for p in prompts]
    for sequence in sequences:
        _check(decoder, sequence, oracle, *_serve(decoder, [sequence]))
    assert [s.stats.cached_tokens for s in sequences] == [0, 0, 0, 0, 0, 20]
    assert decoder.pool.snapshot_takes == 1 and decoder.pool.snapshot_hits == 1


def test_snapshots_off_reuse_no_prefix(package, oracle) -> None:
    """``state_snapshots=0`` (and prefix caching off): as before snapshots, each shared system
    prompt is computed again."""
    engine = _engine(package, False)
    system = _random(20, seed=10)
    prompts = [system + [i, 9] for i in range(3)]
    for kwargs in ({"state_snapshots": 0}, {"prefix_caching": False}):
        decoder = BatchedDecoder(engine, max_seqs=2, max_model_len=48, prefill_chunk=16, **kwargs)
        assert decoder.pool.snapshots is None
        sequences = [engine.new_sequence(p, GREEDY) for p in prompts]
        for sequence in sequences:
            _check(decoder, sequence, oracle, *_serve(decoder, [sequence]))
        assert [s.stats.cached_tokens for s in sequences] == [0, 0, 0]


# -- the option and the counters, through the server's layers --------------------------------------


def test_the_option_reaches_the_runner_and_the_counters_reach_the_metrics() -> None:
    from onnxgen.cli import build_parser
    from onnxgen.errors import OnnxgenError
    from onnxgen.genai.engine_process import _decoded, _encoded
    from onnxgen.genai.events import GenerationEvent
    from onnxgen.genai.scheduler import Output
    from onnxgen.server.metrics import Metrics
    from onnxgen.server.options import ServeOptions

    args = build_parser().parse_args(["serve", "--state-snapshots", "3"])
    assert args.state_snapshots == 3 and build_parser().parse_args(["serve"]).state_snapshots is None
    assert ServeOptions(model_name="m", max_num_seqs=4, state_snapshots=3).runner.state_snapshots == 3
    with pytest.raises(OnnxgenError, match="--state-snapshots"):
        ServeOptions(model_name="m", state_snapshots=-1)
    out = Output(0, GenerationEvent(None, "", None, "length"), 1.0, None, 5, 40, 1, 0)
    assert _decoded(_encoded(out)) == out  # across the engine process's pipe
    metrics = Metrics()
    metrics.state_snapshot_hits, metrics.state_snapshot_takes = 2, 1
    text = metrics.render()
    assert "onnxgen_prefix_state_snapshot_hits_total 2" in text
    assert "onnxgen_prefix_state_snapshots_taken_total 1" in text
