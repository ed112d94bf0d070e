"""Sampling parameters and the logits pipeline, all on the model's device.

Order (as in transformers / llama.cpp): penalties → temperature → top-k → top-p → min-p → draw.
Temperature 0 means greedy (argmax of the penalized logits).

Numerics: the pipeline runs in float32. Where a division can leave float32's range (a temperature or a
repetition penalty below ``SHIFT_BELOW``), the row is scaled relative to its maximum, so its values
lie in [-inf, 0] and the best token stays 0: a temperature of 1e-39 draws the argmax, as its limit
does, instead of inf - inf = NaN. Softmax, top-k, top-p and min-p do not change under such a shift.

Non-finite logits (NaN, +inf, or all -inf: a damaged model) are never turned into a token: the
greedy paths write ``NON_FINITE`` (-1) instead, on the device, which the host sees when it reads the
token (no extra read); the sampled path's draw refuses the probabilities. ``check`` raises for it.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from onnxgen.errors import OnnxgenError

# Below this temperature or repetition penalty, the scaled logits are taken relative to the row's
# maximum; at and above it the values are transformers' (overflow then needs |logit| > 3e35).
SHIFT_BELOW = 1e-3
NON_FINITE = -1  # the token id the greedy paths write for a row whose maximum is not finite
_F32 = torch.finfo(torch.float32)
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2**64); negative seeds alias (s + 2**64)


class SamplingError(OnnxgenError):
    """A sampling value has the wrong type or is out of its valid range."""


class NonFiniteLogitsError(OnnxgenError):
    """The model produced NaN or infinite logits: there is no token to pick."""


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _real(name: str, value: Any) -> float:
    """A finite real number (int, float or a numpy scalar; bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingError(f"{name} must be a number (float), got {_describe(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise SamplingError(f"{name} must be a finite number, got {number}")
    return number


def _integer(name: str, value: Any) -> int:
    """An int (or a numpy integer); floats, bools and strings are refused, not truncated."""
    if isinstance(value, bool):
        raise SamplingError(f"{name} must be an int, got {_describe(value)}")
    try:
        return operator.index(value)
    except TypeError:
        raise SamplingError(f"{name} must be an int, got {_describe(value)}") from None


def _stop_strings(value: Any) -> list[str]:
    """One stop string (a str) or a list/tuple of them; never the letters of one string."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise SamplingError(f"stop must be a str or a list of str, got {_describe(value)}")
    for s in value:
        if not isinstance(s, str):
            raise SamplingError(f"stop must be a str or a list of str; it holds {_describe(s)}")
        if not s:
            raise SamplingError("stop strings must not be empty")
    return list(value)


@dataclass
class SamplingParams:
    """What to sample and when to stop. ``validate()`` (the Generator calls it) checks every field's
    type and range and normalizes it: numbers become float/int, ``stop`` a list of str.

    ``seed``: an int in [0, 2**64) (torch's generator range); negative seeds are refused, since torch
    maps s and s + 2**64 to the same stream. None: a fresh random seed per generation."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int | None = None  # None: what remains of the context
    stop: list[str] | str = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            setattr(self, name, _real(name, getattr(self, name)))
        self.top_k = _integer("top_k", self.top_k)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
            if not 0 <= self.seed < SEED_LIMIT:
                raise SamplingError(f"seed must be >= 0 and < 2**64, got {self.seed}")
        if self.max_new_tokens is not None:
            self.max_new_tokens = _integer("max_new_tokens", self.max_new_tokens)
        self.stop = _stop_strings(self.stop)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos must be a bool, got {_describe(self.ignore_eos)}")
        # the values are finite here, so every comparison below means what it says (none sees a NaN)
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
            # clamped: a NON_FINITE token (-1) may be observed before the host reads it (the pipelined
            # loop's lookahead), and an out-of-range index_add_ is a device-side assert on CUDA
            ids = token_ids.reshape(-1).to(self.device).clamp(min=0)
            self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized, tempered, truncated logits [vocab] in float32 (-inf where excluded); NaN only
        where the model's logits are not finite (see the module's note on the numerics)."""
        p = self.params
        logits = logits.reshape(-1)[: self.vocab_size].float()
        if self._penalize:
            seen = self.counts > 0
            if p.repetition_penalty != 1.0:
                logits = self._repetition_penalty(logits, seen, p.repetition_penalty)
            if p.frequency_penalty != 0.0:
                logits = logits - p.frequency_penalty * self.counts
            if p.presence_penalty != 0.0:
                logits = logits - p.presence_penalty * seen.float()
        if p.greedy:
            return logits
        if p.temperature < SHIFT_BELOW:
            # (x - max) / T lies in [-inf, 0] and is 0 at the max: no overflow, and no 0 / 0 since T
            # is floored at float32's smallest normal (a float32 zero otherwise)
            logits = (logits - logits.max()) / max(p.temperature, _F32.tiny)
        else:
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

    @staticmethod
    def _repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
        """Seen tokens: positive logits divided by the penalty, the others multiplied (transformers).

        The penalty is clamped into float32's normal range first (1e300 would be inf, and 0 * inf is
        NaN for a logit of 0; 1e-45 would be a float32 zero). Below ``SHIFT_BELOW`` the seen positive
        logits can overflow, so the row is shifted by S / penalty, S the largest seen positive logit:
        the seen positive ones become (x - S) / penalty, the best of them 0, and every other logit
        drops by S / penalty (to -inf when that overflows, as the limit has it)."""
        penalty = min(max(penalty, _F32.tiny), _F32.max)
        positive = seen & (logits > 0)
        if penalty >= SHIFT_BELOW:
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            return torch.where(seen, scaled, logits)
        top = torch.where(positive, logits, 0.0).max()  # 0 when no seen logit is positive
        offset = top / penalty
        others = torch.where(seen, logits * penalty, logits) - offset
        return torch.where(positive, (logits - top) / penalty, others)

    def sample(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The next token as a 0-d int64 tensor on the device (no host read here); written into
        ``out`` (0-d int64) when given, which is then returned. Greedy: ``NON_FINITE`` where the
        row's maximum is NaN or infinite (torch.max propagates NaN), decided on the device.
        Sampled: raises NonFiniteLogitsError where the probabilities are not finite."""
        if self.plain_greedy:
            # the maximum of the logits as they are: converting to fp32 first changes no value and no
            # order, and costs a kernel per token; max returns the first maximal index, as argmax
            row = logits.reshape(-1)[: self.vocab_size]
            value, token = torch.max(row, dim=0)
        else:
            processed = self.process(logits)
            if self.params.greedy:
                value, token = torch.max(processed, dim=0)
            else:
                probs = torch.softmax(processed, dim=-1)
                try:
                    # torch checks the probabilities on the host here (NaN, inf, negative, all zero)
                    token = torch.multinomial(probs, 1, generator=self.generator).reshape(())
                except RuntimeError as exc:
                    raise NonFiniteLogitsError(
                        f"the model produced non-finite logits (NaN or inf): torch's draw says {exc}"
                    ) from None
                return token if out is None else out.copy_(token)
        token = torch.where(torch.isfinite(value), token, NON_FINITE)
        return token if out is None else out.copy_(token)

    @staticmethod
    def check(token: torch.Tensor | int) -> int:
        """The token id read on the host; raises NonFiniteLogitsError for ``NON_FINITE``."""
        token_id = int(token)
        if token_id == NON_FINITE:
            raise NonFiniteLogitsError("the model produced non-finite logits (NaN or inf): no token to pick")
        return token_id


def checked_params(params: object) -> SamplingParams:
    """``params`` validated, or SamplingParams() for None; anything else is refused by name, so a dict
    of options does not fail later as an attribute error deep in the sampler."""
    if params is None:
        return SamplingParams().validate()
    if not isinstance(params, SamplingParams):
        hint = " (SamplingParams(**options) builds one from a dict)" if isinstance(params, dict) else ""
        raise SamplingError(f"params must be a SamplingParams or None, got {type(params).__name__}{hint}")
    return params.validate()
