"""Generator: prompt → tokens. Prefill, decode loop, KV state, stop conditions, streaming."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onnxgen.errors import InvalidInputError, OnnxgenError
from onnxgen.genai.chat import render_chat
from onnxgen.genai.decode_tail import GreedyTail
from onnxgen.genai.kv_cache import DynamicKV, GrowingKV, StaticKV, past_feeds_attention_in_place
from onnxgen.genai.package import PackageConfig, load_package_config
from onnxgen.genai.package_checks import check_package, growing_kv
from onnxgen.genai.sampling import LogitsSampler, NonFiniteLogitsError, SamplingParams
from onnxgen.genai.tokenizer import Tokenizer
from onnxgen.runtime.capture.runtime import CaptureRuntime
from onnxgen.runtime.capture.stats import CaptureStats
from onnxgen.runtime.dtypes import ONNX_TO_TORCH
from onnxgen.runtime.model_io import load_model
from onnxgen.runtime.session import InferenceSession
from onnxgen.threads import ThreadOptions


class PromptTooLongError(OnnxgenError):
    """The prompt does not fit in the model's context."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prefill + first token
    decode_s: float = 0.0  # time for the tokens after the first
    stop_reason: str = ""
    kv: str = ""
    first_read_at: float = field(default=0.0, repr=False)  # perf_counter when the first token was read

    def count_token(self, start: float) -> None:
        """One more token read back on the host; ``start``: when the prompt was handed to the model."""
        now = time.perf_counter()
        self.new_tokens += 1
        if self.new_tokens == 1:
            self.first_read_at = now
            self.ttft_s = now - start
        else:
            self.decode_s = now - self.first_read_at

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok, new {self.new_tokens} tok, TTFT {self.ttft_s * 1000:.1f} ms, "
            f"decode {self.decode_tok_s:.1f} tok/s, stop: {self.stop_reason}, kv: {self.kv}"
        )


class HostRead:
    """One sampled token on its way to the host: ``start(token)`` enqueues the read of the 0-d device
    tensor, ``wait()`` blocks until that token (not later work) is there and returns it. One read
    is pending at a time; the pipelined decode loop starts it before it enqueues the next step.
    ``start(token, at)``: the step that made the token also stored it in the reader's pinned
    ``host_tokens`` at index ``at`` (GreedyTail), so only the step's end is waited for."""

    def start(self, token: torch.Tensor, at: int | None = None) -> None:
        raise NotImplementedError

    def wait(self) -> int:
        raise NotImplementedError


class CpuHostRead(HostRead):
    """CPU: nothing runs ahead of the host, so the value is taken at start time and handed out at
    wait time (this is what lets the tests run the pipelined loop on the CPU)."""

    def __init__(self) -> None:
        self.token: torch.Tensor | None = None

    def start(self, token: torch.Tensor, at: int | None = None) -> None:
        # the value now, as the CUDA read copies it in stream order: the caller may reuse the tensor
        self.token = token.clone()

    def wait(self) -> int:
        assert self.token is not None, "wait() without start()"
        token, self.token = self.token, None
        return int(token.item())


class CudaHostRead(HostRead):
    """CUDA: a non-blocking copy into pinned memory with an event recorded right after it. Both are
    enqueued before the next step, so ``wait`` waits for this token's kernels only, while the next
    step runs; ``int(token)`` there would wait for everything enqueued so far."""

    def __init__(self, device: torch.device, host_tokens: torch.Tensor | None = None):
        self.device = device
        self.buffer = torch.empty((), dtype=torch.int64, pin_memory=True)  # reused: one read pending at a time
        self.host_tokens = host_tokens
        self.at: int | None = None
        self.event = torch.cuda.Event()

    def start(self, token: torch.Tensor, at: int | None = None) -> None:
        if at is None or self.host_tokens is None:
            self.buffer.copy_(token.reshape(()), non_blocking=True)
            at = None
        self.at = at
        self.event.record(torch.cuda.current_stream(self.device))

    def wait(self) -> int:
        self.event.synchronize()
        if self.at is not None:
            return int(self.host_tokens[self.at])  # type: ignore[index]
        return int(self.buffer.item())


def host_read(device: torch.device, host_tokens: torch.Tensor | None = None) -> HostRead:
    """The pending token read for ``device`` (also used by bench/random_package.py); ``host_tokens``:
    the pinned tokens a step tail writes (HostRead.start's ``at``)."""
    return CudaHostRead(device, host_tokens) if device.type == "cuda" else CpuHostRead()


class Generator:
    """Runs a package's decoder: ``Generator(path, device="cpu")``, then ``generate``/``stream``.

    ``pipeline``: "auto" (default: on with CUDA, static KV and capture on/verify), "on" (True) or
    "off" (False). Pipelined, the decode loop enqueues step N+1 before it waits for token N, so the
    host builds the next step while the GPU runs the current one; tokens and stats are the same.
    "on" needs static KV; on the CPU it only exists for the tests (there is nothing to overlap).

    ``sample_in_graph`` (default True): with a captured static-KV step and plain greedy decoding
    (no penalties), the argmax and the next position and mask row run at the end of the step, inside
    its graph (decode_tail.py), so the host only launches it. Sampled decoding keeps its kernels
    between the steps. False keeps greedy's there too (the benches compare the two).

    ``threads`` (CPU): torch's thread count, ``ThreadOptions(num_threads=N)``; by default half the
    cores, unless OMP_NUM_THREADS or torch.set_num_threads chose already (onnxgen/threads.py says
    why: torch's threads collapse when cores are shared).
    """

    prefill_chunk = 256  # prompt tokens per CPU prefill step (_prefill); 0: one step
    prefill_progress_tokens: int | None = 1024  # prompts this long show prefill progress on stderr

    def __init__(
        self,
        package: str | Path | PackageConfig,
        device: str = "cpu",
        *,
        kv: str = "auto",
        session: InferenceSession | None = None,
        capture: str | None = None,
        recorder: Any = None,
        verify_steps: int = 8,
        pipeline: str | bool = "auto",
        sample_in_graph: bool = True,
        threads: ThreadOptions | None = None,
    ):
        self.threads: int | None = None  # torch's CPU thread count in force (CPU generators)
        if torch.device(device).type == "cpu":  # torch's thread count is per process (onnxgen/threads.py)
            self.threads = (threads or ThreadOptions()).apply()
        self.config = package if isinstance(package, PackageConfig) else load_package_config(package)
        # the package is checked against the graph proto before any weight is read (and read once)
        proto, model_dir = (session.model, None) if session is not None else load_model(self.config.model_file)
        check_package(self.config, proto)
        self.tokenizer = Tokenizer(self.config.directory)
        self.session = session or InferenceSession(proto, device=device, base_dir=model_dir)
        self.device = self.session.device
        inputs = {i.name: i for i in self.session.program.inputs}
        io = self.config.io
        self.has_mask = bool(io.attention_mask) and io.attention_mask in inputs
        self.has_positions = bool(io.position_ids) and io.position_ids in inputs
        self.kv_dtype = ONNX_TO_TORCH[inputs[self.config.past_key_name(0)].elem_type]
        if kv == "auto":
            kv = "static" if self.config.share_buffer else "dynamic"
        if kv not in ("static", "dynamic"):
            raise InvalidInputError(f"kv must be 'auto', 'static' or 'dynamic', got {kv!r}")
        if kv == "static" and not self.has_mask:
            raise InvalidInputError("static KV needs an attention_mask input to carry the valid length")
        growing = growing_kv(self.config, list(proto.graph.node)) if kv == "static" else None
        if growing:
            raise InvalidInputError(
                f"kv static needs a decoder that writes each step's KV rows in place into a fixed buffer "
                f"(com.microsoft GroupQueryAttention with past and present sharing it), but {growing}: "
                "its KV grows every step; use kv 'dynamic' (or 'auto')"
            )
        self.kv_kind = kv
        self.eos_ids = set(self.config.eos_token_ids)
        eos = self.tokenizer.token_id(self.tokenizer.eos_token)
        if eos is not None:
            self.eos_ids.add(eos)
        self.last_stats = GenerationStats()
        # CUDA graphs for the single-token decode step (prefill stays eager): on by default on CUDA,
        # off on the CPU (a test passes a CPU ReplayRecorder to exercise the logic there)
        self.capture = capture or ("on" if self.device.type == "cuda" else "off")
        self.capture_recorder = recorder
        self.verify_steps = verify_steps
        if self.capture not in ("on", "off", "verify"):
            raise InvalidInputError(f"capture must be 'on', 'off' or 'verify', got {self.capture!r}")
        if self.capture != "off" and self.device.type != "cuda" and recorder is None:
            raise InvalidInputError("capture needs CUDA graphs: use capture='off' on the CPU")
        self._capture: CaptureRuntime | None = None
        self._in_place: bool | None = None  # see _grows_in_place
        self._static_kv: StaticKV | None = None
        self._decode_feeds: tuple[torch.Tensor, torch.Tensor] | None = None  # see _decode_buffers
        self.sample_in_graph = bool(sample_in_graph)
        self._tail: GreedyTail | None = None  # of the static cache it was made for (its mask)
        self._tail_ready_at: int | None = None  # the KV length the last step's tail prepared the feeds for
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

    # -- prompts ---------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        t = self.tokenizer
        return render_chat(t.chat_template, messages, bos_token=t.bos_token, eos_token=t.eos_token)

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of a text prompt (with the chat template if ``chat``), or a caller's ids checked:
        ints (numpy integers too; bool and float refused) within [0, vocab_size), not empty, leaving
        room for one new token. The checked ids are what keeps the decode loop free of bound checks:
        sampled tokens are always in range."""
        if isinstance(prompt, (list, tuple)):
            return self._checked_ids(prompt)
        if not isinstance(prompt, str):
            raise InvalidInputError(
                f"the prompt must be a str or a list of token ids (int), got {type(prompt).__name__}"
            )
        if chat:
            prompt = self.apply_chat_template([{"role": "user", "content": prompt}])
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidInputError(
                f"the prompt is not valid UTF-8 text: U+{ord(prompt[exc.start]):04X} at character {exc.start} is "
                "a lone surrogate (what Python makes of bytes that are not UTF-8, e.g. in a command-line argument)"
            ) from None
        return self._checked_ids(self.tokenizer.encode(prompt))

    def _checked_ids(self, prompt_ids: list[int] | tuple[int, ...]) -> list[int]:
        vocab = self.config.vocab_size
        ids: list[int] = []
        for index, value in enumerate(prompt_ids):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InvalidInputError(
                    f"token ids must be ints; the one at index {index} is {value!r} ({type(value).__name__})"
                )
            if not 0 <= value < vocab:
                raise InvalidInputError(
                    f"token id {int(value)} at index {index} is outside the vocabulary [0, {vocab}) of this model"
                )
            ids.append(int(value))
        if not ids:
            raise InvalidInputError("the prompt is empty; give at least one token of text")
        if len(ids) >= self.config.context_length:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, but the context holds {self.config.context_length} "
                "(prompt plus at least one new token)"
            )
        return ids

    # -- the loop --------------------------------------------------------------------------

    def _static_capacity(self, total: int) -> int:
        """KV rows for a generation of ``total`` tokens: the next power of two (at least 256), at most
        the context. On CUDA the attention spans the whole buffer (fixed shapes for capture), so a
        buffer sized for the full context would cost every step; a few sizes keep recordings reusable."""
        past = next(i for i in self.session.program.inputs if i.name == self.config.past_key_name(0))
        if past.shape and isinstance(past.shape[2], int):
            return past.shape[2]  # a graph built for a fixed buffer length
        context = self.config.context_length
        return min(context, max(256, 1 << max(0, total - 1).bit_length()))

    def _new_kv(self, total: int) -> DynamicKV | GrowingKV | StaticKV:
        if self.kv_kind == "static":
            capacity = self._static_capacity(total)
            if self.capture == "off":
                return StaticKV(self.config, self.kv_dtype, self.device, capacity)
            # captured decode reads the KV buffers at fixed addresses: keep one cache, reset in
            # place (a new one would invalidate the recording and cost a re-record per generation)
            kv = self._static_kv
            if kv is None or kv.capacity != capacity:
                kv = self._static_kv = StaticKV(self.config, self.kv_dtype, self.device, capacity)
            kv.reset()
            return kv
        if self._grows_in_place():
            return GrowingKV(self.config, self.kv_dtype, self.device, limit=self.config.context_length)
        return DynamicKV(self.config, self.kv_dtype, self.device)

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

    def _decode_buffers(self, kv: DynamicKV | GrowingKV | StaticKV) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token ids [1, 1], positions [1, 1]) fed to every captured one-token step with static KV:
        the same device tensors each step, so the capture uses them in place (no copy into its
        bindings), and the sampler writes the next token straight into the ids. None elsewhere."""
        if kv.kind != "static" or self.capture == "off":
            return None
        if self._decode_feeds is None:
            ids = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
            self._decode_feeds = (ids, torch.zeros_like(ids))
        return self._decode_feeds

    def _token_out(self, kv: DynamicKV | GrowingKV | StaticKV) -> torch.Tensor | None:
        """Where the sampler writes the next token (a 0-d view of the decode ids), or None."""
        buffers = self._decode_buffers(kv)
        return buffers[0].view(()) if buffers is not None else None

    def _tail_for(self, kv: DynamicKV | GrowingKV | StaticKV, sampler: LogitsSampler) -> GreedyTail | None:
        """The step tail of this generation's one-token steps, or None (the sampler runs between them)."""
        buffers = self._decode_buffers(kv)
        if buffers is None or not self.sample_in_graph or not sampler.plain_greedy or not isinstance(kv, StaticKV):
            return None
        tail = self._tail
        if tail is None or tail.state()["mask"] is not kv.mask:
            ids, pos = buffers
            host = GreedyTail.host_tokens_for(kv.capacity, self.device)
            tail = self._tail = GreedyTail(self.config.io.logits, self.config.vocab_size, ids, pos, kv.mask, host)
        return tail

    def _step(
        self, kv: DynamicKV | GrowingKV | StaticKV, ids: torch.Tensor, tail: GreedyTail | None = None
    ) -> torch.Tensor:
        """One step of ``ids.shape[1]`` tokens; returns the last row's logits. With ``tail`` (one-token
        captured steps only) the step also writes the next token into the decode ids."""
        io = self.config.io
        n = ids.shape[1]
        feeds: dict[str, torch.Tensor] = {io.input_ids: ids}
        buffers = self._decode_buffers(kv) if n == 1 else None
        if buffers is None:
            tail = None
        # the previous step's tail already wrote this step's position and mask row
        prepared = tail is not None and self._tail_ready_at == kv.length
        if buffers is not None:
            if ids.data_ptr() != buffers[0].data_ptr():  # the token came from elsewhere (a caller's id)
                buffers[0].copy_(ids.reshape(1, 1))
            feeds[io.input_ids] = buffers[0]
            if not prepared and (self.has_positions or tail is not None):
                buffers[1].fill_(kv.length)  # the position feed, and what a tail counts on from
        if self.has_mask:
            # prepared implies a static cache (a tail needs one)
            feeds[io.attention_mask] = kv.attention_mask(n, set_rows=False) if prepared else kv.attention_mask(n)
        if self.has_positions:
            if buffers is not None:
                feeds[io.position_ids] = buffers[1]
            else:
                feeds[io.position_ids] = torch.arange(kv.length, kv.length + n, device=self.device).reshape(1, n)
        feeds.update(kv.feeds())
        if n == 1 and self.capture != "off":
            outputs = self._capture_runtime(kv).run(self.session.check_feeds_repeated(feeds), tail=tail)
        else:
            outputs = self.session.run_torch(feeds)
        kv.update(outputs, n)
        self._tail_ready_at = kv.length if tail is not None else None
        return outputs[io.logits][0, -1]

    def _prefill(self, kv: DynamicKV | GrowingKV | StaticKV, ids: torch.Tensor) -> torch.Tensor:
        """The prompt's steps; returns the last row's logits.

        On the CPU, where the graph's attention is GroupQueryAttention reading the past directly
        (it takes a later prompt chunk: rows at T - S, causal within the chunk), the prompt runs in
        chunks of ``prefill_chunk`` tokens. One pass would hold every row's logits ([S, vocab] fp32,
        the largest tensor of a long prefill) and an S x S attention per head at once; a chunk holds
        ``prefill_chunk`` rows of each. A prompt of at least ``prefill_progress_tokens`` shows a
        Progress line on stderr (None: never). Elsewhere (CUDA, graphs that concatenate their own
        KV) the prompt is one step, as before."""
        n = ids.shape[1]
        chunk = self.prefill_chunk
        if self.device.type != "cpu" or not chunk or n <= chunk or not self._prefill_chunks_apply():
            return self._step(kv, ids)
        from onnxgen.progress import Progress

        threshold = self.prefill_progress_tokens
        with Progress("prefill", total=n, unit="tok", enabled=threshold is not None and n >= threshold) as bar:
            for lo in range(0, n, chunk):
                logits = self._step(kv, ids[:, lo : lo + chunk])
                bar.update(min(chunk, n - lo))
        return logits

    def _prefill_chunks_apply(self) -> bool:
        return self.has_mask and past_feeds_attention_in_place(self.session.model.graph, self.config)

    def _capture_runtime(self, kv: DynamicKV | GrowingKV | StaticKV) -> CaptureRuntime:
        if self._capture is None:
            pin: set[str] = set()
            if kv.kind == "static":  # fixed capacity: the KV length and the mask width are pinned
                pin = StaticKV.pinned_symbols(self.session.program.inputs, self.config)
            self._capture = CaptureRuntime(
                self.session.program,
                self.session.model,
                mode=self.capture,
                recorder=self.capture_recorder,
                pin=pin,
                verify_steps=self.verify_steps,
            )
        return self._capture

    @property
    def capture_stats(self) -> CaptureStats:
        return self._capture.stats if self._capture is not None else CaptureStats(mode=self.capture)

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Iterator[int]:
        """Yields new token ids; stops on EOS or max_new_tokens (stop strings are text-level).

        Raises NonFiniteLogitsError, naming the new token, where the model's logits are NaN or
        infinite. Checked: the first token on every path (its logits row's maximum, or the draw's
        probabilities), and every later token the sampler picks between the steps (its row's maximum
        on the device, folded into the token the host reads anyway; the sampled draw's own check).
        Not checked: the tokens that a captured greedy step's tail picks (sample_in_graph), where
        such a row yields the index of a NaN as argmax does."""
        params = (params or SamplingParams()).validate()
        prompt_ids = self._checked_ids(prompt_ids)
        try:
            yield from self._generate_ids(prompt_ids, params)
        except NonFiniteLogitsError as exc:
            raise NonFiniteLogitsError(
                f"{exc}, at new token {self.last_stats.new_tokens + 1} after a prompt of {len(prompt_ids)} tokens; "
                "the package's weights may be damaged, or its precision overflows on this input"
            ) from None

    def _generate_ids(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        context = self.config.context_length
        room = context - len(prompt_ids)
        max_new = min(params.max_new_tokens or room, room)
        stats = GenerationStats(prompt_tokens=len(prompt_ids), kv=self.kv_kind)
        self.last_stats = stats
        sampler = LogitsSampler(params, self.config.vocab_size, self.device)
        kv = self._new_kv(len(prompt_ids) + max_new)
        ids = torch.tensor([prompt_ids], dtype=torch.int64, device=self.device)
        sampler.observe(ids)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self._token_out(kv)
            token = sampler.sample(self._prefill(kv, ids), out=out)
            tail = self._tail_for(kv, sampler)

            def advance(token: torch.Tensor) -> tuple[torch.Tensor, int | None]:
                """Enqueue the step fed by ``token``; returns the next token (on the device) and, where
                the step's tail also stored it in pinned host memory, its index there."""
                sampler.observe(token.reshape(1))
                logits = self._step(kv, token.reshape(1, 1), tail)
                if tail is not None:  # the step's tail wrote it, at the new position
                    return tail.state()["ids"].view(()), kv.length if tail.writes_host else None
                return sampler.sample(logits, out=out), None

            if self.pipelined and isinstance(kv, StaticKV):
                host = tail.host_tokens if tail is not None and tail.writes_host else None
                reader = host_read(self.device, host)
                ignore_eos = params.ignore_eos
                yield from self._decode_pipelined(token, advance, reader, stats, start, max_new, room, ignore_eos)
                return
            while True:
                token_id = LogitsSampler.check(token)  # the one device-to-host read per token
                stats.count_token(start)
                if token_id in self.eos_ids and not params.ignore_eos:
                    stats.stop_reason = "eos"
                    return
                yield token_id
                if stats.new_tokens >= max_new:
                    stats.stop_reason = "length" if max_new < room else "context full"
                    return
                token = advance(token)[0]

    def _decode_pipelined(
        self,
        token: torch.Tensor,
        advance: Callable[[torch.Tensor], tuple[torch.Tensor, int | None]],
        reader: HostRead,
        stats: GenerationStats,
        start: float,
        max_new: int,
        room: int,
        ignore_eos: bool,
    ) -> Iterator[int]:
        """generate_ids' loop with one step of lookahead: once token N exists on the device (sampled,
        its host read started), step N+1 is enqueued from that device tensor, and only then does the
        host wait for token N. Same tokens, stop reasons and stats as the sequential loop:

        - a step is enqueued only for a token after which one more may come (N < max_new), so no step
          runs past max_new_tokens or the context;
        - the first token is read before the next step is built (then enqueued before it is handed
          out): TTFT stays prefill + first read, and a first decode step that warms up or records the
          capture is not counted in it;
        - EOS is seen when the token is read: the lookahead step already enqueued is dropped. It wrote
          one KV row past this generation's end into the static cache, which the next generation resets
          (``_new_kv``), as it does when the consumer stops iterating early;
        - an error raised while enqueuing step N+1 surfaces after token N is handed out (or not at
          all if token N is EOS), where the sequential loop would have raised it.

        ``token``: the first new token, on the device; ``advance(token)`` enqueues the step it feeds and
        returns the next token (sampled after the step, or by the step's tail) with its index in
        ``reader``'s pinned host tokens where the tail stored it there (no copy to wait for), else None.
        ``sampler.observe`` and the sampling stay on the device, in stream order with the steps."""
        ahead: tuple[torch.Tensor, int | None] | None = None
        at: int | None = None  # where the token on the device is in the reader's host tokens

        def try_advance(token: torch.Tensor) -> Exception | None:
            """advance(); an error is returned, to be raised after the token."""
            nonlocal ahead
            try:
                ahead = advance(token)
            except Exception as exc:
                return exc
            return None

        while True:
            n = stats.new_tokens + 1  # the token on the device is the n-th new one
            reader.start(token, at)  # before step n+1 is enqueued: the wait below is for token n only
            failed = try_advance(token) if 1 < n < max_new else None
            token_id = LogitsSampler.check(reader.wait())
            stats.count_token(start)
            if token_id in self.eos_ids and not ignore_eos:
                stats.stop_reason = "eos"
                return
            if n == 1 and n < max_new:  # the first token is back: its step runs while it is handed out
                failed = try_advance(token)
            yield token_id
            if failed is not None:
                raise failed
            if n >= max_new:
                stats.stop_reason = "length" if max_new < room else "context full"
                return
            assert ahead is not None
            token, at = ahead

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False
    ) -> Iterator[str]:
        """Yields text pieces as they are decoded; honours stop strings (never emitted)."""
        params = (params or SamplingParams()).validate()
        prompt_ids = self.encode(prompt, chat=chat)
        decoder = self.tokenizer.stream()
        pending = ""
        hold = max((len(s) for s in params.stop), default=0)
        for token_id in self.generate_ids(prompt_ids, params):
            pending += decoder.push(token_id)
            if params.stop:
                cut = min((pending.find(s) for s in params.stop if s in pending), default=-1)
                if cut >= 0:
                    if pending[:cut]:
                        yield pending[:cut]
                    self.last_stats.stop_reason = "stop string"
                    return
                # hold back a tail that could still become a stop string
                safe = len(pending) - (hold - 1)
                if safe > 0:
                    yield pending[:safe]
                    pending = pending[safe:]
            elif pending:
                yield pending
                pending = ""
        if pending:
            yield pending

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False) -> str:
        return "".join(self.stream(prompt, params, chat=chat))
