"""What a generation hands out, token by token: ``Generator.events`` yields one ``GenerationEvent``
per new token, then one final event with the finish reason. The surfaces (the CLI's stream, the
HTTP server) build on these; nothing here knows torch or the decode engine.

Finish reasons are OpenAI's: "stop" (a stop id such as EOS, or a stop string) and "length"
(max_new_tokens reached, or the context full).
"""

from __future__ import annotations

from dataclasses import dataclass

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

# GenerationStats.stop_reason (the engine's and the Generator's words) -> the finish reason
_FINISH_REASONS = {
    "eos": FINISH_STOP,
    "stop string": FINISH_STOP,
    "length": FINISH_LENGTH,
    "context full": FINISH_LENGTH,
}


def finish_reason(stop_reason: str) -> str:
    """The OpenAI finish reason of a generation that ended with ``stop_reason`` (GenerationStats)."""
    try:
        return _FINISH_REASONS[stop_reason]
    except KeyError:
        raise ValueError(f"no finish reason for a generation that ended with {stop_reason!r}") from None


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's own distribution: float32 log_softmax of the raw
    logits row, before temperature, penalties and truncation (what vLLM reports by default), so it
    does not depend on the sampling parameters. ``top``: the ``SamplingParams.logprobs`` most likely
    (token_id, logprob), most likely first; () when logprobs is 0."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationEvent:
    """One new token (``token_id`` set, ``finish_reason`` None), or the final event (``token_id``
    None, ``finish_reason`` "stop" or "length"), which comes exactly once, last.

    ``text``: the text released with this event; "" while it is held back (it could still become a
    stop string, or ends in an incomplete UTF-8 character). The final event releases what is left
    held. The texts of all events joined are the generation's text; a stop string is never in it.
    ``logprob``: set on token events when ``SamplingParams.logprobs`` is not None."""

    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
