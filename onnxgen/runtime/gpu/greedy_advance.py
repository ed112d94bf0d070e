"""Greedy decode's step tail in one Triton kernel: the argmax of the logits row, written as the next
step's token id, and the next step's position and attention-mask entry.

Torch would spend a kernel on the argmax, one on the position and two on the mask entry; inside a
recorded step each of them is a node the GPU walks through between the lm_head and the next step.
Here every program takes the maximum of one block of the row and stores it with its index; the
program that draws the last ticket (as in gqa_decode's merge) reduces the partials in block order,
stores the token, advances the position and sets the mask entry, then resets the ticket for the
next call. The result is the one ``torch.argmax`` gives: the first index of the maximum, NaN
counting as the largest value.

With ``host_tokens`` (pinned host memory, which the GPU addresses directly) the kernel also stores
the token there, at its position: the host reads it once the step's event has passed, with no
device-to-host copy in the stream between two steps (that copy and its gap cost about 18 us per
token on the H200, docs/benchmarks/2026-12-01-h200-tail-split.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import LAUNCHES, cached_buffers, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous

BLOCK = 2048  # 75 programs for a 151,936-entry vocabulary


@triton.jit
def _greedy_advance_kernel(
    row_ptr,
    vocab,
    part_val_ptr,  # [programs] fp32
    part_idx_ptr,  # [programs] int32
    part_nan_ptr,  # [programs] int32: the block's first NaN, or vocab when it has none
    ticket_ptr,  # [1] int32, zero between calls
    ids_ptr,
    pos_ptr,
    mask_ptr,
    host_ptr,  # [capacity + 1] int64 in pinned host memory, or unused
    capacity,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HOST: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    wait_for_previous(PDL)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = tl.load(row_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan & inside, offs, vocab), axis=0)
    clean = tl.where(is_nan, float("-inf"), x)
    best = tl.max(clean, axis=0)
    # the first index holding the block's maximum (masked lanes hold -inf at higher indices)
    best_at = tl.min(tl.where((clean == best) & inside, offs, vocab), axis=0)
    tl.store(part_val_ptr + pid, best)
    tl.store(part_idx_ptr + pid, best_at)
    tl.store(part_nan_ptr + pid, first_nan)
    tl.debug_barrier()  # every partial is stored before the ticket (release)
    programs = tl.num_programs(0)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == programs - 1:
        p = tl.arange(0, BLOCK_P)
        valid = p < programs
        vals = tl.load(part_val_ptr + p, mask=valid, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + p, mask=valid, other=vocab, cache_modifier=".cg")
        nans = tl.load(part_nan_ptr + p, mask=valid, other=vocab, cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        token = tl.min(tl.where(vals == top, idxs, vocab), axis=0)
        nan_at = tl.min(nans, axis=0)
        token = tl.where(nan_at < vocab, nan_at, token)
        # an all -inf row: index 0, as torch
        token = tl.where(token < vocab, token, 0)
        tl.store(ids_ptr, token.to(ids_ptr.dtype.element_ty))
        pos = tl.load(pos_ptr) + 1
        tl.store(pos_ptr, pos)
        # the last step of a full cache names a row past its end: that entry is the last one, already set
        tl.store(mask_ptr + tl.minimum(pos, capacity - 1), tl.full((), 1, mask_ptr.dtype.element_ty))
        if HOST:
            tl.store(host_ptr + pos, token.to(host_ptr.dtype.element_ty))
        tl.store(ticket_ptr, 0)


def greedy_advance(
    row: torch.Tensor,
    ids: torch.Tensor,
    pos: torch.Tensor,
    mask: torch.Tensor,
    host_tokens: torch.Tensor | None = None,
) -> None:
    """ids <- argmax(row); pos <- pos + 1; mask[0, min(pos, capacity - 1)] <- 1 (the new pos), in place;
    and host_tokens[pos] <- the token when given. row: [vocab] logits (contiguous); ids, pos: one
    int64 each; mask: [1, capacity]; host_tokens: [capacity + 1] int64, pinned."""
    LAUNCHES["greedy_advance"] += 1
    vocab = row.numel()
    programs = triton.cdiv(vocab, BLOCK)
    part_val, part_idx, part_nan, ticket = _scratch(programs, row.device)
    _greedy_advance_kernel[(programs,)](
        row,
        vocab,
        part_val,
        part_idx,
        part_nan,
        ticket,
        ids,
        pos,
        mask,
        host_tokens if host_tokens is not None else ids,
        mask.shape[-1],
        BLOCK=BLOCK,
        BLOCK_P=triton.next_power_of_2(programs),
        HOST=host_tokens is not None,
        num_warps=4,
        **pdl_launch(row, part_val, part_idx, part_nan, ticket, ids, pos, mask),
    )


def _scratch(programs: int, device: torch.device) -> list[torch.Tensor]:
    """Partials (value, index, first NaN) and the ticket, once per size and device."""
    specs = [(programs, torch.float32), (programs, torch.int32), (programs, torch.int32), (1, torch.int32)]
    return cached_buffers("greedy_advance", programs, device, specs)
