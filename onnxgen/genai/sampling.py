"""Sampling parameters and the logits pipeline, all on the model's device.

Order (as in transformers / llama.cpp): penalties → temperature → top-k → top-p → min-p → draw.
Temperature 0 means greedy (argmax of the penalized logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from onnxgen.errors import OnnxgenError


class SamplingError(OnnxgenError):
    """A sampling value is out of its valid range."""


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int | None = None  # None: what remains of the context
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        checks = [
            (self.temperature >= 0.0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p < 1.0, f"min_p must be in [0, 1), got {self.min_p}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (
                self.max_new_tokens is None or self.max_new_tokens >= 1,
                f"max_new_tokens must be >= 1, got {self.max_new_tokens}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(message)
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class LogitsSampler:
    """Turns the last position's logits into the next token id, on the logits' device."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device):
        self.params = params.validate()
        self.device = device
        self.vocab_size = vocab_size
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            seed = params.seed if params.seed is not None else int(torch.seed() % (2**63))
            self.generator.manual_seed(seed)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self._penalize = (
            params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        )

    @property
    def plain_greedy(self) -> bool:
        """The token is the argmax of the raw logits (greedy, no penalty): what a step tail can do."""
        return self.params.greedy and not self._penalize

    def observe(self, token_ids: torch.Tensor) -> None:
        """Count tokens (prompt and generated) for the penalties."""
        if self._penalize:
            ids = token_ids.reshape(-1).to(self.device)
            self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized, tempered, truncated logits [vocab] in float32 (-inf where excluded)."""
        p = self.params
        logits = logits.reshape(-1)[: self.vocab_size].float()
        if self._penalize:
            seen = self.counts > 0
            if p.repetition_penalty != 1.0:
                scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
                logits = torch.where(seen, scaled, logits)
            if p.frequency_penalty != 0.0:
                logits = logits - p.frequency_penalty * self.counts
            if p.presence_penalty != 0.0:
                logits = logits - p.presence_penalty * seen.float()
        if p.greedy:
            return logits
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
            drop_sorted = before >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        if p.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        return logits

    def sample(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The next token as a 0-d int64 tensor on the device (no host read here); written into
        ``out`` (0-d int64) when given, which is then returned."""
        if self.plain_greedy:
            # argmax of the logits as they are: converting to fp32 first changes no value and no
            # order, and costs a kernel per token
            row = logits.reshape(-1)[: self.vocab_size]
            return torch.argmax(row) if out is None else torch.argmax(row, out=out)
        processed = self.process(logits)
        if self.params.greedy:
            token = torch.argmax(processed)
        else:
            probs = torch.softmax(processed, dim=-1)
            token = torch.multinomial(probs, 1, generator=self.generator).reshape(())
        return token if out is None else out.copy_(token)
