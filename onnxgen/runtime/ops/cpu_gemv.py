"""fp32 products of a few activation rows by a weight matrix on a multi-core CPU (a decode step,
one row per sequence), in the forms MKL runs fastest here.

A decode step multiplies one activation row by every weight matrix, so it is bound by memory
bandwidth. MKL runs such a product (sgemv-shaped sgemm) on one thread here (measured on a 2-core
EPYC: 2 threads gave no speed-up), which leaves the other cores' bandwidth unused. Viewing the
[K, N] weight as P column blocks [P, K, N / P] (a view, no copy) and multiplying them with one
batched GEMM lets torch spread the blocks over its threads: 1.5x on SmolLM2's layers, 1.9x on
its 49152-row lm_head. Each output element is still one K-long dot product computed by the same
BLAS routine; on the shapes we checked the result was bit-identical to torch.mm (and greedy
decoding identical to onnxruntime-genai).

A batched decode step (2 to _MAX_ROWS rows, one per running sequence) takes the same column
blocks for [K, N] weights, and for [N, K] weights used transposed (Gemm transB, the lm_head of a
tied embedding) with N >= K, up to _MAX_NK_ROWS rows, the product W @ A^T, transposed back: for a
few rows MKL is slow on A @ W^T and fast on W @ A^T there, though not where N < K
(docs/benchmarks/2026-12-03-cpu-batching.md, "fp32 GEMMs of a few rows"). These forms round
otherwise than the one-row path, as torch.mm does at several rows: a row's result depends on the
row count (docs/batching.md).

Used only for fp32 CPU tensors, at most _MAX_ROWS rows, weights of at least _MIN_ELEMENTS, with
more than one torch thread and N a multiple of the split. Everything else keeps the plain call.
"""

from __future__ import annotations

import torch

_MAX_ROWS = 16  # a batched decode step; prompt-sized GEMMs are compute-bound and MKL threads them itself
_MAX_NK_ROWS = 8  # W @ A^T for [N, K] weights up to this many rows (beyond: the column blocks)
_MIN_ELEMENTS = 1 << 16  # below this the extra dispatch costs more than the second core gives


def split_gemv(a: torch.Tensor, b: torch.Tensor, *, b_transposed: bool = False) -> torch.Tensor | None:
    """a [..., K] @ b ([K, N], or [N, K] with b_transposed), or None where the fast path does not apply."""
    if not (a.is_cpu and b.is_cpu and a.dtype == torch.float32 and b.dtype == torch.float32):
        return None
    if b.dim() != 2 or a.dim() < 1 or not b.is_contiguous():
        return None
    parts = torch.get_num_threads()
    if parts < 2 or b.numel() < _MIN_ELEMENTS:
        return None
    k, n = (b.shape[1], b.shape[0]) if b_transposed else (b.shape[0], b.shape[1])
    rows = a.numel() // k if a.shape[-1] == k else 0
    if not 1 <= rows <= _MAX_ROWS or n % parts:
        return None
    if b_transposed and 1 < rows <= _MAX_NK_ROWS and n >= k:
        return torch.mm(b, a.reshape(rows, k).t()).t().reshape(*a.shape[:-1], n)
    if b_transposed:  # [N, K] -> P contiguous row blocks, each used transposed: [P, K, N / P]
        blocks = b.view(parts, n // parts, k).transpose(1, 2)
    else:  # [K, N] -> P column blocks: [P, K, N / P] (strided view)
        blocks = b.view(k, parts, n // parts).permute(1, 0, 2)
    out = torch.bmm(a.reshape(1, rows, k).expand(parts, rows, k), blocks)  # [P, rows, N / P]
    return out.permute(1, 0, 2).reshape(*a.shape[:-1], n)  # one row: a view, no copy
