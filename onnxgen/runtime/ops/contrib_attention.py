"""com.microsoft attention ops that onnxruntime-genai's model builder writes: GroupQueryAttention, (M)RotaryEmbedding.

GroupQueryAttention keeps its KV cache in one of two layouts, chosen by the past buffer's length:

* separate (past length < total_sequence_length): present is a new [B, Hkv, total, D] tensor holding
  the first ``past_seqlen[b]`` rows of past, the new rows, and zeros elsewhere (as onnxruntime CPU).
* shared (past length >= total_sequence_length): past is a fixed-capacity buffer. The new rows are
  written *in place* into it and present_key/present_value *are* the past tensors. This is
  onnxruntime's past/present buffer sharing (genai binds one buffer to both); it is what lets a
  decode step run with fixed shapes. A caller that feeds a tensor here gets it updated.

Per batch entry b, with T = seqlens_k[b] + 1 tokens in the cache after the step (all on the device):
the step's rows start at P = T - S (or 0 on the first prompt, or T - query_seqlens[b]); query row s
sits at absolute position P + s and sees the keys j < min(P + s + 1, T), the last
``local_window_size`` of them when a window is set (onnxruntime 1.32 counts the current token in
the window). Rotary positions are the same P + s unless position_ids are given.

Nothing here reads device data on the host, except on the CPU (where a host read costs nothing)
to spot a plain append step and take a shorter path (_cpu_appending). total_sequence_length (a
host input) sets the present length and tells a first prompt (S == total, S > 1) from a later
chunk; for S == 1 the result does not depend on its value, so a captured decode step stays right
as the sequence grows. On CUDA the attention spans the whole shared buffer (masked), so its shapes
do not change from step to step; over a shared buffer, Triton kernels take a decode step
(gpu/gqa_decode.py) and a prompt chunk (gpu/gqa_prefill.py), reading T on the device and never
touching the key blocks past what a row may see. (The one departure from onnxruntime this costs: a one-token
first prompt with position_ids, where onnxruntime would use position_ids[0] for every batch entry,
uses each entry's own.)

sliding_window_cache=1 (window-sized buffers, rows [0, L(T)) holding the latest positions) is
handled in place, like the shared layout. Not supported (the implementation says so): quantized KV caches,
the output_qk output. Supported beyond onnxruntime's CPU kernel: q_norm_weight/k_norm_weight (fused Q/K RMSNorm).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from onnxgen.runtime.gpu.launch import triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints, sdpa
from onnxgen.runtime.ops.registry import MS_DOMAIN, implements

_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """fp32 for half types on the CPU (onnxruntime CPU computes them in fp32; CPU half math is slow)."""
    return torch.float32 if device.type == "cpu" and dtype in _HALF else dtype


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] channels of x [..., D]; cos/sin broadcast to [..., R/2].

    Computed in fp32 and cast back, as onnxruntime does for half inputs.
    """
    rot = cos.shape[-1] * 2
    head = x[..., :rot].float()
    cos = cos.float()
    sin = sin.float()
    if interleaved:  # pairs (2i, 2i+1) rotate by angle i
        x1, x2 = head[..., 0::2], head[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:  # halves (i, i + R/2) rotate by angle i
        x1, x2 = head[..., : rot // 2], head[..., rot // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = out.to(x.dtype)
    if rot < x.shape[-1]:
        out = torch.cat((out, x[..., rot:]), dim=-1)
    return out


def _rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm over D (the fused Q/K norm of Qwen3-style models), fp32 inside."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv * weight.float()).to(x.dtype)


def _fit_bias(bias: torch.Tensor, length: int) -> torch.Tensor:
    """attention_bias is indexed by absolute key position: cut or zero-pad its last axis to `length`."""
    width = bias.shape[-1]
    if width >= length:
        return bias[..., :length]
    return F.pad(bias, (0, length - width))


@implements("GroupQueryAttention", domain=MS_DOMAIN, host_inputs=(6,))
def group_query_attention(
    ctx: NodeContext,
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    seqlens_k: torch.Tensor | None = None,
    total_sequence_length: torch.Tensor | None = None,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
    head_sink: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    query_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    num_heads = int(ctx.require("num_heads"))
    kv_heads = int(ctx.require("kv_num_heads"))
    _check_supported(ctx, num_heads, kv_heads, past_key, past_value, seqlens_k, total_sequence_length, k_scale)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ctx.fail("q_norm_weight and k_norm_weight must be given together")
    if query.dim() != 3:
        raise ctx.fail(f"query must be 3D [batch, seq, hidden], got shape {list(query.shape)}")
    batch, seq, hidden = query.shape
    device = query.device
    if triton_serves(query):
        fast = _triton_step(
            ctx, num_heads, kv_heads, query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
            cos_cache, sin_cache, position_ids, attention_bias, head_sink, q_norm_weight, query_seqlens,
        )  # fmt: skip
        if fast is not None:
            return fast

    # -- split and shape Q, K, V as [B, heads, S, D] -------------------------------------------
    if key is None:  # packed QKV in query
        head_size = hidden // (num_heads + 2 * kv_heads)
        q, k, v = query.split((num_heads * head_size, kv_heads * head_size, kv_heads * head_size), dim=-1)
    else:
        if value is None:
            raise ctx.fail("key and value must both be given, or both be absent for packed QKV")
        head_size = hidden // num_heads
        q, k, v = query, key, value
    q = q.reshape(batch, seq, num_heads, head_size).transpose(1, 2)
    k = k.reshape(batch, seq, kv_heads, head_size).transpose(1, 2)
    v = v.reshape(batch, seq, kv_heads, head_size).transpose(1, 2)

    # -- where this step's rows sit, per batch entry (device tensors, no host reads) -------------
    total = ints(total_sequence_length)[0]
    past_len = past_key.shape[2] if past_key is not None else 0
    present_len = max(total, past_len)
    first_prompt = query_seqlens is None and seq > 1 and seq == total
    append_at = _cpu_appending(ctx, query, past_key, seqlens_k, query_seqlens, total, seq, first_prompt)
    if append_at is not None:  # the CPU decode fast path (see _cpu_appending)
        return _appending_step(
            ctx, q, k, v, past_key, past_value, total, cos_cache, sin_cache, position_ids,
            attention_bias, head_sink, q_norm_weight, k_norm_weight, first_prompt, append_at,
        )  # fmt: skip
    if _cpu_batched_decode(query, past_key, query_seqlens, attention_bias, total, seq, ctx):
        # each entry as its own appending step: the arithmetic of a batch of one, whatever else
        # is in the batch, so a sequence decodes the same tokens alone or batched
        lengths = (seqlens_k.reshape(-1).to(torch.long) + 1).tolist()
        if min(lengths) >= 1 and max(lengths) <= past_len:
            fast = _batched_appending_decode(
                ctx, q, k, v, past_key, past_value, lengths, cos_cache, sin_cache, position_ids, head_sink,
                q_norm_weight, k_norm_weight,
            )  # fmt: skip
            if fast is not None:
                return fast, past_key, past_value
            outs = [
                _appending_step(
                    ctx, q[b : b + 1], k[b : b + 1], v[b : b + 1], past_key[b : b + 1], past_value[b : b + 1],
                    lengths[b], cos_cache, sin_cache, None if position_ids is None else position_ids[b : b + 1],
                    None, head_sink, q_norm_weight, k_norm_weight, False, lengths[b] - 1,
                )[0]
                for b in range(batch)
            ]  # fmt: skip
            return torch.cat(outs), past_key, past_value
    cache_len = seqlens_k.to(torch.long) + 1  # T per batch entry
    steps = torch.arange(seq, device=device)
    if query_seqlens is not None:
        start = cache_len - query_seqlens.to(torch.long)
    elif first_prompt or past_key is None:
        start = torch.zeros_like(cache_len)
    else:
        start = cache_len - seq  # decode (S == 1) and later prompt chunks
    positions = start[:, None] + steps  # [B, S] absolute position of each new row

    # -- optional fused Q/K norm, then rotary ------------------------------------------------------
    if q_norm_weight is not None:
        default_eps = float(ctx.attr("qk_norm_epsilon", 1e-6))
        q = _rms_norm_heads(q, q_norm_weight, float(ctx.attr("q_norm_epsilon", default_eps)))
        k = _rms_norm_heads(k, k_norm_weight, float(ctx.attr("k_norm_epsilon", default_eps)))
    if int(ctx.attr("do_rotary", 0)):
        if cos_cache is None or sin_cache is None:
            raise ctx.fail("do_rotary=1 needs cos_cache and sin_cache")
        if position_ids is None:
            rotary_pos = positions
        elif first_prompt:  # onnxruntime reads only position_ids[0] on the first prompt
            rotary_pos = (position_ids.reshape(-1)[:1].to(torch.long) + steps).expand(batch, seq)
        else:
            rotary_pos = position_ids.to(torch.long).reshape(batch, seq)
        cos = cos_cache[rotary_pos].unsqueeze(1)  # [B, 1, S, R/2]
        sin = sin_cache[rotary_pos].unsqueeze(1)
        interleaved = bool(ctx.attr("rotary_interleaved", 0))
        q = apply_rotary(q, cos, sin, interleaved)
        k = apply_rotary(k, cos, sin, interleaved)

    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(head_size)
    if int(ctx.attr("sliding_window_cache", 0)):
        out, present_key, present_value = _windowed_cache_step(
            ctx, q, k, v, past_key, past_value, start, cache_len, attention_bias, head_sink, scale
        )
        return out.transpose(1, 2).reshape(batch, seq, num_heads * head_size), present_key, present_value

    # -- write the new rows into the cache ---------------------------------------------------------
    present_key = _present(past_key, start, present_len, total, (batch, kv_heads, head_size), k)
    present_value = _present(past_value, start, present_len, total, (batch, kv_heads, head_size), v)
    index = positions[:, None, :, None].expand(batch, kv_heads, seq, head_size)
    present_key.scatter_(2, index, k.to(present_key.dtype))
    present_value.scatter_(2, index, v.to(present_value.dtype))

    # -- attention over the cache ------------------------------------------------------------------
    # Every key a row may see lies below T <= total: the attention stops there. total is a host
    # value (the mask's width), fixed per binding key, so a captured step keeps its shapes; a static
    # cache's decode step feeds the whole mask (total = the buffer length), a captured prefill chunk
    # only the rows up to its end (genai/engine.py).
    kv_len = min(present_len, total)
    keys = present_key[:, :, :kv_len]
    values = present_value[:, :, :kv_len]
    allowed = _allowed_keys(ctx, positions, cache_len, kv_len)  # [B, 1, S, L]
    out = _attend(ctx, q, keys, values, allowed, attention_bias, head_sink, scale)
    out = out.transpose(1, 2).reshape(batch, seq, num_heads * head_size)
    return out, present_key, present_value


def _triton_step(
    ctx: NodeContext,
    num_heads: int,
    kv_heads: int,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    past_key: torch.Tensor | None,
    past_value: torch.Tensor | None,
    seqlens_k: torch.Tensor,
    total_sequence_length: torch.Tensor,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    attention_bias: torch.Tensor | None,
    head_sink: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    query_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The step over a shared KV buffer in Triton kernels: a one-token decode step in one
    (gpu/gqa_decode.py), a prompt or prompt chunk in two (gpu/gqa_prefill.py). None when the node
    or its inputs need the general path (extras such as bias, sinks, softcap, a non-causal or
    growing KV, unusual layouts)."""
    if past_key is None or past_value is None or query_seqlens is not None:
        return None
    if attention_bias is not None or head_sink is not None or q_norm_weight is not None:
        return None
    if float(ctx.attr("softcap", 0.0)) > 0 or int(ctx.attr("smooth_softmax", 0)):
        return None
    if int(ctx.attr("sliding_window_cache", 0)):
        return None
    batch, seq = query.shape[0], query.shape[1]
    head_size = past_key.shape[3] if past_key.dim() == 4 else 0
    total = ints(total_sequence_length)[0]
    if past_key.shape[2] < total or past_key.shape[0] != batch or past_key.shape[1] != kv_heads:
        return None  # not a shared buffer that already holds the new rows' slots
    if not (16 <= head_size <= 256) or past_value.shape != past_key.shape or seqlens_k.numel() != batch:
        return None
    if not (past_key.is_contiguous() and past_value.is_contiguous()) or past_key.dtype != query.dtype:
        return None
    expected = (num_heads + (0 if key is not None else 2 * kv_heads)) * head_size
    if query.shape[2] != expected or query.stride(-1) != 1:
        return None
    for t in (key, value):
        if t is not None and (t.shape != (batch, seq, kv_heads * head_size) or t.stride(-1) != 1):
            return None
    first_prompt = seq > 1 and seq == total  # rows from 0; rotary reads position_ids[0] only
    do_rotary = bool(int(ctx.attr("do_rotary", 0)))
    if do_rotary:
        if cos_cache is None or sin_cache is None or cos_cache.shape[-1] * 2 > head_size:
            return None
        cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
        if position_ids is not None and position_ids.numel() != batch * seq and not first_prompt:
            return None
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(head_size)
    interleaved = bool(ctx.attr("rotary_interleaved", 0))
    window = int(ctx.attr("local_window_size", -1))
    if seq > 1:
        if not int(ctx.attr("causal", 1)):
            return None
        return _triton_prefill(
            num_heads, kv_heads, query, key, value, past_key, past_value, seqlens_k, first_prompt, scale,
            cos_cache if do_rotary else None, sin_cache if do_rotary else None,
            position_ids if do_rotary else None, interleaved, window,
        )  # fmt: skip
    from onnxgen.runtime.gpu.gqa_decode import decode_attention

    out = decode_attention(
        query,
        key,
        value,
        past_key,
        past_value,
        seqlens_k,
        num_heads=num_heads,
        kv_heads=kv_heads,
        scale=scale,
        cos_cache=cos_cache if do_rotary else None,
        sin_cache=sin_cache if do_rotary else None,
        position_ids=position_ids if do_rotary else None,
        interleaved=interleaved,
        window=window,
    )
    return out, past_key, past_value


def _triton_prefill(
    num_heads: int,
    kv_heads: int,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    first_prompt: bool,
    scale: float,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt (chunk) of S > 1 rows: which rotary positions they take, by the general path's
    rules (``first_prompt``: S == total, rows from 0)."""
    from onnxgen.runtime.gpu.gqa_prefill import prefill_attention

    batch, seq = query.shape[0], query.shape[1]
    positions = None
    if position_ids is not None:
        if first_prompt:  # onnxruntime reads only position_ids[0] on the first prompt
            steps = torch.arange(seq, device=query.device)
            positions = (position_ids.reshape(-1)[:1].to(torch.long) + steps).expand(batch, seq)
        else:
            positions = position_ids.to(torch.long).reshape(batch, seq)
    out = prefill_attention(
        query, key, value, past_key, past_value, seqlens_k, num_heads=num_heads, kv_heads=kv_heads,
        scale=scale, first_prompt=first_prompt, cos_cache=cos_cache, sin_cache=sin_cache,
        positions=positions, interleaved=interleaved, window=window,
    )  # fmt: skip
    return out, past_key, past_value


def _cpu_appending(
    ctx: NodeContext,
    query: torch.Tensor,
    past_key: torch.Tensor | None,
    seqlens_k: torch.Tensor,
    query_seqlens: torch.Tensor | None,
    total: int,
    seq: int,
    first_prompt: bool,
) -> int | None:
    """Where this step's S rows start, if it only appends them to an unpadded single-sequence
    cache on the CPU (None: take the general path).

    Two layouts qualify. Separate buffers (past length + S == total): present is cat(past, new
    rows) and the rows start at the past length. A shared buffer with room to spare (past length
    >= total, every row below T = total valid): the rows are written in place at T - S (0 for a
    first prompt) and the attention reads rows [0, T) only; this is how a growing CPU cache
    (genai/kv_cache.py GrowingKV) avoids copying the whole cache every step. A one-token step sees
    every key (no mask needed). The general path costs ~15 small ops more. Reading seqlens_k on
    the host is free on the CPU; on CUDA (where it would sync, and where steps are captured) the
    general path always runs.
    """
    if not query.is_cpu or past_key is None or query.shape[0] != 1 or query_seqlens is not None:
        return None
    past_len = past_key.shape[2]
    if int(ctx.attr("sliding_window_cache", 0)) or (past_len + seq != total and past_len < total):
        return None
    cache_len = int(seqlens_k.reshape(-1)[0]) + 1
    start = 0 if first_prompt else cache_len - seq
    if cache_len != total:
        return None
    if past_len + seq == total:
        return start if start == past_len else None
    return start if start >= 0 else None


def _batched_appending_decode(
    ctx: NodeContext,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    lengths: list[int],
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    head_sink: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
) -> torch.Tensor | None:
    """A one-token step of several entries over a shared buffer, entry b at length lengths[b]: the
    Q/K norm, the rotary and the KV write for all entries at once, each entry's attention on its own
    rows. Every operation computes each entry's values as _appending_step computes them for that
    entry alone (elementwise, or per row), so the results are the same bit for bit. None for the
    forms it does not take (rotary by position_ids, interleaved or partial; a local window shorter
    than an entry): the caller runs _appending_step per entry."""
    batch, num_heads, _, head_size = q.shape
    window = int(ctx.attr("local_window_size", -1))
    if window > 0 and window < max(lengths):
        return None
    rotary = int(ctx.attr("do_rotary", 0))
    if rotary and (
        cos_cache is None or sin_cache is None or position_ids is not None
        or int(ctx.attr("rotary_interleaved", 0)) or cos_cache.shape[-1] * 2 != head_size
    ):  # fmt: skip
        return None
    if q_norm_weight is not None:
        default_eps = float(ctx.attr("qk_norm_epsilon", 1e-6))
        q = _rms_norm_heads(q, q_norm_weight, float(ctx.attr("q_norm_epsilon", default_eps)))
        k = _rms_norm_heads(k, k_norm_weight, float(ctx.attr("k_norm_epsilon", default_eps)))
    starts = torch.tensor([n - 1 for n in lengths])
    if rotary:
        cos = cos_cache[starts].float()[:, None, None]  # [B, 1, 1, R/2]: the rows _RotaryFactors slices
        sin = sin_cache[starts].float()[:, None, None]
        cos2, sin2 = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        qk = torch.cat((q, k), dim=1)
        half = head_size // 2
        swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        qk = (qk.float() * cos2 + swapped.float() * sin2).to(q.dtype)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
    entries = torch.arange(batch)
    past_key[entries, :, starts] = k[:, :, 0].to(past_key.dtype)
    past_value[entries, :, starts] = v[:, :, 0].to(past_value.dtype)
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(head_size)
    plain = head_sink is None and float(ctx.attr("softcap", 0.0)) <= 0 and int(ctx.attr("smooth_softmax", 0)) != 1
    if plain and q.dtype == compute_dtype(q.dtype, q.device) and past_key.dtype == q.dtype:
        # _attend's fused branch without its per-call checks: the same kernel on the same tensors
        gqa = num_heads != past_key.shape[1]
        attend = F.scaled_dot_product_attention
        outs = [
            attend(q[b : b + 1], past_key[b : b + 1, :, :n], past_value[b : b + 1, :, :n], scale=scale, enable_gqa=gqa)
            for b, n in enumerate(lengths)
        ]
    else:
        outs = [
            _attend(
                ctx,
                q[b : b + 1],
                past_key[b : b + 1, :, :n],
                past_value[b : b + 1, :, :n],
                None,
                None,
                head_sink,
                scale,
            )  # fmt: skip
            for b, n in enumerate(lengths)
        ]
    return torch.cat(outs).transpose(1, 2).reshape(batch, 1, num_heads * head_size)


def _cpu_batched_decode(
    query: torch.Tensor,
    past_key: torch.Tensor | None,
    query_seqlens: torch.Tensor | None,
    attention_bias: torch.Tensor | None,
    total: int,
    seq: int,
    ctx: NodeContext,
) -> bool:
    """A one-token step of several entries on the CPU over a shared buffer (a batched decode step,
    genai/batched.py): each entry can take _appending_step at its own length."""
    if not query.is_cpu or past_key is None or query.shape[0] < 2 or seq != 1 or query_seqlens is not None:
        return False
    if attention_bias is not None or int(ctx.attr("sliding_window_cache", 0)):
        return False
    return past_key.shape[2] >= total


class _RotaryFactors:
    """Full-width rotary factors for positions [start, start + S), remembered for the next layers.

    With cos2 = [cos, cos] and sin2 = [-sin, sin], x * cos2 + [x2, x1] * sin2 gives
    [x1 cos - x2 sin, x2 cos + x1 sin] with the same roundings as apply_rotary (a + (-b) is a - b
    exactly), in 4 ops instead of ~10. Every layer of a step asks for the same positions; a batched
    step for one per sequence, so up to ``entries`` (start, S) pairs are kept, for one cos/sin pair.
    """

    entries = 256

    def __init__(self) -> None:
        self._tables: tuple = ()
        self._refs: tuple = ()
        self._values: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def factors(
        self, cos_cache: torch.Tensor, sin_cache: torch.Tensor, start: int, seq: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tables = (id(cos_cache), id(sin_cache), _version(cos_cache), _version(sin_cache))
        alive = self._refs and self._refs[0]() is cos_cache and self._refs[1]() is sin_cache
        if tables != self._tables or not alive:
            self._tables, self._refs, self._values = tables, (weakref.ref(cos_cache), weakref.ref(sin_cache)), {}
        value = self._values.get((start, seq))
        if value is not None:
            return value
        if len(self._values) >= self.entries:
            self._values.clear()
        cos = cos_cache[start : start + seq].float()
        sin = sin_cache[start : start + seq].float()
        cos2 = torch.cat((cos, cos), dim=-1)[None, None]
        sin2 = torch.cat((-sin, sin), dim=-1)[None, None]
        value = self._values[(start, seq)] = (cos2, sin2)
        return value


_ROTARY = _RotaryFactors()


def _version(tensor: torch.Tensor) -> int:
    """The in-place write counter (an inference-mode tensor has none: it counts as never written)."""
    try:
        return tensor._version
    except RuntimeError:
        return 0


def _appending_step(
    ctx: NodeContext,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    total: int,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    attention_bias: torch.Tensor | None,
    head_sink: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    first_prompt: bool,
    start: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The general path's arithmetic for a step that _cpu_appending accepted (rows from ``start``),
    with host positions."""
    batch, num_heads, seq, head_size = q.shape
    if q_norm_weight is not None:
        default_eps = float(ctx.attr("qk_norm_epsilon", 1e-6))
        q = _rms_norm_heads(q, q_norm_weight, float(ctx.attr("q_norm_epsilon", default_eps)))
        k = _rms_norm_heads(k, k_norm_weight, float(ctx.attr("k_norm_epsilon", default_eps)))
    if int(ctx.attr("do_rotary", 0)):
        if cos_cache is None or sin_cache is None:
            raise ctx.fail("do_rotary=1 needs cos_cache and sin_cache")
        cos2 = None
        interleaved = bool(ctx.attr("rotary_interleaved", 0))
        if position_ids is None and not interleaved and cos_cache.shape[-1] * 2 == head_size:
            # the common decode case: every layer rotates by the same angles, so the full-width
            # factors are made once per step and shared (see _RotaryFactors)
            cos2, sin2 = _ROTARY.factors(cos_cache, sin_cache, start, seq)
            qk = torch.cat((q, k), dim=1)
            half = head_size // 2
            swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
            qk = (qk.float() * cos2 + swapped.float() * sin2).to(q.dtype)
            q, k = qk[:, :num_heads], qk[:, num_heads:]
        elif position_ids is None:  # positions start .. start + S - 1: a slice, not a gather
            cos = cos_cache[start : start + seq][None, None]
            sin = sin_cache[start : start + seq][None, None]
        else:
            pos = position_ids.to(torch.long).reshape(-1)
            if first_prompt:  # as in the general path: only position_ids[0] counts
                pos = pos[:1] + torch.arange(seq)
            cos = cos_cache[pos][None, None]
            sin = sin_cache[pos][None, None]
        if cos2 is None:
            # Q and K rotate by the same angles: one pass over both heads (elementwise, same values)
            qk = apply_rotary(torch.cat((q, k), dim=1), cos, sin, interleaved)
            q, k = qk[:, :num_heads], qk[:, num_heads:]
    if past_key.shape[2] >= total:  # a shared buffer: write in place, attend over the valid rows
        past_key[:, :, start:total] = k
        past_value[:, :, start:total] = v
        present_key, present_value = past_key, past_value
        keys, values = past_key[:, :, :total], past_value[:, :, :total]
    else:
        keys = present_key = torch.cat((past_key, k.to(past_key.dtype)), dim=2)
        values = present_value = torch.cat((past_value, v.to(past_value.dtype)), dim=2)
    window = int(ctx.attr("local_window_size", -1))
    if seq == 1 and (window <= 0 or window >= total):
        allowed = None  # one query row at position T - 1 sees every key of the cache
    else:
        positions = torch.arange(start, start + seq).reshape(1, seq)
        allowed = _allowed_keys(ctx, positions, torch.tensor([total]), total)
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(head_size)
    out = _attend(ctx, q, keys, values, allowed, attention_bias, head_sink, scale)
    out = out.transpose(1, 2).reshape(batch, seq, num_heads * head_size)
    return out, present_key, present_value


def _check_supported(
    ctx: NodeContext,
    num_heads: int,
    kv_heads: int,
    past_key: torch.Tensor | None,
    past_value: torch.Tensor | None,
    seqlens_k: torch.Tensor | None,
    total_sequence_length: torch.Tensor | None,
    k_scale: torch.Tensor | None,
) -> None:
    if num_heads <= 0 or kv_heads <= 0 or num_heads % kv_heads:
        raise ctx.fail(f"num_heads ({num_heads}) must be a positive multiple of kv_num_heads ({kv_heads})")
    if seqlens_k is None or total_sequence_length is None:
        raise ctx.fail("seqlens_k and total_sequence_length are required")
    if (past_key is None) != (past_value is None):
        raise ctx.fail("past_key and past_value must both be given or both be absent")
    quant = str(ctx.attr("k_quant_type", "NONE")).upper() != "NONE" or k_scale is not None
    if quant or (past_key is not None and not past_key.is_floating_point()):
        raise ctx.fail("a quantized KV cache (k_quant_type/v_quant_type, k_scale/v_scale) is not supported")
    if int(ctx.attr("sliding_window_cache", 0)):
        if past_key is None or int(ctx.attr("local_window_size", -1)) <= 0:
            raise ctx.fail("sliding_window_cache=1 needs past_key/past_value and local_window_size > 0")
        if past_key.shape[2] < int(ctx.attr("local_window_size", -1)):
            raise ctx.fail(f"the window cache holds {past_key.shape[2]} rows, fewer than local_window_size")
    if int(ctx.attr("qk_output", 0)) and len(ctx.outputs_wanted) > 3 and ctx.outputs_wanted[3]:
        raise ctx.fail("the output_qk output (qk_output != 0) is not supported")


def _present(
    past: torch.Tensor | None,
    start: torch.Tensor,
    present_len: int,
    total: int,
    dims: tuple[int, int, int],
    like: torch.Tensor,
) -> torch.Tensor:
    """The buffer the new rows go into: past itself (shared mode) or a new zeroed tensor."""
    batch, heads, head_size = dims
    if past is not None and past.shape[2] >= total:
        return past  # shared past/present buffer: written in place
    present = torch.zeros((batch, heads, present_len, head_size), dtype=like.dtype, device=like.device)
    if past is not None and past.shape[2]:
        # only the first `start[b]` rows of past are this entry's history (the rest is padding)
        keep = torch.arange(past.shape[2], device=like.device) < start[:, None]
        present[:, :, : past.shape[2]] = torch.where(keep[:, None, :, None], past, 0)
    return present


def _resident(total: torch.Tensor, capacity: int, window: int) -> torch.Tensor:
    """How many of the latest positions a window cache keeps after T tokens (evicts G at a time)."""
    reclaim = capacity - window + 1
    over = (total - capacity).clamp(min=0)
    return total - reclaim * ((over + reclaim - 1) // reclaim)


def _windowed_cache_step(
    ctx: NodeContext,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    start: torch.Tensor,
    cache_len: torch.Tensor,
    attention_bias: torch.Tensor | None,
    head_sink: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sliding_window_cache=1: window-sized buffers; rows [0, L(T)) hold the latest L(T) positions.

    The step attends over [cached rows, new rows] by absolute position, then writes the new layout
    back into the past buffers in place (they are also present_key/present_value).
    """
    batch, kv_heads, capacity, head_size = past_key.shape
    seq = k.shape[2]
    window = int(ctx.attr("local_window_size"))
    device = q.device
    cached = _resident(start, capacity, window)  # rows of past that hold positions [start - cached, start)
    first_cached = start - cached
    rows = torch.arange(capacity, device=device)
    steps = torch.arange(seq, device=device)
    key_pos = torch.cat((first_cached[:, None] + rows, start[:, None] + steps), dim=1)  # [B, C + S]
    key_ok = torch.cat((rows < cached[:, None], steps < (cache_len - start)[:, None]), dim=1)
    query_end = torch.minimum(start[:, None] + steps + 1, cache_len[:, None])  # [B, S] exclusive
    allowed = (key_pos[:, None, :] < query_end[..., None]) & (key_pos[:, None, :] >= (query_end - window)[..., None])
    allowed = (allowed & key_ok[:, None, :]).unsqueeze(1)  # [B, 1, S, C + S]
    keys = torch.cat((past_key, k.to(past_key.dtype)), dim=2)
    values = torch.cat((past_value, v.to(past_value.dtype)), dim=2)
    if attention_bias is not None:  # its columns are absolute positions
        columns = key_pos.clamp(0, attention_bias.shape[-1] - 1)
        columns = columns[:, None, None, :].expand(batch, attention_bias.shape[1], seq, -1)
        attention_bias = attention_bias.expand(batch, -1, -1, -1).gather(3, columns)
    out = _attend(ctx, q, keys, values, allowed, attention_bias, head_sink, scale)

    # new layout: row r holds position T - L(T) + r, found in the cached rows or the new ones
    kept = _resident(cache_len, capacity, window)
    wanted = (cache_len - kept)[:, None] + rows  # [B, C]
    source = torch.where(wanted >= start[:, None], capacity + wanted - start[:, None], wanted - first_cached[:, None])
    source = source.clamp(0, capacity + seq - 1)[:, None, :, None].expand(batch, kv_heads, capacity, head_size)
    past_key.copy_(keys.gather(2, source))
    past_value.copy_(values.gather(2, source))
    return out, past_key, past_value


def _allowed_keys(ctx: NodeContext, positions: torch.Tensor, cache_len: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, 1, S, L] bool: which cache rows each query row attends to."""
    key_pos = torch.arange(kv_len, device=positions.device)
    if int(ctx.attr("causal", 1)):
        # rows past T (right padding of a first prompt) are capped at T, as onnxruntime does
        end = torch.minimum(positions + 1, cache_len[:, None])  # [B, S] exclusive
    else:
        end = cache_len[:, None].expand_as(positions)
    allowed = key_pos < end[..., None]
    window = int(ctx.attr("local_window_size", -1))
    if window > 0:
        allowed &= key_pos >= (end - window)[..., None]
    return allowed.unsqueeze(1)


def _attend(
    ctx: NodeContext,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor | None,
    attention_bias: torch.Tensor | None,
    head_sink: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """softmax(q k^T * scale [softcap] + bias, masked [with sink]) v, grouped over KV heads.

    allowed None: every key is visible (no mask)."""
    out_dtype = q.dtype
    dtype = compute_dtype(out_dtype, q.device)
    q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    softcap = float(ctx.attr("softcap", 0.0))
    smooth = int(ctx.attr("smooth_softmax", 0)) == 1 or head_sink is not None
    bias = _fit_bias(attention_bias.to(dtype), keys.shape[2]) if attention_bias is not None else None

    if softcap <= 0 and not smooth:
        # one fused kernel; the bias (if any) rides in a float mask
        if allowed is None:
            mask = bias
        else:
            mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
        out = sdpa(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1])
        return out.to(out_dtype)

    # explicit path, in onnxruntime's order: scale, softcap, bias, mask, (smooth) softmax
    batch, num_heads, seq, head_size = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, num_heads // kv_heads, seq, head_size)
    scores = torch.matmul(grouped, keys.unsqueeze(2).transpose(-1, -2)) * scale
    scores = scores.reshape(batch, num_heads, seq, -1)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if smooth:  # an extra logit (the head's sink, or 0) joins the softmax denominator only
        sink = head_sink.to(dtype) if head_sink is not None else torch.zeros(num_heads, dtype=dtype, device=q.device)
        sink = sink.reshape(1, num_heads, 1, 1).expand(batch, num_heads, seq, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.reshape(batch, kv_heads, num_heads // kv_heads, seq, -1)
    out = torch.matmul(probs, values.unsqueeze(2)).reshape(batch, num_heads, seq, head_size)
    return out.to(out_dtype)


def _rotary_heads(ctx: NodeContext, x: torch.Tensor, cos_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x as [B, N, S, H] (a 3-D [B, S, hidden] input split into heads) and the rotary dim R, from
    the attributes num_heads / rotary_embedding_dim as both rotary contrib ops read them."""
    num_heads = int(ctx.attr("num_heads", 0))
    rotary_dim = int(ctx.attr("rotary_embedding_dim", 0))
    if rotary_dim and not num_heads:
        raise ctx.fail("num_heads must be set when rotary_embedding_dim is")
    if x.dim() == 4:
        head_size = x.shape[-1]
        xs = x
    elif x.dim() == 3:
        batch, seq, hidden = x.shape
        head_size = hidden // num_heads if rotary_dim else cos_cache.shape[1] * 2
        xs = x.reshape(batch, seq, hidden // head_size, head_size).transpose(1, 2)
    else:
        raise ctx.fail(f"input must be 3D or 4D, got rank {x.dim()}")
    rotary_dim = rotary_dim or head_size
    if rotary_dim > head_size or cos_cache.shape[1] * 2 < rotary_dim:
        raise ctx.fail(f"rotary dim {rotary_dim} does not fit head size {head_size} / caches {list(cos_cache.shape)}")
    return xs, rotary_dim


def _rotated(
    x: torch.Tensor, xs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate the heads view ``xs`` of ``x`` by cos/sin [B, S, R/2]; the result in x's layout."""
    out = apply_rotary(xs, cos.unsqueeze(1), sin.unsqueeze(1), interleaved)
    if x.dim() == 3:
        out = out.transpose(1, 2).reshape(x.shape)
    return out


@implements("RotaryEmbedding", domain=MS_DOMAIN)
def rotary_embedding(
    ctx: NodeContext,
    x: torch.Tensor,
    position_ids: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> torch.Tensor:
    """com.microsoft RotaryEmbedding: input [B, S, hidden] or [B, N, S, H]; caches [max_pos, R/2].

    position_ids is [B, S], or one start position for every batch entry. The attributes scale and
    is_packed_batching are ignored, as onnxruntime 1.32's CPU kernel ignores them.
    """
    xs, rotary_dim = _rotary_heads(ctx, x, cos_cache)
    batch, seq = xs.shape[0], xs.shape[2]
    interleaved = bool(ctx.attr("interleaved", 0))
    if triton_serves(x) and (position_ids.numel() == 1 or tuple(position_ids.shape) == (batch, seq)):
        from onnxgen.runtime.gpu.rotary import rotary

        fast = rotary(x, xs, position_ids, cos_cache, sin_cache, rotary_dim=rotary_dim, interleaved=interleaved)
        if fast is not None:
            return fast
    pos = position_ids.to(torch.long)
    if pos.numel() == 1:  # one start position for every batch entry
        pos = (pos.reshape(1, 1) + torch.arange(seq, device=x.device)).expand(batch, seq)
    half = rotary_dim // 2
    return _rotated(x, xs, cos_cache[pos, :half], sin_cache[pos, :half], interleaved)


def mrope_select(rows: torch.Tensor, section: list[int], layout: int) -> torch.Tensor:
    """One cos (or sin) vector per token from the three position streams' rows [3, B, S, R/2]:
    layout 0 takes contiguous chunks of section[0] / [1] / [2] channels from streams T / H / W;
    layout 1 starts from T everywhere, then H takes every third channel from 1 below 3 * section[1]
    and W every third from 2 below 3 * section[2]. Slices only: no index tensor is made per call,
    so the op records in a CUDA graph."""
    if layout == 0:
        t, h = section[0], section[0] + section[1]
        return torch.cat((rows[0, ..., :t], rows[1, ..., t:h], rows[2, ..., h:]), dim=-1)
    out = rows[0].clone()
    out[..., 1 : 3 * section[1] : 3] = rows[1, ..., 1 : 3 * section[1] : 3]
    out[..., 2 : 3 * section[2] : 3] = rows[2, ..., 2 : 3 * section[2] : 3]
    return out


@implements("MRotaryEmbedding", domain=MS_DOMAIN)
def m_rotary_embedding(
    ctx: NodeContext,
    x: torch.Tensor,
    position_ids: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> torch.Tensor:
    """com.microsoft MRotaryEmbedding (multimodal RoPE): position_ids [3, B, S] holds the temporal,
    height and width streams; each indexes the caches and mrope_section / mrope_layout pick, per
    rotary channel, which stream's angle applies (mrope_select). Text-only streams are equal, and
    the op is then RotaryEmbedding. scale and is_packed_batching are refused where they would
    change the result (packed batching is a CUDA-only form)."""
    section = [int(v) for v in ctx.require("mrope_section")]
    layout = int(ctx.attr("mrope_layout", 0))
    if len(section) != 3 or min(section) < 0:
        raise ctx.fail(f"mrope_section must be 3 non-negative integers, got {section}")
    if layout not in (0, 1):
        raise ctx.fail(f"mrope_layout must be 0 (sectioned) or 1 (interleaved), got {layout}")
    if int(ctx.attr("is_packed_batching", 0)):
        raise ctx.fail("is_packed_batching=1 (ragged batches) is not supported; feed [B, S] padded batches")
    if float(ctx.attr("scale", 1.0)) != 1.0:
        raise ctx.fail(f"scale {ctx.attr('scale', 1.0)} is not supported (only 1.0)")
    xs, rotary_dim = _rotary_heads(ctx, x, cos_cache)
    half = rotary_dim // 2
    if sum(section) != half:
        raise ctx.fail(f"mrope_section {section} must sum to half the rotary dim ({half})")
    batch, seq = xs.shape[0], xs.shape[2]
    if position_ids.dim() != 3 or position_ids.shape[0] != 3 or tuple(position_ids.shape[1:]) != (batch, seq):
        raise ctx.fail(f"position_ids must be [3, {batch}, {seq}] (T, H, W streams), got {list(position_ids.shape)}")
    if triton_serves(x):
        from onnxgen.runtime.gpu.rotary import rotary

        fast = rotary(x, xs, position_ids, cos_cache, sin_cache, rotary_dim=rotary_dim,
                      interleaved=bool(ctx.attr("interleaved", 0)), section=section, layout=layout)  # fmt: skip
        if fast is not None:
            return fast
    pos = position_ids.to(torch.long)
    cos = mrope_select(cos_cache[pos, :half], section, layout)
    sin = mrope_select(sin_cache[pos, :half], section, layout)
    return _rotated(x, xs, cos, sin, bool(ctx.attr("interleaved", 0)))


@implements("MultiHeadAttention", domain=MS_DOMAIN)
def multi_head_attention(
    ctx: NodeContext,
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    past_sequence_length: torch.Tensor | None = None,
    cache_indirection: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """com.microsoft MultiHeadAttention without buffer sharing or beam search.

    Q/K/V come as [B, S, hidden] (plus the packed QKV [B, S, N, 3, H] and KV [B, L, N, 2, H] forms);
    K/V may also come as [B, N, L, H], used as they are (a cross-attention cache). Masked scores get
    mask_filter_value (not -inf), as onnxruntime does, so a fully masked row averages V.
    """
    num_heads = int(ctx.require("num_heads"))
    if past_sequence_length is not None or cache_indirection is not None:
        raise ctx.fail("past/present buffer sharing and cache_indirection (beam search) are not supported")
    if len(ctx.outputs_wanted) > 3 and ctx.outputs_wanted[3]:
        raise ctx.fail("the qk output is not supported")
    batch, seq = query.shape[:2]
    if query.dim() == 5:  # packed QKV [B, S, N, 3, H]
        q, k, v = (query[:, :, :, i].transpose(1, 2) for i in range(3))
    else:
        q_hidden = query.shape[-1]
        if bias is not None:
            query = query + bias[:q_hidden]
        q = query.reshape(batch, seq, num_heads, -1).transpose(1, 2)
        if key is None:
            raise ctx.fail("key is required unless query is packed QKV")
        if key.dim() == 5:  # packed KV [B, L, N, 2, H]
            k, v = key[:, :, :, 0].transpose(1, 2), key[:, :, :, 1].transpose(1, 2)
        elif key.dim() == 4:  # already [B, N, L, H]
            k, v = key, value
        else:
            if bias is not None:
                key = key + bias[q_hidden : 2 * q_hidden]
                value = value + bias[2 * q_hidden :]
            k = key.reshape(batch, key.shape[1], num_heads, -1).transpose(1, 2)
            v = value.reshape(batch, value.shape[1], num_heads, -1).transpose(1, 2)
    if past_key is not None and key is not None and key.dim() != 4:
        k = torch.cat((past_key, k), dim=2)
        v = torch.cat((past_value, v), dim=2)
    total = k.shape[2]
    allowed = torch.ones((batch, 1, seq, total), dtype=torch.bool, device=q.device)
    key_pos = torch.arange(total, device=q.device)
    if int(ctx.attr("unidirectional", 0)):
        query_pos = torch.arange(seq, device=q.device) + (total - seq)
        allowed = allowed & (key_pos <= query_pos[:, None])
    if key_padding_mask is not None:
        allowed = allowed & _key_padding(ctx, key_padding_mask, batch, seq, total, key_pos)
    dtype = compute_dtype(q.dtype, q.device)
    fill = float(ctx.attr("mask_filter_value", -10000.0))
    mask = torch.where(allowed, 0.0, fill).to(dtype)
    if attention_bias is not None:
        mask = mask + attention_bias.to(dtype)
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(q.shape[-1])
    out = sdpa(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, scale=scale)
    out = out.to(query.dtype).transpose(1, 2).reshape(batch, seq, -1)
    return (out, k, v)[: max(ctx.num_outputs, 1)]


def _key_padding(
    ctx: NodeContext, mask: torch.Tensor, batch: int, seq: int, total: int, key_pos: torch.Tensor
) -> torch.Tensor:
    """key_padding_mask as [B, 1, S or 1, T] bool: lengths (B), 0/1 per key (B, T) or (B, S, T)."""
    if mask.dim() == 1 and mask.shape[0] == batch:
        return (key_pos < mask.to(torch.long)[:, None]).reshape(batch, 1, 1, total)
    if mask.dim() == 2:
        return (mask != 0).reshape(batch, 1, 1, total)
    if mask.dim() == 3:
        return (mask != 0).reshape(batch, 1, seq, total)
    raise ctx.fail(f"key_padding_mask of shape {list(mask.shape)} is not supported")
