"""``ServeOptions``: everything `onnxgen serve` is configured with, declared once.

The CLI builds it from its arguments; tests build it directly. The server reads nothing else: no
environment variable, no global (tests/test_layering.py checks the environment rule).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onnxgen.genai.batch_scheduler import RunnerOptions


@dataclass(frozen=True)
class ServeOptions:
    """``model_name``: the id clients send as ``model`` and /v1/models lists (--served-model-name, else
    the --model name). ``max_queue``: requests that may wait for the engine before new ones get 503.
    ``max_choices``: choices (n x prompts) per request. ``max_body_bytes``: larger bodies get 413.
    ``shutdown_grace_s``: on SIGINT/SIGTERM, how long admitted requests may run on before they are
    cut with an error. ``api_key``: when set, /v1/*, /tokenize and /detokenize need ``Authorization:
    Bearer KEY``. ``stream_interval_s``: the least time between two reads of a request's tokens (the
    first is read at once): a stream faster than that is sent a few tokens per chunk, which keeps
    the event loop's work per second bounded, and with it what the loop takes from the engine
    thread's share of the interpreter. ``max_chunk_rate``: reads per second over all requests at
    most (0: no cap): with many streams open each one's interval widens to open streams /
    max_chunk_rate (pacing.py). ``max_num_seqs``: sequences decoded at once (continuous batching,
    genai/batch_scheduler.py); 1 decodes one request at a time (SerialScheduler, the captured
    single-sequence step on CUDA); None: 8 on the CPU, 1 on CUDA (one stream is fastest through the
    serial runner, and the default KV budget below is a CPU-sized one: a CUDA default sized from the
    device's memory has not been built). ``max_model_len``: tokens (prompt and output) one sequence
    may hold when batching; None: 16,384 tokens shared by the slots (at most the model's context, at
    least 256). ``prefix_caching``: a batching server reuses the KV rows of a prompt prefix it still
    holds (genai/kv_pool.py). ``state_snapshots``: for a hybrid decoder's carried states, snapshots
    after shared prompt prefixes that a batching server keeps (genai/state_snapshots.py; None: one
    per sequence slot, 0: none, as with prefix caching off). ``max_prefill_tokens``: prompt tokens
    a batching server computes between two decode steps at most (None: 512 where steps run
    eagerly, 2048 where they are captured and prompts run in groups; genai/batched.py).
    ``engine_process``: run the engine in a process of its own (genai/engine_process.py: the event
    loop's HTTP work and the engine's steps do not share one interpreter lock); None: the device's
    default (``in_engine_process``)."""

    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 64
    max_choices: int = 16
    max_body_bytes: int = 2 * 1024 * 1024
    shutdown_grace_s: float = 10.0
    stream_interval_s: float = 0.005
    max_chunk_rate: float = 2000.0
    device: str = "cpu"
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    prefix_caching: bool = True
    state_snapshots: int | None = None
    max_prefill_tokens: int | None = None
    engine_process: bool | None = None

    @property
    def runner(self) -> RunnerOptions:
        """The runner these options ask for (genai/batch_scheduler.py)."""
        from onnxgen.genai.batch_scheduler import RunnerOptions

        return RunnerOptions(
            max_seqs=self.batch_size,
            max_model_len=self.max_model_len,
            prefix_caching=self.prefix_caching,
            prefill_budget=self.max_prefill_tokens,
            state_snapshots=self.state_snapshots,
        )

    @property
    def in_engine_process(self) -> bool:
        """Whether the engine runs in a process of its own (engine_process, or the device's default:
        on CUDA, where the event loop's share of the interpreter lock slows the captured steps)."""
        if self.engine_process is not None:
            return self.engine_process
        return self.device.startswith("cuda")

    @property
    def batch_size(self) -> int:
        """Sequences decoded at once (max_num_seqs, or the device's default)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return 1 if self.device.startswith("cuda") else 8

    def __post_init__(self) -> None:
        checks = [
            (bool(self.model_name), "the served model name must not be empty"),
            (0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}"),
            (self.max_queue >= 1, f"--max-queue must be >= 1, got {self.max_queue}"),
            (self.max_choices >= 1, f"max_choices must be >= 1, got {self.max_choices}"),
            (self.max_body_bytes >= 1024, f"max_body_bytes must be >= 1024, got {self.max_body_bytes}"),
            (self.shutdown_grace_s >= 0, f"--shutdown-grace must be >= 0, got {self.shutdown_grace_s}"),
            (
                0 <= self.stream_interval_s <= 1,
                f"--stream-interval-ms must be in [0, 1000], got {self.stream_interval_s * 1000:g}",
            ),
            (
                self.max_chunk_rate == 0 or 10 <= self.max_chunk_rate <= 1e6,
                f"--max-chunk-rate must be 0 (no cap) or in [10, 1000000] chunks/s, got {self.max_chunk_rate:g}",
            ),
            (self.api_key is None or bool(self.api_key), "--api-key must not be empty"),
            (
                self.max_num_seqs is None or self.max_num_seqs >= 1,
                f"--max-num-seqs must be >= 1, got {self.max_num_seqs}",
            ),
            (
                self.max_prefill_tokens is None or self.max_prefill_tokens >= 16,
                f"--max-prefill-tokens must be >= 16, got {self.max_prefill_tokens}",
            ),
            (
                self.state_snapshots is None or self.state_snapshots >= 0,
                f"--state-snapshots must be >= 0, got {self.state_snapshots}",
            ),
            (
                self.max_model_len is None or self.max_model_len >= 2,
                f"--max-model-len must be >= 2, got {self.max_model_len}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                from onnxgen.errors import OnnxgenError

                raise OnnxgenError(message)


def runner_for_package(options: ServeOptions, package: Path) -> tuple[ServeOptions, str | None]:
    """``options`` with the runner this package can have: where batching is the device's default
    (no --max-num-seqs given) and the package's decoder cannot be batched (batched.batching_refusal:
    a hybrid's carried states, attention that keeps its own KV), one request at a time, with the
    line that says so; a --max-num-seqs the user gave is kept (the load then fails with the reason)."""
    if options.max_num_seqs is not None or options.batch_size <= 1:
        return options, None
    import onnx

    from onnxgen.genai.batched import batching_refusal
    from onnxgen.genai.graph_layout import with_graph_layout
    from onnxgen.genai.package import load_package_config

    config = load_package_config(package)
    model = onnx.load(str(config.model_file), load_external_data=False)
    refusal = batching_refusal(with_graph_layout(config, model), model)
    if refusal is None:
        return options, None
    note = f"onnxgen serve: this model is served one request at a time, not {options.batch_size} at once: {refusal}"
    return dataclasses.replace(options, max_num_seqs=1), note
