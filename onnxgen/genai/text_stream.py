"""Token ids to text events for one generation: incremental detokenization, the stop-string
hold-back and the final event. The Generator's loop (one sequence) and the batching scheduler
(many sequences, each with its own stream) both hand their tokens through one of these, so a
token's text is the same whichever runner produced it."""

from __future__ import annotations

from typing import Any

from onnxgen.genai.events import GenerationEvent, TokenLogprob, finish_reason
from onnxgen.genai.sampling import SamplingParams


class TextStream:
    """``push`` each new token id (a stop id never comes here), then ``final`` once.

    Text is held back while it could still become a stop string or ends in an incomplete UTF-8
    character; a stop string is never released, and the text before it is released with the token
    that completed it. Stop strings are looked for once ``params.min_tokens`` tokens exist."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self._decoder = tokenizer.stream()
        self._held = _HeldText(params.stop)
        self._min_tokens = params.min_tokens
        self.tokens = 0
        self.stopped = False  # a stop string was found: the generation must end here

    def push(self, token_id: int, logprob: TokenLogprob | None = None) -> GenerationEvent:
        self.tokens += 1
        text, self.stopped = self._held.push(self._decoder.push(token_id), look=self.tokens >= self._min_tokens)
        return GenerationEvent(token_id, text, logprob)

    def final(self, stop_reason: str) -> GenerationEvent:
        """The last event: what is still held (nothing after a stop string) and the finish reason
        of ``stop_reason`` (GenerationStats' words; "stop string" where ``stopped``)."""
        if self.stopped:
            return GenerationEvent(None, "", finish_reason=finish_reason("stop string"))
        return GenerationEvent(None, self._held.flush(), finish_reason=finish_reason(stop_reason))


class _HeldText:
    """The stop-string hold-back: decoded text comes in piece by piece; what cannot be part of a
    stop string any more is released, a tail as long as the longest stop string minus one is held
    (it could still become one), and text from a stop string on is never released."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=0)
        self.pending = ""

    def push(self, piece: str, look: bool = True) -> tuple[str, bool]:
        """(text to release now, whether a stop string was found); ``look`` False: none is looked
        for yet (min_tokens), though the tail is held as usual."""
        self.pending += piece
        if not self.stop:
            return self.flush(), False
        cut = min((self.pending.find(s) for s in self.stop if s in self.pending), default=-1) if look else -1
        if cut >= 0:
            text, self.pending = self.pending[:cut], ""
            return text, True
        safe = len(self.pending) - (self.hold - 1)
        if safe <= 0:
            return "", False
        text, self.pending = self.pending[:safe], self.pending[safe:]
        return text, False

    def flush(self) -> str:
        """Everything still held (the generation ended without a stop string)."""
        text, self.pending = self.pending, ""
        return text
