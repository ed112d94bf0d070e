"""How often a request's outputs are read on the event loop: the least interval between two reads
of one request, widened with the number of requests being read at once.

Every read of a stream costs the loop thread a chunk (JSON, SSE framing, the ASGI send path, a
socket write), and the loop shares the interpreter lock with the engine thread: with many streams
at a fixed interval the loop's chunks per second grow with the streams, until the loop holds the
lock most of the time and the engine thread's batched steps wait for it. So the interval is
``max(base_s, open_readers / max_chunk_rate)``: at most ``max_chunk_rate`` reads per second over
all requests, a fast stream getting several tokens per chunk. Tokens are never held back beyond
that (the first output of a request is read at once), and TPOT (the time per token of a whole
request) does not depend on the chunking.
"""

from __future__ import annotations


class StreamPacing:
    """``base_s``: the least interval of one request; ``max_chunk_rate``: reads per second over all
    requests (0: no cap). ``open_readers`` is kept by the readers (Relay) on the loop thread."""

    def __init__(self, base_s: float, max_chunk_rate: float) -> None:
        if base_s < 0 or max_chunk_rate < 0:
            raise ValueError(f"pacing needs base_s >= 0 and max_chunk_rate >= 0, got {base_s}, {max_chunk_rate}")
        self.base_s = base_s
        self.max_chunk_rate = max_chunk_rate
        self.open_readers = 0

    def interval(self) -> float:
        """The least time between two reads of one request now."""
        if not self.max_chunk_rate:
            return self.base_s
        return max(self.base_s, self.open_readers / self.max_chunk_rate)
