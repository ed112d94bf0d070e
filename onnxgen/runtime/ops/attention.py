"""Default-domain Attention (opsets 23-25) and RotaryEmbedding (opset 23).

One Attention implementation serves prefill (seq > 1, causal) and decode (seq = 1 with a past): the
masks it needs are built on the device from shapes alone (no host reads of device data), so it
records into a CUDA graph for fixed shapes. The common case goes through
``scaled_dot_product_attention``; the spec's extras (softcap, the qk_matmul_output debug output,
a double softmax) take an explicit path that follows the spec's operation order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from onnxgen.runtime.dtypes import torch_dtype
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import sdpa
from onnxgen.runtime.ops.registry import implements

_NEG_INF = float("-inf")


def _to_4d(x: torch.Tensor, num_heads: int | None, what: str, ctx: NodeContext) -> torch.Tensor:
    """[B, S, H*D] -> [B, H, S, D] (a view); 4D inputs pass through."""
    if x.dim() == 4:
        return x
    if x.dim() != 3 or not num_heads:
        raise ctx.fail(f"{what} must be 4D, or 3D with q_num_heads/kv_num_heads set (got rank {x.dim()})")
    b, s, hidden = x.shape
    if hidden % num_heads:
        raise ctx.fail(f"{what} hidden size {hidden} is not a multiple of {num_heads} heads")
    return x.view(b, s, num_heads, hidden // num_heads).transpose(1, 2)


class _Masks:
    """The attention bias split into a boolean 'allowed' part and an additive float part.

    ``allowed`` is None when every key is allowed; ``additive`` is None without a float mask.
    Both broadcast to [B, Hq, Sq, Sk].
    """

    def __init__(self) -> None:
        self.allowed: torch.Tensor | None = None
        self.additive: torch.Tensor | None = None
        # A user mask or nonpad_kv_seqlen can leave a query row with no key; causal and window
        # bounds around a past-length offset always keep the query's own position.
        self.may_empty_rows = False

    def restrict(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed if self.allowed is None else self.allowed & allowed

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The combined additive bias (0 / -inf / float mask values) or None when empty."""
        if self.additive is None:
            if self.allowed is None:
                return None
            zero = torch.zeros((), dtype=dtype)  # a host scalar: no fill kernel on the device
            return torch.where(self.allowed, zero, _NEG_INF)
        additive = self.additive.to(dtype)
        if self.allowed is None:
            return additive
        return additive.masked_fill(~self.allowed, _NEG_INF)

    def live_rows(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """[..., Sq, 1] False where a query row has no attendable key (the spec makes it zero);
        None when no row can be empty."""
        if not self.may_empty_rows:
            return None
        if self.additive is None:
            if self.allowed is None:
                return None
            return self.allowed.any(dim=-1, keepdim=True)
        assert bias is not None
        return bias.amax(dim=-1, keepdim=True) > _NEG_INF


def _build_masks(
    ctx: NodeContext,
    attn_mask: torch.Tensor | None,
    nonpad: torch.Tensor | None,
    batch: int,
    sq: int,
    sk: int,
    past_len: int,
    device: torch.device,
) -> _Masks:
    masks = _Masks()
    masks.may_empty_rows = attn_mask is not None or nonpad is not None
    if attn_mask is not None:
        pad = sk - attn_mask.shape[-1]
        if pad < 0:
            raise ctx.fail(f"attn_mask has {attn_mask.shape[-1]} keys, more than the {sk} total keys")
        if attn_mask.dtype == torch.bool:
            if pad:  # a short mask is padded with 'not allowed'
                attn_mask = F.pad(attn_mask, (0, pad), value=False)
            masks.restrict(attn_mask)
        else:
            if pad:
                attn_mask = F.pad(attn_mask, (0, pad), value=_NEG_INF)
            masks.additive = attn_mask
    is_causal = bool(ctx.attr("is_causal", 0))
    left = int(ctx.attr("left_window_size", -1))
    right = int(ctx.attr("right_window_size", -1))
    per_batch_offset = nonpad is not None and past_len == 0
    if is_causal and not per_batch_offset and left < 0 and right < 0:
        # bottom-right causal: query i sees keys up to past_len + i (nothing to do when that
        # already covers every key, as in decode)
        if past_len < sk - 1:
            masks.restrict(torch.ones(sq, sk, dtype=torch.bool, device=device).tril(past_len))
    elif is_causal or left >= 0 or right >= 0:
        # Query i sits at absolute position i + offset; offset counts the valid keys before the
        # query block: the past length, or per batch nonpad_kv_seqlen - Sq for an external cache.
        i = torch.arange(sq, device=device).view(sq, 1)
        j = torch.arange(sk, device=device).view(1, sk)
        if per_batch_offset:
            assert nonpad is not None
            offset = (nonpad.to(device=device, dtype=torch.int64) - sq).view(-1, 1, 1, 1)
            diff = (i + offset) - j  # [B, 1, Sq, Sk]
        else:
            diff = (i + past_len) - j  # [Sq, Sk]
        if is_causal:
            masks.restrict(diff >= 0)
        if left >= 0:
            masks.restrict(diff <= left)
        if right >= 0:
            masks.restrict(-diff <= right)
    if nonpad is not None:
        keys = torch.arange(sk, device=device).view(1, sk)
        valid = keys < nonpad.to(device=device, dtype=torch.int64).view(-1, 1)
        masks.restrict(valid.view(batch, 1, 1, sk))
    return masks


def _explicit_attention(
    ctx: NodeContext,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masks: _Masks,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The spec's graph step by step; returns Y and the requested qk_matmul_output (or None)."""
    dtype = q.dtype
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # head h of Q reads KV head h // groups
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    root = math.sqrt(scale)
    scores = torch.matmul(q * root, (k * root).transpose(-1, -2))
    softcap = float(ctx.attr("softcap", 0.0))
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    mode = int(ctx.attr("qk_matmul_output_mode", 0))
    want_qk = ctx.num_outputs > 3 and ctx.outputs_wanted[3]
    qk_out = scores if want_qk and mode in (0, 1) else None
    bias = masks.bias(dtype)
    biased = scores if bias is None else scores + bias
    if want_qk and mode == 2:
        qk_out = biased
    precision = ctx.attr("softmax_precision")
    if precision is not None:
        soft_dtype = torch_dtype(int(precision))
    else:  # fp16/bf16 softmax runs in fp32, as onnxruntime does
        soft_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    probs = torch.softmax(biased.to(soft_dtype), dim=-1)
    live = masks.live_rows(bias)
    if live is not None:
        probs = torch.where(live, probs, 0.0)
    probs = probs.to(dtype)
    if want_qk and mode == 3:
        qk_out = probs
    y = torch.matmul(probs, v)
    if qk_out is not None and qk_out.shape[:2] != y.shape[:2]:
        qk_out = qk_out.expand(*y.shape[:2], *qk_out.shape[2:])
    return y, (None if qk_out is None else qk_out.to(dtype).contiguous())


def _sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masks: _Masks,
    scale: float,
    causal: str | None,
) -> torch.Tensor:
    """The fast path: one fused SDPA call; fully masked rows are zeroed as the spec asks.

    ``causal`` is None (the masks say everything), "top_left" (no offset) or "lower_right"
    (offset = Sk - Sq, the past length), both without materialising a mask.
    """
    # a float bias even for boolean masks: SDPA would convert a bool mask itself, in more kernels
    mask = masks.bias(q.dtype)
    live = masks.live_rows(mask)
    batch, q_heads, sq, _ = q.shape
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    if causal == "lower_right":
        # imported here, not at module load: torch.nn.attention.bias pulls in torch._dynamo (and with
        # it sympy and triton), ~100 MiB of resident memory that a model without this case never needs
        from torch.nn.attention.bias import causal_lower_right

        return sdpa(q, k, v, attn_mask=causal_lower_right(sq, k.shape[2]), scale=scale, enable_gqa=groups > 1)
    same_mask_per_head = mask is None or mask.dim() < 3 or mask.shape[-3] == 1
    if groups > 1 and causal is None and same_mask_per_head and q.device.type == "cpu":
        # CPU GQA: the G query heads that share a KV head become G*Sq rows of that head (no KV
        # repeat); CUDA backends take GQA natively through enable_gqa.
        q = q.reshape(batch, kv_heads, groups * sq, q.shape[-1])
        if mask is not None and mask.dim() >= 2 and mask.shape[-2] != 1:
            mask = mask.repeat(*([1] * (mask.dim() - 2)), groups, 1)  # row g*Sq + i is query i
        y = sdpa(q, k, v, attn_mask=mask, scale=scale)
        y = y.reshape(batch, q_heads, sq, y.shape[-1])
    else:
        y = sdpa(q, k, v, attn_mask=mask, is_causal=causal == "top_left", scale=scale, enable_gqa=groups > 1)
    if live is not None:
        y = torch.where(live, y, 0.0)
    return y


@implements("Attention", since=23)
def attention(
    ctx: NodeContext,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    nonpad_kv_seqlen: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    three_d = q.dim() == 3
    q4 = _to_4d(q, ctx.attr("q_num_heads"), "Q", ctx)
    k4 = _to_4d(k, ctx.attr("kv_num_heads"), "K", ctx)
    v4 = _to_4d(v, ctx.attr("kv_num_heads"), "V", ctx)
    if (past_key is None) != (past_value is None):
        raise ctx.fail("past_key and past_value must be given together")
    past_len = 0
    if past_key is not None and past_value is not None:
        past_len = past_key.shape[2]
        k4 = torch.cat((past_key, k4), dim=2)  # the KV cache grows along the sequence axis
        v4 = torch.cat((past_value, v4), dim=2)
    present_key, present_value = k4, v4
    batch, q_heads, sq, head_size = q4.shape
    kv_heads, sk = k4.shape[1], k4.shape[2]
    if q_heads % kv_heads:
        raise ctx.fail(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    scale = ctx.attr("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_size)

    want_qk = ctx.num_outputs > 3 and ctx.outputs_wanted[3]
    precision = ctx.attr("softmax_precision")
    # the fused path's softmax runs in fp32 (or the input's precision); other requests go explicit
    exotic_softmax = precision is not None and torch_dtype(int(precision)) not in (torch.float32, q4.dtype)
    if want_qk or float(ctx.attr("softcap", 0.0)) > 0 or exotic_softmax or q4.dtype == torch.float64:
        masks = _build_masks(ctx, attn_mask, nonpad_kv_seqlen, batch, sq, sk, past_len, q4.device)
        y, qk_out = _explicit_attention(ctx, q4, k4, v4, masks, scale)
    else:
        windowed = int(ctx.attr("left_window_size", -1)) >= 0 or int(ctx.attr("right_window_size", -1)) >= 0
        plain_causal = (
            bool(ctx.attr("is_causal", 0)) and attn_mask is None and nonpad_kv_seqlen is None and not windowed
        )
        causal: str | None = None
        masks = _Masks()
        if plain_causal and past_len == 0:
            causal = "top_left"  # SDPA's own causal mask is the spec's when there is no offset
        elif plain_causal and sq > 1 and sk - sq == past_len and q4.device.type == "cuda":
            causal = "lower_right"  # chunked prefill over a past: fused offset causal, no mask
        elif not plain_causal or past_len < sk - 1:  # (decode: one query after the past sees every key)
            masks = _build_masks(ctx, attn_mask, nonpad_kv_seqlen, batch, sq, sk, past_len, q4.device)
        y = _sdpa_attention(q4, k4, v4, masks, scale, causal)
        qk_out = None

    if three_d:
        y = y.transpose(1, 2).reshape(batch, sq, -1)
    outputs: list[torch.Tensor | None] = [y, present_key, present_value, qk_out]
    return tuple(outputs[: max(ctx.num_outputs, 1)])


@implements("RotaryEmbedding", since=23)
def rotary_embedding(
    ctx: NodeContext,
    x: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    interleaved = bool(ctx.attr("interleaved", 0))
    if x.dim() == 4:  # [B, H, S, D]: cos/sin [B, S, R/2] broadcast over heads
        xs = x
        head_axis = 1
    elif x.dim() == 3:  # [B, S, H*D] -> [B, S, H, D]
        num_heads = int(ctx.attr("num_heads", 0))
        if not num_heads:
            raise ctx.fail("3D input needs the num_heads attribute")
        b, s, hidden = x.shape
        xs = x.reshape(b, s, num_heads, hidden // num_heads)
        head_axis = 2
    else:
        raise ctx.fail(f"input must be 3D or 4D, got rank {x.dim()}")
    head_size = xs.shape[-1]
    rot = int(ctx.attr("rotary_embedding_dim", 0)) or head_size
    if position_ids is not None:  # caches are [max_position, R/2]; gather per token
        cos = cos_cache[position_ids.long()]
        sin = sin_cache[position_ids.long()]
    else:  # caches are already [B, S, R/2]
        cos, sin = cos_cache, sin_cache
    if cos.shape[-1] != rot // 2:
        raise ctx.fail(f"cos/sin caches have {cos.shape[-1]} columns, expected rotary_embedding_dim/2 = {rot // 2}")
    cos = cos.unsqueeze(head_axis).to(xs.dtype)
    sin = sin.unsqueeze(head_axis).to(xs.dtype)
    rotated = xs[..., :rot]
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    else:
        x1, x2 = rotated[..., : rot // 2], rotated[..., rot // 2 :]
    real = x1 * cos - x2 * sin
    imag = x1 * sin + x2 * cos
    if interleaved:
        out = torch.stack((real, imag), dim=-1).flatten(-2)
    else:
        out = torch.cat((real, imag), dim=-1)
    if rot < head_size:
        out = torch.cat((out, xs[..., rot:]), dim=-1)
    return out.reshape(x.shape)
