"""Per-op torch kernels of the ONNX transformer ops of opsets 23-25: RotaryEmbedding and Attention."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from opfuse.errors import ModelError
from opfuse.runtime.ops_registry import onnx_torch_dtype, optional, register, required

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]


@register("RotaryEmbedding")
def rotary_embedding(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "RotaryEmbedding")
    cos, sin = required(inputs, 1, "RotaryEmbedding"), required(inputs, 2, "RotaryEmbedding")
    position_ids = optional(inputs, 3)
    # Work in (batch, seq, heads, head_size): 4-D inputs come as (batch, heads, seq, head_size),
    # 3-D ones as (batch, seq, heads * head_size).
    if x.dim() == 4:
        t = x.transpose(1, 2)
    elif x.dim() == 3:
        heads = int(attrs.get("num_heads", 0))
        if heads <= 0:
            raise ModelError("RotaryEmbedding: num_heads is required for a 3-D input")
        t = x.reshape(x.shape[0], x.shape[1], heads, x.shape[2] // heads)
    else:
        raise ModelError(f"RotaryEmbedding: the input must be 3-D or 4-D, got rank {x.dim()}")
    dim = int(attrs.get("rotary_embedding_dim", 0)) or t.shape[-1]
    rotate, keep = t[..., :dim], t[..., dim:]
    if position_ids is not None:
        # Positions past the caches are invalid; wrapped (like Gather's indices) instead of raising.
        positions = torch.remainder(position_ids.to(torch.int64), cos.shape[0])
        cos, sin = cos[positions], sin[positions]
    if cos.shape[-1] != dim // 2:
        raise ModelError(f"RotaryEmbedding: the caches' last dim is {cos.shape[-1]}, expected {dim // 2}")
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    interleaved = attrs.get("interleaved", 0) == 1
    x1, x2 = (rotate[..., 0::2], rotate[..., 1::2]) if interleaved else rotate.chunk(2, dim=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    rotated = torch.stack([real, imag], dim=-1).flatten(-2) if interleaved else torch.cat([real, imag], -1)
    y = torch.cat([rotated.to(x.dtype), keep], dim=-1)
    return [y.transpose(1, 2) if x.dim() == 4 else y.reshape(x.shape)]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as an additive bias; float masks are biases already."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, -torch.inf)
    return mask.to(dtype)


def _allowed_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.full((), -torch.inf, dtype=dtype))


def _positions(q_len: int, kv_len: int, offset: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    """(query position + offset) - key position, per (batch,) q, kv: how far back each key is."""
    i = torch.arange(q_len, device=device).reshape(q_len, 1)
    j = torch.arange(kv_len, device=device).reshape(1, kv_len)
    if isinstance(offset, torch.Tensor):  # per batch: (batch, 1, q, kv)
        return (i + offset.reshape(-1, 1, 1).to(torch.int64) - j).unsqueeze(1)
    return i + offset - j


@register("Attention", wants_num_outputs=True)
def attention(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    """Scaled dot-product attention as ONNX defines it (opsets 23-25), after the ONNX reference:
    3-D inputs split into heads, past key/value caches, grouped-query heads, boolean or additive
    masks, causal and sliding-window masking aligned to the cache, softcap, and rows with nothing
    to attend giving 0."""
    q, k, v = (required(inputs, i, "Attention") for i in range(3))
    mask, past_k, past_v, nonpad = (optional(inputs, i) for i in range(3, 7))
    rank3 = q.dim() == 3
    if rank3:
        q_heads, kv_heads = int(attrs.get("q_num_heads", 0)), int(attrs.get("kv_num_heads", 0))
        if q_heads <= 0 or kv_heads <= 0:
            raise ModelError("Attention: 3-D inputs need q_num_heads and kv_num_heads")
        q = q.reshape(q.shape[0], q.shape[1], q_heads, -1).transpose(1, 2)
        k = k.reshape(k.shape[0], k.shape[1], kv_heads, -1).transpose(1, 2)
        v = v.reshape(v.shape[0], v.shape[1], kv_heads, -1).transpose(1, 2)
    dtype = q.dtype
    scale = float(attrs["scale"]) if "scale" in attrs else 1.0 / math.sqrt(q.shape[3])
    # The reference scales Q and K by sqrt(scale) each (smaller intermediates in half precision).
    root = torch.tensor(math.sqrt(scale), dtype=dtype)
    if past_k is not None and past_v is not None:
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    present_k, present_v = k, v
    q_len, kv_len = q.shape[2], k.shape[2]
    bias = torch.zeros((q_len, kv_len), dtype=dtype, device=q.device)
    if mask is not None and mask.shape[-1] < kv_len:  # a mask for the new keys only: pad as masked
        fill = False if mask.dtype == torch.bool else -torch.inf
        mask = F.pad(mask, [0, kv_len - mask.shape[-1]], value=fill)
    # Causal and window masks line up with the cache: query i sits at position offset + i.
    offset: torch.Tensor | int = past_k.shape[2] if past_k is not None else 0
    if past_k is None and nonpad is not None:
        offset = nonpad.reshape(-1) - q_len
    if mask is not None:
        bias = bias + _additive(mask, dtype)
    if attrs.get("is_causal", 0) == 1:
        bias = bias + _allowed_bias(_positions(q_len, kv_len, offset, q.device) >= 0, dtype)
    left, right = int(attrs.get("left_window_size", -1)), int(attrs.get("right_window_size", -1))
    if left >= 0 or right >= 0:
        back = _positions(q_len, kv_len, offset, q.device)
        allowed = torch.ones_like(back, dtype=torch.bool)
        if left >= 0:
            allowed &= back <= left
        if right >= 0:
            allowed &= -back <= right
        bias = bias + _allowed_bias(allowed, dtype)
    if nonpad is not None:
        keep = torch.arange(kv_len, device=q.device) < nonpad.reshape(-1, 1).to(torch.int64)
        bias = bias + _allowed_bias(keep.reshape(-1, 1, 1, kv_len), dtype)
    if k.shape[1] != q.shape[1] and q.shape[1] % k.shape[1] == 0:  # grouped-query heads
        reps = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
    qk = torch.matmul(q * root, (k * root).transpose(-1, -2))
    softcap = float(attrs.get("softcap", 0.0))
    if softcap > 0:
        qk = torch.tanh(qk / softcap) * softcap
    scores = qk + bias
    mode = int(attrs.get("qk_matmul_output_mode", 0))
    qk_out = scores if mode == 2 else qk
    if "softmax_precision" in attrs:
        scores = scores.to(onnx_torch_dtype(int(attrs["softmax_precision"])))
    probs = torch.softmax(scores, dim=-1)
    # A row whose bias masks every key attends to nothing: 0, decided on the bias (not the scores).
    nothing = torch.isneginf(torch.amax(bias, dim=-1, keepdim=True))
    probs = torch.where(nothing, torch.zeros((), dtype=probs.dtype), probs)
    if mode == 3:
        qk_out = probs
    y = torch.matmul(probs.to(dtype), v)
    if rank3:
        y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
    return [y, present_k, present_v, qk_out.to(dtype)]
