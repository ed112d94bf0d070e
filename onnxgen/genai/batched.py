"""Continuous batching: many sequences decoded together, one step for all of them, joining and
leaving between steps. The engine's batched mode; the scheduler (batch_scheduler.py) drives it.

``BatchedDecoder`` keeps a KVPool (kv_pool.py: one slot per sequence, at fixed addresses) and runs
its sequences through the engine's session:

- ``admit`` queues a checked sequence (its tokens limited to what a slot holds);
- ``iterate`` runs prompt chunks of the oldest admitted sequences (each at most ``prefill_chunk``
  tokens, together at most ``prefill_budget``, so a long prompt or many new ones do not stall the
  running streams for more than that), then one decode step of every running sequence, all slots
  in one batched step; it returns the tokens read, per sequence;
- ``release`` ends a sequence (cancelled, a stop string) and frees its slot.

A prompt starts in the slot that holds its longest prefix already (kv_pool.py), and computes the
rest; a hybrid decoder's prompt that the pool marks (``snapshot_at``) has a chunk end there and
leaves a snapshot of its states for later prompts with that prefix (state_snapshots.py). Every
sequence samples with its own LogitsSampler (its own seed and counters), so what it draws does not
depend on the other sequences of the batch; the logits may, by rounding, where a kernel's
arithmetic changes with the number of rows (docs/batching.md says which).

The batched step runs the package's graph with batch = the slots it spans, each row its own
length: the past inputs are views of the pool's buffers and the attention mask says each row's
length, which GroupQueryAttention over a shared past buffer turns into per-row positions and
writes in place. Graphs whose attention concatenates its own KV cannot do that; the decoder
refuses them at construction.

Where the engine captures (CUDA graphs; a test's stand-in recorder), the step is recorded per
batch-size bucket (batch_buckets.py): a step over slots [0, hi) runs as the smallest bucket of at
least hi rows, fed the bucket's persistent tensors (a mask as wide as a slot), through the
engine's batched capture runtime, which warms, records, replays and (in verify mode) checks it
against eager like the one-sequence step. There the waiting prompts that fit one chunk run in
groups, one captured step per group (prompt_groups.py); a longer prompt runs alone as the engine's
captured prefill chunks. Elsewhere the step spans the running slots [lo, hi) only, with a mask as
wide as the longest row, eagerly, and each prompt runs alone in chunks.

The tokens of a step are read to the host at once: one argmax over the rows of every plain greedy
sequence, each other sequence's own sampler, then one read of them all.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import onnx
import torch

from onnxgen.errors import InvalidInputError, OnnxgenError
from onnxgen.genai.batch_buckets import BucketFeeds, batch_buckets, bucket_for
from onnxgen.genai.engine import DecodeEngine, padded_rows, prompt_pieces
from onnxgen.genai.kv_cache import StaticKV, past_feeds_attention_in_place
from onnxgen.genai.kv_pool import KVPool
from onnxgen.genai.package import PackageConfig
from onnxgen.genai.prompt_groups import (
    MAX_GROUP_ROWS,
    GroupFeeds,
    power_of_two_at_least,
    power_of_two_at_most,
)
from onnxgen.genai.prompt_text import PromptTooLongError
from onnxgen.genai.recorded_ops import RecordedOps
from onnxgen.genai.sampling import NON_FINITE, LogitsSampler
from onnxgen.genai.sequence import Sequence
from onnxgen.runtime.capture.stats import CaptureStats


class BatchingNotSupportedError(InvalidInputError):
    """The package's graph cannot decode several sequences of different lengths in one step."""


@dataclass(frozen=True)
class Read:
    """A token read on the host for ``sequence`` (None: the sequence ended without one to hand out,
    a stop id, or with ``error``: its own failure, e.g. non-finite logits, which ended it alone).
    After it, ``sequence.done`` says whether the sequence is over."""

    sequence: Sequence
    token_id: int | None
    error: OnnxgenError | None = None


UNREAD = -1  # a slot's content id of a token fed to a step before the host read it (matches no prompt)


@dataclass
class _Launched:
    """A captured step enqueued on the device whose tokens the host has not read yet."""

    members: list[tuple[Sequence, int]]  # (sequence, row) that step draws a token for
    host: torch.Tensor  # [rows] int64: the tokens by row, once ``ready`` has passed
    ready: torch.cuda.Event | None  # None on the CPU: the copy was done when enqueued
    errors: list[Read]  # members whose sampler failed when the step was enqueued (they have ended)
    fed: dict[Sequence, int]  # members fed a token of the step before, unread: its index in the slot's contents


DEFAULT_KV_TOKENS = 16384  # KV rows of all slots together when max_model_len is not given
CAPTURED_PREFILL_BUDGET = 2048  # prompt tokens per iteration at most, by default, where steps are captured


def batching_refusal(config: PackageConfig, model: onnx.ModelProto) -> str | None:
    """Why BatchedDecoder cannot run this decoder (None: it can), from the package's config (with
    its graph layout) and graph alone, so that a server can choose its runner before loading."""
    inputs = {v.name for v in model.graph.input}
    if not config.io.attention_mask or config.io.attention_mask not in inputs:
        return "batched decoding needs an attention_mask input (it carries each sequence's length)"
    if not past_feeds_attention_in_place(model.graph, config):
        return (
            "batched decoding needs GroupQueryAttention (com.microsoft) reading the past KV inputs directly, "
            "so that each sequence's rows are written in place at its own length; this graph's attention "
            "concatenates its own KV cache"
        )
    return None


class BatchedDecoder:
    """``max_seqs`` sequences at once, each of at most ``max_model_len`` tokens (prompt and new
    tokens; default: DEFAULT_KV_TOKENS shared by the slots, as llama.cpp's server splits its context
    among its parallel slots, at most the model's context and at least 256). Engine-thread only,
    like the engine."""

    def __init__(
        self,
        engine: DecodeEngine,
        max_seqs: int,
        max_model_len: int | None = None,
        prefill_chunk: int = 256,
        *,
        prefix_caching: bool = True,
        prefill_budget: int | None = None,
        state_snapshots: int | None = None,
    ) -> None:
        config = engine.config
        if max_seqs < 1:
            raise InvalidInputError(f"max_seqs must be >= 1, got {max_seqs}")
        if prefill_chunk < 1:
            raise InvalidInputError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        refusal = batching_refusal(config, engine.session.model)
        if refusal is not None:
            raise BatchingNotSupportedError(refusal)
        default = max(256, DEFAULT_KV_TOKENS // max_seqs)
        capacity = min(config.context_length, max_model_len or default)
        if capacity < 2:
            raise InvalidInputError(f"max_model_len must be at least 2 tokens, got {max_model_len}")
        self.engine = engine
        self.prefill_chunk = prefill_chunk
        self.captured = engine.capture != "off"
        # prompt tokens computed per iteration at most (default: two chunks; where steps are captured,
        # where prompts run in groups, CAPTURED_PREFILL_BUDGET)
        default_budget = max(2 * prefill_chunk, CAPTURED_PREFILL_BUDGET) if self.captured else 2 * prefill_chunk
        self.prefill_budget = max(prefill_chunk, prefill_budget or default_budget)
        self.pool = KVPool(
            config, engine.kv_dtype, engine.device, max_seqs, capacity,
            prefix_caching=prefix_caching, state_snapshots=state_snapshots,
        )  # fmt: skip
        self.waiting: collections.deque[Sequence] = collections.deque()  # admitted, prompt not started
        self.prefilling: Sequence | None = None  # the one whose prompt is part computed
        self.running: list[Sequence] = []  # first token read, decoding
        self._row_zero = torch.zeros(1, dtype=torch.int64, device=engine.device)
        self._rows = torch.arange(prefill_chunk, dtype=torch.int64, device=engine.device)
        self.steps = 0  # batched decode steps run
        self.stepped_rows = 0  # rows those steps computed (running sequences and idle slots between them)
        # captured steps: one recording per bucket, over the bucket's persistent feeds
        self.buckets = batch_buckets(max_seqs) if self.captured else []
        self._bucket_feeds: dict[int, BucketFeeds] = {}
        self._scratch: StaticKV | None = None  # see _scratch_from_slot
        self._runtime = engine.batched_runtime() if self.captured else None
        # overlapped captured steps (_launch, _collect): each step's tokens by row, on the device, and
        # two host buffers the tokens of consecutive steps are copied into
        self._inflight: _Launched | None = None
        # prompts done whose first token is on the device, not read yet: fed to the next step from
        # _tokens[slot], read with that step's launch (_prompt_done)
        self._fresh: dict[Sequence, int] = {}  # sequence -> its slot (= its row in _tokens)
        self._fresh_reads: list[_Launched] = []
        pinned = engine.device.type == "cuda"
        self._fresh_host = torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pinned)
        self._tokens = torch.zeros(max_seqs, dtype=torch.int64, device=engine.device)
        self._host_tokens = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        # an all-greedy step's argmax and host copy as recorded ops (_greedy_to_host), and the events
        # that say when each host buffer's copy is done (reused: a buffer is read before its next use)
        self._greedy_ops: dict[tuple[int, int], tuple[tuple, RecordedOps]] = {}
        self._copied = [torch.cuda.Event() for _ in range(2)] if pinned else []
        # a hybrid's captured steps: each bucket's state write-back as recorded ops (_states_back)
        self._state_ops: dict[int, tuple[tuple[int, ...], RecordedOps]] = {}
        # prompt groups (prompt_groups.py): a scratch cache of group_rows sequences, feeds per (rows, size),
        # each group's first tokens on the device and a pinned host buffer per group of an iteration
        self.group_rows = power_of_two_at_most(min(max_seqs, MAX_GROUP_ROWS))
        self._group_scratch: StaticKV | None = None
        self._group_feeds: dict[tuple[int, int], GroupFeeds] = {}
        self._group_runtime = engine.batched_runtime("batched prompt groups") if self.captured else None
        self._group_tokens = torch.zeros(self.group_rows, dtype=torch.int64, device=engine.device)
        self._group_hosts: list[torch.Tensor] = []
        self.prompt_groups = 0  # groups run
        self.grouped_prompts = 0  # prompts computed in them

    # -- sequences -------------------------------------------------------------------------

    @property
    def max_seqs(self) -> int:
        return self.pool.slots

    @property
    def capture_stats(self) -> CaptureStats:
        """The captured batched steps' statistics (``steps``: batched steps; mode off when eager)."""
        if self._runtime is None:
            return CaptureStats(mode="off", what="batched decode steps")
        return self._runtime.stats

    @property
    def prompt_capture_stats(self) -> CaptureStats:
        """The captured prompt groups' statistics (``steps``: groups run; mode off when eager)."""
        if self._group_runtime is None:
            return CaptureStats(mode="off", what="batched prompt groups")
        return self._group_runtime.stats

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def admitted(self) -> int:
        """Sequences admitted and not over (waiting, prefilling, prompted with the first token not
        read yet, or running)."""
        return len(self.waiting) + (self.prefilling is not None) + len(self._fresh) + len(self.running)

    @property
    def room(self) -> int:
        """Sequences that may still be admitted now (each will have a slot)."""
        return self.pool.slots - self.admitted

    def admit(self, sequence: Sequence) -> None:
        """Queues ``sequence`` (from engine.new_sequence) for its prompt; its new tokens are cut to
        what a slot leaves room for. Raises PromptTooLongError if the prompt fills a slot."""
        if self.room < 1:
            raise RuntimeError("no room for another sequence: admit only while room > 0")
        room = self.pool.capacity - len(sequence.prompt_ids)
        if room < 1:
            raise PromptTooLongError(
                f"the prompt has {len(sequence.prompt_ids)} tokens, but a sequence may hold {self.pool.capacity} "
                "(prompt plus at least one new token; the server's --max-model-len)"
            )
        if sequence.max_new_tokens > room:
            sequence.max_new_tokens = room
            sequence.limit_reason = "length"
        sequence.stats.kv = self.pool.kind
        self.waiting.append(sequence)

    def release(self, sequence: Sequence, reason: str = "cancelled") -> None:
        """Ends ``sequence`` where it is (``reason`` if it is not done) and frees its slot; its rows
        stay in the slot for later prompts with the same prefix."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        if self.prefilling is sequence:
            self.prefilling = None
        if sequence in self.running:
            self.running.remove(sequence)
        self._fresh.pop(sequence, None)
        if sequence.slot is not None:
            self.pool.release(sequence.slot)
            sequence.slot = None
        self.engine.release([sequence], reason)

    def shapes_to_record(self) -> tuple[list[int], list[tuple[int, int]]]:
        """The decode buckets and the prompt-group shapes (rows, size) this decoder can run captured."""
        if not self.captured:
            return [], []
        engine = self.engine
        # the sizes _group_size can give (a prompt's rest padded up) that fit a slot and the budget
        if not self._groups_take_carried():  # a hybrid's prompts run alone (_group_size)
            return list(self.buckets), []
        rest = min(self.prefill_chunk, engine.captured_prefill_max)
        padded = power_of_two_at_least(rest, engine.captured_prefill_min)
        largest = min(padded, self.pool.capacity, self.prefill_budget)
        groups = []
        size = engine.captured_prefill_min
        while size <= largest:
            rows = 1
            while rows <= min(self.group_rows, power_of_two_at_most(self.prefill_budget // size)):
                groups.append((rows, size))
                rows *= 2
            size *= 2
        return list(self.buckets), groups

    def record_shapes(self, runs: int = 3) -> int:
        """Where steps are captured, every decode bucket and prompt-group shape run ``runs`` times
        on dummy feeds (the capture runtime warms a shape twice, then records it), so that no
        request pays a shape's warm-ups and recording later. Only while the pool holds nothing:
        the dummy steps write row 0 of the slots and rows of the scratch. Returns the shapes run."""
        buckets, groups = self.shapes_to_record()
        if self.admitted or any(self.pool.contents):
            raise RuntimeError("record_shapes runs before any sequence: the pool must hold nothing")
        with torch.inference_mode():
            for rows in buckets:
                self._bucket_step(rows, [0] * rows, [1] * rows, runs=runs)
            for rows, size in groups:
                self._group_step([[0] * size] * rows, [0] * rows, [0] * rows, size, runs=runs)
        return len(buckets) + len(groups)

    # -- the loop --------------------------------------------------------------------------

    def iterate(self) -> list[Read]:
        """Prompt work up to ``prefill_budget`` tokens (groups of waiting prompts where steps are
        captured, else chunks of one prompt at a time, oldest first), then one batched decode step
        (if any sequence runs). A sequence that ends is released here (its slot freed)."""
        reads: list[Read] = []
        with torch.inference_mode():
            budget = self.prefill_budget
            while (self.prefilling is not None or self.waiting) and budget > 0:
                found = self._next_group(budget) if self.captured and self.prefilling is None else ([], 0)
                if found is None:  # the next group does not fit what is left of the budget
                    break
                group, size = found
                if group:
                    reads += self._run_group(group, size)
                    budget -= power_of_two_at_least(len(group)) * size
                    continue
                chunk_reads, computed = self._prefill_chunk(budget)
                reads += chunk_reads
                budget -= computed
            if self.captured:
                launched = self._launch() if self.running or self._fresh else None
                if self._inflight is not None:
                    reads += self._collect(self._inflight, launched)
                for fresh in self._fresh_reads:
                    reads += self._collect(fresh, launched)
                    for sequence, _ in fresh.members:
                        self._fresh.pop(sequence, None)
                self._fresh_reads = []
                self._inflight = launched
            elif self.running:
                reads += self._step()
        return reads

    def _prefill_chunk(self, budget: int) -> tuple[list[Read], int]:
        """One chunk (at most ``budget`` tokens) of the prompt being computed, or of the next
        admitted one; returns its reads (the first token, when the prompt is done) and the prompt
        tokens it computed."""
        engine = self.engine
        sequence = self.prefilling
        if sequence is None:
            sequence = self.prefilling = self.waiting.popleft()
            self._start(sequence)
            if self.captured:
                self._scratch_from_slot(sequence)
        slot = sequence.slot
        assert slot is not None
        prompt = sequence.prompt_ids
        lo = sequence.prefilled
        hi = min(len(prompt), lo + min(self.prefill_chunk, budget))
        point = self.pool.snapshot_at[slot]  # a hybrid's chunk ends where its states are kept (kv_pool.py)
        if lo < point < hi:
            hi = point
        if self.captured:
            return self._prefill_chunk_captured(sequence, lo, hi), hi - lo
        # a hybrid's chunk as the captured path runs it (engine._prefill_padded): padded where its
        # states stop at a row, else in pieces (engine._prefill_pieces); split or padded otherwise it
        # would round otherwise, and the capture setting would change the tokens
        rule = engine.carried_chunks() if engine.config.carried else "whole"
        start = lo
        for piece in prompt_pieces(hi - lo) if rule == "pieces" else [hi - lo]:
            logits = self._prefill_piece(sequence, start, start + piece, padded=rule == "padded")
            start += piece
        sequence.prefilled = hi
        if hi == point:
            self._keep_snapshot(sequence, {name: state[slot] for name, state in self.pool.states.items()})
        if hi < len(prompt):
            return [], hi - lo
        self.prefilling = None
        return [self._sample_and_read(sequence, logits)], hi - lo

    def _prefill_piece(self, sequence: Sequence, lo: int, hi: int, *, padded: bool = False) -> torch.Tensor:
        """Prompt rows ``lo`` .. ``hi`` of the sequence run uncaptured in its slot; returns the last
        row's logits. ``padded``: more than one row runs padded at its end as the engine's padded
        chunks are (engine._prefill_padded: padded_rows, where the slot has the room); the padding's
        KV rows lie past the slot's contents, masked from later steps and overwritten by them, and
        the carried states stop at the last real row."""
        engine = self.engine
        slot = sequence.slot
        assert slot is not None
        n = hi - lo
        size = n
        if padded and n > 1:
            size = padded_rows(n, engine.captured_prefill_min)
            size = size if lo + size <= self.pool.capacity else n
        io = engine.config.io
        device = engine.device
        ids = sequence.prompt_ids[lo:hi] + [0] * (size - n)
        feeds = {
            io.input_ids: torch.tensor([ids], dtype=torch.int64, device=device),
            io.attention_mask: torch.ones((1, lo + size), dtype=torch.int64, device=device),
        }
        if engine.has_positions:
            positions = torch.arange(lo, lo + size, dtype=torch.int64, device=device).reshape(1, size)
            feeds[io.position_ids] = engine.positions_feed(positions)
        feeds.update(engine.row_feeds(self._rows[n - 1 : n]))
        past = self.pool.slot_feeds(slot)
        feeds.update(past)
        outputs = engine.session.run_torch(feeds)
        self._keep_in_place(outputs, past)
        self._keep_states(outputs, past, None)
        self.pool.contents[slot].extend(sequence.prompt_ids[lo:hi])
        return outputs[io.logits][0, 0 if engine.logits_row is not None else n - 1]

    def _start(self, sequence: Sequence) -> None:
        """The sequence's slot (its longest held prefix reused), once: a sequence looked at for a
        prompt group keeps the slot it got while it waits for a later one."""
        if sequence.slot is not None:
            return
        running = [s.slot for s in self.running if s.slot is not None]
        if self.captured:  # a step spans the bucket of [0, hi): keep the slots low
            span = range(bucket_for(self.buckets, max(running) + 1) if running else 0)
        else:
            span = range(min(running), max(running) + 1) if running else range(0)
        hits = self.pool.snapshot_hits
        sequence.slot, sequence.prefilled = self.pool.acquire(sequence.prompt_ids, span, lowest_first=self.captured)
        sequence.stats.cached_tokens = sequence.prefilled
        sequence.stats.snapshot_hits = self.pool.snapshot_hits - hits
        sequence.started_at = time.perf_counter()
        if sequence.sampler.plan.penalize:  # the prompt's ids counted (a copy that waits for the device)
            sequence.sampler.observe(torch.tensor([sequence.prompt_ids], dtype=torch.int64, device=self.engine.device))

    def _keep_snapshot(self, sequence: Sequence, states: dict[str, torch.Tensor]) -> None:
        """A hybrid's prompt has reached its slot's ``snapshot_at``: ``states`` (name -> its states
        now, in its slot or its scratch cache) kept as the snapshot of its prompt so far. A copy on
        the host's stream, between steps, into buffers allocated with the pool."""
        slot = sequence.slot
        assert slot is not None
        self.pool.keep_snapshot(slot, sequence.prompt_ids[: sequence.prefilled], states)
        sequence.stats.snapshot_takes += 1

    # -- captured prompts in groups (prompt_groups.py) -------------------------------------------

    def _groups_take_carried(self) -> bool:
        """Prompts of this graph may run in groups: it carries no states, or its carried states stop
        at each row's last real row (engine.carried_chunks ``padded``: the state row input), so a
        row's padding never folds into them."""
        return not self.engine.config.carried or self.engine.carried_chunks() == "padded"

    def _group_size(self, sequence: Sequence) -> int | None:
        """The padded chunk size of the sequence's prompt in a group; None if what is left of it
        does not fit one chunk (or its padding the slot), or, for a graph with carried states, if
        its chunks must end where the slot keeps a snapshot of them (kv_pool.py) or cannot be
        padded: it runs alone, in chunks."""
        engine = self.engine
        rest = len(sequence.prompt_ids) - sequence.prefilled
        if rest > min(self.prefill_chunk, engine.captured_prefill_max):
            return None
        if not self._groups_take_carried() or self.pool.snapshot_at[sequence.slot]:  # type: ignore[index]
            return None  # snapshot_at: a hybrid's chunk ends where its slot keeps its states (kv_pool.py)
        size = power_of_two_at_least(rest, engine.captured_prefill_min)
        return size if sequence.prefilled + size <= self.pool.capacity else None

    def _next_group(self, budget: int) -> tuple[list[Sequence], int] | None:
        """The waiting sequences (taken off the queue) whose prompts run as the next group, and
        their chunk size: the oldest and those after it of the same size, as many as ``budget``
        tokens and the group rows allow. No sequences when the oldest runs alone (a prompt of
        several chunks); None when its group would not fit ``budget``."""
        head = self.waiting[0]
        self._start(head)
        size = self._group_size(head)
        if size is None:
            return [], 0
        if size > budget:
            return None
        limit = min(self.group_rows, power_of_two_at_most(budget // size))
        group = [head]
        for sequence in list(self.waiting)[1:limit]:
            self._start(sequence)
            if self._group_size(sequence) != size:
                break
            group.append(sequence)
        for _ in group:
            self.waiting.popleft()
        return group, size

    def _run_group(self, group: list[Sequence], size: int) -> list[Read]:
        """One step computing the prompts of ``group`` (prompt_groups.py), their rows copied into
        their slots; their first tokens are drawn on the device and read with the next step's
        launch, like a lone prompt's (_prompt_done)."""
        engine = self.engine
        pool = self.pool
        scratch = self._groups_scratch()
        count = len(group)
        rows = power_of_two_at_least(count)
        if engine.config.carried:  # a hybrid's rows start from zeros, or from their slot's states (_copy_prefix)
            torch._foreach_zero_([buffer[:rows] for buffer in scratch.states.buffers.values()])
        for b, sequence in enumerate(group):
            if sequence.prefilled:
                self._copy_prefix(sequence, scratch, b)
        chunks = [s.prompt_ids[s.prefilled :] for s in group]
        slots = [s.slot for s in group]
        assert all(slot is not None for slot in slots)
        feeds_of, outputs = self._group_step(chunks, [s.prefilled for s in group], slots, size)  # type: ignore[arg-type]
        end = max(s.prefilled for s in group) + size
        slot_rows = feeds_of.slots[:count]
        for name, buffer in pool.buffers.items():
            buffer[:, :, :end].index_copy_(0, slot_rows, scratch.buffers[name][:count, :, :end])
        if engine.config.carried:  # each row's states stopped at its last real row
            for spec in engine.config.carried:
                pool.states[spec.past].index_copy_(0, slot_rows, outputs[spec.present][:count])
            for slot in slots:
                pool.state_held[slot] = True  # type: ignore[index]
        for sequence in group:
            contents = pool.contents[sequence.slot]  # type: ignore[index]
            contents.extend(sequence.prompt_ids[len(contents) :])
            sequence.prefilled = len(sequence.prompt_ids)
        self.prompt_groups += 1
        self.grouped_prompts += count
        logits = outputs[engine.config.io.logits]
        if engine.logits_row is None:  # every row's logits: each prompt's own last row
            index = feeds_of.last.view(rows, 1, 1).expand(rows, 1, logits.shape[-1])
            logits = logits.gather(1, index)
        return self._group_done(group, logits, slot_rows)

    def _group_step(
        self, chunks: list[list[int]], starts: list[int], slots: list[int], size: int, runs: int = 1
    ) -> tuple[GroupFeeds, dict[str, torch.Tensor]]:
        """The group step itself (in the scratch cache): its feeds and its outputs."""
        engine = self.engine
        scratch = self._groups_scratch()
        rows = power_of_two_at_least(len(chunks))
        feeds_of = self._group_feeds.get((rows, size))
        if feeds_of is None:
            io = engine.config.io
            feeds_of = self._group_feeds[(rows, size)] = GroupFeeds(
                scratch, rows, size, input_ids=io.input_ids, attention_mask=io.attention_mask,
                position_ids=io.position_ids if engine.has_positions else None, row_inputs=engine.row_inputs,
                position_streams=engine.config.position_streams,
            )  # fmt: skip
        feeds = feeds_of.fill(chunks, starts, slots)
        if not feeds_of.checked:
            engine.session.check_feeds_repeated(feeds)
            feeds_of.checked = True
        assert self._group_runtime is not None
        for _ in range(runs):
            outputs = self._group_runtime.run(feeds)
            self._keep_in_place(outputs, feeds)
        return feeds_of, outputs

    def _copy_prefix(self, sequence: Sequence, scratch: StaticKV, row: int) -> None:
        """The sequence's reused prefix rows (``prefilled``) from its slot into row ``row`` of a scratch
        cache, and a hybrid slot's states (a prefix is reused with the slot's states whole: kv_pool.py)."""
        reused = sequence.prefilled
        for name, buffer in self.pool.buffers.items():
            scratch.buffers[name][row, :, :reused].copy_(buffer[sequence.slot, :, :reused])
        for name, state in self.pool.states.items():
            scratch.states.buffers[name][row].copy_(state[sequence.slot])

    def _groups_scratch(self) -> StaticKV:
        """The prompt groups' scratch cache of ``group_rows`` sequences (made on first use)."""
        if self._group_scratch is None:
            engine = self.engine
            self._group_scratch = StaticKV(
                engine.config, engine.kv_dtype, engine.device, self.pool.capacity, batch=self.group_rows
            )
        return self._group_scratch

    def _group_done(self, group: list[Sequence], logits: torch.Tensor, slot_rows: torch.Tensor) -> list[Read]:
        """The group's first tokens, drawn into ``_tokens`` at the sequences' slots and copied
        towards the host, read after the next step is enqueued (iterate); one pinned host buffer
        per group of an iteration (all are read before the iteration ends)."""
        members = list(zip(group, range(len(group))))
        errors = self._sample_into(members, logits, self._group_tokens)
        ended = {read.sequence for read in errors}
        count = len(group)
        self._tokens.index_copy_(0, slot_rows, self._group_tokens[:count])
        turn = len(self._fresh_reads)
        while len(self._group_hosts) <= turn:
            pinned = self.engine.device.type == "cuda"
            self._group_hosts.append(torch.zeros(self.group_rows, dtype=torch.int64, pin_memory=pinned))
        host = self._group_hosts[turn]
        ready = self._to_host(host[:count], self._group_tokens[:count])
        live = [(s, b) for s, b in members if s not in ended]
        for sequence, _ in live:
            self._fresh[sequence] = sequence.slot  # type: ignore[assignment]
        self._fresh_reads.append(_Launched(live, host, ready, [], {}))
        return errors

    # -- captured prompts: in a one-sequence static cache, then copied into the slot -------------

    def _scratch_from_slot(self, sequence: Sequence) -> None:
        """Where steps are captured, a prompt runs as the engine's captured prefill chunks
        (engine._prefill_padded: padded chunk sizes, a few recordings for every length) over one
        static cache of a slot's capacity, kept at fixed addresses for those recordings; the rows
        it computes are copied into the slot when the prompt is done. Its reused prefix is copied
        from the slot first. The slot's ``contents`` grow only with that last copy, so no other
        prompt reuses rows that are not there yet."""
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = StaticKV(
                self.engine.config, self.engine.kv_dtype, self.engine.device, self.pool.capacity
            )
        scratch.reset(zero_rows=False)  # rows past the mask are never read; the mask is cleared
        reused = sequence.prefilled
        if reused:
            self._copy_prefix(sequence, scratch, 0)
            scratch.mask[:, :reused] = 1
            scratch.length = reused
        sequence.kv = scratch

    def _prefill_chunk_captured(self, sequence: Sequence, lo: int, hi: int) -> list[Read]:
        engine = self.engine
        prompt = sequence.prompt_ids
        ids = torch.tensor([prompt[lo:hi]], dtype=torch.int64, device=engine.device)
        logits = engine._prefill_padded(sequence, ids)
        sequence.prefilled = hi
        scratch, slot = sequence.kv, sequence.slot
        assert isinstance(scratch, StaticKV) and slot is not None
        if hi == self.pool.snapshot_at[slot]:
            self._keep_snapshot(sequence, {name: buffer[0] for name, buffer in scratch.states.buffers.items()})
        if hi < len(prompt):
            return []
        start = len(self.pool.contents[slot])
        for name, buffer in self.pool.buffers.items():
            buffer[slot, :, start:hi].copy_(scratch.buffers[name][0, :, start:hi])
        for name, state in self.pool.states.items():
            state[slot].copy_(scratch.states.buffers[name][0])
        self.pool.contents[slot].extend(prompt[start:hi])
        self.pool.state_held[slot] = True  # a step that ran meanwhile wrote a dummy row into the old ones
        sequence.kv = None
        self.prefilling = None
        return self._prompt_done(sequence, logits)

    def _prompt_done(self, sequence: Sequence, logits: torch.Tensor) -> list[Read]:
        """The first token of a prompt computed in captured chunks, drawn on the device into
        ``_tokens`` at the sequence's slot (a row no step in flight draws for: it was prompting),
        copied towards the host and read after the next step is enqueued (iterate): the host does
        not wait for the prompt here, and the next step is fed the token from the device."""
        slot = sequence.slot
        assert slot is not None
        try:
            token = self.engine._sample(sequence, logits, None)
        except OnnxgenError as exc:
            self.release(sequence, "error")
            return [Read(sequence, None, exc)]
        self._tokens[slot].copy_(token)
        ready = self._to_host(self._fresh_host[slot], self._tokens[slot])
        self._fresh[sequence] = slot
        self._fresh_reads.append(_Launched([(sequence, slot)], self._fresh_host, ready, [], {}))
        return []

    def _step(self) -> list[Read]:
        """One uncaptured decode step of every running sequence (the captured ones: _launch), read
        before it returns: the rows of slots [lo, lo + rows). A slot there
        that is not running (free, or holding a prompt part computed) is fed a dummy token that
        writes the row just past what it holds, which nothing reads (a prompt's next chunk writes it
        again)."""
        engine = self.engine
        pool = self.pool
        by_slot = {s.slot: s for s in self.running}
        lo = min(by_slot)
        rows = max(by_slot) + 1 - lo
        ids = [0] * rows
        ends = [len(pool.contents[slot]) + 1 for slot in range(lo, lo + rows)]  # each row's length after the step
        for slot, sequence in by_slot.items():
            ids[slot - lo] = sequence.generated[-1]
        for sequence in self.running:
            if sequence.token is not None:  # the penalties count the token fed now
                sequence.sampler.observe(sequence.token.reshape(1))
        feeds = self._eager_feeds(ids, ends)
        past = pool.range_feeds(lo, lo + rows)
        feeds.update(past)
        outputs = engine.session.run_torch(feeds)
        self._keep_in_place(outputs, past)
        self._keep_states(outputs, past, [slot - lo for slot in sorted(by_slot)])
        self.steps += 1
        self.stepped_rows += rows
        order = sorted(by_slot.items())
        for slot, sequence in order:
            pool.contents[slot].append(sequence.generated[-1])
        logits = outputs[engine.config.io.logits]
        return self._sample_rows([(sequence, slot - lo) for slot, sequence in order], logits)

    # -- captured steps, overlapped with the host's work -----------------------------------------

    def _launch(self) -> _Launched | None:
        """Enqueues one captured step of every running sequence that may still need a token, before
        the tokens of the step in flight are read: a sequence in that step is fed its token straight
        from the device (``_tokens``), the others (their first token came from their prompt) from
        the host. The host's reading and handing out of one step's tokens thus runs while the
        device computes the next. A sequence that turns out to have ended in the step in flight (a
        stop id, a stop string, a cancel) has its row in this one computed for nothing: the row
        lands just past what its slot holds, as an idle row's would. Returns None if no sequence
        needs a step."""
        engine = self.engine
        pool = self.pool
        inflight = self._inflight
        previous = {s: row for s, row in inflight.members} if inflight is not None else {}
        previous.update(self._fresh)  # a prompt's first token, unread, at its slot's row of _tokens
        members = {
            s.slot: s
            for s in (*self.running, *self._fresh)
            if s.slot is not None and s.stats.new_tokens + (s in previous) < s.max_new_tokens
        }
        if not members:
            return None
        rows = bucket_for(self.buckets, max(members) + 1)
        ids, sources = [0] * rows, [-1] * rows
        ends = [len(pool.contents[slot]) + 1 for slot in range(rows)]  # each row's length after the step
        fed: dict[Sequence, int] = {}
        for slot, sequence in members.items():
            row = previous.get(sequence)
            if sequence.sampler.plan.penalize:  # the penalties count the token fed now
                token = self._tokens[row] if row is not None else sequence.token
                if token is not None:
                    sequence.sampler.observe(token.reshape(1))
            if row is not None:
                sources[slot] = row
                fed[sequence] = len(pool.contents[slot])
                pool.contents[slot].append(UNREAD)
            else:
                ids[slot] = sequence.generated[-1]
                pool.contents[slot].append(sequence.generated[-1])
        outputs = self._bucket_step(rows, ids, ends, sources)
        if engine.config.carried:
            self._states_back(rows, outputs)
            for slot in range(rows):  # a dummy row went into these slots' states
                if slot not in members:
                    pool.state_held[slot] = False
        self.steps += 1
        self.stepped_rows += rows
        ordered = [(sequence, slot) for slot, sequence in sorted(members.items())]
        logits = outputs[engine.config.io.logits]
        turn = self.steps % 2
        host = self._host_tokens[turn][:rows]
        if all(self._plain_greedy(s) for s, _ in ordered):
            for sequence, _ in ordered:
                sequence.sampled += 1
            self._greedy_to_host(logits, host)
            errors: list[Read] = []
            ready = self._copied[turn] if self._copied else None
            if ready is not None:
                ready.record()
        else:
            errors = self._sample_into(ordered, logits)
            ready = self._to_host(host, self._tokens[:rows])
        ended = {read.sequence for read in errors}
        return _Launched([(s, r) for s, r in ordered if s not in ended], host, ready, errors, fed)

    def _bucket_step(
        self, rows: int, ids: list[int], ends: list[int], sources: list[int] | None = None, runs: int = 1
    ) -> dict[str, torch.Tensor]:
        """The captured step of bucket ``rows`` over its persistent feeds (BucketFeeds.fill),
        ``runs`` times; its outputs."""
        bucket = self._feeds_of(rows)
        feeds = bucket.fill(ids, ends, sources)
        if not bucket.checked:  # the same tensors every step: their names, shapes and dtypes hold
            self.engine.session.check_feeds_repeated(feeds)
            bucket.checked = True
        assert self._runtime is not None
        for _ in range(runs):
            outputs = self._runtime.run(feeds)
            self._keep_in_place(outputs, feeds)
        return outputs

    def _greedy_to_host(self, logits: torch.Tensor, host: torch.Tensor) -> None:
        """Every row's argmax (NON_FINITE where its maximum is not finite) into ``_tokens`` and
        copied into ``host`` (pinned), as recorded ops: one per logits tensor and host buffer, which
        keep their addresses from step to step of a bucket (the recorded step's output). One per
        bucket and host buffer is kept: logits at another address (an eager warm-up's) replace it,
        so no earlier logits tensor is held alive."""
        slot = (host.shape[0], host.data_ptr())
        key = (logits.data_ptr(), tuple(logits.shape), logits.stride())
        entry = self._greedy_ops.get(slot)
        if entry is not None and entry[0] == key:
            ops = entry[1]
        else:
            rows, tokens = logits.shape[0], self._tokens

            def argmax_to_host() -> None:
                self._argmax_rows(logits, tokens)
                host.copy_(tokens[:rows], non_blocking=True)

            ops = RecordedOps(argmax_to_host, self.engine.device)
            self._greedy_ops[slot] = (key, ops)
        ops()

    def _to_host(self, host: torch.Tensor, device: torch.Tensor) -> torch.cuda.Event | None:
        """Copies ``device`` into ``host`` (pinned on CUDA) in stream order, without waiting; the
        event that says when the copy is done (None on the CPU, where it is done at once)."""
        if self.engine.device.type != "cuda":
            host.copy_(device)
            return None
        host.copy_(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def _collect(self, launched: _Launched, following: _Launched | None) -> list[Read]:
        """The tokens of ``launched`` read and handed out; in the slot contents of ``following`` (the
        step enqueued since, fed those tokens) their ids replace the UNREAD marks."""
        reads = list(launched.errors)
        if launched.ready is not None:
            launched.ready.synchronize()
        tokens = launched.host.tolist()
        fed = following.fed if following is not None else {}
        for sequence, row in launched.members:
            if sequence.done or sequence.slot is None:  # released meanwhile
                continue
            token_id = tokens[row]
            at = fed.get(sequence)
            if at is not None and token_id >= 0:
                self.pool.contents[sequence.slot][at] = token_id
            reads.append(self._read_checked(sequence, token_id, launched.host[row : row + 1]))
        return reads

    def _sample_into(
        self, members: list[tuple[Sequence, int]], logits: torch.Tensor, out: torch.Tensor | None = None
    ) -> list[Read]:
        """Each member's next token from its row of ``logits`` [batch, 1, vocab] into ``out``
        (default ``_tokens``) at that row (device work, no host read): the plain greedy ones (no
        logprobs, nothing banned) by one argmax over their rows, the others by their own samplers;
        NON_FINITE where a row's logits are not finite. Returns the members whose sampler raised
        (released here)."""
        out = self._tokens if out is None else out
        engine = self.engine
        errors: list[Read] = []
        if any(self._plain_greedy(s) for s, _ in members):
            # every row's argmax (idle rows' too: cheaper than gathering the members' rows, which
            # would need their indices on the device); the other members' rows are written below
            self._argmax_rows(logits, out)
        for sequence, row in members:
            if self._plain_greedy(sequence):
                sequence.sampled += 1
                continue
            try:
                out[row].copy_(engine._sample(sequence, logits[row, 0], None))
            except OnnxgenError as exc:
                self.release(sequence, "error")
                errors.append(Read(sequence, None, exc))
        return errors

    def _eager_feeds(self, ids: list[int], ends: list[int]) -> dict[str, torch.Tensor]:
        """An uncaptured step's feeds but the past: the mask as wide as the longest row."""
        engine = self.engine
        device = engine.device
        io = engine.config.io
        rows, width = len(ids), max(ends)
        mask = torch.arange(width).expand(rows, width) < torch.tensor(ends)[:, None]
        feeds = {
            io.input_ids: torch.tensor(ids, dtype=torch.int64, device=device).reshape(rows, 1),
            io.attention_mask: mask.to(device=device, dtype=torch.int64),
        }
        if engine.has_positions:
            positions = (torch.tensor(ends, dtype=torch.int64) - 1).reshape(rows, 1).to(device)
            feeds[io.position_ids] = engine.positions_feed(positions)
        feeds.update(engine.row_feeds(self._row_zero))
        return feeds

    def _feeds_of(self, rows: int) -> BucketFeeds:
        feeds = self._bucket_feeds.get(rows)
        if feeds is None:
            engine = self.engine
            io = engine.config.io
            extra = engine.row_feeds(self._row_zero)
            feeds = self._bucket_feeds[rows] = BucketFeeds(
                self.pool, rows, input_ids=io.input_ids, attention_mask=io.attention_mask,
                position_ids=io.position_ids if engine.has_positions else None, extra=extra, carried=self._tokens,
                position_streams=engine.config.position_streams,
            )  # fmt: skip
        return feeds

    def _sample_rows(self, members: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[Read]:
        """Each member's next token (``_sample_into``), read to the host in one read and handed out.
        A sequence whose logits are not finite ends alone."""
        reads = self._sample_into(members, logits)
        ended = {read.sequence for read in reads}
        tokens = self._tokens[: logits.shape[0]]
        values = tokens.tolist()
        for sequence, row in members:
            if sequence not in ended:
                reads.append(self._read_checked(sequence, values[row], tokens[row : row + 1].clone()))
        return reads

    def _argmax_rows(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """Every row's argmax of ``logits`` [rows, 1, vocab] into ``out[:rows]``, NON_FINITE where
        the row's maximum is not finite (device work only)."""
        value, token = torch.max(logits[:, 0, : self.engine.config.vocab_size], dim=-1)
        out[: logits.shape[0]].copy_(torch.where(torch.isfinite(value), token, NON_FINITE))

    @classmethod
    def _plain_greedy(cls, sequence: Sequence) -> bool:
        """Whether the sequence's token is the plain argmax of its row (no sampler of its own)."""
        return sequence.sampler.plain_greedy and not cls._needs_own_sampler(sequence)

    @staticmethod
    def _needs_own_sampler(sequence: Sequence) -> bool:
        """Whether the sequence's token needs engine._sample (logprobs, stop ids still banned)."""
        params = sequence.sampler.params
        banning = sequence.sampler.banned is not None and sequence.sampled < params.min_tokens
        return params.logprobs is not None or banning

    def _sample_and_read(self, sequence: Sequence, logits: torch.Tensor) -> Read:
        """The sequence's next token from its logits row, read; a failure of its own (non-finite
        logits) ends this sequence only, not the batch."""
        try:
            token = self.engine._sample(sequence, logits, None)
        except OnnxgenError as exc:
            self.release(sequence, "error")
            return Read(sequence, None, exc)
        return self._read_checked(sequence, int(token), token)

    def _read_checked(self, sequence: Sequence, token_id: int, token: torch.Tensor) -> Read:
        try:
            LogitsSampler.check(token_id)
        except OnnxgenError as exc:
            self.release(sequence, "error")
            return Read(sequence, None, exc)
        return self._read(sequence, token_id, token)

    def _keep_in_place(self, outputs: dict[str, torch.Tensor], past: dict[str, torch.Tensor]) -> None:
        """GroupQueryAttention over a shared buffer returns the past views as present; were a
        present output a new tensor, its rows are copied back into the pool."""
        config = self.engine.config
        for layer in config.kv_layer_ids:
            for past_name, present_name in (
                (config.past_key_name(layer), config.present_key_name(layer)),
                (config.past_value_name(layer), config.present_value_name(layer)),
            ):
                out, view = outputs[present_name], past[past_name]
                if out.data_ptr() != view.data_ptr():
                    view.copy_(out[:, :, : view.shape[2]])

    def _states_back(self, rows: int, outputs: dict[str, torch.Tensor]) -> None:
        """A captured step's carried states into the pool, every row of bucket ``rows``, as recorded
        ops (one per bucket, over the recording's outputs). Idle rows too: where steps are captured a
        prompt is computed in a scratch cache and lands in its slot, states included, when it is
        done (its slot taken just before), so no slot of the bucket holds a state a running
        sequence needs; a free slot's held states are marked as gone (_launch)."""
        carried = self.engine.config.carried
        feeds = self._feeds_of(rows).feeds
        pairs = [(outputs[s.present], feeds[s.past]) for s in carried]
        key = tuple(out.data_ptr() for out, _ in pairs)
        entry = self._state_ops.get(rows)
        if entry is None or entry[0] != key:

            def copy_back() -> None:
                for out, view in pairs:
                    view.copy_(out)

            entry = self._state_ops[rows] = (key, RecordedOps(copy_back, self.engine.device))
        entry[1]()

    def _keep_states(
        self, outputs: dict[str, torch.Tensor], past: dict[str, torch.Tensor], rows: list[int] | None
    ) -> None:
        """A hybrid decoder's carried states after a step, copied into the pool: every row of the
        step (``rows`` None) or only ``rows``, the running sequences'. An idle slot's row and a
        slot whose prompt is part computed were fed a dummy token, which a state, unlike a KV
        cache, would keep: their states stay as they were."""
        for state in self.engine.config.carried:
            out, view = outputs[state.present], past[state.past]
            if rows is None or len(rows) == view.shape[0]:
                view.copy_(out)
            else:
                index = torch.tensor(rows, dtype=torch.int64, device=view.device)
                view.index_copy_(0, index, out.index_select(0, index))

    def _read(self, sequence: Sequence, token_id: int, token: torch.Tensor) -> Read:
        """The sampled token (``token_id`` read on the host from ``token``, checked finite): handed
        out, or the end of the sequence."""
        stats = sequence.stats
        stats.count_token(sequence.started_at)
        if token_id in sequence.stop_ids:
            self._retire(sequence, "eos")
            return Read(sequence, None)
        self.engine._took(sequence, token_id)
        sequence.token = token
        if sequence not in self.running:
            self.running.append(sequence)
        if stats.new_tokens >= sequence.max_new_tokens:
            self._retire(sequence, sequence.limit_reason)
        return Read(sequence, token_id)

    def _retire(self, sequence: Sequence, reason: str) -> None:
        sequence.finish(reason)
        self.release(sequence, reason)
