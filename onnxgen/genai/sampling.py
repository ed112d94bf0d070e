"""Sampling parameters and the logits pipeline, all on the model's device.

Order (as in transformers / llama.cpp): penalties → temperature → top-k → top-p → min-p → draw.
Temperature 0 means greedy (argmax of the penalized logits). The draw is Gumbel-max: the argmax of
the processed logits plus Gumbel noise is a draw from their softmax, and the noise comes from a
counter-based hash of (seed, draw number, token index), not from a generator's hidden state. Every
stage is device work of shapes fixed by the parameters' ``SamplingPlan``: a step tail records the
whole pipeline into a CUDA graph, and a replay draws what an eager run draws, bit for bit.

Numerics: the pipeline runs in float32. Where a division can leave float32's range (a temperature or a
repetition penalty below ``SHIFT_BELOW``), the row is scaled relative to its maximum, so its values
lie in [-inf, 0] and the best token stays 0: a temperature of 1e-39 draws the argmax, as its limit
does, instead of inf - inf = NaN. Softmax, top-k, top-p and min-p do not change under such a shift.

Non-finite logits (NaN, +inf, or all -inf: a damaged model) are never turned into a token: the
pipeline writes ``NON_FINITE`` (-1) instead, on the device, which the host sees when it reads the
token (no extra read). ``check`` raises for it.
"""

from __future__ import annotations

import math
import numbers
import operator
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, TypeVar

import torch

from onnxgen.errors import OnnxgenError
from onnxgen.genai.events import TokenLogprob
from onnxgen.runtime import NOISY_ARGMAX_TOP_K_MAX, device_kernels_available, noisy_argmax

# Below this temperature or repetition penalty, the scaled logits are taken relative to the row's
# maximum; at and above it the values are transformers' (overflow then needs |logit| > 3e35).
SHIFT_BELOW = 1e-3
NON_FINITE = -1  # the token id the greedy paths write for a row whose maximum is not finite
_F32 = torch.finfo(torch.float32)
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2**64); negative seeds alias (s + 2**64)
LOGPROBS_MAX = 20  # alternatives per token at most: OpenAI's top_logprobs limit


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
    # until this many new tokens exist, the stop ids cannot be drawn (their logits are -inf) and stop
    # strings are not looked for
    min_tokens: int = 0
    # None: off; n in [0, LOGPROBS_MAX]: each new token's logprob and the n most likely alternatives
    # (events.TokenLogprob: log_softmax of the raw logits row, before any stage of the pipeline)
    logprobs: int | None = None

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
        self.min_tokens = _integer("min_tokens", self.min_tokens)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs)
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
            (self.min_tokens >= 0, f"min_tokens must be >= 0 (0 = off), got {self.min_tokens}"),
            (
                self.max_new_tokens is None or self.min_tokens <= self.max_new_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_new_tokens ({self.max_new_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= LOGPROBS_MAX,
                f"logprobs must be None (off) or in [0, {LOGPROBS_MAX}] (alternatives per token), got {self.logprobs}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(message)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingPlan(NamedTuple):
    """What the logits pipeline does, apart from its values: the kernels it runs and their shapes.

    Two parameter sets with one plan run the same kernels on different values (``SamplerState``),
    so a step tail recorded for one plan serves every generation with that plan."""

    greedy: bool
    shift_temperature: bool  # temperature below SHIFT_BELOW: scale relative to the row's maximum
    top_k: int  # 0: off
    top_p: bool
    min_p: bool
    repetition: str  # "off", "scale" or "shift" (a penalty below SHIFT_BELOW)
    frequency: bool
    presence: bool

    @property
    def penalize(self) -> bool:
        return self.repetition != "off" or self.frequency or self.presence

    @staticmethod
    def of(params: SamplingParams, vocab_size: int) -> SamplingPlan:
        p = params
        return SamplingPlan(
            greedy=p.greedy,
            shift_temperature=not p.greedy and p.temperature < SHIFT_BELOW,
            top_k=p.top_k if not p.greedy and 0 < p.top_k < vocab_size else 0,
            top_p=not p.greedy and p.top_p < 1.0,
            min_p=not p.greedy and p.min_p > 0.0,
            repetition="off"
            if p.repetition_penalty == 1.0
            else "shift"
            if p.repetition_penalty < SHIFT_BELOW
            else "scale",
            frequency=p.frequency_penalty != 0.0,
            presence=p.presence_penalty != 0.0,
        )


# the values of a parameter set, in SamplerState.values
TEMPERATURE, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE = range(6)
_MASK32 = 0xFFFFFFFF
IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)
_KEY_MULTIPLIER = 0x9E3779B1  # the draw counter stays far below 2**31: the product fits int64


def _mix32(x: IntOrTensor) -> IntOrTensor:
    """A bijective 32-bit integer hash of values in [0, 2**32): int64 tensors or Python ints (the
    same operators). Both multipliers are odd and below 2**31, so no product leaves int64's range
    (no wrap-around to rely on)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


@dataclass
class SamplerState:
    """A generation's sampling state, all device tensors (a step tail advances them in place):
    ``counts`` [vocab] float32, how often each token occurred (prompt and generated; the penalties);
    ``draws`` 0-d int64, how many tokens were drawn so far; ``seed`` [2] int64, the seed's two 32-bit
    words (the high one hashed); ``lanes`` [vocab] int64, their hash of each token index (the torch
    path's; the fused kernel hashes the index itself, to the same bits); ``values`` [6] float32, the
    parameter values (TEMPERATURE ... PRESENCE)."""

    counts: torch.Tensor
    draws: torch.Tensor
    seed: torch.Tensor
    lanes: torch.Tensor
    values: torch.Tensor

    @staticmethod
    def new(
        params: SamplingParams, plan: SamplingPlan, vocab_size: int, seed: int, device: torch.device
    ) -> SamplerState:
        p = params
        temperature = max(p.temperature, _F32.tiny) if plan.shift_temperature else p.temperature
        penalty = min(max(p.repetition_penalty, _F32.tiny), _F32.max)
        values = [temperature or 1.0, p.top_p, p.min_p, penalty, p.frequency_penalty, p.presence_penalty]
        words = (_mix32((seed >> 32) & _MASK32), seed & _MASK32)
        index = torch.arange(0 if plan.greedy else vocab_size, dtype=torch.int64, device=device)
        lanes = _mix32(_mix32((index + words[0]) & _MASK32) ^ words[1])  # greedy: none
        return SamplerState(
            counts=torch.zeros(vocab_size, dtype=torch.float32, device=device),
            draws=torch.zeros((), dtype=torch.int64, device=device),
            seed=torch.tensor(words, dtype=torch.int64, device=device),
            lanes=lanes,
            values=torch.tensor(values, dtype=torch.float32, device=device),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def clone(self) -> SamplerState:
        return SamplerState(**{name: t.clone() for name, t in self.tensors().items()})

    def copy_(self, other: SamplerState) -> None:
        for mine, theirs in zip(self.tensors().values(), other.tensors().values(), strict=True):
            mine.copy_(theirs)


def observe(plan: SamplingPlan, counts: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Count tokens into ``counts`` for the penalties (nothing to count without them)."""
    if plan.penalize:
        # clamped: a NON_FINITE token (-1) may be observed before the host reads it (the pipelined
        # loop's lookahead), and an out-of-range index_add_ is a device-side assert on CUDA
        ids = token_ids.reshape(-1).to(counts.device).clamp(min=0)
        counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))


def process(
    plan: SamplingPlan, state: Mapping[str, torch.Tensor], logits: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Penalized, tempered, truncated logits [vocab] in float32 (-inf where excluded); NaN only
    where the model's logits are not finite (see the module's note on the numerics). Device work
    only, of shapes the plan fixes: a step tail records it."""
    values, counts = state["values"], state["counts"]
    logits = logits.reshape(-1)[:vocab_size].float()
    if plan.penalize:
        seen = counts > 0
        if plan.repetition != "off":
            logits = _repetition_penalty(logits, seen, values[REPETITION], plan.repetition == "shift")
        if plan.frequency:
            logits = logits - values[FREQUENCY] * counts
        if plan.presence:
            logits = logits - values[PRESENCE] * seen.float()
    if plan.greedy:
        return logits
    if plan.shift_temperature:
        # (x - max) / T lies in [-inf, 0] and is 0 at the max: no overflow, and no 0 / 0 since T
        # is floored at float32's smallest normal (a float32 zero otherwise)
        logits = (logits - logits.max()) / values[TEMPERATURE]
    else:
        logits = logits / values[TEMPERATURE]
    if plan.top_k:
        kth = torch.topk(logits, plan.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if plan.top_p:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before >= values[TOP_P]
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if plan.min_p:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < values[MIN_P] * probs.max(), float("-inf"))
    return logits


def _repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor, shift: bool) -> torch.Tensor:
    """Seen tokens: positive logits divided by the penalty, the others multiplied (transformers).

    The penalty is clamped into float32's normal range (SamplerState.new: 1e300 would be inf, and
    0 * inf is NaN for a logit of 0; 1e-45 would be a float32 zero). Below ``SHIFT_BELOW`` (``shift``)
    the seen positive logits can overflow, so the row is shifted by S / penalty, S the largest seen
    positive logit: the seen positive ones become (x - S) / penalty, the best of them 0, and every
    other logit drops by S / penalty (to -inf when that overflows, as the limit has it)."""
    if not shift:
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(seen, scaled, logits)
    positive = seen & (logits > 0)
    top = torch.where(positive, logits, 0.0).max()  # 0 when no seen logit is positive
    offset = top / penalty
    others = torch.where(seen, logits * penalty, logits) - offset
    return torch.where(positive, (logits - top) / penalty, others)


def gumbel_noise(lanes: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [vocab] float32 for draw number ``draws`` (0-d int64): a counter-based
    hash of (seed, draw, token index), so the same seed repeats exactly on any device and in any
    recording, and no generator state has to be carried through a CUDA graph. 23 bits of the hash
    give u in (0, 1) exactly (m + 0.5) / 2**23; the noise is -log(-log u)."""
    x = _mix32(lanes ^ ((draws * _KEY_MULTIPLIER) & _MASK32))
    u = ((x >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(-torch.log(u))


def pick(plan: SamplingPlan, state: Mapping[str, torch.Tensor], processed: torch.Tensor) -> torch.Tensor:
    """The token (0-d int64) from ``process``'s logits: their argmax (greedy), or the argmax of the
    logits plus Gumbel noise (a draw from their softmax; the draw counter then advances). NON_FINITE
    where the row's maximum is NaN or infinite or every token is excluded; decided on the device."""
    value = processed.max()  # NaN propagates
    if plan.greedy:
        token = torch.argmax(processed)
    else:
        token = torch.argmax(processed + gumbel_noise(state["lanes"], state["draws"]))
        state["draws"].add_(1)
    return torch.where(torch.isfinite(value), token, NON_FINITE)


def _one(values: torch.Tensor, index: int) -> torch.Tensor:
    return values[index : index + 1]


def draw_token(
    plan: SamplingPlan,
    state: Mapping[str, torch.Tensor],
    logits: torch.Tensor,
    vocab_size: int,
    out: torch.Tensor,
    *,
    count: bool = False,
    advance: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> bool:
    """The next token into ``out`` (0-d int64): ``pick(process(logits))``, as device work only.
    ``count``: the token is also counted for the penalties. ``advance`` (position [1, 1], mask
    [1, capacity], pinned host tokens or None): a step tail's bookkeeping, which the fused kernel
    does along with the draw (position += 1, the new position's mask entry, the host token);
    returns whether it did (else the caller does it).

    Where the runtime's fused kernels serve the logits' device, a sampled draw is its noisy_argmax:
    one kernel for the penalties, the temperature, the draw and the bookkeeping (two with top-k or
    min-p, four with top-p alone) where the plan has no shifted scaling and top-k at most
    NOISY_ARGMAX_TOP_K_MAX; after ``process``'s torch ops otherwise. The kernels' cuts are the same
    rules computed otherwise: min-p in log space; top-p within top-k by bisection over the kept
    values (exact ties at the cut are all kept, where sorting keeps the first of them); top-p alone
    from two histograms of the softmax mass, which keep every token within one fine bucket
    (28 / 2048**2 nats) of the cut. Either way the
    same device always takes the same path, so a draw between the steps and one in a step's tail
    agree bit for bit."""
    row = logits.reshape(-1)[:vocab_size]
    if not plan.greedy and device_kernels_available(row):
        fused = plan.top_k <= NOISY_ARGMAX_TOP_K_MAX and not (plan.shift_temperature or plan.repetition == "shift")
        values = state["values"]
        source = row.contiguous() if fused else process(plan, state, row, vocab_size)
        position, mask, host = advance if advance is not None else (None, None, None)
        noisy_argmax(
            source,
            state["seed"],
            state["draws"],
            out,
            state["counts"],
            scale=_one(values, REPETITION) if fused and plan.repetition == "scale" else None,
            linear=_one(values, FREQUENCY) if fused and plan.frequency else None,
            present=_one(values, PRESENCE) if fused and plan.presence else None,
            temper=_one(values, TEMPERATURE) if fused else None,
            top_k=plan.top_k if fused else 0,
            top_p=_one(values, TOP_P) if fused and plan.top_p else None,
            floor_ratio=_one(values, MIN_P) if fused and plan.min_p else None,
            count=count and plan.penalize,
            position=position,
            flags=mask,
            host_out=host,
        )
        return advance is not None
    out.copy_(pick(plan, state, process(plan, state, row, vocab_size)))
    if count:
        observe(plan, state["counts"], out)
    return False


class LogitsSampler:
    """Turns the last position's logits into the next token id, on the logits' device: the plan and
    the state (SamplingPlan, SamplerState) of one generation, and the functions above run on them.

    A seeded draw depends on the seed, the number of draws before it and the logits only (Gumbel
    noise from a counter-based hash): the same seed repeats exactly, between the steps or inside a
    captured step's tail (decode_tail.SampledTail), eagerly or replayed."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device, stop_ids: Iterable[int] = ()):
        self.params = params.validate()
        self.device = device
        self.vocab_size = vocab_size
        self.plan = SamplingPlan.of(self.params, vocab_size)
        self._seed = self.params.seed if self.params.seed is not None else secrets.randbits(64)
        self._state: SamplerState | None = None  # made on first use (see ``state``)
        # the ids min_tokens keeps from being drawn (None: min_tokens is 0, or there is no stop id)
        banned = sorted({i for i in stop_ids if 0 <= i < vocab_size}) if self.params.min_tokens else []
        self.banned = torch.tensor(banned, dtype=torch.int64, device=device) if banned else None

    @property
    def state(self) -> SamplerState:
        """The device state, made when first asked for: a plain greedy generation in a batched step
        never needs it, and making it costs copies from pageable host memory, each of which waits
        for the work already queued on the device (the batched step in flight)."""
        if self._state is None:
            with torch.inference_mode(False):  # plain tensors, as when made with the sampler: updated in place anywhere
                self._state = SamplerState.new(self.params, self.plan, self.vocab_size, self._seed, self.device)
        return self._state

    @property
    def between_steps(self) -> str | None:
        """Why this generation's sampler must run between the decode steps, not in a step's tail:
        what it needs that the tails (decode_tail.py) do not do, or None."""
        if self.params.logprobs is not None:
            return "logprobs (each token's logits row is read for its log-probabilities)"
        if self.banned is not None:
            return "min_tokens (the stop ids' logits are masked until min_tokens new tokens exist)"
        return None

    @property
    def plain_greedy(self) -> bool:
        """The token is the argmax of the raw logits (greedy, no penalty): greedy's own tail."""
        return self.plan.greedy and not self.plan.penalize

    def adopt(self, state: SamplerState) -> None:
        """Work on ``state`` from now on (a step tail's, which it advanced from this one's copy)."""
        self._state = state

    def observe(self, token_ids: torch.Tensor) -> None:
        """Count tokens (prompt and generated) for the penalties (nothing to count without them)."""
        if self.plan.penalize:
            observe(self.plan, self.state.counts, token_ids)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized, tempered, truncated logits [vocab] in float32 (-inf where excluded)."""
        return process(self.plan, self.state.tensors(), logits, self.vocab_size)

    def sample(self, logits: torch.Tensor, out: torch.Tensor | None = None, *, ban: bool = False) -> torch.Tensor:
        """The next token as a 0-d int64 tensor on the device (no host read here); written into
        ``out`` (0-d int64) when given, which is then returned. ``NON_FINITE`` where the row's
        maximum is NaN or infinite or nothing is left to draw, decided on the device. ``ban``: the
        stop ids (``banned``) cannot be drawn, their logits -inf before every stage (min_tokens)."""
        if ban and self.banned is not None:
            logits = logits.reshape(-1)[: self.vocab_size].index_fill(0, self.banned, float("-inf"))
        if self.plain_greedy:
            # the maximum of the logits as they are: converting to fp32 first changes no value and no
            # order, and costs a kernel per token; max returns the first maximal index, as argmax
            row = logits.reshape(-1)[: self.vocab_size]
            value, token = torch.max(row, dim=0)
            token = torch.where(torch.isfinite(value), token, NON_FINITE)
            return token if out is None else out.copy_(token)
        if out is None:
            out = torch.empty((), dtype=torch.int64, device=logits.device)
        draw_token(self.plan, self.state.tensors(), logits, self.vocab_size, out)
        return out

    @staticmethod
    def check(token: torch.Tensor | int) -> int:
        """The token id read on the host; raises NonFiniteLogitsError for ``NON_FINITE``."""
        token_id = int(token)
        if token_id == NON_FINITE:
            raise NonFiniteLogitsError("the model produced non-finite logits (NaN or inf): no token to pick")
        return token_id


def logprobs_of(logits: torch.Tensor, token: torch.Tensor, top: int, vocab_size: int) -> torch.Tensor:
    """The log-probabilities a TokenLogprob reports, as device work: float32 log_softmax of the raw
    logits row (before any stage of the pipeline), packed in float64 as [the token's, the ``top``
    largest (descending), their ids] so one host read takes them (ids are exact in float64). On
    CUDA they are copied into pinned host memory in stream order: the host reads them after the
    token drawn with them, whose read waits for that copy too, so they cost no wait of their own."""
    row = torch.log_softmax(logits.reshape(-1)[:vocab_size].float(), dim=-1)
    chosen = row[token.reshape(1).clamp(min=0)]  # NON_FINITE (-1) is raised for when the token is read
    values, ids = torch.topk(row, top) if top else (row[:0], token.new_empty(0))
    packed = torch.cat((chosen.double(), values.double(), ids.double()))
    if packed.device.type != "cuda":
        return packed
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    return host.copy_(packed, non_blocking=True)


def token_logprob(packed: torch.Tensor, token_id: int) -> TokenLogprob:
    """``logprobs_of``'s values, read on the host, as the TokenLogprob of ``token_id``."""
    values = packed.tolist()
    top = (len(values) - 1) // 2
    pairs = tuple((int(i), v) for v, i in zip(values[1 : 1 + top], values[1 + top :], strict=True))
    return TokenLogprob(token_id, values[0], pairs)


def checked_params(params: object) -> SamplingParams:
    """``params`` validated, or SamplingParams() for None; anything else is refused by name, so a dict
    of options does not fail later as an attribute error deep in the sampler."""
    if params is None:
        return SamplingParams().validate()
    if not isinstance(params, SamplingParams):
        hint = " (SamplingParams(**options) builds one from a dict)" if isinstance(params, dict) else ""
        raise SamplingError(f"params must be a SamplingParams or None, got {type(params).__name__}{hint}")
    return params.validate()
