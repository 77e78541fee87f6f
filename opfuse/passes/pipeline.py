"""The pass pipeline: ONNX-level optimization (onnxscript), then opfuse's own rules on the IR."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import onnx

from opfuse.frontend import rule_registry as names
from opfuse.frontend.load import infer_shapes
from opfuse.graph import Graph
from opfuse.passes.attention_op import attention_op
from opfuse.passes.batchnorm import batchnorm_to_affine, fold_batchnorm
from opfuse.passes.channel_shuffle import fold_channel_shuffles
from opfuse.passes.cleanup import (
    collapse_reshapes,
    eliminate_noops,
    fold_pad_into_conv,
    unit_dim_views,
    where_fill_last,
)
from opfuse.passes.col2im import col2im_to_views
from opfuse.passes.concat_convs import merge_concat_convs
from opfuse.passes.constants import drop_unused_constants, fold_constant_nodes
from opfuse.passes.conv_bias import forward_conv_bias
from opfuse.passes.dft import merge_dfts
from opfuse.passes.einsum import einsum_matmul
from opfuse.passes.gather_slice import gather_to_slice, gathernd_as_gather
from opfuse.passes.gemm_reshape import gemm_to_matmul
from opfuse.passes.group_norm import group_norm
from opfuse.passes.head_scale import head_scale
from opfuse.passes.indices import check_constant_indices
from opfuse.passes.layout import to_channels_last
from opfuse.passes.local_response_norm import local_response_norm
from opfuse.passes.merge_reductions import merge_reductions
from opfuse.passes.pointwise_views import pointwise_before_views
from opfuse.passes.projections import merge_projections
from opfuse.passes.rotary import rotate_half
from opfuse.passes.row_views import reshape_before_pointwise
from opfuse.passes.rules import GraphRule, NotFired, Pass, PassContext
from opfuse.passes.scatter import scatternd_as_where
from opfuse.passes.shortcut_conv import shortcut_conv
from opfuse.passes.sibling_convs import merge_sibling_convs, sum_sibling_convs
from opfuse.passes.stack_reduce import reduce_stack
from opfuse.passes.sum_gemms import sum_sibling_gemms

log = logging.getLogger(__name__)


def _fold(graph: Graph, ctx: PassContext) -> None:
    fold_constant_nodes(graph)


def _channels_last(graph: Graph, ctx: PassContext) -> None:
    to_channels_last(graph, ctx.log, ctx.precision, ctx.device, ctx.disabled)


# The graph passes in the order they run (the registry's order; constants are folded again after
# the rewrites). Each runs unless the job turned it off, or a rule it requires, by name
# (JobCreate.fusion.disable; the prerequisites are the registry's).
PASSES: tuple[Pass, ...] = (
    GraphRule(names.CHECK_INDICES, lambda g, ctx: check_constant_indices(g)),  # before a fold could hide one
    GraphRule(names.FOLD_CONSTANTS, _fold),
    eliminate_noops,
    where_fill_last,
    fold_pad_into_conv,
    einsum_matmul,
    attention_op,
    gathernd_as_gather,
    scatternd_as_where,
    gather_to_slice,
    col2im_to_views,
    rotate_half,
    head_scale,
    group_norm,
    local_response_norm,
    merge_dfts,
    fold_batchnorm,
    sum_sibling_convs,
    sum_sibling_gemms,
    forward_conv_bias,
    reduce_stack,
    merge_reductions,
    merge_concat_convs,
    batchnorm_to_affine,
    gemm_to_matmul,
    GraphRule(names.POINTWISE_BEFORE_VIEWS, pointwise_before_views),
    GraphRule(names.RESHAPE_BEFORE_POINTWISE, reshape_before_pointwise),
    collapse_reshapes,
    unit_dim_views,
    collapse_reshapes,  # again: the Reshapes unit_dim_views moved next to others
    GraphRule(names.FOLD_CHANNEL_SHUFFLE, lambda g, ctx: fold_channel_shuffles(g, ctx.log)),
    GraphRule(names.MERGE_PROJECTIONS, lambda g, ctx: merge_projections(g, ctx.log)),
    GraphRule(names.CHANNELS_LAST, _channels_last, options=(names.FP32_DENSE_NCHW,)),
    # Only the conv template runs the shortcut's K loop (the per-op form is three library
    # launches). Before the sibling merge, which would take the shortcut into a conv of its input.
    GraphRule(names.SHORTCUT_CONV, lambda g, ctx: shortcut_conv(g, ctx.log)),
    # Only the conv template writes the merged conv's Split as separate buffers.
    GraphRule(names.MERGE_SIBLING_CONVS, lambda g, ctx: merge_sibling_convs(g, ctx.log)),
    GraphRule(names.FOLD_CONSTANTS, _fold),
    GraphRule(names.DROP_UNUSED_CONSTANTS, lambda g, ctx: drop_unused_constants(g)),
)


@dataclass
class PassResult:
    fired: dict[str, int] = field(default_factory=dict)
    not_fired: list[NotFired] = field(default_factory=list)
    onnx_optimizer: str = "applied"


def optimize_onnx(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """Constant folding and shape-arithmetic folding with the onnxscript constant folder.

    Only folding: the graph keeps every compute node, so the "before" plan is the model as
    written, and each rewrite opfuse makes later is its own rule with its own reasons. The folder
    is an aid, not a requirement: if it fails on a model, compilation goes on with the unfolded
    graph (and the report says so).
    """
    import onnx_ir as ir
    import onnxscript.optimizer

    try:
        # One conversion to the IR and one back (the proto entry points convert on each call,
        # weights included); the IR reads the model without changing it.
        ir_model = ir.serde.deserialize_model(model)
        onnxscript.optimizer.fold_constants(ir_model, onnx_shape_inference=True)
        onnxscript.optimizer.remove_unused_nodes(ir_model)
        optimized = ir.serde.serialize_model(ir_model)
    except Exception as exc:  # a bug in the optimizer must not fail the user's job
        log.warning("onnxscript optimizer failed; continuing without it: %s", exc)
        return model, f"skipped: {type(exc).__name__}"
    del optimized.graph.value_info[:]
    return infer_shapes(optimized), "applied"


def run_passes(
    graph: Graph, disabled: Iterable[str] = (), precision: str = "fp32", device: str = "cpu"
) -> PassResult:
    ctx = PassContext(frozenset(disabled), precision, device)
    for p in PASSES:
        if names.enabled(p.name, ctx.disabled):
            p.apply(graph, ctx)
    return PassResult(fired=ctx.log.fired, not_fired=ctx.log.not_fired)
