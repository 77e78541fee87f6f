"""Every rewrite pass and fusion rule of opfuse, as data: name, stage, doc line, prerequisites, switch.

This module is the one place a rule's name is spelt. The passes (`opfuse/passes/`), the planner
(`opfuse/fusion/`) and codegen import their names from here; `fusion.disable` (the library's
`fusion_disable`, JobCreate's `fusion.disable`) is checked against it; docs/design.md's rule table
and docs/library.md's list of names are generated from it:

    .venv/bin/python -m opfuse.frontend.rule_registry --write-docs

It imports nothing but the standard library (and opfuse.errors), so the API server (which never imports torch) checks
a job's `fusion.disable` with the same list the compiler applies. Entries are in the order the
compiler applies them.

Adding a graph rewrite: a constant and an entry here, the pass in a file of its own in
opfuse/passes/ added to `passes/pipeline.py` `PASSES`. Adding a fusion rule: a constant and an
entry here whose `impl` names the rule's module (opfuse/fusion/rules/<rule>.py, its `RULE`), which
the planner imports and runs in this order, and its test in tests/unit/fusion_rules/
(docs/design.md, "Adding a fusion rule").
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from opfuse.errors import OpfuseError

# Stages, in the order the compiler runs them.
ONNX_REWRITE = "onnx-rewrite"  # on the ONNX model, with onnxscript's optimizer
GRAPH_PASS = "graph-pass"  # rewrites of opfuse's graph (opfuse/passes/)
FUSION = "fusion"  # the planner's rules: which nodes share a kernel (opfuse/fusion/)
CODEGEN = "codegen"  # switches a template reads (opfuse/codegen/)
STAGES = (ONNX_REWRITE, GRAPH_PASS, FUSION, CODEGEN)

# -- names (one constant per rule; nothing else spells them) -------------------------------------
ONNX_FOLD_CONSTANTS = "onnx_fold_constants"
CHECK_INDICES = "check_constant_indices"
FOLD_CONSTANTS = "fold_constants"
ELIMINATE_NOOPS = "eliminate_noops"
WHERE_FILL_LAST = "where_fill_last"
FOLD_PAD_INTO_CONV = "fold_pad_into_conv"
EINSUM_MATMUL = "einsum_matmul"
ATTENTION_OP = "attention_op"
GATHERND_AS_GATHER = "gathernd_as_gather"
SCATTERND_AS_WHERE = "scatternd_as_where"
GATHER_TO_SLICE = "gather_to_slice"
COL2IM_TO_VIEWS = "col2im_to_views"
ROTATE_HALF = "rotate_half"
HEAD_SCALE = "head_scale"
GROUP_NORM = "group_norm"
LOCAL_RESPONSE_NORM = "local_response_norm"
FOLD_BATCHNORM = "fold_batchnorm"
SUM_SIBLING_CONVS = "sum_sibling_convs"
SUM_SIBLING_GEMMS = "sum_sibling_gemms"
FORWARD_CONV_BIAS = "forward_conv_bias"
REDUCE_STACK = "reduce_stack"
MERGE_REDUCTIONS = "merge_reductions"
MERGE_DFTS = "merge_dfts"
MERGE_CONCAT_CONVS = "merge_concat_convs"
BATCHNORM_TO_AFFINE = "batchnorm_to_affine"
GEMM_TO_MATMUL = "gemm_to_matmul"
POINTWISE_BEFORE_VIEWS = "pointwise_before_views"
RESHAPE_BEFORE_POINTWISE = "reshape_before_pointwise"
COLLAPSE_RESHAPES = "collapse_reshapes"
UNIT_DIM_VIEWS = "unit_dim_views"
FOLD_CHANNEL_SHUFFLE = "fold_channel_shuffle"
MERGE_PROJECTIONS = "merge_projections"
CHANNELS_LAST = "channels_last"
FP32_DENSE_NCHW = "fp32_dense_nchw"
SHORTCUT_CONV = "shortcut_conv"
MERGE_SIBLING_CONVS = "merge_sibling_convs"
DROP_UNUSED_CONSTANTS = "drop_unused_constants"
ATTENTION = "attention"
ROW_REDUCTION = "row_reduction"
CONCAT_SELECT = "concat_select"
RESIZE_GATHER = "resize_gather"
PAD_GATHER = "pad_gather"
LAYOUT_VIEWS = "layout_views"
GEMM_EPILOGUE = "gemm_epilogue"
CONV_EPILOGUE = "conv_epilogue"
POOL_EPILOGUE = "pool_epilogue"
PAD_PROLOGUE = "pad_prologue"
LAYOUT_PROLOGUE = "layout_prologue"
CONCAT_PROLOGUE = "concat_prologue"
OPERAND_PROLOGUE = "operand_prologue"
DEPTHWISE_PROLOGUE = "depthwise_prologue"
POOL_PROLOGUE = "pool_prologue"
POOL_TAIL = "pool_tail"
GEMV_CHAIN = "gemv_chain"
DEPTHWISE_REDUCTION = "depthwise_reduction"
GEMM_REDUCTION = "gemm_reduction"
GATHER_PROLOGUE = "gather_prologue"
CONCAT_EPILOGUE = "concat_epilogue"
POOLED_GEMM = "pooled_gemm"
POINTWISE = "pointwise"
CHANNEL_WINDOW = "channel_window"
SPLIT_K = "split_k"


class UnknownRuleError(OpfuseError, ValueError):
    """`fusion.disable` names a rule opfuse does not have (the message lists those it has)."""


@dataclass(frozen=True)
class RuleInfo:
    """One pass or rule. `requires`: rules it runs only with (turning one of them off turns this
    one off too). `switch`: the `fusion.disable` entry that turns it off (None: it always runs).
    `impl`: for a fusion rule, the module whose `RULE` the planner runs (several entries may name
    one module: one pass that claims for each); empty for a rule applied inside another's groups
    (that rule lists it in its `options`). Named, not imported: this module imports no stage."""

    name: str
    stage: str
    doc: str
    requires: tuple[str, ...] = ()
    switchable: bool = True
    impl: str = ""

    @property
    def switch(self) -> str | None:
        return self.name if self.switchable else None


def _r(
    name: str,
    stage: str,
    doc: str,
    requires: tuple[str, ...] = (),
    switchable: bool = True,
    impl: str = "",
) -> RuleInfo:
    return RuleInfo(name, stage, doc, requires, switchable, impl)


RULES_PACKAGE = "opfuse.fusion.rules"  # where opfuse's own fusion rules live


REGISTRY: tuple[RuleInfo, ...] = (
    _r(
        ONNX_FOLD_CONSTANTS,
        ONNX_REWRITE,
        "onnxscript's constant folder and unused-node removal on the ONNX model: shape arithmetic folds "
        "away; where the optimizer fails the graph goes on unfolded (`fusion.passes.onnx_optimizer`).",
        switchable=False,
    ),
    _r(
        CHECK_INDICES,
        GRAPH_PASS,
        "Constant Gather/Scatter indices out of range are a model error, as in onnxruntime, before a "
        "fold or a rewrite could hide them.",
        switchable=False,
    ),
    _r(
        FOLD_CONSTANTS,
        GRAPH_PASS,
        "Nodes whose inputs are all constants are computed at compile time (again after the rewrites).",
        switchable=False,
    ),
    _r(
        ELIMINATE_NOOPS,
        GRAPH_PASS,
        "Identity, inference-time Dropout, and copies whose output is their input (a Pad of all-zero pads, "
        "an Expand or Cast to the input's shape and type, a Slice keeping it all) compute nothing: their "
        "consumers read the input directly. So does an Expand whose readers all broadcast its input to "
        "the same shape (F.normalize's norm), and arithmetic by a constant neutral element (x + 0, "
        "x - 0, x * 1, x / 1) that broadcasts nothing. A global pool of a 1x1 map is its input, and a "
        "mean, sum, max, min or product that drops axes of one element a Reshape (the dynamo "
        "exporter's adaptive pooling of a 1x1 map); one that keeps them stays (the row planner's).",
    ),
    _r(
        WHERE_FILL_LAST,
        GRAPH_PASS,
        "Where(constant condition, scalar fill, x), a masked fill written fill-first (DeBERTa's "
        "masked_fill of the scores), becomes Where(negated condition, x, fill): the spelling the "
        "attention kernel's mask reads.",
    ),
    _r(
        FOLD_PAD_INTO_CONV,
        GRAPH_PASS,
        'A zero Pad of the spatial axes read only by a Conv (TensorFlow\'s "same" padding, which the '
        "exporter writes out before each conv of a ported model) becomes the Conv's own pads: one launch "
        "less, and every conv template, depthwise ones too, takes the padding.",
    ),
    _r(
        EINSUM_MATMUL,
        GRAPH_PASS,
        "An Einsum of two operands that is a (batched) matrix product (every letter a batch, row, column "
        "or contracted one, as in MaxViT's attention) becomes MatMul, with Transposes and Reshapes "
        "where the operands or the output are laid out otherwise, so it fuses like any other MatMul.",
    ),
    _r(
        ATTENTION_OP,
        GRAPH_PASS,
        "Attention-23 (4-D, no cache) becomes Transpose, MatMul, Mul, [mask], Softmax, MatMul: the "
        "spelling the attention rule fuses into one flash-attention kernel.",
    ),
    _r(
        GATHERND_AS_GATHER,
        GRAPH_PASS,
        "GatherND by constant index tuples (batch_dims 0) becomes a Gather on axis 0 of the data with the "
        "tuples' axes flattened (a Reshape, a view), by the tuples' flat positions: the one spelling "
        "gather_to_slice and pad_gather read (the dynamo exporter's adaptive pooling and advanced indexing).",
    ),
    _r(
        SCATTERND_AS_WHERE,
        GRAPH_PASS,
        "ScatterND by constant index tuples (a slice assignment) becomes Where(mask, Gather of the updates "
        "by a table of each element's update, data): pointwise, the Gather computed by the loads of the "
        "kernel that reads it (pad_gather); not for a reduction or tuples that hit one element twice.",
    ),
    _r(
        GATHER_TO_SLICE,
        GRAPH_PASS,
        "Gather by constant consecutive indices becomes a Slice (and Reshape), and Gather "
        "by indices of an evenly stepped grid whose steps nest (an unfold's patches) a Slice, Reshape "
        "and Transpose: views, not a kernel.",
    ),
    _r(
        COL2IM_TO_VIEWS,
        GRAPH_PASS,
        "Col2Im of blocks that tile the image (strides equal to the block shape, no padding or "
        "dilation: MobileViT V2's fold) sums nothing: it becomes Reshape, Transpose, Reshape, views "
        "a kernel reads through.",
    ),
    _r(
        ROTATE_HALF,
        GRAPH_PASS,
        "Concat(-x[..., h:], x[..., :h]) (rotary embeddings), and the interleaved form "
        "stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2) (GPT-J, CodeGen, EVA-02), becomes x @ R, a "
        "signed permutation: one GEMM whose epilogue takes the rest of the rotation.",
    ),
    _r(
        HEAD_SCALE,
        GRAPH_PASS,
        "Attention scores scaled per head by a constant [H, 1, 1] (Swin V2's logit scale, XCiT's "
        "temperature) on their way to a Softmax: the scale moves onto the query, (q @ k) * s = "
        "(q * s) @ k, so the attention rule fuses the rest into one flash-attention kernel.",
    ),
    _r(
        GROUP_NORM,
        GRAPH_PASS,
        "Reshape → InstanceNormalization → Reshape → Mul → Add (GroupNorm written out) becomes one "
        "GroupNormalization node with per-channel scale and bias.",
    ),
    _r(
        LOCAL_RESPONSE_NORM,
        GRAPH_PASS,
        "Mul(x, x) → Reshape → Pad → AveragePool over channels → Reshape → Mul → Add → Pow → Div "
        "(LocalResponseNorm written out) becomes one LRN node, where the padding is ONNX LRN's window "
        "(odd sizes only, as torch exports them).",
    ),
    _r(
        MERGE_DFTS,
        GRAPH_PASS,
        "DFTs over different axes, each reading the last (`torch.fft.fftn`: a DFT per axis), are one "
        "`opfuse.DFTN` node: one library transform over every axis, its intermediate in float32 (a "
        "float16 signal on a GPU whose transformed lengths are powers of two in half precision, as "
        "torch.fft runs it: no cast kernel either side); and a real signal padded with zero imaginary parts (Concat(x, 0) along the pairs) is read as the "
        "real signal it is, the zeros never written.",
    ),
    _r(
        FOLD_BATCHNORM,
        GRAPH_PASS,
        "Conv followed by inference BatchNormalization becomes one Conv with scaled weights and a new bias.",
    ),
    _r(
        SUM_SIBLING_CONVS,
        GRAPH_PASS,
        "Two convolutions of one input added together are one convolution whose weight is their "
        "sum (each kernel placed in the bounding window, grouped ones of the same groups too) and "
        "whose bias is the sum of theirs; a conv added to its own input, or to an inference "
        "BatchNormalization of it (a re-parameterizable block's identity branch: RepVGG, MobileOne, "
        "FastViT), is one convolution with that scale on its centre tap and the shift in its bias.",
    ),
    _r(
        SUM_SIBLING_GEMMS,
        GRAPH_PASS,
        "Two products of one input by constant weights added together (a distilled classifier's "
        "two heads, averaged) are one product by the sum of the weights, with the sum of their "
        "biases: one GEMM, where the first ran alone to write what the second's epilogue added.",
    ),
    _r(
        FORWARD_CONV_BIAS,
        GRAPH_PASS,
        "A Conv read only by Convs that pad nothing and have a bias (a depthwise conv and the 1x1 "
        "conv after it) runs without its bias: conv(x + b) is conv(x) plus the reader's weights "
        "summed against b, a constant added to each reader's bias; the library's conv then needs "
        "no add kernel after it.",
    ),
    _r(
        REDUCE_STACK,
        GRAPH_PASS,
        "A reduction over the axis a stack adds (`torch.stack(xs).sum(0)`, weighted or not: SKNet's "
        "branches, BiFPN's fusion, an ensemble's mean) is the elementwise sum (mean, max, min) of the "
        "stacked tensors: pointwise ops that join their neighbours' kernels, where a copy of every "
        "branch and a reduction ran.",
    ),
    _r(
        MERGE_REDUCTIONS,
        GRAPH_PASS,
        "A reduction of a reduction of the same kind (`x.mean(2, keepdim=True).mean(3, keepdim=True)`: "
        "FocalNet's global context) is one reduction over both sets of axes: one row kernel where two ran.",
    ),
    _r(
        MERGE_CONCAT_CONVS,
        GRAPH_PASS,
        "Convolutions of one input concatenated along channels become one convolution that writes "
        "the Concat's output (the taps a branch lacks are zeros, which the template skips); so do "
        "depthwise convolutions of a Split's parts (MixConv), as one depthwise conv of its input.",
    ),
    _r(
        BATCHNORM_TO_AFFINE,
        GRAPH_PASS,
        "A BatchNormalization that cannot fold into a Conv becomes x*a + b with per-channel constants, "
        "which then fuse with their neighbours (BN+Relu in one kernel).",
    ),
    _r(
        GEMM_TO_MATMUL,
        GRAPH_PASS,
        "A linear layer written as Reshape → Gemm → Reshape becomes MatMul + Add on the unflattened tensor.",
    ),
    _r(
        POINTWISE_BEFORE_VIEWS,
        GRAPH_PASS,
        "A pointwise op after a view (Reshape, Flatten, Squeeze, Unsqueeze, Transpose) whose only reader "
        "it is runs before the view, so it joins the producer's epilogue: view(x) → f becomes f(x) → view "
        "(constants only where they broadcast alike on both sides).",
    ),
    _r(
        RESHAPE_BEFORE_POINTWISE,
        GRAPH_PASS,
        "A Reshape a row op reads moves above the pointwise ops that compute its input (and a product "
        "by a 2-D matrix, where the last axis stays): the residual Add, the bias and the GEMM before "
        "a normalization that reads them reshaped (Swin's tokens and windows) join its row kernel.",
    ),
    _r(
        COLLAPSE_RESHAPES,
        GRAPH_PASS,
        "A Reshape of a Reshape (Flatten, Squeeze, Unsqueeze) reads the first one's input (one view, not "
        "two), and a Reshape to its "
        "input's own shape goes: such pairs, which exporters write around a Linear on flattened tokens "
        "(LeViT), kept the residual Add out of the GEMM's epilogue.",
    ),
    _r(
        UNIT_DIM_VIEWS,
        GRAPH_PASS,
        "A Transpose that moves only size-1 dims before a Softmax is a Reshape, and a Reshape that only "
        "adds or drops size-1 dims after a Softmax of a view goes before it (ResNeSt's radix Softmax "
        "between such views): the views collapse into one and the Softmax's rows take the shape of "
        "the weighted sum that reads them, which computes them in its row kernel.",
    ),
    _r(
        FOLD_CHANNEL_SHUFFLE,
        GRAPH_PASS,
        "Channel shuffles (Reshape → Transpose → Reshape over channels) become permutations the "
        "neighbouring convolutions, Slices and Concats absorb: no copy of a shuffled tensor.",
    ),
    _r(
        MERGE_PROJECTIONS,
        GRAPH_PASS,
        "MatMuls of one input by constant weights (attention's Q, K, V) become one wider MatMul and a Split.",
    ),
    _r(
        CHANNELS_LAST,
        GRAPH_PASS,
        "The conv region runs in NHWC: internal ops named `opfuse.*`, exported in the bundle's "
        "model.onnx in the `ai.opfuse` domain, never accepted from a model. A 1-D conv's [N, C, L] "
        "runs as one image row [N, 1, L, C], so it is the 2-D conv template's with its epilogue.",
    ),
    _r(
        FP32_DENSE_NCHW,
        GRAPH_PASS,
        "In fp32 on the GPU a conv region without depthwise convolutions stays NCHW (ResNet-50: 10.5 ms "
        "NCHW against 11.8 ms channels-last at batch 32 on the H200).",
        requires=(CHANNELS_LAST,),
    ),
    _r(
        SHORTCUT_CONV,
        GRAPH_PASS,
        "A convolution plus a 1x1 shortcut conv of another input is one implicit GEMM whose K loop "
        "reads both inputs (tuning times it against the library's two convolutions).",
        requires=(CHANNELS_LAST, CONV_EPILOGUE),
    ),
    _r(
        MERGE_SIBLING_CONVS,
        GRAPH_PASS,
        "Convolutions of one input at one stride become one, then a Split whose parts the conv "
        "template writes as buffers of their own.",
        requires=(CHANNELS_LAST, CONV_EPILOGUE),
    ),
    _r(
        DROP_UNUSED_CONSTANTS,
        GRAPH_PASS,
        "Constants no node reads any more leave the graph.",
        switchable=False,
    ),
    _r(
        ATTENTION,
        FUSION,
        "Flash attention: MatMul → [scale, mask] → Softmax → MatMul in one kernel, head split/merge "
        "read as strided views, a Q or K joined along the head dim (a partial rotary) read from the "
        "Concat's inputs, one-input pointwise ops on the output (LeViT's Hardswish) computed on its tile; "
        "the channels-first form V' @ Pᵀ (EfficientViT's) reads V and writes the output transposed.",
        impl=f"{RULES_PACKAGE}.attention",
    ),
    _r(
        ROW_REDUCTION,
        FUSION,
        "Softmax/LogSoftmax/Reduce* over one contiguous run of axes, LayerNorm/InstanceNorm/GroupNorm, "
        "each with its prologue and epilogue; non-trailing axes read as (outer, R, inner) tiles, GroupNorm "
        "rows as (n, g) channel groups; a row fits one program (≤ 16384 elements). A row kernel over a "
        "broadcast of another's rows that only it reads (MobileViT V2's query Softmax) is recomputed by it.",
        impl=f"{RULES_PACKAGE}.row_reduction",
    ),
    _r(
        CONCAT_SELECT,
        FUSION,
        "A Concat in a pointwise group (or the input of a row kernel whose rows lie whole: GroupNorm, "
        "InstanceNorm, a LayerNorm over the last axis): each element "
        "loaded from the input whose range holds it; a lone Concat of gathered or viewed inputs a kernel "
        "of its own.",
        requires=(POINTWISE,),
    ),
    _r(
        RESIZE_GATHER,
        FUSION,
        "A Resize (nearest, linear or cubic) read only by one pointwise kernel, one channels-last conv's "
        "epilogue or one row kernel is computed by that kernel's gather loads; any other is a gather "
        "kernel of its own.",
        requires=(POINTWISE,),
    ),
    _r(
        PAD_GATHER,
        FUSION,
        "A constant Pad, with the Reshapes, Transposes, Expands and Slices around it, read only by one "
        "pointwise kernel or GEMM epilogue is computed by that kernel's loads (relative-position "
        "logits' shifts, CoaT's class-token row): each element loaded from the buffer behind the "
        "chain, the border lanes the Pad's value. So is a Gather by constant indices no view "
        "describes, read by one pointwise kernel (adaptive pooling's overlapping windows): each "
        "coordinate on its axis loaded from the index table. A row kernel's full-shaped input loads "
        "through such a chain too (TinyViT's windows of a padded map into their LayerNorm), and so "
        "does a GEMM's A operand where the chain leaves K alone (Swin's and DaViT's window partition: "
        "each row of A from its token's row); a Concat's inputs each at its own offsets, chains may "
        "share ops, and a chain of layout ops alone is one where strides do not reach its start (a "
        "window reverse or partition the runtime would copy).",
        requires=(POINTWISE,),
    ),
    _r(
        LAYOUT_VIEWS,
        FUSION,
        "Reshape/Transpose/Slice/Split between kernels read as strides of the buffer behind them.",
    ),
    _r(
        GEMM_EPILOGUE,
        FUSION,
        "One GEMM plus its pointwise epilogue (bias, activation, residual, scale, cast); a batched MatMul reads both operands through the layout ops before them.",
        impl=f"{RULES_PACKAGE}.anchor_epilogue",
    ),
    _r(
        CONV_EPILOGUE,
        FUSION,
        "One convolution plus its pointwise epilogue; never two compute-bound anchors in one kernel.",
        impl=f"{RULES_PACKAGE}.anchor_epilogue",
    ),
    _r(
        POOL_EPILOGUE,
        FUSION,
        "An NHWC max or average pool as a Triton kernel with the pointwise ops after it.",
        impl=f"{RULES_PACKAGE}.anchor_epilogue",
    ),
    _r(
        PAD_PROLOGUE,
        FUSION,
        "An anchor's template reads through the constant, reflect or edge Pad before it.",
    ),
    _r(
        LAYOUT_PROLOGUE,
        FUSION,
        "A channels-last conv of few input channels (a network's stem) reads its NCHW input in "
        "place, a plane a channel, where the region's Transpose to NHWC has no other reader: no "
        "copy of the input.",
        requires=(CHANNELS_LAST,),
    ),
    _r(
        CONCAT_PROLOGUE,
        FUSION,
        "A 1x1 conv of a channel Concat, through per-channel affine ops and a Relu (DenseNet's "
        "pre-activation BatchNorm), reads the Concat's inputs in turn in its K loop, activating each tile.",
        requires=(CHANNELS_LAST,),
    ),
    _r(
        OPERAND_PROLOGUE,
        FUSION,
        "The pointwise ops that compute a GEMM's A operand (a gate, a rescale) and that only the GEMM "
        "reads run on its A tiles in the K loop: A is never written. A Concat along K is read from "
        "its parts, each at its own columns.",
        requires=(GEMM_EPILOGUE,),
    ),
    _r(
        DEPTHWISE_PROLOGUE,
        FUSION,
        "A depthwise conv computed on the input tiles of the 1x1 conv that reads it.",
        impl=f"{RULES_PACKAGE}.window_prologue",
    ),
    _r(
        POOL_PROLOGUE,
        FUSION,
        "A max or average pool computed on the input tiles of the conv (any window) that reads it (an "
        "average divided as the pool's own kernel divides); where others read the pool too, the conv stores "
        "the tile it loads at its centre window position.",
        impl=f"{RULES_PACKAGE}.window_prologue",
    ),
    _r(
        POOL_TAIL,
        FUSION,
        "A max or average pool whose windows tile the map (window = stride, no padding: VGG's, a "
        "DenseNet transition's) after a conv's epilogue, computed on the conv's output tile: the "
        "conv's rows run window by window, and only the pooled tile is stored.",
        requires=(CHANNELS_LAST, CONV_EPILOGUE),
    ),
    _r(
        GEMV_CHAIN,
        FUSION,
        "Two memory-bound 1x1 convolutions of 1x1 maps back to back (squeeze-excitation's MLP) in one "
        "kernel, with their epilogues, or either alone (ResNeSt's split attention).",
        impl=f"{RULES_PACKAGE}.gemv_chain",
    ),
    _r(
        DEPTHWISE_REDUCTION,
        FUSION,
        "A depthwise conv, or a max or average pool, computed on the tiles of the row kernel that "
        "reduces its output (squeeze-excitation's squeeze, ConvNeXt's LayerNorm, PoolFormer's "
        "pool before its norm over each image).",
        impl=f"{RULES_PACKAGE}.depthwise_reduction",
    ),
    _r(
        GEMM_REDUCTION,
        FUSION,
        "A GEMM, or a dense NHWC conv as an implicit GEMM, computed on the tiles of the row kernel that "
        "reduces over its output's columns (a transformer's Linear with its bias, residual add and "
        "LayerNorm; a patch-embedding conv and its LayerNorm), where a row fits one tile, or over its "
        "rows of one item (the conv before an ECA or squeeze-excitation mean over the pixels, "
        "ConvNeXt V2's Linear before its global response norm), or over each item (a conv before a "
        "one-group GroupNorm: PoolFormer, MobileViT V2); the product stored where others read it.",
        impl=f"{RULES_PACKAGE}.gemm_reduction",
    ),
    _r(
        GATHER_PROLOGUE,
        FUSION,
        "An embedding lookup (a Gather of a constant table's rows by runtime indices) computed on the tiles "
        "of the row kernel that reads it (a transformer's embeddings with their adds and LayerNorm).",
        impl=f"{RULES_PACKAGE}.gather_prologue",
    ),
    _r(
        CONCAT_EPILOGUE,
        FUSION,
        "A conv kernel writes the channel Concat its output feeds, in place, and copies the Concat's "
        "other inputs.",
        requires=(LAYOUT_VIEWS,),
        impl=f"{RULES_PACKAGE}.concat_epilogue",
    ),
    _r(
        POOLED_GEMM,
        FUSION,
        "A global average pool computed on the A tiles of the GEMM, the 1x1 conv of the 1x1 map or "
        "the GEMV chain that reads it (a classifier's head, squeeze-excitation's MLP).",
        impl=f"{RULES_PACKAGE}.pooled_gemm",
    ),
    _r(
        POINTWISE,
        FUSION,
        "Elementwise ops of one iteration shape (broadcasts included) in one kernel.",
        impl=f"{RULES_PACKAGE}.pointwise",
    ),
    _r(
        CHANNEL_WINDOW,
        FUSION,
        "An LRN in a pointwise group, its window read by loads of its input at neighbouring channels "
        "(so that input is always a kernel input).",
        requires=(POINTWISE,),
    ),
    _r(
        SPLIT_K,
        CODEGEN,
        "The conv and GEMM templates' split-K configs, offered to tuning where the output tiles are "
        "too few to fill the GPU.",
    ),
)

RULES: dict[str, RuleInfo] = {r.name: r for r in REGISTRY}
# What `fusion.disable` accepts.
SWITCHES: tuple[str, ...] = tuple(r.name for r in REGISTRY if r.switchable)


def stage_rules(stage: str) -> tuple[RuleInfo, ...]:
    return tuple(r for r in REGISTRY if r.stage == stage)


def unknown_names(names: Iterable[str]) -> list[str]:
    """The names in `names` that `fusion.disable` does not accept, in their order, once each."""
    valid = set(SWITCHES)
    return list(dict.fromkeys(n for n in names if n not in valid))


def unknown_names_message(unknown: Iterable[str]) -> str:
    listed = ", ".join(repr(n) for n in unknown)
    return (
        f"fusion.disable names no rule: {listed}. Use the names of rules that can be turned off: "
        f"{', '.join(SWITCHES)} (docs/design.md lists what each one does)"
    )


def check_disable(names: Iterable[str]) -> frozenset[str]:
    """`names` as a set, or UnknownRuleError (a ValueError) naming the unknown ones and listing the valid ones."""
    if isinstance(names, str):
        raise UnknownRuleError(
            f"fusion.disable is a list of rule names, got the string {names!r}: write [{names!r}]"
        )
    names = list(names)
    unknown = unknown_names(names)
    if unknown:
        raise UnknownRuleError(unknown_names_message(unknown))
    return frozenset(names)


def enabled(name: str, disabled: Iterable[str] = ()) -> bool:
    """Whether rule `name` runs when the rules in `disabled` are turned off: it is not, and neither
    is any rule it requires."""
    off = disabled if isinstance(disabled, (set, frozenset)) else frozenset(disabled)
    rule = RULES[name]
    return name not in off and all(enabled(r, off) for r in rule.requires)


# -- docs ------------------------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs"
TABLE_BEGIN = "<!-- rule table: generated by `python -m opfuse.frontend.rule_registry --write-docs` -->"
TABLE_END = "<!-- end of rule table -->"
NAMES_BEGIN = (
    "<!-- fusion.disable names: generated by `python -m opfuse.frontend.rule_registry --write-docs` -->"
)
NAMES_END = "<!-- end of fusion.disable names -->"


def markdown_table() -> str:
    lines = [
        "| rule | stage | what it does | requires | `fusion.disable` |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in REGISTRY:
        requires = ", ".join(f"`{x}`" for x in r.requires) or "–"
        switch = f"`{r.name}`" if r.switchable else "always runs"
        lines.append(f"| `{r.name}` | {r.stage} | {r.doc} | {requires} | {switch} |")
    return "\n".join(lines)


def markdown_names() -> str:
    return ", ".join(f"`{n}`" for n in SWITCHES) + "."


def _replace_between(text: str, begin: str, end: str, body: str) -> str:
    start = text.index(begin) + len(begin)
    stop = text.index(end, start)
    return text[:start] + "\n" + body + "\n" + text[stop:]


def generated_docs() -> dict[Path, str]:
    """docs/design.md and docs/library.md as they must read: their generated blocks from this registry."""
    design = DOCS / "design.md"
    library = DOCS / "library.md"
    return {
        design: _replace_between(design.read_text(), TABLE_BEGIN, TABLE_END, markdown_table()),
        library: _replace_between(library.read_text(), NAMES_BEGIN, NAMES_END, markdown_names()),
    }


def main(argv: list[str]) -> int:
    if argv == ["--write-docs"]:
        for path, text in generated_docs().items():
            if path.read_text() != text:
                path.write_text(text)
                print(f"rewrote {path}")
        return 0
    if argv == ["--table"]:
        print(markdown_table())
        return 0
    print("usage: python -m opfuse.frontend.rule_registry --write-docs | --table", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
