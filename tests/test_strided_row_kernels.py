"""Kernels that read views of a packed projection in place: the RMSNorm kernel (gpu/rms_norm.py) on
the heads of one member of a q | k | v GEMM's output, SiluMul (gpu/silu_mul.py) on the two halves
of a gate | up output and SigmoidGate (gpu/sigmoid_gate.py) on a gate column beside the shared
expert's projections, against torch on the same values; and Split, whose outputs are such views
(no copy per output).

The kernel cases run through Triton's interpreter in a child process (tests/interpreted_kernels.py)
and directly on CUDA (gpu mark).
"""

from __future__ import annotations

import pytest
import torch

from onnxgen.runtime.gpu.launch import LAUNCHES
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.indexing import split
from tests.interpreted_kernels import KERNEL_DEVICES, assert_close_to_torch_path
from tests.interpreted_runs import IN_THE_PARENT, interpreted_file, runs


def _packed(tokens: int, widths: list[int], *, device: str, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Views of one [2, tokens, sum(widths)] tensor, as a packed GEMM's output split along N."""
    gen = torch.Generator().manual_seed(seed)
    whole = torch.randn(2, tokens, sum(widths), generator=gen).to(device=device, dtype=dtype)
    return list(torch.split(whole, widths, dim=-1))


def _rms_reference(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).to(x.dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["heads_of_a_member", "rows_of_a_member", "contiguous", "transposed"])
def test_rms_norm_reads_strided_rows(device: str, dtype: torch.dtype, layout: str) -> None:
    from onnxgen.runtime.gpu.rms_norm import fused_rms_norm

    heads, head_dim = 3, 24
    q, k, _ = _packed(5, [4 * head_dim, heads * head_dim, 40], device=device, dtype=dtype, seed=0)
    if layout == "heads_of_a_member":  # k's heads: token stride 172, head stride 24
        x = k.reshape(2, 5, heads, head_dim)
    elif layout == "rows_of_a_member":
        x = k
    elif layout == "contiguous":
        x = k.contiguous()
    else:  # no two strides describe it: the kernel gets a copy
        x = q.reshape(2, 5, 4, head_dim).transpose(1, 2)
    gamma = (1.0 + 0.1 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(1))).to(device, dtype)
    before = LAUNCHES["rms_norm"]
    y, _, inv = fused_rms_norm(x, gamma, 1e-6, want_inv=True)
    assert LAUNCHES["rms_norm"] == before + 1
    assert y.is_contiguous() and inv is not None
    assert_close_to_torch_path(y, _rms_reference(x, gamma, 1e-6))
    expected_inv = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_close_to_torch_path(inv, expected_inv)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["member", "transposed"])
def test_rms_norm_with_a_skip_reads_strided_x(device: str, dtype: torch.dtype, layout: str) -> None:
    """The residual sum (and y) come out contiguous and right whatever x's strides: a member of a
    packed output, or a dense x with its first two axes swapped."""
    from onnxgen.runtime.gpu.rms_norm import fused_rms_norm

    x, skip_wide = _packed(4, [48, 48], device=device, dtype=dtype, seed=2)
    if layout == "transposed":
        x = x.contiguous().transpose(0, 1).contiguous().transpose(0, 1)  # [2, 4, 48], strides (48, 96, 1)
        assert not x.is_contiguous()
    skip = skip_wide.contiguous()
    gamma = torch.ones(48, device=device, dtype=dtype)
    y, total, _ = fused_rms_norm(x, gamma, 1e-6, skip=skip, want_sum=True)
    assert total is not None and total.is_contiguous() and y.is_contiguous()
    assert_close_to_torch_path(total, (x.float() + skip.float()).to(dtype))
    assert_close_to_torch_path(y, _rms_reference((x.float() + skip.float()).to(dtype), gamma, 1e-6))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["halves_of_one_output", "contiguous", "one_row", "transposed"])
def test_silu_mul_reads_strided_halves(device: str, dtype: torch.dtype, layout: str) -> None:
    from onnxgen.runtime.gpu.silu_mul import silu_mul

    width = 1100  # two column blocks of 1024, the second partial
    g, u = _packed(3, [width, width], device=device, dtype=dtype, seed=3)
    if layout == "contiguous":
        g, u = g.contiguous(), u.contiguous()
    elif layout == "one_row":
        g, u = g[:1, :1], u[:1, :1]
    elif layout == "transposed":
        g, u = g[..., :6].transpose(0, 2), u[..., :6].transpose(0, 2)
    before = LAUNCHES["silu_mul"]
    out = silu_mul(g, u)
    assert LAUNCHES["silu_mul"] == before + 1 and out.is_contiguous()
    assert_close_to_torch_path(out, (torch.nn.functional.silu(g.float()) * u.float()).to(dtype))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["per_row_gate_column", "elementwise_members_with_x", "transposed"])
def test_sigmoid_gate_reads_strided_rows(device: str, dtype: torch.dtype, form: str) -> None:
    from onnxgen.runtime.gpu.sigmoid_gate import sigmoid_gate, sigmoid_gate_applies

    width = 1100
    y, g, x = _packed(3, [width, width, width], device=device, dtype=dtype, seed=4)
    if form == "per_row_gate_column":  # the shared expert's gate: one column of a wider output
        g, x = g[..., :1], None
    elif form == "transposed":
        y, g, x = (t[..., :6].transpose(0, 2) for t in (y, g, x))
    assert sigmoid_gate_applies(y, g, x)
    before = LAUNCHES["sigmoid_gate"]
    out = sigmoid_gate(y, g, x)
    assert LAUNCHES["sigmoid_gate"] == before + 1 and out.is_contiguous()
    expected = y.float() * torch.sigmoid(g.float()) + (x.float() if x is not None else 0.0)
    assert_close_to_torch_path(out, expected.to(dtype))


def test_split_gives_views_of_its_input() -> None:
    """Split's outputs share x's memory (a copy each would be a kernel each on the GPU) and hold
    its values; the opset-18 ceil-sized chunks included."""
    x = torch.arange(2 * 3 * 10, dtype=torch.float32).reshape(2, 3, 10)
    ctx = NodeContext("Split", "s", "", 18, {"axis": -1}, torch.device("cpu"), 2, 3, (True, True, True))
    parts = split(ctx, x, torch.tensor([2, 3, 5]))
    assert [p.shape[-1] for p in parts] == [2, 3, 5]
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in parts)
    torch.testing.assert_close(torch.cat(parts, dim=-1), x, rtol=0, atol=0)
    chunks = split(NodeContext("Split", "s", "", 18, {"axis": 0, "num_outputs": 2}, torch.device("cpu"), 1, 2,
                               (True, True)), x.reshape(6, 10))  # fmt: skip
    assert [c.shape[0] for c in chunks] == [3, 3]
    torch.testing.assert_close(torch.cat(chunks), x.reshape(6, 10), rtol=0, atol=0)


@IN_THE_PARENT
@runs(KERNELS := interpreted_file(__file__, "through_the_triton_interpreter or gives_views"))
def test_strided_row_kernels_through_the_triton_interpreter() -> None:
    launches = KERNELS.launches()
    assert launches.get("rms_norm", 0) >= 12 and launches.get("silu_mul", 0) >= 8, launches
    assert launches.get("sigmoid_gate", 0) >= 6, launches
