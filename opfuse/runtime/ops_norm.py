"""Per-op torch kernels of the ONNX normalizations beyond BatchNormalization and LayerNormalization
(which live with the other NN ops): instance, group, RMS, mean-variance, Lp and local response."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from opfuse.errors import ModelError
from opfuse.runtime.ops_registry import normalize_axes, normalize_axis, onnx_torch_dtype, register, required

Inputs = list[torch.Tensor | None]
Attrs = dict[str, Any]


def _per_channel(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A (C,) parameter shaped to broadcast over an (N, C, D1, ...) tensor."""
    return t.reshape(-1, *([1] * (rank - 2)))


def _stash(x: torch.Tensor, attrs: Attrs) -> torch.dtype:
    """The dtype statistics are computed in: stash_type (float32 by default), never narrower than x."""
    stash = onnx_torch_dtype(int(attrs.get("stash_type", 1)))
    return torch.promote_types(stash, x.dtype)


@register("InstanceNormalization")
def instance_normalization(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, scale, bias = (required(inputs, i, "InstanceNormalization") for i in range(3))
    eps = float(attrs.get("epsilon", 1e-5))
    dims = list(range(2, x.dim()))
    # Statistics in float32 for half inputs (torch's instance_norm does the same on its own).
    xs = x.to(torch.promote_types(x.dtype, torch.float32))
    mean = xs.mean(dim=dims, keepdim=True)
    var = ((xs - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (xs - mean) * torch.rsqrt(var + eps) * _per_channel(scale, x.dim()) + _per_channel(bias, x.dim())
    return [y.to(x.dtype)]


@register("GroupNormalization")
def group_normalization(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, scale, bias = (required(inputs, i, "GroupNormalization") for i in range(3))
    if "num_groups" not in attrs:
        raise ModelError("GroupNormalization: the 'num_groups' attribute is missing")
    groups = int(attrs["num_groups"])
    channels = x.shape[1]
    if groups <= 0 or channels % groups:
        raise ModelError(f"GroupNormalization: {channels} channels do not split into {groups} groups")
    eps = float(attrs.get("epsilon", 1e-5))
    xs = x.to(_stash(x, attrs)).reshape(x.shape[0], groups, -1)
    mean = xs.mean(dim=-1, keepdim=True)
    var = ((xs - mean) ** 2).mean(dim=-1, keepdim=True)
    normed = ((xs - mean) * torch.rsqrt(var + eps)).reshape(x.shape)
    # Opset 18 scales and shifts per group, opset 21 per channel; the parameter's length tells which.
    if scale.numel() == groups and groups != channels:
        scale = scale.repeat_interleave(channels // groups)
        bias = bias.repeat_interleave(channels // groups)
    y = normed * _per_channel(scale, x.dim()) + _per_channel(bias, x.dim())
    return [y.to(x.dtype)]


@register("RMSNormalization")
def rms_normalization(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x, scale = required(inputs, 0, "RMSNormalization"), required(inputs, 1, "RMSNormalization")
    axis = normalize_axis(int(attrs.get("axis", -1)), x.dim(), "RMSNormalization")
    eps = float(attrs.get("epsilon", 1e-5))
    xs = x.to(_stash(x, attrs))
    ms = (xs * xs).mean(dim=list(range(axis, x.dim())), keepdim=True)
    return [(xs * torch.rsqrt(ms + eps) * scale).to(x.dtype)]


@register("MeanVarianceNormalization")
def mean_variance_normalization(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "MeanVarianceNormalization")
    dims = normalize_axes(list(attrs.get("axes", [0, 2, 3])), x.dim(), "MeanVarianceNormalization")
    # As the ONNX function body writes it: sqrt(E[x^2] - E[x]^2) + 1e-9, the epsilon outside the root.
    mean = x.mean(dim=dims, keepdim=True)
    std = torch.sqrt((x * x).mean(dim=dims, keepdim=True) - mean * mean)
    return [(x - mean) / (std + 1e-9)]


@register("LpNormalization")
def lp_normalization(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "LpNormalization")
    axis = normalize_axis(int(attrs.get("axis", -1)), x.dim(), "LpNormalization")
    p = int(attrs.get("p", 2))
    if p not in (1, 2):
        raise ModelError(f"LpNormalization: p must be 1 or 2, got {p}")
    norm = torch.linalg.vector_norm(x, ord=p, dim=axis, keepdim=True)
    # A zero norm gives 0, not 0/0 (as the ONNX reference has it).
    return [torch.where(norm == 0, torch.zeros_like(x), x / norm)]


@register("LRN")
def lrn(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    x = required(inputs, 0, "LRN")
    if "size" not in attrs:
        raise ModelError("LRN: the 'size' attribute is missing")
    size = int(attrs["size"])
    alpha, beta = float(attrs.get("alpha", 1e-4)), float(attrs.get("beta", 0.75))
    bias = float(attrs.get("bias", 1.0))
    # The window over channels runs from c - floor((size-1)/2) to c + ceil((size-1)/2). torch's
    # local_response_norm centres even windows the other way, so the sum is written out.
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = (x * x).unsqueeze(1)  # (N, 1, C, ...): pad and pool the channel dim as a spatial one
    sq = F.pad(sq, [0, 0] * (x.dim() - 2) + [before, after])
    channels = x.shape[1]
    square_sum = sq[:, 0, 0:channels]
    for i in range(1, size):
        square_sum = square_sum + sq[:, 0, i : i + channels]
    return [x / (bias + (alpha / size) * square_sum) ** beta]


@register("opfuse.LRNNHWC")
def lrn_nhwc(inputs: Inputs, attrs: Attrs) -> list[torch.Tensor]:
    """LRN in the channels-last region (opfuse/passes/layout.py): the window over the last axis."""
    x = required(inputs, 0, "LRNNHWC")
    return [lrn([x.permute(0, 3, 1, 2)], attrs)[0].permute(0, 2, 3, 1)]
