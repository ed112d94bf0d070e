"""Continuous batching of hybrid decoders (Gated DeltaNet + full attention, dense and MoE; onnxgen's
builder and onnxruntime-genai's) on the CPU: the KV pool keeps each slot's conv and recurrent
states beside its KV rows, and a batched step writes back only the states of the rows that ran.

Oracle: the one-sequence engine loop on the same package (itself checked against transformers in
test_builder_hybrid.py and test_foreign_hybrid.py): the same tokens, greedy and seeded, whatever
else is in the batch.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from onnxgen.genai.batched import BatchedDecoder
from onnxgen.genai.engine import DecodeEngine
from onnxgen.genai.sampling import SamplingParams
from onnxgen.models.builder import build_package
from onnxgen.models.hf_source import HFSource
from tests.conftest import make_engine
from tests.test_batching import _run_as_room_allows as run_as_room_allows

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no Qwen3_5ForCausalLM", allow_module_level=True)

VOCAB = 128


ALL = ["onnxgen-dense", "onnxgen-moe", "genai-dense"]


@pytest.fixture(scope="module")
def package(request, tmp_path_factory) -> Path:
    from tests.test_builder_hybrid import tiny_checkpoint

    root = tmp_path_factory.mktemp("batching-hybrid")
    if request.param == "genai-dense":
        pytest.importorskip("onnxruntime_genai")
        from tests.test_foreign_hybrid import genai_build, wrapper_checkpoint

        return genai_build(wrapper_checkpoint(root / "hf", experts=0), root / "pkg", "fp32")
    experts = 8 if request.param == "onnxgen-moe" else 0
    checkpoint = tiny_checkpoint(root / "hf", value_heads=4, tied=False, experts=experts)
    return build_package(HFSource(checkpoint), root / "pkg", precision="fp32")


def serial(engine: DecodeEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return list(engine.generate([engine.new_sequence(prompt, params)]))


@pytest.mark.parametrize("package", ALL[:1], indirect=True)
def test_the_engine_reads_the_layout_from_its_graph(package: Path) -> None:
    """A DecodeEngine handed the package's config as genai_config.json gives it (no KV layers or
    carried states filled in) takes them from the graph its session runs, and decodes as the
    engine of a filled-in config does (bench/random_package.py once built one without them, which
    failed on the H200 looking for layer 0's KV input)."""
    from onnxgen.genai.engine import engine_model
    from onnxgen.genai.package import load_package_config
    from onnxgen.runtime.model_io import load_model
    from onnxgen.runtime.session import InferenceSession

    plain = load_package_config(package)
    proto, base = load_model(plain.model_file)
    engine = DecodeEngine(InferenceSession(engine_model(proto, plain), device="cpu", base_dir=base), plain)
    assert engine.config.carried and engine.config.kv_layer_ids != range(plain.num_layers)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert serial(engine, [3, 7, 11], params) == serial(make_engine(package), [3, 7, 11], params)


@pytest.mark.parametrize("package", ALL, indirect=True)
def test_batched_tokens_equal_one_sequence_at_a_time(package: Path) -> None:
    """Six requests through four slots as room allows (slots reused, so a reused slot's states must
    start from zero again), prompts in chunks of 8, greedy and seeded sampling."""
    engine = make_engine(package)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.9, top_k=20, seed=5 + i, max_new_tokens=10, ignore_eos=True) for i in range(2)
    ]
    expected = [serial(engine, p, q) for p, q in zip(prompts, params)]
    decoder = BatchedDecoder(engine, max_seqs=4, max_model_len=64, prefill_chunk=8)
    sequences = [engine.new_sequence(p, q) for p, q in zip(prompts, params)]
    run_as_room_allows(decoder, sequences)
    assert [s.generated for s in sequences] == expected
    assert decoder.steps < sum(len(e) for e in expected) / 2  # the steps really were shared
    assert decoder.pool.free == 4


@pytest.mark.parametrize("package", ["onnxgen-dense", "genai-dense"], indirect=True)
def test_a_prompt_in_chunks_between_running_rows_keeps_its_states(package: Path) -> None:
    """A long prompt takes the slot between two running sequences and is computed a chunk per
    iteration while they decode: every batched step spans its slot with a dummy token, which would
    fold into its conv and recurrent states were they written back (a KV row is simply overwritten
    by the next chunk; a state is not)."""
    engine = make_engine(package)
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 6, 7, 30)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 2, 20, 8)]
    expected = [serial(engine, p, q) for p, q in zip(prompts, params)]
    decoder = BatchedDecoder(engine, max_seqs=4, max_model_len=64, prefill_chunk=8, prefill_budget=8)
    sequences = [engine.new_sequence(p, q) for p, q in zip(prompts, params)]
    for sequence in sequences[:3]:
        decoder.admit(sequence)
    slots: dict[int, int] = {}
    tick = 0
    while decoder.admitted or tick < 5:
        if tick == 4:
            decoder.admit(sequences[3])
        decoder.iterate()
        slots.update({i: s.slot for i, s in enumerate(sequences) if s.slot is not None})
        tick += 1
    assert slots[3] == slots[1] and slots[0] < slots[3] < slots[2]  # the freed middle slot, between running rows
    assert [s.generated for s in sequences] == expected


@pytest.mark.parametrize("package", ["onnxgen-dense"], indirect=True)
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_a_next_turn_reuses_the_slot_whole_and_nothing_else_is_reused(package: Path, captured: bool) -> None:
    """A state holds all of its slot's tokens and cannot be cut back to a prefix: a prompt that
    continues everything a free slot holds (a conversation's next turn) reuses its KV rows and its
    states; the same prompt again (which shares only part of what the slot holds) is computed
    whole; and once a captured step has written a dummy row into a free slot's states, nothing is
    reused from it. Each gives the one-sequence loop's tokens."""
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    plain = make_engine(package)
    kwargs = dict(kv="static", capture="verify", recorder=ReplayRecorder(), verify_steps=10_000) if captured else {}
    engine = make_engine(package, **kwargs)
    decoder = BatchedDecoder(engine, max_seqs=2, max_model_len=64)
    assert set(decoder.pool.states) == {s.past for s in engine.config.carried}
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def run(prompt: list[int], cached: int) -> list[int]:
        sequence = engine.new_sequence(prompt, params)
        decoder.admit(sequence)
        while decoder.admitted:
            decoder.iterate()
        assert sequence.stats.cached_tokens == cached
        assert sequence.generated == serial(plain, prompt, params)
        return sequence.generated

    prompt = [3, 17, 91, 5, 44, 120, 8]
    reply = run(prompt, 0)
    run(prompt, 0)  # shares 6 of the 12 ids its slot holds: computed whole
    turn = prompt + reply + [5, 6]
    run(turn, len(prompt) + len(reply) - 1)  # the reply's last token was never fed
    if captured:  # a short and a long sequence side by side: the long one's steps span the freed slot
        short = engine.new_sequence([9, 9, 9], SamplingParams(max_new_tokens=2, ignore_eos=True))
        long = engine.new_sequence([4, 4], SamplingParams(max_new_tokens=8, ignore_eos=True))
        decoder.admit(short)
        decoder.admit(long)
        slots = {}
        while decoder.admitted:
            decoder.iterate()
            slots.update({name: s.slot for name, s in (("short", short), ("long", long)) if s.slot is not None})
        assert slots["short"] < slots["long"] and not decoder.pool.state_held[slots["short"]]
        run([9, 9, 9] + short.generated + [1], 0)


@pytest.mark.parametrize("package", ["onnxgen-dense", "onnxgen-moe"], indirect=True)
def test_captured_batched_steps_give_the_same_tokens(package: Path) -> None:
    """Captured (CPU stand-in recorder, verify mode: every replay also run eagerly on copies and
    compared bit for bit): the decode step recorded per bucket with the states' write-back; short
    prompts computed together in padded groups (prompt_groups.py: each row's states stop at its
    last real row, runtime/state_rows.py) and a long one alone in chunks, each landing in its slot
    with its states; arrivals that change buckets, greedy and seeded, after recording every shape
    first."""
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    plain = make_engine(package)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))] for _ in range(5)] + [[7] * 40]
    params = [SamplingParams(max_new_tokens=7, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.8, top_k=30, seed=7 + i, max_new_tokens=7, ignore_eos=True) for i in range(2)
    ]
    expected = [serial(plain, p, q) for p, q in zip(prompts, params)]
    engine = make_engine(package, kv="static", capture="verify", recorder=ReplayRecorder(), verify_steps=10_000)
    decoder = BatchedDecoder(engine, max_seqs=4, max_model_len=64, prefill_chunk=32)
    buckets, groups = decoder.shapes_to_record()
    assert buckets == [1, 2, 4] and (4, 16) in groups
    decoder.record_shapes()
    sequences = [engine.new_sequence(p, q) for p, q in zip(prompts, params)]
    queue, tick = list(sequences[:2]), 0
    while queue or decoder.admitted or tick < 4:
        if tick == 3:
            queue += sequences[2:]
        while queue and decoder.room:
            decoder.admit(queue.pop(0))
        decoder.iterate()
        tick += 1
    assert [s.generated for s in sequences] == expected
    stats = decoder.capture_stats
    assert stats.replays > 0 and stats.verified_steps > 0 and stats.invalidations == 0 and not stats.unsupported
    assert decoder.grouped_prompts >= 4 and engine.prefill_capture_stats.steps > 0  # the long one alone
    assert sorted(decoder.pool.busy) == [False] * 4


@pytest.mark.parametrize("package", ["onnxgen-dense"], indirect=True)
@pytest.mark.parametrize(("rule", "steps"), [("pad", [16, 16, 16]), ("split", [8, 4, 4, 2, 8, 4, 2])])
def test_a_batched_hybrid_prompt_runs_the_same_pieces_captured_or_not(package: Path, rule: str, steps) -> None:
    """The batching decoder's uncaptured prompt chunks run as the captured path's: padded to a
    power of two (option prefill_pieces pad, the states stopping at the last real row; captured,
    a prompt of one chunk runs as a prompt group of that size) or in its power-of-two pieces
    (split). A chunk split or padded otherwise rounds otherwise, so the capture
    setting would change the tokens (the H200 run of 2026-12-05 saw a captured batch part from the
    eager one when the captured prompts ran as pieces and the eager ones whole). The rows each path
    runs (prompts of 12, 6 and 14 tokens: no one-row piece, so every row count above one is a
    prompt's) are recorded as the session and the engine see them; both engines hold a CPU
    recorder, which stands in for CUDA (without one the CPU runs a chunk whole, padding nothing).
    Bit equality itself is the GPU test's (tests/test_gpu_hybrid.py): on the CPU the two paths'
    attentions span different mask widths and round apart anyway."""
    from onnxgen import options
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    prompts = [[5, 17, 100, 41, 9, 80, 3, 7, 11, 2, 1, 6], [8, 3, 3, 90, 1, 4], [2] * 14]

    def pieces(captured: bool) -> list[int]:
        kwargs = dict(kv="static", capture="on" if captured else "off", recorder=ReplayRecorder())
        engine = make_engine(package, **kwargs)
        rows: list[int] = []
        if captured:  # the scratch cache's prompt steps
            forward = engine._forward
            engine._forward = lambda sequence, ids, **kw: rows.append(ids.shape[1]) or forward(sequence, ids, **kw)
        else:  # the slot's prompt steps (a decode step feeds one row per sequence)
            run = engine.session.run_torch
            ids_name = engine.config.io.input_ids

            def counted(feeds, *rest, **kw):
                if feeds[ids_name].shape[1] > 1:
                    rows.append(feeds[ids_name].shape[1])
                return run(feeds, *rest, **kw)

            engine.session.run_torch = counted
        decoder = BatchedDecoder(engine, max_seqs=1, max_model_len=64, prefill_chunk=32)
        if captured:  # a prompt of one chunk runs as a group (prompt_groups.py) under pad
            group_step = decoder._group_step
            decoder._group_step = lambda chunks, starts, slots, size, runs=1: (
                rows.extend([size] * len(chunks)) or group_step(chunks, starts, slots, size, runs)
            )
        sequences = [engine.new_sequence(p, SamplingParams(max_new_tokens=2, ignore_eos=True)) for p in prompts]
        run_as_room_allows(decoder, sequences)
        return rows

    with options.override(prefill_pieces=rule, prefill_sizes="pow2"):
        assert pieces(True) == steps
        assert pieces(False) == steps


@pytest.mark.parametrize("package", ["onnxgen-dense"], indirect=True)
def test_carried_states_are_rebound_when_nothing_records_them(package: Path) -> None:
    """With capture off a step's present state becomes the next step's past (no copy of every
    state per step); where a recording reads the buffers (capture on), the present is copied into
    them and their addresses stay."""
    from onnxgen.genai.kv_cache import CarriedStates
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    for kv in ("static", "dynamic"):
        eager = make_engine(package, kv=kv)
        captured = make_engine(package, kv=kv, capture="on", recorder=ReplayRecorder())
        assert eager._new_kv(16).states.rebind and not captured._new_kv(16).states.rebind, kv
    config = eager.config
    outputs = {s.present: torch.randn(1, *s.shape) for s in config.carried}
    rebound = CarriedStates(config, torch.float32, torch.device("cpu"), rebind=True)
    rebound.update(outputs)
    assert all(rebound.buffers[s.past] is outputs[s.present] for s in config.carried)
    fixed = CarriedStates(config, torch.float32, torch.device("cpu"))
    addresses = {name: buffer.data_ptr() for name, buffer in fixed.buffers.items()}
    fixed.update(outputs)
    assert {name: buffer.data_ptr() for name, buffer in fixed.buffers.items()} == addresses
    assert all(torch.equal(fixed.buffers[s.past], outputs[s.present]) for s in config.carried)


@pytest.mark.parametrize("package", ["onnxgen-dense"], indirect=True)
def test_a_static_cache_resets_to_zeros_in_place(package: Path) -> None:
    """reset() empties a used static cache: every KV row, every carried state (one rebound to a
    step's output included) and the mask are zeros again, in the buffers of the first step (the
    addresses a recording reads); the buffers share one block per kind, so each starts aligned and
    none overlaps another (a write to one shows in no other)."""
    from onnxgen.genai.kv_cache import VIEW_ALIGN_BYTES, StaticKV

    config = make_engine(package, kv="static").config
    assert config.carried, "the hybrid package carries states"
    kv = StaticKV(config, torch.float32, torch.device("cpu"), capacity=16, rebind_states=True)
    first = {name: t.data_ptr() for name, t in kv.feeds().items()}
    assert all(t.storage_offset() * t.element_size() % VIEW_ALIGN_BYTES == 0 for t in kv.feeds().values())
    for i, t in enumerate(kv.feeds().values()):
        t.fill_(i + 1.0)
    assert all(bool((t == i + 1.0).all()) for i, t in enumerate(kv.feeds().values())), "views overlap"
    kv.attention_mask(5)
    kv.states.update({s.present: torch.ones(1, *s.shape) for s in config.carried})
    assert {name: t.data_ptr() for name, t in kv.feeds().items()} != first  # the states were rebound
    kv.reset()
    assert {name: t.data_ptr() for name, t in kv.feeds().items()} == first
    assert all(not t.any() for t in kv.feeds().values()) and not kv.mask.any() and kv.length == 0
