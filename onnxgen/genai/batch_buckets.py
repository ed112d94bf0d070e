"""Batch-size buckets of the captured batched decode step, and the feeds each bucket is recorded on.

A recorded step reads its inputs at fixed addresses with fixed shapes, so the batched step is
recorded once per batch size it runs at. To keep that a handful of recordings, a step over slots
[0, hi) runs at the smallest bucket >= hi (1, 2, 4, 8, then every 8 up to the pool's slots, as
vLLM and SGLang pad their decode batches), the slots past hi taking part as idle rows (batched.py).

``BucketFeeds`` holds one bucket's feeds, the same tensors every step (the capture runtime then
uses them in place, no copy into its bindings): the token ids [rows, 1], the positions [rows, 1],
an attention mask [rows, capacity] whose row b has ends[b] ones (the KV length after the step:
the graph turns it into each row's seqlens_k), and views of the pool's first ``rows`` slots as
the past inputs. The mask is as wide as a slot (a pinned symbol: every step of a bucket has one
shape); the decode attention kernel skips the key blocks past each row's length, so the width
costs no reads.
"""

from __future__ import annotations

import torch

from onnxgen.genai.graph_layout import position_feed
from onnxgen.genai.kv_pool import KVPool
from onnxgen.genai.recorded_ops import RecordedOps

BUCKET_STEP = 8  # buckets past 8 rows: every 8 rows


def batch_buckets(max_seqs: int) -> list[int]:
    """The batch sizes recorded for a pool of ``max_seqs`` slots, ascending; the last is max_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_seqs]
    sizes += list(range(BUCKET_STEP, max_seqs, BUCKET_STEP))
    return sorted(set(sizes) | {max_seqs})


def bucket_for(buckets: list[int], rows: int) -> int:
    """The smallest bucket of at least ``rows`` rows (rows <= the largest bucket)."""
    for size in buckets:
        if size >= rows:
            return size
    raise ValueError(f"{rows} rows exceed the largest batch bucket {buckets[-1]}")


class BucketFeeds:
    """The persistent feeds of a batched step over slots [0, rows) of ``pool``."""

    def __init__(
        self,
        pool: KVPool,
        rows: int,
        *,
        input_ids: str,
        attention_mask: str,
        position_ids: str | None,
        position_streams: int = 0,
        extra: dict[str, torch.Tensor],
        carried: torch.Tensor | None = None,
    ):
        device = pool.device
        self.rows = rows
        self.checked = False  # the session has checked these feeds (batched.py, once)
        self._names = (input_ids, attention_mask, position_ids)
        self._staged = torch.zeros((3, rows), dtype=torch.int64, device=device)  # ids; ends; sources
        # the host side of that copy: pinned on CUDA (a copy from pageable memory would wait for the
        # work already queued, the step in flight), two buffers used in turn, so that the host never
        # writes one whose copy may still be pending (the step before the last has been read)
        pinned = device.type == "cuda"
        self._host = [torch.zeros((3, rows), dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        self.ids = torch.zeros((rows, 1), dtype=torch.int64, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.int64, device=device)
        self.mask = torch.zeros((rows, pool.capacity), dtype=torch.int64, device=device)
        self._keys = torch.arange(pool.capacity, dtype=torch.int64, device=device)
        self._allowed = torch.zeros((rows, pool.capacity), dtype=torch.bool, device=device)
        self.feeds: dict[str, torch.Tensor] = {input_ids: self.ids, attention_mask: self.mask}
        if position_ids:
            self.feeds[position_ids] = position_feed(self.positions, position_streams)
        self.feeds.update(extra)
        self.feeds.update(pool.range_feeds(0, rows))
        self._carried = carried  # the device tokens a row may be fed from (fill's sources)
        self._prepare = RecordedOps(self._prepare_on_device, device)  # one graph replay per step on CUDA

    def fill(self, ids: list[int], ends: list[int], sources: list[int] | None = None) -> dict[str, torch.Tensor]:
        """The feeds for a step where row b is fed token ``ids[b]`` and holds ``ends[b]`` rows after
        it (its new row at ends[b] - 1); one copy from the host, the rest on the device (recorded
        ops: recorded_ops.py). Where ``sources[b] >= 0`` the row's token is ``carried[sources[b]]``
        instead (``carried``: given at construction), a token still on the device (the previous
        step's, not read yet: batched.py's overlapped steps); a non-finite marker there (negative)
        is fed as id 0, its sequence ends when it is read."""
        rows = self.rows
        if len(ids) != rows or len(ends) != rows or (sources is not None and len(sources) != rows):
            raise ValueError(f"a bucket of {rows} rows got {len(ids)} ids and {len(ends)} ends")
        if sources is not None and self._carried is None and max(sources) >= 0:
            raise ValueError("sources name carried tokens, but this bucket's feeds were made without them")
        host = self._host[self._turn]
        self._turn ^= 1
        host[0] = torch.tensor(ids, dtype=torch.int64)
        host[1] = torch.tensor(ends, dtype=torch.int64)
        host[2] = torch.tensor(sources or [-1] * rows, dtype=torch.int64)
        self._staged.copy_(host, non_blocking=True)
        self._prepare()
        return self.feeds

    def _prepare_on_device(self) -> None:
        """The feeds from the staged copy (and the carried tokens): device work only, on tensors
        that keep their addresses (what RecordedOps needs)."""
        rows = self.rows
        ends_now = self._staged[1]
        if self._carried is not None:
            source = self._staged[2]
            from_device = self._carried.index_select(0, source.clamp(min=0)).clamp(min=0)
            torch.where(source >= 0, from_device, self._staged[0], out=self.ids.view(rows))
        else:
            self.ids.copy_(self._staged[0].view(rows, 1))
        torch.sub(ends_now.view(rows, 1), 1, out=self.positions)
        torch.lt(self._keys, ends_now.view(rows, 1), out=self._allowed)
        self.mask.copy_(self._allowed)
