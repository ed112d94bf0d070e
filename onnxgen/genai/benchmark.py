"""Decode speed of one package through the Generator, the way a user runs it (``onnxgen bench``).

A fixed, seeded prompt of ``prompt_tokens`` ids is decoded greedily for exactly ``new_tokens``
tokens (EOS ignored), once as a warm-up (allocations, dequantized copies, CUDA-graph recording),
then ``repeats`` timed times. Each run reports the Generator's own statistics: TTFT (prefill + the
first token read back) and decode tok/s over the tokens after the first; the result is the median
run. Peers are compared by ``bench/peers_decode.py``; this measures onnxgen alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from onnxgen.errors import InvalidInputError
from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import SEED_LIMIT, SamplingParams


@dataclass
class BenchResult:
    package: str
    device: str
    kv: str
    capture: str
    prompt_tokens: int
    new_tokens: int
    repeats: int
    decode_tok_s: float  # median run
    ms_per_token: float
    ttft_ms: float
    decode_tok_s_runs: list[float] = field(default_factory=list)
    capture_summary: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        runs = ", ".join(f"{r:.1f}" for r in self.decode_tok_s_runs)
        return "\n".join([
            f"package   {self.package}",
            f"device    {self.device}  kv={self.kv}  capture={self.capture}",
            f"workload  prompt {self.prompt_tokens} tokens, {self.new_tokens} new, greedy, median of {self.repeats}",
            f"decode    {self.decode_tok_s:.1f} tok/s  ({self.ms_per_token:.3f} ms/token; runs: {runs})",
            f"TTFT      {self.ttft_ms:.1f} ms",
            *([f"capture   {self.capture_summary}"] if self.capture_summary else []),
        ])  # fmt: skip


def prompt_ids(vocab_size: int, count: int, seed: int = 0) -> list[int]:
    """``count`` seeded random ids in [0, vocab): the same workload on every run and engine."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count,), generator=generator).tolist()


def check_workload(prompt_tokens: int, new_tokens: int, repeats: int, seed: int) -> None:
    """The workload's own limits (the context is checked once the model is loaded): the CLI checks
    them before it loads anything."""
    if prompt_tokens < 1 or new_tokens < 2 or repeats < 1:
        raise InvalidInputError(
            f"bench needs prompt tokens >= 1, new tokens >= 2 and repeats >= 1 "
            f"(got {prompt_tokens}, {new_tokens}, {repeats})"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise InvalidInputError(f"bench's prompt seed must be an int in [0, 2**64), got {seed!r}")


PREFILL_WARMUP_RUNS = 3  # the capture runtime's two warm-up runs of a chunk shape, then its recording


def run_bench(
    generator: Generator,
    *,
    prompt_tokens: int = 16,
    new_tokens: int = 128,
    repeats: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    check_workload(prompt_tokens, new_tokens, repeats, seed)
    context = generator.config.context_length
    if prompt_tokens + new_tokens > context:
        raise InvalidInputError(
            f"prompt {prompt_tokens} + new {new_tokens} tokens exceed the model's context of {context} tokens"
        )
    ids = prompt_ids(generator.config.vocab_size, prompt_tokens, seed)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    say = progress or (lambda _: None)
    runs = []

    def generate() -> None:
        made = sum(1 for _ in generator.generate_ids(ids, params))
        if made != new_tokens:
            raise InvalidInputError(f"the generation stopped after {made} of {new_tokens} tokens")

    # warm-up: one run, or as many as a captured prefill needs to record its chunks (two eager
    # warm-ups, then the recording), so that every timed run replays like a warm server's
    for i in range(PREFILL_WARMUP_RUNS):
        say("warm-up run" if i == 0 else f"warm-up run {i + 1} (the captured prefill records)")
        generate()
        prefill = generator.engine.prefill_capture_stats
        if prefill.steps == 0 or prefill.captures > 0 or prefill.unsupported:
            break
    for i in range(1, repeats + 1):
        say(f"timed run {i} of {repeats}")
        generate()
        runs.append(generator.last_stats)
    rates = [r.decode_tok_s for r in runs]
    median = sorted(runs, key=lambda r: r.decode_tok_s)[len(runs) // 2]
    capture = generator.capture
    return BenchResult(
        package=str(generator.config.directory),
        device=str(generator.device),
        kv=generator.kv_kind,
        capture=capture,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        repeats=repeats,
        decode_tok_s=median.decode_tok_s,
        ms_per_token=1000 * median.decode_s / (new_tokens - 1),
        ttft_ms=1000 * statistics.median(r.ttft_s for r in runs),
        decode_tok_s_runs=rates,
        capture_summary=generator.capture_stats.summary() if capture != "off" else "",
    )
