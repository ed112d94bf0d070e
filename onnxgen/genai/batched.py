"""Continuous batching: many sequences decoded together, one step for all of them, joining and
leaving between steps. The engine's batched mode; the scheduler (batch_scheduler.py) drives it.

``BatchedDecoder`` keeps a KVPool (kv_pool.py: one slot per sequence, at fixed addresses) and runs
its sequences through the engine's session:

- ``admit`` queues a checked sequence (its tokens limited to what a slot holds);
- ``iterate`` runs one prompt chunk of the oldest admitted sequence (at most ``prefill_chunk``
  tokens, so a long prompt does not stall the running streams for more than a chunk), then one
  decode step of every running sequence, all slots in one batched step; it returns the tokens
  read, per sequence;
- ``release`` ends a sequence (cancelled, a stop string) and frees its slot.

A prompt starts in the slot that holds its longest prefix already (kv_pool.py), and computes the
rest. Every sequence samples with its own LogitsSampler (its own seed and counters), so what it
draws does not depend on the other sequences of the batch; the logits may, by rounding, where a
kernel's arithmetic changes with the number of rows (docs/batching.md says which).

The batched step runs the package's graph with batch = the slots it spans, each row its own
length: the past inputs are views of the pool's buffers and the attention mask says each row's
length, which GroupQueryAttention over a shared past buffer turns into per-row positions and
writes in place. Graphs whose attention concatenates its own KV cannot do that; the decoder
refuses them at construction. On CUDA the batched step runs eagerly (not captured yet): said once.
"""

from __future__ import annotations

import collections
import time
import warnings
from dataclasses import dataclass

import torch

from onnxgen.errors import InvalidInputError, OnnxgenError
from onnxgen.genai.engine import DecodeEngine, PromptTooLongError
from onnxgen.genai.kv_cache import past_feeds_attention_in_place
from onnxgen.genai.kv_pool import KVPool
from onnxgen.genai.sampling import LogitsSampler
from onnxgen.genai.sequence import Sequence


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


DEFAULT_KV_TOKENS = 16384  # KV rows of all slots together when max_model_len is not given


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
    ) -> None:
        config = engine.config
        if max_seqs < 1:
            raise InvalidInputError(f"max_seqs must be >= 1, got {max_seqs}")
        if prefill_chunk < 1:
            raise InvalidInputError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if not engine.has_mask:
            raise BatchingNotSupportedError(
                "batched decoding needs an attention_mask input (it carries each sequence's length)"
            )
        if not past_feeds_attention_in_place(engine.session.model.graph, config):
            raise BatchingNotSupportedError(
                "batched decoding needs GroupQueryAttention (com.microsoft) reading the past KV inputs directly, "
                "so that each sequence's rows are written in place at its own length; this graph's attention "
                "concatenates its own KV cache"
            )
        default = max(256, DEFAULT_KV_TOKENS // max_seqs)
        capacity = min(config.context_length, max_model_len or default)
        if capacity < 2:
            raise InvalidInputError(f"max_model_len must be at least 2 tokens, got {max_model_len}")
        self.engine = engine
        self.prefill_chunk = prefill_chunk
        self.pool = KVPool(config, engine.kv_dtype, engine.device, max_seqs, capacity, prefix_caching=prefix_caching)
        self.waiting: collections.deque[Sequence] = collections.deque()  # admitted, prompt not started
        self.prefilling: Sequence | None = None  # the one whose prompt is part computed
        self.running: list[Sequence] = []  # first token read, decoding
        self._row_zero = torch.zeros(1, dtype=torch.int64, device=engine.device)
        self._rows = torch.arange(prefill_chunk, dtype=torch.int64, device=engine.device)
        self.steps = 0  # batched decode steps run
        self.stepped_rows = 0  # rows those steps computed (running sequences and idle slots between them)
        if engine.device.type == "cuda":
            warnings.warn(
                "onnxgen: batched decode steps run eagerly on CUDA (captured batched steps are not built yet); "
                "one sequence at a time (max_seqs 1) keeps the captured single-sequence step",
                stacklevel=2,
            )

    # -- sequences -------------------------------------------------------------------------

    @property
    def max_seqs(self) -> int:
        return self.pool.slots

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def admitted(self) -> int:
        """Sequences admitted and not over (waiting, prefilling or running)."""
        return len(self.waiting) + (self.prefilling is not None) + len(self.running)

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
        if sequence.slot is not None:
            self.pool.release(sequence.slot)
            sequence.slot = None
        self.engine.release([sequence], reason)

    # -- the loop --------------------------------------------------------------------------

    def iterate(self) -> list[Read]:
        """One prompt chunk (if a sequence waits for one), then one batched decode step (if any
        sequence runs). A sequence that ends is released here (its slot freed)."""
        reads: list[Read] = []
        with torch.inference_mode():
            if self.prefilling is not None or self.waiting:
                reads += self._prefill_chunk()
            if self.running:
                reads += self._step()
        return reads

    def _prefill_chunk(self) -> list[Read]:
        engine = self.engine
        sequence = self.prefilling
        if sequence is None:
            sequence = self.prefilling = self.waiting.popleft()
            running = [s.slot for s in self.running if s.slot is not None]
            span = range(min(running), max(running) + 1) if running else range(0)
            sequence.slot, sequence.prefilled = self.pool.acquire(sequence.prompt_ids, span)
            sequence.stats.cached_tokens = sequence.prefilled
            sequence.started_at = time.perf_counter()
            sequence.sampler.observe(torch.tensor([sequence.prompt_ids], dtype=torch.int64, device=engine.device))
        slot = sequence.slot
        assert slot is not None
        prompt = sequence.prompt_ids
        lo = sequence.prefilled
        hi = min(len(prompt), lo + self.prefill_chunk)
        n = hi - lo
        io = engine.config.io
        device = engine.device
        feeds = {
            io.input_ids: torch.tensor([prompt[lo:hi]], dtype=torch.int64, device=device),
            io.attention_mask: torch.ones((1, hi), dtype=torch.int64, device=device),
        }
        if engine.has_positions:
            feeds[io.position_ids] = torch.arange(lo, hi, dtype=torch.int64, device=device).reshape(1, n)
        if engine.logits_row is not None:
            feeds[engine.logits_row] = self._rows[n - 1 : n]
        past = self.pool.slot_feeds(slot)
        feeds.update(past)
        outputs = engine.session.run_torch(feeds)
        self._keep_in_place(outputs, past)
        self.pool.contents[slot].extend(prompt[lo:hi])
        sequence.prefilled = hi
        if hi < len(prompt):
            return []
        self.prefilling = None
        logits = outputs[io.logits][0, 0 if engine.logits_row is not None else n - 1]
        return [self._sample_and_read(sequence, logits)]

    def _step(self) -> list[Read]:
        """One decode step of every running sequence: the rows of slots [lo, hi). A slot there that
        is not running (free, or holding a prompt part computed) is fed a dummy token that writes the
        row just past what it holds, which nothing reads (a prompt's next chunk writes it again)."""
        engine = self.engine
        pool = self.pool
        by_slot = {s.slot: s for s in self.running}
        lo, hi = min(by_slot), max(by_slot) + 1
        ids = [0] * (hi - lo)
        ends = [len(pool.contents[slot]) + 1 for slot in range(lo, hi)]  # each row's length after the step
        for slot, sequence in by_slot.items():
            ids[slot - lo] = sequence.generated[-1]
        width = max(ends)
        device = engine.device
        io = engine.config.io
        rows = hi - lo
        mask = torch.arange(width).expand(rows, width) < torch.tensor(ends)[:, None]
        feeds = {
            io.input_ids: torch.tensor(ids, dtype=torch.int64, device=device).reshape(rows, 1),
            io.attention_mask: mask.to(device=device, dtype=torch.int64),
        }
        if engine.has_positions:
            feeds[io.position_ids] = (torch.tensor(ends, dtype=torch.int64) - 1).reshape(rows, 1).to(device)
        if engine.logits_row is not None:
            feeds[engine.logits_row] = self._row_zero
        for sequence in self.running:
            if sequence.token is not None:  # the penalties count the token fed now
                sequence.sampler.observe(sequence.token.reshape(1))
        past = pool.range_feeds(lo, hi)
        feeds.update(past)
        outputs = engine.session.run_torch(feeds)
        self._keep_in_place(outputs, past)
        self.steps += 1
        self.stepped_rows += rows
        logits = outputs[io.logits]
        reads = []
        for slot, sequence in sorted(by_slot.items()):
            pool.contents[slot].append(sequence.generated[-1])
            reads.append(self._sample_and_read(sequence, logits[slot - lo, 0]))
        return reads

    def _sample_and_read(self, sequence: Sequence, logits: torch.Tensor) -> Read:
        """The sequence's next token from its logits row, read; a failure of its own (non-finite
        logits) ends this sequence only, not the batch."""
        try:
            return self._read(sequence, self.engine._sample(sequence, logits, None))
        except OnnxgenError as exc:
            self.release(sequence, "error")
            return Read(sequence, None, exc)

    def _keep_in_place(self, outputs: dict[str, torch.Tensor], past: dict[str, torch.Tensor]) -> None:
        """GroupQueryAttention over a shared buffer returns the past views as present; were a
        present output a new tensor, its rows are copied back into the pool."""
        config = self.engine.config
        for layer in range(config.num_layers):
            for past_name, present_name in (
                (config.past_key_name(layer), config.present_key_name(layer)),
                (config.past_value_name(layer), config.present_value_name(layer)),
            ):
                out, view = outputs[present_name], past[past_name]
                if out.data_ptr() != view.data_ptr():
                    view.copy_(out[:, :, : view.shape[2]])

    def _read(self, sequence: Sequence, token: torch.Tensor) -> Read:
        """The sampled ``token`` read on the host: handed out, or the end of the sequence."""
        token_id = LogitsSampler.check(token)
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
