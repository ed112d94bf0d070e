"""Generator: prompt text → text. Tokenizer, chat template, stop strings, streaming and stats over
the decode engine (engine.py), which runs the token ids. ``events`` is the one loop from token ids to
text (events.py: one event per token, then a final one); ``stream`` and ``generate`` read it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from onnxgen.genai.engine import DecodeEngine, engine_model
from onnxgen.genai.events import GenerationEvent
from onnxgen.genai.graph_layout import with_graph_layout
from onnxgen.genai.package import PackageConfig, load_package_config
from onnxgen.genai.package_checks import check_package
from onnxgen.genai.prompt_text import PromptText, PromptTooLongError
from onnxgen.genai.sampling import NonFiniteLogitsError, SamplingParams, checked_params
from onnxgen.genai.sequence import GenerationStats, Sequence
from onnxgen.genai.text_stream import TextStream
from onnxgen.runtime.capture.stats import CaptureStats
from onnxgen.runtime.model_io import load_model
from onnxgen.runtime.session import InferenceSession, resolve_device
from onnxgen.threads import ThreadOptions

__all__ = ["GenerationStats", "Generator", "PromptTooLongError"]


class Generator:
    """Runs a package's decoder: ``Generator(path, device="cpu")``, then ``generate``/``stream``/``events``.

    Text, chat templates, stop strings, streaming and stats are the Generator's; the token ids are
    decoded by its ``engine`` (DecodeEngine, engine.py), to which the options below are handed.

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
        device = resolve_device(device)  # a bad name is refused before the package is read
        if device.type == "cpu":  # torch's thread count is per process (onnxgen/threads.py)
            self.threads = (threads or ThreadOptions()).apply()
        self.config = package if isinstance(package, PackageConfig) else load_package_config(package)
        # the package is checked against the graph proto before any weight is read (and read once)
        proto, model_dir = (session.model, None) if session is not None else load_model(self.config.model_file)
        check_package(self.config, proto)
        self.config = with_graph_layout(self.config, proto)  # KV layers and carried states, from the graph
        self.text = PromptText(self.config)
        self.tokenizer = self.text.tokenizer
        if session is None:
            session = InferenceSession(engine_model(proto, self.config), device=device, base_dir=model_dir)
        self.session = session
        self.engine = DecodeEngine(
            self.session,
            self.config,
            kv=kv,
            capture=capture,
            recorder=recorder,
            verify_steps=verify_steps,
            pipeline=pipeline,
            sample_in_graph=sample_in_graph,
            package_model=proto,
        )
        self.device = self.session.device
        self.kv_kind = self.engine.kv_kind
        self.capture = self.engine.capture
        self.pipeline = self.engine.pipeline
        self.pipelined = self.engine.pipelined
        self.sample_in_graph = self.engine.sample_in_graph
        self.has_mask = self.engine.has_mask
        self.has_positions = self.engine.has_positions
        self.eos_ids = self.text.eos_ids
        self.last_stats = GenerationStats()

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per CPU prefill step (DecodeEngine.prefill_chunk); 0: one step."""
        return self.engine.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int) -> None:
        self.engine.prefill_chunk = tokens

    @property
    def prefill_progress_tokens(self) -> int | None:
        """Prompts this long show prefill progress on stderr (None: never)."""
        return self.engine.prefill_progress_tokens

    @prefill_progress_tokens.setter
    def prefill_progress_tokens(self, tokens: int | None) -> None:
        self.engine.prefill_progress_tokens = tokens

    # -- prompts ---------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return self.text.apply_chat_template(messages)

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of a text prompt (with the chat template if ``chat``), or a caller's ids checked:
        ints (numpy integers too; bool and float refused) within [0, vocab_size), not empty, leaving
        room for one new token. The checked ids are what keeps the decode loop free of bound checks:
        sampled tokens are always in range."""
        return self.text.encode(prompt, chat=chat)

    def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Checked prompt ids of a chat: the package's chat template over the whole ``messages``
        list (each a dict with a str "role" and a str "content"; flattening content parts is the
        caller's), with the assistant's turn opened for the reply."""
        return self.text.encode_messages(messages)

    # -- generation ----------------------------------------------------------------------

    @property
    def capture_stats(self) -> CaptureStats:
        return self.engine.capture_stats

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Iterator[int]:
        """Yields new token ids; stops on EOS or max_new_tokens (stop strings are text-level).

        Raises NonFiniteLogitsError, naming the new token, where the model's logits are NaN or
        infinite (which tokens are checked: DecodeEngine.generate)."""
        params = checked_params(params)
        yield from self._run(self.engine.new_sequence(prompt_ids, params, self.eos_ids))

    def _run(self, sequence: Sequence) -> Iterator[int]:
        """The engine's tokens of ``sequence``, whose stats become ``last_stats``."""
        self.last_stats = sequence.stats
        try:
            yield from self.engine.generate([sequence])
        except NonFiniteLogitsError as exc:
            raise NonFiniteLogitsError(
                f"{exc}, at new token {sequence.stats.new_tokens + 1} after a prompt of {len(sequence.prompt_ids)} "
                "tokens; the package's weights may be damaged, or its precision overflows on this input"
            ) from None

    def events(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False
    ) -> Iterator[GenerationEvent]:
        """One ``GenerationEvent`` per new token, then exactly one final event (token_id None,
        finish_reason "stop" or "length", text: what was still held back, "" if nothing).

        ``prompt``: text (with the chat template if ``chat``) or token ids (``encode_messages`` makes
        them for a message list). The prompt and the parameters are checked here, when ``events`` is
        called, so a caller can refuse a request before it starts iterating. Text is held back while
        it could still become a stop string or ends in an incomplete UTF-8 character; a stop string is
        never released, and the text before it is released with the token that completed it.

        Afterwards ``last_stats`` holds the usage (set when iteration starts). Its ``new_tokens``
        counts every token the model produced, the EOS (a stop id) included, as OpenAI counts
        completion tokens; the EOS itself has no event. Closing the iterator early (``close()``, or
        dropping it) stops the generation there: no further decode step runs, and the sequence's KV
        state is released (``last_stats.stop_reason`` is then "cancelled")."""
        params = checked_params(params)
        return self._events(self.engine.new_sequence(self.encode(prompt, chat=chat), params, self.eos_ids))

    def _events(self, sequence: Sequence) -> Iterator[GenerationEvent]:
        """The one loop from token ids to events (text_stream.TextStream: text decoding, the
        stop-string hold-back) with each token's logprobs."""
        params = sequence.sampler.params
        text = TextStream(self.tokenizer, params)
        ids = self._run(sequence)
        try:
            for token_id in ids:
                logprob = sequence.logprobs[-1] if params.logprobs is not None else None
                yield text.push(token_id, logprob)
                if text.stopped:
                    break
        finally:
            ids.close()  # an early end (a stop string, the caller's close) ends the engine's loop here
        if text.stopped:  # after the close, which calls an unfinished sequence cancelled
            self.last_stats.stop_reason = "stop string"
        yield text.final(self.last_stats.stop_reason)

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False
    ) -> Iterator[str]:
        """Yields text pieces as they are decoded (``events``' non-empty texts); honours stop strings
        (never emitted)."""
        for event in self.events(prompt, params, chat=chat):
            if event.text:
                yield event.text

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False) -> str:
        return "".join(self.stream(prompt, params, chat=chat))
