"""One generation as the decode engine sees it: token ids in, token ids out, and its own state.

A ``Sequence`` is what a scheduler will hand the engine in batches: its prompt ids, its sampler
(the sampling parameters), its stop ids, its KV state and position, the ids generated so far, and
whether it is done. The engine fills in everything below ``stop_ids`` as it runs it; nothing in
here knows text, tokenizers or chat templates.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from onnxgen.genai.events import TokenLogprob
from onnxgen.genai.sampling import LogitsSampler

if TYPE_CHECKING:
    from onnxgen.genai.decode_tail import GreedyTail, SampledTail
    from onnxgen.genai.kv_cache import DynamicKV, GrowingKV, StaticKV


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prefill + first token
    decode_s: float = 0.0  # time for the tokens after the first
    stop_reason: str = ""
    kv: str = ""
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not computed (batched decoding's prefix reuse)
    # a hybrid decoder's state snapshots (state_snapshots.py): restored for its reused prefix (0 or 1),
    # and taken of its prompt's prefix for later prompts
    snapshot_hits: int = 0
    snapshot_takes: int = 0
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


@dataclass(eq=False)
class Sequence:
    """A generation's state (``DecodeEngine.new_sequence`` makes one).

    Invariants while it runs: ``kv.length`` rows of KV hold the prompt and the generated tokens fed
    so far (the position of the next step); ``token`` is the newest token on the device, sampled but
    not yet read by the host; ``token_at`` is its index in the pinned host tokens where the step's
    tail stored it there (else None); ``tail`` is the step tail that samples its one-token steps
    inside the graph (None: its sampler runs between them); ``prepared_at`` is the KV length for
    which the last step's tail already set the next step's position and mask row (None: the host
    sets them). ``sampled`` counts the tokens the sampler drew between the steps (a sequence that
    needs them counted, min_tokens, has no tail).
    ``max_new_tokens`` is what the context leaves room for at most; ``limit_reason`` the stop reason
    when it is reached ("length" or "context full")."""

    prompt_ids: list[int]
    sampler: LogitsSampler
    max_new_tokens: int
    limit_reason: str
    stop_ids: frozenset[int] = frozenset()
    stats: GenerationStats = field(default_factory=GenerationStats)
    generated: list[int] = field(default_factory=list)
    done: bool = False
    kv: DynamicKV | GrowingKV | StaticKV | None = None
    token: torch.Tensor | None = None
    token_at: int | None = None
    tail: GreedyTail | SampledTail | None = None
    prepared_at: int | None = None
    started_at: float = 0.0  # perf_counter when the prompt was handed to the model
    sampled: int = 0  # tokens sampled so far between the steps (min_tokens counts these)
    # logprobs (SamplingParams.logprobs): those of each sampled token not yet read by the host, in
    # order (sampling.logprobs_of), and those of the tokens in ``generated``, one each
    pending_logprobs: deque[torch.Tensor] = field(default_factory=deque)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # batched decoding (batched.py): the KV pool slot it decodes in, and the prompt rows held there
    slot: int | None = None
    prefilled: int = 0

    def finish(self, reason: str) -> None:
        self.stats.stop_reason = reason
        self.done = True
