"""The decode engine: token ids in, token ids out. The one decode loop of onnxgen.

It owns what a decoder's generation needs below text: the KV state (kv_cache.py: DynamicKV,
GrowingKV, StaticKV), the captured single-token step (a CaptureRuntime from the session), the
persistent feeds that step is fed in place, the step tail that samples inside the graph
(decode_tail.py), chunked prefill on the CPU, captured prefill in padded power-of-two chunks where
the decode step is captured with static KV (a capture runtime of its own), and the pipelined loop
(step N+1 enqueued before token N is read, host_read.py). The Generator (text, chat templates,
stop strings, streaming) and every bench drive it; none of them keeps a copy of this loop.

Batches: the entry points here take a list of ``Sequence``s and run a batch of one (more raise
``BatchNotSupportedError``); several sequences at once decode through the engine's batched mode,
``batched.BatchedDecoder`` (a KV pool of slots, continuous batching), over this engine's session,
sequences and samplers.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import onnx
import torch

from onnxgen import options
from onnxgen.errors import InvalidInputError
from onnxgen.genai.decode_tail import GreedyTail, SampledTail
from onnxgen.genai.graph_layout import carried_states, position_feed, with_graph_layout
from onnxgen.genai.host_read import HostRead, host_read
from onnxgen.genai.kv_cache import DynamicKV, GrowingKV, StaticKV, past_feeds_attention_in_place
from onnxgen.genai.package import PackageConfig
from onnxgen.genai.package_checks import default_kv_kind, growing_kv
from onnxgen.genai.prompt_text import PromptTooLongError, checked_prompt_ids  # noqa: F401 - the error re-exported
from onnxgen.genai.sampling import LogitsSampler, SamplingParams, SamplingPlan, logprobs_of, token_logprob
from onnxgen.genai.sequence import Sequence
from onnxgen.runtime.capture.stats import CaptureStats
from onnxgen.runtime.dtypes import ONNX_TO_TORCH
from onnxgen.runtime.row_select import select_row
from onnxgen.runtime.session import InferenceSession
from onnxgen.runtime.state_rows import stop_states_at_row

if TYPE_CHECKING:
    from onnxgen.runtime.capture.runtime import CaptureRuntime

KV = DynamicKV | GrowingKV | StaticKV

# the graph inputs that engine_model adds: which row of the step the logits are computed for, and
# the row after which a carried state takes nothing in (both fed the step's last real row)
LOGITS_ROW_INPUT = "onnxgen_logits_row"
STATE_ROW_INPUT = "onnxgen_state_row"


class EngineGraph(NamedTuple):
    """engine_graph's result: the rewritten graph, why its logits are not cut to one row and why its
    carried states do not stop at a row (None: the rewrite applied, or for the states: the graph has
    none), and how many carried states it has."""

    model: onnx.ModelProto
    logits_why_not: str | None
    states_why_not: str | None
    carried: int


def engine_graph(model: onnx.ModelProto, config: PackageConfig) -> EngineGraph:
    """The package's graph as the engine runs it: the logits computed for one row of a step only
    (runtime/row_select.py; the engine feeds the prompt's last real row), since generation reads no
    other. A prompt of S rows then skips S - 1 rows of the lm_head and holds [1, vocab] logits, not
    [S, vocab]; a one-token decode step runs the same kernels as before. A graph with carried
    states (a hybrid decoder) also has them stop at that row (runtime/state_rows.py), so that its
    prompt chunks can be padded like a dense decoder's. A graph that does not fit a rewrite runs
    without it; the result says why (engine_model warns, ``onnxgen show --capture`` prints it)."""
    rewritten, logits_why_not = select_row(model, config.io.logits, LOGITS_ROW_INPUT)
    presents = [state.present for state in carried_states(config, model)] if config.io.states else []
    states_why_not = None
    if presents:
        rewritten, states_why_not = stop_states_at_row(rewritten, presents, STATE_ROW_INPUT)
    return EngineGraph(rewritten, logits_why_not, states_why_not, len(presents))


def engine_model(model: onnx.ModelProto, config: PackageConfig) -> onnx.ModelProto:
    """engine_graph's graph; a rewrite that does not fit says why once."""
    graph = engine_graph(model, config)
    if graph.logits_why_not is not None:
        warnings.warn(
            f"onnxgen: the prompt's logits are computed for every prompt row, not only the last "
            f"({graph.logits_why_not}); prefill does the lm_head's work once per prompt token",
            stacklevel=2,
        )
    if graph.states_why_not is not None:
        warnings.warn(
            f"onnxgen: a prompt chunk of this graph cannot be padded ({graph.states_why_not}); it runs as unpadded "
            "pieces, one pass over the weights each",
            stacklevel=2,
        )
    return graph.model


class BatchNotSupportedError(InvalidInputError):
    """More than one sequence was handed to the engine: it decodes one sequence at a time so far."""


def fine_sizes(fine: bool | None) -> bool:
    """``fine``, or where None option prefill_sizes: prompt chunk sizes of 1.5 times a power of two
    too (24, 48, 96, ...), not only powers of two."""
    return options.current().prefill_sizes == "fine" if fine is None else fine


def padded_rows(rows: int, floor: int, fine: bool | None = None) -> int:
    """The rows a prompt chunk of ``rows`` rows is padded to: the next power of two of at least
    ``floor``, or with ``fine`` (default: option prefill_sizes) the next of those and 1.5 times a
    power of two from 24 on (20 -> 24, 33 -> 48, 100 -> 128). Each size is a recording, so the sizes
    stay few: 7 from 16 to 1,024 rows, 13 with ``fine``."""
    size = max(floor, 1 << (rows - 1).bit_length())
    three_quarters = size // 4 * 3
    if fine_sizes(fine) and three_quarters >= max(rows, floor, 24):
        size = three_quarters
    return size


def prompt_pieces(rows: int, fine: bool | None = None) -> list[int]:
    """``rows`` as the prompt pieces of a graph whose chunks are not padded, largest first: powers
    of two (37 -> [32, 4, 1], 56 -> [32, 16, 8]); ``fine`` (default: option prefill_sizes) also 1.5
    times a power of two from 24 on (56 -> [48, 8], 100 -> [96, 4]). Each piece is a pass over the
    weights (on a MoE model nearly all its experts), so fewer pieces take less time; each piece size
    is a recording, so the sizes stay few: 11 up to 1,024 rows, 17 with ``fine`` (the one-row piece
    is a decode step's)."""
    fine = fine_sizes(fine)
    pieces = []
    while rows:
        piece = 1 << (rows.bit_length() - 1)
        if fine and piece >= 16 and rows >= piece + piece // 2:
            piece += piece // 2
        pieces.append(piece)
        rows -= piece
    return pieces


class DecodeEngine:
    """Decodes sequences of token ids with one session.

    ``kv``: "auto" (static where the package shares its KV buffer, on CUDA or where the graph fixes
    the buffer length; else dynamic), "static" or "dynamic". ``capture``: None (on with CUDA, off on
    the CPU), "on", "off" or "verify"; a CPU ``recorder`` (capture.recorder.ReplayRecorder) stands
    in for CUDA graphs in tests and smoke runs.
    ``pipeline``: "auto" (on with CUDA, static KV and capture on/verify), "on" (True) or "off" (False).
    ``sample_in_graph``: a captured static-KV step picks its next token (greedy's argmax, or the
    whole sampling pipeline and its seeded draw), next position and mask row in the step's tail,
    inside the graph (False: between the steps).
    ``host_tokens``: greedy's tail also stores each token in pinned host memory, so the host reads it
    without a copy in the stream (False: the loop copies each token to the host). ``kv_capacity``:
    a fixed static-cache size (the benches), kept from run to run; None sizes it per generation.
    ``package_model``: the graph as the package holds it, before the session's device rewrites (what
    the static-KV check names in its error); default: the session's.
    """

    prefill_chunk = 256  # prompt tokens per CPU prefill step (_prefill); 0: one step
    prefill_progress_tokens: int | None = 1024  # prompts this long show prefill progress on stderr
    # captured prefill (_prefill_padded): prompt chunks of at most this many tokens, each padded to
    # a few sizes of at least captured_prefill_min rows (padded_rows), so that a few recordings serve
    # every length
    captured_prefill_max = 1024
    captured_prefill_min = 16
    # chunk shapes (rows, capacity) recorded at most: each recording keeps its own graph memory (a
    # 1,024-row chunk holds its [1,024, vocab] logits); chunks of further shapes run eagerly, said once
    captured_prefill_keys = 16
    # sampled step tails at most (one per sampling plan and KV capacity): each tail's recordings keep
    # their graph memory; a generation that would need a further one samples between the steps, said once
    sampled_tails_max = 8

    def __init__(
        self,
        session: InferenceSession,
        config: PackageConfig,
        *,
        kv: str = "auto",
        capture: str | None = None,
        recorder: object = None,
        verify_steps: int = 8,
        pipeline: str | bool = "auto",
        sample_in_graph: bool = True,
        host_tokens: bool = True,
        kv_capacity: int | None = None,
        package_model: onnx.ModelProto | None = None,
    ):
        self.session = session
        # the KV layers, carried states (the state names the package declares, matched against the
        # graph's inputs) and position streams come from the graph the session runs (idempotent
        # where the caller filled them in already), so no caller can hand in a hybrid's config
        # without them
        config = self.config = with_graph_layout(config, session.model)
        self.device = session.device
        inputs = {i.name: i for i in session.graph_inputs}
        io = config.io
        self.has_mask = bool(io.attention_mask) and io.attention_mask in inputs
        self.has_positions = bool(io.position_ids) and io.position_ids in inputs
        # engine_model's row input: the logits come for the one row fed there
        self.logits_row = LOGITS_ROW_INPUT if LOGITS_ROW_INPUT in inputs else None
        # and its state row: the carried states stop at the row fed there (a padded prompt chunk's last real one)
        self.state_row = STATE_ROW_INPUT if STATE_ROW_INPUT in inputs else None
        self._rows: torch.Tensor | None = None  # see _row_feed
        self._row_zero: torch.Tensor | None = None
        self._past = inputs[config.first_past_key_name]
        self.kv_dtype = ONNX_TO_TORCH[self._past.elem_type]
        if kv == "auto":
            kv = default_kv_kind(config, self.device.type, self._fixed_buffer_length is not None)
        if kv not in ("static", "dynamic"):
            raise InvalidInputError(f"kv must be 'auto', 'static' or 'dynamic', got {kv!r}")
        if kv == "static" and not self.has_mask:
            raise InvalidInputError("static KV needs an attention_mask input to carry the valid length")
        graph = (package_model or session.model).graph
        growing = growing_kv(config, list(graph.node)) if kv == "static" else None
        if growing:
            raise InvalidInputError(
                f"kv static needs a decoder that writes each step's KV rows in place into a fixed buffer "
                f"(com.microsoft GroupQueryAttention with past and present sharing it), but {growing}: "
                "its KV grows every step; use kv 'dynamic' (or 'auto')"
            )
        self.kv_kind = kv
        # CUDA graphs for the single-token decode step (and, with static KV, the prefill chunks): on by default on CUDA,
        # off on the CPU (a test passes a CPU ReplayRecorder to exercise the logic there)
        self.capture = capture or ("on" if self.device.type == "cuda" else "off")
        self.capture_recorder = recorder
        self.verify_steps = verify_steps
        if self.capture not in ("on", "off", "verify"):
            raise InvalidInputError(f"capture must be 'on', 'off' or 'verify', got {self.capture!r}")
        if self.capture != "off" and self.device.type != "cuda" and recorder is None:
            raise InvalidInputError("capture needs CUDA graphs: use capture='off' on the CPU")
        mode = {True: "on", False: "off"}[pipeline] if isinstance(pipeline, bool) else pipeline
        if mode not in ("auto", "on", "off"):
            raise InvalidInputError(f"pipeline must be 'auto', 'on' or 'off' (or True/False), got {pipeline!r}")
        if mode == "on" and self.kv_kind != "static":
            # dynamic KV: the next step's feeds are this step's present outputs, and its graph is not
            # captured; keep the sequential loop there
            raise InvalidInputError("pipeline='on' needs static KV (kv='static'); dynamic KV decodes sequentially")
        self.pipeline = mode
        self.pipelined = mode == "on" or (
            mode == "auto" and self.device.type == "cuda" and self.kv_kind == "static" and self.capture != "off"
        )
        self.sample_in_graph = bool(sample_in_graph)
        self.host_tokens = bool(host_tokens)
        self.kv_capacity = kv_capacity
        self._capture: CaptureRuntime | None = None
        self._prefill_capture: CaptureRuntime | None = None
        self._prefill_keys: set[tuple[int, int, int]] = set()  # see _prefill_key_admitted
        self._prefill_keys_said = False
        self._in_place: bool | None = None  # see _grows_in_place
        # one static cache per capacity, kept: recordings adopt a cache's buffers (their addresses), so a
        # generation that needs another capacity leaves the others' recordings valid for later ones
        self._static_kvs: dict[int, StaticKV] = {}
        self._static_kv: StaticKV | None = None  # the one the last generation used
        self._decode_feeds: tuple[torch.Tensor, torch.Tensor] | None = None  # see _decode_buffers
        # step tails per static cache (a tail reads its cache's mask; a key's recordings belong to one tail)
        self._greedy_tails: dict[int, GreedyTail] = {}  # by capacity
        self._tail: GreedyTail | None = None  # the one the last greedy generation used
        self._sampled_tails: dict[tuple[int, SamplingPlan], SampledTail] = {}  # by (capacity, sampling plan)
        self._sampled_tails_said = False
        self._between_steps_said: set[str] = set()  # see _say_between_steps

    # -- sequences -------------------------------------------------------------------------

    def checked_prompt_ids(self, prompt_ids: Iterable[object]) -> list[int]:
        """``prompt_ids`` checked against this model's vocabulary and context (prompt_text.py)."""
        return checked_prompt_ids(prompt_ids, self.config.vocab_size, self.config.context_length)

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = ()) -> Sequence:
        """A sequence for ``prompt_ids``, checked by ``checked_prompt_ids``. It stops at
        ``params.max_new_tokens`` (at most what the context leaves room for) or at a token of
        ``stop_ids`` (unless ``params.ignore_eos``); the stop id is counted in the stats but not
        handed out. ``params.min_tokens`` keeps the stop ids from being drawn until that many new
        tokens exist; ``params.logprobs`` fills in ``sequence.logprobs``, one per generated token."""
        prompt_ids = self.checked_prompt_ids(prompt_ids)
        stop = frozenset() if params.ignore_eos else frozenset(stop_ids)
        room = self.config.context_length - len(prompt_ids)
        max_new = min(params.max_new_tokens or room, room)
        sequence = Sequence(
            prompt_ids=list(prompt_ids),
            sampler=LogitsSampler(params, self.config.vocab_size, self.device, stop),
            max_new_tokens=max_new,
            limit_reason="length" if max_new < room else "context full",
            stop_ids=stop,
        )
        sequence.stats.prompt_tokens = len(prompt_ids)
        sequence.stats.kv = self.kv_kind
        return sequence

    @staticmethod
    def _one(sequences: list[Sequence]) -> Sequence:
        if len(sequences) != 1:
            raise BatchNotSupportedError(
                f"the decode engine runs one sequence at a time so far; got a batch of {len(sequences)}"
            )
        return sequences[0]

    # -- the loop --------------------------------------------------------------------------

    def generate(self, sequences: list[Sequence], after_first_read: Callable[[], None] | None = None) -> Iterator[int]:
        """Runs the sequences to their end, yielding each new token id as the host reads it (the
        stop id excepted); fills in their ``generated``, ``done`` and ``stats``.

        Raises NonFiniteLogitsError where the model's logits are NaN or infinite. Checked: the first
        token on every path (its logits row's maximum, or the draw's probabilities), and every later
        token the sampler picks between the steps (its row's maximum on the device, folded into the
        token the host reads anyway), and every token a sampled step's tail draws. Not checked: the
        tokens that a captured greedy step's tail picks (sample_in_graph), where such a row yields
        the index of a NaN as argmax does. ``after_first_read()``: called once the first token is on the host,
        before it is counted (a profiler starts there; its time is TTFT's, not decode's)."""
        sequence = self._one(sequences)
        try:
            yield from self._generate(sequence, after_first_read)
        except GeneratorExit:  # the consumer stopped iterating: no further step runs
            self.release([sequence])
            raise

    def _generate(self, sequence: Sequence, after_first_read: Callable[[], None] | None) -> Iterator[int]:
        self.prefill([sequence])
        with torch.inference_mode():
            tail = sequence.tail
            if self.pipelined and isinstance(sequence.kv, StaticKV):
                host = tail.host_tokens if tail is not None and tail.writes_host else None
                reader = host_read(self.device, host)
                yield from self._decode_pipelined(sequence, reader, after_first_read)
                return
            stats = sequence.stats
            while True:
                token_id = LogitsSampler.check(sequence.token)  # the one device-to-host read per token
                if stats.new_tokens == 0 and after_first_read is not None:
                    after_first_read()
                stats.count_token(sequence.started_at)
                if token_id in sequence.stop_ids:
                    sequence.finish("eos")
                    return
                self._took(sequence, token_id)
                yield token_id
                if stats.new_tokens >= sequence.max_new_tokens:
                    sequence.finish(sequence.limit_reason)
                    return
                self.step([sequence])

    @staticmethod
    def _took(sequence: Sequence, token_id: int) -> None:
        """``token_id``, read on the host and not a stop id, joins the sequence's generated tokens,
        with its logprobs where they are asked for (sampled with it, in order, so the oldest pending)."""
        sequence.generated.append(token_id)
        if sequence.pending_logprobs:
            sequence.logprobs.append(token_logprob(sequence.pending_logprobs.popleft(), token_id))

    def release(self, sequences: list[Sequence], reason: str = "cancelled") -> None:
        """Ends the sequences where they are: a sequence not yet done is finished with ``reason``,
        and each drops its KV state, its device token and its step tail, so a cancelled generation
        holds no memory. A static cache the engine keeps for its recordings stays with the engine
        (the next generation resets it), as does a step tail's state (the next one rebinds it)."""
        for sequence in sequences:
            if not sequence.done:
                sequence.finish(reason)
            sequence.kv = None
            sequence.token = None
            sequence.token_at = None
            sequence.tail = None
            sequence.prepared_at = None
            sequence.pending_logprobs.clear()

    def prefill(self, sequences: list[Sequence]) -> None:
        """Each sequence's prompt steps, in a fresh KV state; its first new token is then on the
        device (``sequence.token``), and ``sequence.tail`` the step tail of its decode steps (None:
        the sampler runs between them). The KV state is made outside inference mode (a reused
        static cache is written in place later), the steps run inside it."""
        sequence = self._one(sequences)
        kv = sequence.kv = self._new_kv(len(sequence.prompt_ids) + sequence.max_new_tokens)
        sequence.prepared_at = None
        ids = torch.tensor([sequence.prompt_ids], dtype=torch.int64, device=self.device)
        sequence.sampler.observe(ids)
        sequence.started_at = time.perf_counter()
        with torch.inference_mode():
            sequence.token = self._sample(sequence, self._prefill(sequence, ids), self._token_out(kv))
            sequence.token_at = None
            sequence.tail = self._tail_for(sequence)

    def step(self, sequences: list[Sequence]) -> None:
        """Enqueues one decode step per sequence, fed its newest token (on the device); the next
        token is then ``sequence.token`` (sampled after the step, or by the step's tail, which also
        stored it in pinned host memory at ``sequence.token_at`` where it writes the host). Nothing
        is read to the host. Call under torch.inference_mode, after ``prefill``."""
        sequence = self._one(sequences)
        kv, token, tail = sequence.kv, sequence.token, sequence.tail
        assert kv is not None and token is not None, "step() before prefill()"
        if tail is None:  # a tail counts the token it draws for the penalties itself
            sequence.sampler.observe(token.reshape(1))
        logits = self._forward(sequence, token.reshape(1, 1), tail)
        if tail is not None:  # the step's tail wrote it, at the new position
            sequence.token = tail.state()["ids"].view(())
            sequence.token_at = kv.length if tail.writes_host else None
            return
        sequence.token = self._sample(sequence, logits, self._token_out(kv))
        sequence.token_at = None

    def _sample(self, sequence: Sequence, logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The sampler's next token from ``logits`` (device work, no host read), with what the
        parameters add to it: the stop ids banned while fewer than min_tokens tokens were sampled,
        and the token's logprobs queued for the host (sampling.logprobs_of). Without those, this is
        ``sampler.sample`` and two attribute tests: no kernel more."""
        sampler = sequence.sampler
        params = sampler.params
        token = sampler.sample(logits, out=out, ban=sequence.sampled < params.min_tokens)
        if params.logprobs is not None:
            sequence.pending_logprobs.append(logprobs_of(logits, token, params.logprobs, self.config.vocab_size))
        sequence.sampled += 1
        return token

    def _decode_pipelined(
        self, sequence: Sequence, reader: HostRead, after_first_read: Callable[[], None] | None
    ) -> Iterator[int]:
        """generate's loop with one step of lookahead: once token N exists on the device (sampled,
        its host read started), step N+1 is enqueued from that device tensor, and only then does the
        host wait for token N. Same tokens, stop reasons and stats as the sequential loop:

        - a step is enqueued only for a token after which one more may come (N < max_new), so no step
          runs past max_new_tokens or the context;
        - the first token is read before the next step is built (then enqueued before it is handed
          out): TTFT stays prefill + first read, and a first decode step that warms up or records the
          capture is not counted in it;
        - a stop id is seen when the token is read: the lookahead step already enqueued is dropped.
          It wrote one KV row past this generation's end into the static cache, which the next
          generation resets (``_new_kv``), as it does when the consumer stops iterating early;
        - an error raised while enqueuing step N+1 surfaces after token N is handed out (or not at
          all if token N is a stop id), where the sequential loop would have raised it.

        ``reader`` reads the token on the device, from the copy it starts or, where the step's tail
        stored it in the reader's pinned host tokens (``sequence.token_at``), with no copy to wait
        for. ``sampler.observe`` and the sampling stay on the device, in stream order with the steps."""
        stats = sequence.stats
        max_new = sequence.max_new_tokens
        token, at = sequence.token, sequence.token_at
        assert token is not None
        ahead: tuple[torch.Tensor, int | None] | None = None

        def try_advance() -> Exception | None:
            """step(); an error is returned, to be raised after the token."""
            nonlocal ahead
            try:
                self.step([sequence])
            except Exception as exc:
                return exc
            assert sequence.token is not None
            ahead = (sequence.token, sequence.token_at)
            return None

        while True:
            n = stats.new_tokens + 1  # the token on the device is the n-th new one
            reader.start(token, at)  # before step n+1 is enqueued: the wait below is for token n only
            failed = try_advance() if 1 < n < max_new else None
            token_id = LogitsSampler.check(reader.wait())
            if n == 1 and after_first_read is not None:
                after_first_read()
            stats.count_token(sequence.started_at)
            if token_id in sequence.stop_ids:
                sequence.finish("eos")
                return
            if n == 1 and n < max_new:  # the first token is back: its step runs while it is handed out
                failed = try_advance()
            self._took(sequence, token_id)
            yield token_id
            if failed is not None:
                raise failed
            if n >= max_new:
                sequence.finish(sequence.limit_reason)
                return
            assert ahead is not None
            token, at = ahead

    # -- KV state and the step's feeds ------------------------------------------------------

    @property
    def _fixed_buffer_length(self) -> int | None:
        """The KV buffer length the graph declares as a number (None: symbolic)."""
        shape = self._past.shape
        return shape[2] if shape and isinstance(shape[2], int) else None

    def _static_capacity(self, total: int) -> int:
        """KV rows for a generation of ``total`` tokens: ``kv_capacity`` where fixed, else the next
        power of two (at least 256), at most the context. On CUDA the attention spans the whole
        buffer (fixed shapes for capture), so a buffer sized for the full context would cost every
        step; a few sizes keep recordings reusable."""
        if self._fixed_buffer_length is not None:
            return self._fixed_buffer_length  # a graph built for a fixed buffer length
        if self.kv_capacity is not None:
            return self.kv_capacity
        context = self.config.context_length
        return min(context, max(256, 1 << max(0, total - 1).bit_length()))

    def _new_kv(self, total: int) -> KV:
        # with capture off no recording reads a carried state's address: each step's becomes the next past
        rebind = self.capture == "off"
        if self.kv_kind == "static":
            capacity = self._static_capacity(total)
            if self.capture == "off" and self.kv_capacity is None:
                return StaticKV(self.config, self.kv_dtype, self.device, capacity, rebind_states=rebind)
            # captured decode reads the KV buffers at fixed addresses: keep the cache of each capacity,
            # reset in place (a new one would invalidate its recordings and cost a re-record per
            # generation); a fixed capacity keeps it eagerly too (the benches' runs share one cache).
            # The memory is what the recordings kept alive anyway: each adopts its cache.
            kv = self._static_kvs.get(capacity)
            if kv is None:
                kv = self._static_kvs[capacity] = StaticKV(self.config, self.kv_dtype, self.device, capacity)
            self._static_kv = kv
            kv.reset()
            return kv
        if self._grows_in_place():
            return GrowingKV(self.config, self.kv_dtype, self.device, limit=self.config.context_length,
                             rebind_states=rebind)  # fmt: skip
        return DynamicKV(self.config, self.kv_dtype, self.device, rebind_states=rebind)

    def _grows_in_place(self) -> bool:
        """Dynamic KV on the CPU keeps spare rows (GrowingKV) where the graph's attention writes in
        place; CUDA keeps DynamicKV (its attention spans the whole past buffer: spare rows would cost)."""
        if self._in_place is None:
            self._in_place = (
                self.device.type == "cpu"
                and self.has_mask
                and past_feeds_attention_in_place(self.session.model.graph, self.config)
            )
        return self._in_place

    def _decode_buffers(self, kv: KV) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token ids [1, 1], positions [1, 1]) fed to every captured one-token step with static KV:
        the same device tensors each step, so the capture uses them in place (no copy into its
        bindings), and the sampler writes the next token straight into the ids. None elsewhere."""
        if kv.kind != "static" or self.capture == "off":
            return None
        if self._decode_feeds is None:
            ids = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
            self._decode_feeds = (ids, torch.zeros_like(ids))
        return self._decode_feeds

    @property
    def decode_feeds(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The persistent (token ids, positions) feeds of the captured one-token step, once made
        (``_decode_buffers``); a bench that rewinds a sequence sets them (bench/step_anatomy.py)."""
        return self._decode_feeds

    def _token_out(self, kv: KV) -> torch.Tensor | None:
        """Where the sampler writes the next token (a 0-d view of the decode ids), or None."""
        buffers = self._decode_buffers(kv)
        return buffers[0].view(()) if buffers is not None else None

    def _tail_for(self, sequence: Sequence) -> GreedyTail | SampledTail | None:
        """The step tail of this sequence's one-token steps, or None (the sampler runs between them).
        Called once its first token is sampled; a sampled tail takes over the sampler's state."""
        kv = sequence.kv
        assert kv is not None
        buffers = self._decode_buffers(kv)
        if buffers is None or not self.sample_in_graph or not isinstance(kv, StaticKV):
            return None
        why = sequence.sampler.between_steps
        if why is not None:
            self._say_between_steps(why)
            return None
        if not sequence.sampler.plain_greedy:
            return self._sampled_tail_for(sequence, kv, buffers)
        tail = self._greedy_tails.get(kv.capacity)
        if tail is None or tail.state()["mask"] is not kv.mask:
            ids, pos = buffers
            host = GreedyTail.host_tokens_for(kv.capacity, self.device) if self.host_tokens else None
            tail = GreedyTail(self.config.io.logits, self.config.vocab_size, ids, pos, kv.mask, host)
            self._greedy_tails[kv.capacity] = tail
        self._tail = tail
        return tail

    def _say_between_steps(self, why: str) -> None:
        """Once per reason: a generation whose sampler runs between the captured steps (no tail)."""
        if why in self._between_steps_said:
            return
        self._between_steps_said.add(why)
        warnings.warn(
            f"onnxgen: generations with {why} sample between the decode steps, not in the captured step's "
            "tail (a few more kernels per token)",
            stacklevel=4,
        )

    def _sampled_tail_for(
        self, sequence: Sequence, kv: StaticKV, buffers: tuple[torch.Tensor, torch.Tensor]
    ) -> SampledTail | None:
        sampler = sequence.sampler
        tail = self._sampled_tails.get((kv.capacity, sampler.plan))
        if tail is None or tail.state()["mask"] is not kv.mask:
            if tail is None and len(self._sampled_tails) >= self.sampled_tails_max:
                if not self._sampled_tails_said:
                    self._sampled_tails_said = True
                    warnings.warn(
                        f"onnxgen: {self.sampled_tails_max} sampling plans (each on one KV size) already have a "
                        "captured step tail; generations with other top_k values, other stages switched on or "
                        "another KV size sample between the steps (a few more kernels per token)",
                        stacklevel=4,
                    )
                return None
            ids, pos = buffers
            state = sampler.state.clone()  # the tail's own storage; bind() fills it for each generation
            host = GreedyTail.host_tokens_for(kv.capacity, self.device) if self.host_tokens else None
            tail = SampledTail(
                self.config.io.logits, sampler.plan, state, self.config.vocab_size, ids, pos, kv.mask, host
            )
            self._sampled_tails[(kv.capacity, sampler.plan)] = tail
        assert sequence.token is not None
        sampler.observe(sequence.token.reshape(1))  # the first token, drawn between the steps
        tail.bind(sampler)
        return tail

    def _forward(
        self,
        sequence: Sequence,
        ids: torch.Tensor,
        tail: GreedyTail | SampledTail | None = None,
        real: int | None = None,
    ) -> torch.Tensor:
        """One step of ``ids.shape[1]`` tokens; returns the logits of the last real row. With ``tail``
        (one-token captured steps only) the step also writes the next token into the decode ids.
        ``real``: a captured prefill chunk's first ``real`` rows are the prompt, the rest padding
        (_prefill_padded; static KV only): the KV advances by ``real`` rows."""
        kv = sequence.kv
        assert kv is not None
        io = self.config.io
        n = ids.shape[1]
        real = n if real is None else real
        feeds: dict[str, torch.Tensor] = {io.input_ids: ids}
        buffers = self._decode_buffers(kv) if n == 1 else None
        if buffers is None:
            tail = None
        # the previous step's tail already wrote this step's position and mask row
        prepared = tail is not None and sequence.prepared_at == kv.length
        if buffers is not None:
            if ids.data_ptr() != buffers[0].data_ptr():  # the token came from elsewhere (a caller's id)
                buffers[0].copy_(ids.reshape(1, 1))
            feeds[io.input_ids] = buffers[0]
            if not prepared and (self.has_positions or tail is not None):
                buffers[1].fill_(kv.length)  # the position feed, and what a tail counts on from
        if self.has_mask:
            # prepared implies a static cache (a tail needs one). A static cache's mask is as wide as the
            # cache whatever the step's rows, so a recorded prompt chunk replays at every position: the
            # graph's attention (GroupQueryAttention over the shared buffer) finds the rows it may see
            # from the mask's sums, and its prompt kernel never reads the key blocks past them
            # (gpu/gqa_prefill.py)
            feeds[io.attention_mask] = kv.attention_mask(n, set_rows=False) if prepared else kv.attention_mask(n)
        if self.has_positions:
            if buffers is not None:
                feeds[io.position_ids] = self.positions_feed(buffers[1])
            else:
                positions = torch.arange(kv.length, kv.length + n, device=self.device).reshape(1, n)
                feeds[io.position_ids] = self.positions_feed(positions)
        feeds.update(self.row_feeds(self._row_feed(real - 1, n)))
        feeds.update(kv.feeds())
        if self.capture != "off" and n == 1:
            outputs = self.capture_runtime().run(self.session.check_feeds_repeated(feeds), tail=tail)
        elif self.capture != "off" and isinstance(kv, StaticKV) and self._prefill_key_admitted(n, kv):
            outputs = self.prefill_runtime().run(self.session.check_feeds_repeated(feeds))
        else:
            outputs = self.session.run_torch(feeds)
        kv.update(outputs, real)
        if real < n:
            kv.unmask_rows(kv.length, n - real)  # the padding's rows: invisible to later steps
        sequence.prepared_at = kv.length if tail is not None else None
        return outputs[io.logits][0, 0 if self.logits_row is not None else real - 1]

    def row_feeds(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """engine_model's row inputs that this graph has, each fed ``row`` (int64 [1], or [batch]: a
        row per entry): the step's last real row."""
        return dict.fromkeys(self.row_inputs, row)

    @property
    def row_inputs(self) -> tuple[str, ...]:
        """engine_model's row inputs that this graph has (the logits row, the state row)."""
        return tuple(name for name in (self.logits_row, self.state_row) if name is not None)

    def positions_feed(self, positions: torch.Tensor) -> torch.Tensor:
        """What the graph's position input takes for the [B, S] ``positions`` (graph_layout.position_feed)."""
        return position_feed(positions, self.config.position_streams)

    def _row_feed(self, row: int, n: int) -> torch.Tensor:
        """A [1] int64 device tensor holding ``row``, fed without a copy from the host. A one-row
        step gets the same tensor every time (the captured decode step adopts it: no copy per step);
        a prompt chunk a new view into one arange kept on the device (a recorded chunk copies its
        value in, since the last real row differs from prompt to prompt)."""
        if n == 1:
            if self._row_zero is None:
                self._row_zero = torch.zeros(1, dtype=torch.int64, device=self.device)
            return self._row_zero
        if self._rows is None or row >= self._rows.numel():
            size = max(1024, 1 << row.bit_length())
            self._rows = torch.arange(size, dtype=torch.int64, device=self.device)
        return self._rows[row : row + 1]

    def _prefill(self, sequence: Sequence, ids: torch.Tensor) -> torch.Tensor:
        """The prompt's steps; returns the last row's logits.

        On the CPU, where the graph's attention is GroupQueryAttention reading the past directly
        (it takes a later prompt chunk: rows at T - S, causal within the chunk), the prompt runs in
        chunks of ``prefill_chunk`` tokens. One pass would hold every row's logits ([S, vocab] fp32,
        the largest tensor of a long prefill) and an S x S attention per head at once; a chunk holds
        ``prefill_chunk`` rows of each. A prompt of at least ``prefill_progress_tokens`` shows a
        Progress line on stderr (None: never). Elsewhere (CUDA, graphs that concatenate their own
        KV) the prompt is one step, as before."""
        n = ids.shape[1]
        if isinstance(sequence.kv, StaticKV) and self._prefill_chunks_apply():
            if self.config.carried:  # captured or not: recording must not change a prompt's arithmetic
                if self.carried_chunks() == "whole":
                    return self._prefill_chunks(sequence, ids, self._carried_span(), pieces=False)
                return self._prefill_padded(sequence, ids)  # padded, or in pieces
            if self.capture != "off":
                return self._prefill_padded(sequence, ids)
        chunk = self.prefill_chunk
        if self.device.type != "cpu" or not chunk or n <= chunk or not self._prefill_chunks_apply():
            return self._forward(sequence, ids)
        return self._prefill_chunks(sequence, ids, chunk, pieces=False)

    def carried_chunks(self) -> str:
        """How a prompt chunk of this graph with carried states runs over a static cache (the engine's
        and the batching decoder's alike): ``pieces`` (unpadded, prompt_pieces) where its states do
        not stop at a row (no engine_model state row) or option prefill_pieces is ``split``; else
        ``padded`` where its steps may be recorded, captured or not (CUDA, or a CPU recorder standing
        in for CUDA graphs), and ``whole`` on the CPU without one, which records nothing."""
        if self.state_row is None or options.current().prefill_pieces != "pad":
            return "pieces"
        return "padded" if self.device.type == "cuda" or self.capture_recorder is not None else "whole"

    def _carried_span(self) -> int:
        """The most rows of a prompt chunk of a graph with carried states: ``captured_prefill_max``, on
        the CPU ``prefill_chunk`` where smaller."""
        span = self.captured_prefill_max
        if self.device.type == "cpu" and self.prefill_chunk:
            span = min(span, self.prefill_chunk)
        return span

    def _prefill_padded(self, sequence: Sequence, ids: torch.Tensor) -> torch.Tensor:
        """The prompt as (captured) steps: chunks of at most ``captured_prefill_max`` tokens (a graph
        with carried states: _carried_span), each padded at its end to the next power of two (at
        least ``captured_prefill_min``; option prefill_sizes fine: or 1.5 times one, padded_rows)
        where the cache has the room, so that every prompt length reuses the recordings of a few
        chunk sizes. Padding is sound because every row depends only on the rows before it (the
        graph's attention, GroupQueryAttention over the shared cache, is causal within a chunk; so
        are a hybrid's convolutions and recurrences), the padding's KV rows are unmasked again and
        overwritten by the next step, and carried states stop at the last real row (engine_model's
        state row). Each chunk is a binding key of the capture runtime (chunk rows; the mask spans
        the cache, so not the chunk's position): warmed, recorded and then replayed like the decode
        step, and checked against eager in verify mode. A graph with carried states pads with
        capture off too (on CUDA), so that recording does not change the prompt's arithmetic; where
        its states do not stop at a row, it runs as unpadded pieces instead (_prefill_pieces)."""
        if self.config.carried and self.carried_chunks() == "pieces":
            return self._prefill_pieces(sequence, ids)
        kv = sequence.kv
        assert isinstance(kv, StaticKV)
        n = ids.shape[1]
        span = self._carried_span() if self.config.carried else self.captured_prefill_max
        logits = None
        for lo in range(0, n, span):
            real = min(span, n - lo)
            size = padded_rows(real, self.captured_prefill_min)
            if kv.length + size > kv.capacity or real == 1:
                # no room for the padding, or one row, which the eager path computes with the
                # one-row kernels (padded it would take the many-row ones and its logits and KV row
                # would differ from eager): this chunk runs at its own length
                size = real
            chunk = ids[:, lo : lo + real]
            if size > real:
                chunk = torch.cat((chunk, chunk.new_zeros((1, size - real))), dim=1)
            logits = self._forward(sequence, chunk, real=real)
        assert logits is not None
        return logits

    def _prefill_pieces(self, sequence: Sequence, ids: torch.Tensor) -> torch.Tensor:
        """A prompt of a graph with carried states (a hybrid decoder) over a static cache whose chunks
        are not padded (carried_chunks: option prefill_pieces ``split``, or states that do
        not stop at a row): chunks of at most _carried_span tokens, each as unpadded pieces, largest
        first (prompt_pieces: powers of two, 37 = 32 + 4 + 1, or the finer sizes; a one-row piece is
        a decode step). Padding would fold its tokens into such states for good, so pieces are what
        lets a handful of recorded shapes serve every length. The pieces are the same whether the
        steps are captured or not: a chunk split otherwise rounds otherwise, and a capture setting
        would change the generated tokens. Returns the last row's logits."""
        return self._prefill_chunks(sequence, ids, self._carried_span(), pieces=True)

    def _prefill_chunks(self, sequence: Sequence, ids: torch.Tensor, span: int, *, pieces: bool) -> torch.Tensor:
        """The prompt as steps of chunks of at most ``span`` tokens, each whole or (``pieces``) as its
        prompt_pieces, largest first; a Progress line on stderr for a prompt of at least
        ``prefill_progress_tokens`` (None: never). Returns the last row's logits."""
        from onnxgen.progress import Progress

        n = ids.shape[1]
        threshold = self.prefill_progress_tokens
        logits = None
        with Progress("prefill", total=n, unit="tok", enabled=threshold is not None and n >= threshold) as bar:
            start = 0
            for lo in range(0, n, span):
                rows = min(span, n - lo)
                for piece in prompt_pieces(rows) if pieces else [rows]:
                    logits = self._forward(sequence, ids[:, start : start + piece])
                    start += piece
                    bar.update(piece)
        assert logits is not None
        return logits

    def _prefill_key_admitted(self, rows: int, kv: StaticKV) -> bool:
        """Whether a prefill chunk of ``rows`` rows over this cache runs captured: its shape is one of
        the first ``captured_prefill_keys`` seen (see there)."""
        key = (rows, kv.capacity)
        if key in self._prefill_keys:
            return True
        if len(self._prefill_keys) < self.captured_prefill_keys:
            self._prefill_keys.add(key)
            return True
        if not self._prefill_keys_said:
            self._prefill_keys_said = True
            warnings.warn(
                f"captured prefill: {self.captured_prefill_keys} chunk shapes are recorded already (each keeps "
                "its own graph memory); prompt chunks of other shapes run eagerly",
                stacklevel=2,
            )
        return False

    def _prefill_chunks_apply(self) -> bool:
        return self.has_mask and past_feeds_attention_in_place(self.session.model.graph, self.config)

    # -- capture ---------------------------------------------------------------------------

    def capture_runtime(self) -> CaptureRuntime:
        """The captured step's runtime (made on first use; static KV pins the KV length and the mask
        width, what a fixed capacity fixes)."""
        if self._capture is None:
            self._capture = self._new_capture_runtime("decode steps")
        return self._capture

    def prefill_runtime(self) -> CaptureRuntime:
        """The captured prefill chunks' runtime (_prefill_padded): a capture runtime of its own, so
        that the decode step's statistics (capture_stats) count decode steps only."""
        if self._prefill_capture is None:
            self._prefill_capture = self._new_capture_runtime("prefill chunks")
        return self._prefill_capture

    def batched_runtime(self, what: str = "batched decode steps") -> CaptureRuntime:
        """A new capture runtime for a batched decoder's steps or prompt groups (batched.py): one
        recording per shape over its KV pool (or its prompt scratch), whose slot length and mask
        width are fixed like a static cache's. Each decoder holds its own (its recordings adopt its
        buffers' addresses)."""
        return self._new_capture_runtime(what, fixed_kv=True)

    def _new_capture_runtime(self, what: str, *, fixed_kv: bool = False) -> CaptureRuntime:
        pin: set[str] = set()
        if self.kv_kind == "static" or fixed_kv:
            pin = StaticKV.pinned_symbols(self.session.graph_inputs, self.config)
        runtime = self.session.capture_runtime(
            mode=self.capture, recorder=self.capture_recorder, pin=pin, verify_steps=self.verify_steps
        )
        runtime.stats.what = what
        return runtime

    @property
    def capture_stats(self) -> CaptureStats:
        return self._capture.stats if self._capture is not None else CaptureStats(mode=self.capture)

    @property
    def prefill_capture_stats(self) -> CaptureStats:
        """The captured prefill chunks' statistics (a ``steps`` count of chunks, not of decode steps)."""
        runtime = self._prefill_capture
        return runtime.stats if runtime is not None else CaptureStats(mode=self.capture, what="prefill chunks")
