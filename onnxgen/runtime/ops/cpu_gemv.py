"""fp32 matrix-vector products on a multi-core CPU: the weight split across threads by hand.

A decode step multiplies one activation row by every weight matrix, so it is bound by memory
bandwidth. MKL runs such a product (sgemv-shaped sgemm) on one thread here (measured on a 2-core
EPYC: 2 threads gave no speed-up), which leaves the other cores' bandwidth unused. Viewing the
[K, N] weight as P column blocks [P, K, N / P] (a view, no copy) and multiplying them with one
batched GEMM lets torch spread the blocks over its threads: 1.5x on SmolLM2's layers, 1.9x on
its 49152-row lm_head. Each output element is still one K-long dot product computed by the same
BLAS routine; on the shapes we checked the result was bit-identical to torch.mm (and greedy
decoding identical to onnxruntime-genai).

Used only for fp32 CPU tensors, at most _MAX_ROWS rows, weights of at least _MIN_ELEMENTS, with
more than one torch thread and N a multiple of the split. Everything else keeps the plain call.
"""

from __future__ import annotations

import torch

_MAX_ROWS = 1  # decode; prompt-sized GEMMs are compute-bound and MKL threads them itself
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
    if a.shape[-1] != k or n % parts or a.numel() != k * _MAX_ROWS:
        return None
    if b_transposed:  # [N, K] -> P contiguous row blocks, each used transposed: [P, K, N / P]
        blocks = b.view(parts, n // parts, k).transpose(1, 2)
    else:  # [K, N] -> P column blocks: [P, K, N / P] (strided view)
        blocks = b.view(k, parts, n // parts).permute(1, 0, 2)
    row = a.reshape(1, 1, k).expand(parts, 1, k)
    out = torch.bmm(row, blocks)  # [P, 1, N / P]
    return out.reshape(*a.shape[:-1], n)
