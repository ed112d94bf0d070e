"""Teacher forcing: the logits a decoder gives at every position of a fixed context.

Two ways to run a context ``c[0..T-1]`` through a package, both returning position ``i``'s logits
(the model's prediction for ``c[i+1]`` from ``c[0..i]``):

- ``prefill_logits``: one forward pass over the whole context with an empty cache, on the
  package's graph as it is (its logits output holds a row per input token). The attention is
  causal, so row ``i`` sees ``c[0..i]`` only: the same inputs as position ``i`` fed token by token,
  computed as one prompt (a prefill's kernels).
- ``decode_forced``: the decode engine's own path, a prompt prefill and then one-token decode steps
  (eager or captured, static or growing KV: whatever the engine was built with), where each step is
  fed the recorded next token instead of the one it would pick. With ``extend`` it goes on past the
  context with greedy tokens: how the reference records the context in the first place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from onnxgen.genai.engine import DecodeEngine
from onnxgen.genai.graph_layout import position_feed
from onnxgen.genai.kv_cache import DynamicKV
from onnxgen.genai.package import PackageConfig
from onnxgen.genai.sampling import LogitsSampler, SamplingParams
from onnxgen.runtime.dtypes import ONNX_TO_TORCH
from onnxgen.runtime.session import InferenceSession


class ForcingSampler(LogitsSampler):
    """A greedy sampler that keeps every logits row it is handed and answers with the recorded next
    token of the context (``feed``, in order); once the feed is used up, with the row's argmax
    (``extend`` more tokens at most). The rows are copied as they come: a captured step's logits
    live in a buffer that the next replay overwrites."""

    def __init__(self, feed: Sequence[int], vocab_size: int, device: torch.device):
        super().__init__(SamplingParams(), vocab_size, device)
        self.feed = list(feed)
        self.rows: list[torch.Tensor] = []
        self.picked: list[int] = []  # the tokens handed back, forced or greedy

    def sample(self, logits: torch.Tensor, out: torch.Tensor | None = None, *, ban: bool = False) -> torch.Tensor:
        row = logits.reshape(-1)[: self.vocab_size]
        self.rows.append(row.to(torch.float32, copy=True))
        index = len(self.picked)
        token_id = self.feed[index] if index < len(self.feed) else int(torch.argmax(row))
        self.picked.append(token_id)
        token = torch.tensor(token_id, dtype=torch.int64, device=self.device)
        return token if out is None else out.copy_(token)


@dataclass
class ForcedRun:
    """``decode_forced``'s result: ``context`` (the tokens fed plus the greedy extension) and the
    float32 logits rows [R, vocab] of positions ``start - 1`` to ``len(context) - 2``, on the CPU."""

    context: list[int]
    start: int
    logits: torch.Tensor


def decode_forced(engine: DecodeEngine, context: Sequence[int], start: int, extend: int = 0) -> ForcedRun:
    """``context[:start]`` as one prompt through ``engine.prefill``, then ``context[start:]`` one token per
    ``engine.step``, then ``extend`` greedy tokens; the logits of every position from ``start - 1`` on.

    The engine must sample between its steps (built with ``sample_in_graph=False``): a step tail that
    picks the token inside the captured graph would never hand the logits to the sampler."""
    if not 0 < start <= len(context):
        raise ValueError(f"start {start} must be within the context (1 to {len(context)})")
    if engine.sample_in_graph:
        raise ValueError("decode_forced needs an engine built with sample_in_graph=False")
    rows = len(context) - start + extend  # positions start-1 .. end-2, one new token each
    sequence = engine.new_sequence(list(context[:start]), SamplingParams(max_new_tokens=rows, ignore_eos=True))
    if sequence.max_new_tokens < rows:
        raise ValueError(f"{start} + {rows} tokens do not fit the context of {engine.config.context_length}")
    sampler = ForcingSampler(context[start:], engine.config.vocab_size, engine.device)
    sequence.sampler = sampler
    try:
        engine.prefill([sequence])
        with torch.inference_mode():
            for _ in range(rows - 1):  # the last row's token is not fed: nothing after it is scored
                engine.step([sequence])
    finally:
        engine.release([sequence], reason="done")
    logits = torch.stack(sampler.rows).cpu()
    return ForcedRun(list(context[:start]) + sampler.picked, start, logits)


def prefill_logits(session: InferenceSession, config: PackageConfig, ids: Sequence[int]) -> torch.Tensor:
    """One forward pass of ``session`` (the package's graph, its logits output not cut to one row) over
    ``ids`` with an empty cache: float32 logits [len(ids), vocab] on the CPU."""
    device = session.device
    inputs = {i.name: i for i in session.graph_inputs}
    io = config.io
    past = inputs[config.first_past_key_name]
    kv = DynamicKV(config, ONNX_TO_TORCH[past.elem_type], device)
    n = len(ids)
    feeds: dict[str, torch.Tensor] = {io.input_ids: torch.tensor([list(ids)], dtype=torch.int64, device=device)}
    if io.attention_mask and io.attention_mask in inputs:
        feeds[io.attention_mask] = kv.attention_mask(n)
    if io.position_ids and io.position_ids in inputs:
        feeds[io.position_ids] = position_feed(torch.arange(n, device=device).reshape(1, n), config.position_streams)
    feeds.update(kv.feeds())
    with torch.inference_mode():
        logits = session.run_torch(feeds, [io.logits])[io.logits]
    if logits.dim() != 3 or logits.shape[1] != n:
        raise ValueError(
            f"the graph's {io.logits!r} output is {list(logits.shape)} for a prompt of {n} tokens; teacher forcing "
            "in one pass needs a row per token [1, tokens, vocab]"
        )
    return logits[0, :, : config.vocab_size].to(torch.float32).cpu()
