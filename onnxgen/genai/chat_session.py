"""An interactive chat's history and the rule that keeps it within the model's context.

No I/O here: ``onnxgen run`` prints what ``ChatSession.fit`` reports and reads the lines.

The rule: a new message is sent with as much of the history as fits. Whole exchanges (a user message
and the reply to it) are dropped, oldest first, until the rendered prompt plus ``reserve`` tokens
for the reply fit in the context. If the new message does not fit even with no history (with the
system prompt, if any), it is refused and the history is kept as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Message = dict[str, str]


def reply_reserve(context_length: int, max_new_tokens: int | None) -> int:
    """Tokens kept free for each reply: ``max_new_tokens`` when given, at most half the context;
    else a quarter of the context. At least 1 (the prompt must leave room for one new token)."""
    if max_new_tokens is not None:
        return max(1, min(max_new_tokens, context_length // 2))
    return max(1, context_length // 4)


@dataclass
class Fit:
    """What ``ChatSession.fit`` found for a new message.

    ``ids``: the prompt's token ids, or None when the message is refused; ``tokens``: their count (when
    refused: the count of the message alone, with the system prompt); ``dropped``: the oldest exchanges
    left out (applied to the history by ``ChatSession.add``)."""

    ids: list[int] | None
    tokens: int
    dropped: int

    @property
    def refused(self) -> bool:
        return self.ids is None


@dataclass
class ChatSession:
    """``encode(messages)``: the prompt's token ids for a message list (the chat template applied,
    with the generation prompt). ``turns``: the (user, assistant) exchanges kept, oldest first."""

    encode: Callable[[list[Message]], list[int]]
    context_length: int
    reserve: int
    system: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)

    def messages(self, user: str, drop: int = 0) -> list[Message]:
        """The messages sent for ``user`` with the ``drop`` oldest exchanges left out."""
        out: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        for question, answer in self.turns[drop:]:
            out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return out + [{"role": "user", "content": user}]

    def fits(self, tokens: int) -> bool:
        return tokens + self.reserve <= self.context_length

    def fit(self, user: str) -> Fit:
        """The prompt for ``user`` under the rule (the module's docstring); the history is unchanged."""
        ids: list[int] = []
        for drop in range(len(self.turns) + 1):
            ids = self.encode(self.messages(user, drop))
            if self.fits(len(ids)):
                return Fit(ids, len(ids), drop)
        return Fit(None, len(ids), 0)

    def add(self, fit: Fit, user: str, reply: str) -> None:
        """Record an exchange that was sent as ``fit`` said: its dropped exchanges go, this one is appended."""
        if fit.refused:
            raise ValueError("a refused message is not part of the history")
        del self.turns[: fit.dropped]
        self.turns.append((user, reply))

    def reset(self, system: str | None = None) -> None:
        self.turns.clear()
        self.system = system
