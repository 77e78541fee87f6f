"""Channels-last: run the convolutional part of a graph in NHWC.

Tensor cores and cuDNN compute 2-D convolutions natively in NHWC; an NCHW convolution pays layout
conversions inside the library, and an implicit-GEMM template on NCHW gathers its reduction axis
(input channels) with a stride. This pass rewrites the graph so that every 2-D and 1-D Conv, the
pointwise ops around it, pooling and global pooling work on channels-last tensors: NHWC, and for
the [N, C, L] tensors of a 1-D conv their tokens [N, L, C] as one image row [N, 1, L, C]:

- a Conv becomes `opfuse.ConvNHWC`, its weight stored as [Cout, KH, KW, Cin/group]; a 1-D Conv
  becomes the ConvNHWC of the row [N, 1, L, C] by [Cout, 1, K, Cin/group]: audio front ends
  (wav2vec2's feature extractor and positional conv, Whisper's stem) and convs over tokens
  (SqueezeBERT, ConvBERT, ECA's conv across channels) run as the conv template with their
  epilogue, where the library's conv1d ran alone and its epilogue was a second kernel, and the
  model's transposes between tokens and [N, C, L] around them are views of the row;
- MaxPool / AveragePool become `opfuse.MaxPoolNHWC` / `opfuse.AveragePoolNHWC`;
- GlobalAveragePool / GlobalMaxPool become ReduceMean / ReduceMax over axes (1, 2), and a
  written-out ReduceMean/Sum/Max/Min with constant axes reduces the same axes in NHWC numbering;
- pointwise ops take their per-channel constants transposed ([C,1,1] -> [1,1,1,C]);
- Concat along channels concatenates along the last axis;
- a Pad of a value already channels-last pads its NHWC twin (the same pads, numbered in NHWC), so
  the region does not leave for it and come back: a conv after it reads through it
  (pad_prologue), the depthwise template too (TResNet's anti-aliasing blur pools: a reflect Pad
  after a conv, then a depthwise blur conv);
- LRN becomes `opfuse.LRNNHWC`, its window over the last axis (the channels, contiguous);
- a GroupNormalization with one group becomes LayerNormalization over axes 1-3 (the same
  statistics), its per-channel scale and bias broadcast along the last axis;
- the model's own permutes between the layouts (ConvNeXt's LayerNorm over channels) are absorbed:
  a Transpose to NHWC of a value already there is that value, and the operand of a Transpose back
  to NCHW is the NHWC form of its result;
- pointwise ops that only a conv of the region reads, each with one computed input and constants,
  the chain starting from a layout op's output or a graph input (a BatchNorm's scale and shift
  before a conv: MaxViT's MBConv pre-norm after the window reverse) run in NHWC: the Transpose
  into the region moves above them, where their kernel reads it as a view, instead of a copy the
  runtime makes of their NCHW output for the conv.

At the region's edges an explicit Transpose converts (into NHWC before the first conv, back to
NCHW before an op that needs the original layout or a graph output); the fusion planner folds
those into neighbouring kernels as strided views where it can. The rewritten graph computes the
same function: every value keeps its meaning, only NHWC twins are added.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.ops import FLOAT_TYPES, LRN_NHWC, NHWC_CONV, POINTWISE_OPS, ROW_REDUCTIONS, is_depthwise
from opfuse.ir.ops import NHWC_POOLS as POOLS
from opfuse.ir.support import pad_per_dim
from opfuse.passes.pointwise_views import VIEWS
from opfuse.passes.rules import NotFired, RuleLog, node_label

RULE = names.CHANNELS_LAST
FP32_DENSE_RULE = names.FP32_DENSE_NCHW  # keeps a dense-only conv region NCHW in fp32 on the GPU
TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)
RANKS = (3, 4)  # the ranks whose values have twins: [N, C, L] and [N, C, H, W]
GLOBAL_POOLS = {"GlobalAveragePool": "ReduceMean", "GlobalMaxPool": "ReduceMax"}


TOKENS = (0, 2, 1)  # [N, C, L] <-> [N, L, C]: a 1-D conv's channels-first and channels-last


def _nhwc_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a value's twin: NHWC; [N, 1, L, C] for an [N, C, L] value (one image row,
    so that a 1-D conv is the 2-D template's and its neighbours' kernels see 4-D tensors)."""
    if len(shape) == 3:
        return (shape[0], 1, shape[2], shape[1])
    return tuple(shape[d] for d in TO_NHWC)


def _conv_reason(graph: Graph, node: Node) -> str | None:
    x = graph.spec(node.inputs[0])
    if len(x.shape) not in RANKS:
        return f"a {len(x.shape) - 2}-D convolution: channels-last covers 1-D and 2-D"
    if x.dtype not in FLOAT_TYPES:
        return f"input of type {x.dtype}"
    if node.inputs[1] not in graph.constants:
        return "the weight is not a constant"
    if len(node.inputs) > 2 and node.inputs[2] and node.inputs[2] not in graph.constants:
        return "the bias is not a constant"
    return None


class _Rewriter:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.twin: dict[str, str] = {}  # NCHW value -> its NHWC twin
        self.constant_twin: dict[tuple[str, int], str] = {}  # (constant, rank) -> its channels-last form
        self.out: list[Node] = []
        self.converted_outputs: set[str] = set()  # NCHW names now produced only as NHWC twins
        self.count = 0
        self.nodes_made = 0

    def fresh(self, base: str) -> str:
        self.count += 1
        name = f"{base}__nhwc{self.count}"
        while name in self.graph.values:
            self.count += 1
            name = f"{base}__nhwc{self.count}"
        return name

    def node_id(self) -> str:
        self.nodes_made += 1
        return f"ncl{self.nodes_made}"

    def constant(self, name: str, rank: int = 4) -> str:
        """The channels-last form of a constant that broadcasts against a value of `rank`."""
        if (name, rank) in self.constant_twin:
            return self.constant_twin[name, rank]
        arr = self.graph.constants[name]
        if arr.size == 1:
            return name  # a scalar broadcasts the same in any layout
        full = arr.reshape((1,) * (rank - arr.ndim) + arr.shape)
        if rank == 3:
            last = full.transpose(TOKENS).reshape(_nhwc_shape(full.shape))
        else:
            last = full.transpose(TO_NHWC)
        new = self.fresh(name)
        self.graph.add_constant(new, np.ascontiguousarray(last), self.graph.spec(name).dtype)
        self.constant_twin[name, rank] = new
        if rank == 4:
            self.twin[name] = new  # as a value's twin: a pointwise op reading it joins the region
        return new

    def nhwc_input(self, name: str) -> str:
        """The channels-last twin of a 3-D or 4-D value, made by a Transpose the first time it is
        needed."""
        if name in self.twin:
            return self.twin[name]
        spec = self.graph.spec(name)
        if name in self.graph.constants:
            return self.constant(name, len(spec.shape))
        if len(spec.shape) == 3:  # the tokens transposed, viewed as one image row
            n, c, length = spec.shape
            tokens = self.fresh(name)
            self.graph.values[tokens] = TensorSpec(tokens, spec.dtype, (n, length, c))
            self.out.append(Node(self.node_id(), "Transpose", [name], [tokens], {"perm": list(TOKENS)}))
            self.twin[name] = self.view(tokens, _nhwc_shape(spec.shape))
            return self.twin[name]
        new = self.fresh(name)
        self.graph.values[new] = TensorSpec(new, spec.dtype, _nhwc_shape(spec.shape))
        self.out.append(Node(self.node_id(), "Transpose", [name], [new], {"perm": list(TO_NHWC)}))
        self.twin[name] = new
        return new

    def view(self, src: str, shape: tuple[int, ...], out: str = "") -> str:
        """A Reshape of `src` (a view: the same elements in the same order) appended."""
        node_id = self.node_id()
        out = out or self.fresh(src)
        self.out.append(self.graph.reshape_node(node_id, src, shape, out))
        return out

    def new_output(self, name: str) -> str:
        spec = self.graph.spec(name)
        new = self.fresh(name)
        self.graph.values[new] = TensorSpec(new, spec.dtype, _nhwc_shape(spec.shape))
        self.twin[name] = new
        self.converted_outputs.add(name)
        return new


def _reduce_axes(graph: Graph, node: Node) -> list[int] | None:
    """The constant axes a 4-D reduction reduces (NCHW numbering), when it can run on the NHWC twin."""
    if len(graph.spec(node.inputs[0]).shape) != 4 or node.attrs.get("noop_with_empty_axes", 0):
        return None
    if len(node.inputs) > 1 and node.inputs[1]:
        if node.inputs[1] not in graph.constants:
            return None
        axes = sorted({int(a) % 4 for a in np.asarray(graph.constants[node.inputs[1]]).ravel()})
    else:
        axes = sorted({int(a) % 4 for a in node.attrs.get("axes", [])}) or [0, 1, 2, 3]
    kept_nchw = [a for a in range(4) if a not in axes]
    kept_nhwc = [a for a in TO_NHWC if a not in axes]
    if not int(node.attrs.get("keepdims", 1)) and kept_nchw != kept_nhwc:
        return None
    return axes


def _pointwise_ok(graph: Graph, node: Node, twin: dict[str, str]) -> bool:
    """A pointwise op joins the region when one of its inputs of its output's rank (3 or 4)
    already is channels-last."""
    if node.op_type not in POINTWISE_OPS or len([o for o in node.outputs if o]) != 1:
        return False
    rank = len(graph.spec(node.outputs[0]).shape)
    if rank not in RANKS:
        return False
    touches = False
    for x in node.inputs:
        if not x:
            continue
        spec = graph.spec(x)
        if x in twin and x not in graph.constants:
            if len(spec.shape) != rank:
                return False  # an [N, C, L] value broadcast against a 4-D one: not its twin's shape
            touches = True
            continue
        if x in twin and rank == 4:
            touches = True  # a constant already transposed for a 4-D neighbour
            continue
        if x in graph.constants or spec.numel == 1:
            continue
        if len(spec.shape) != rank:
            return False  # a lower-rank computed value would need a reshape as well
    return touches


def _hoisted(graph: Graph, convs: list[Node]) -> set[str]:
    """The pointwise ops that run in NHWC ahead of the region (module doc): walking back from
    each 2-D conv's input, an op with one computed input of its output's rank (4), the rest
    constants, whose output is no graph output and is read only by the region's convs and ops
    already taken; and only a chain that starts from a layout op's output (a Reshape, a
    Transpose: MaxViT's window reverse) or a graph input. A chain after an op that computes (a
    GroupNorm's row kernel, whose epilogue it would be) stays: there the NCHW value is one
    kernel's output either way, and moving the chain would cost it that kernel's epilogue."""
    producers, consumers = graph.producers(), graph.consumers()
    outputs = {o.name for o in graph.outputs}
    conv_ids = {n.id for n in convs}
    taken: set[str] = set()
    for conv in convs:
        x = conv.inputs[0]
        chain: set[str] = set()
        while True:
            node = producers.get(x)
            if (
                node is None
                or node.op_type not in POINTWISE_OPS
                or node.id in taken
                or len([o for o in node.outputs if o]) != 1
                or x in outputs
                or len(graph.spec(x).shape) != 4
                or graph.spec(x).dtype not in FLOAT_TYPES
            ):
                break
            if any(
                r.id not in conv_ids and r.id not in taken and r.id not in chain for r in consumers.get(x, [])
            ):
                break
            computed = [i for i in node.inputs if i and i not in graph.constants]
            if len(computed) != 1 or len(graph.spec(computed[0]).shape) != 4:
                break
            chain.add(node.id)
            x = computed[0]
        source = producers.get(x)
        if chain and (source is None or source.op_type in VIEWS):
            taken.update(chain)
    return taken


def _one_group(graph: Graph, node: Node) -> bool:
    """A 4-D GroupNormalization with one group, its scale and bias one value per channel (or one
    in all), whose statistics are those of LayerNormalization over the same elements."""
    if int(node.attrs.get("num_groups", 0)) != 1 or len([o for o in node.outputs if o]) != 1:
        return False
    x = graph.spec(node.inputs[0]).shape
    params = [p for p in node.inputs[1:3] if p]
    return len(x) == 4 and len(params) == 2 and all(graph.spec(p).shape in ((x[1],), (1,)) for p in params)


# cuDNN's fp32 kernels (no tensor cores) for dense convolutions are NCHW-native; in channels-last
# it converts layouts inside the library. ResNet-50 on the H200 in fp32: its convolutions took
# 10.5 ms NCHW against 11.8 ms channels-last at batch 32 (1.59 against 1.85 ms at batch 1), 302
# kernels launched against 104 planned. Depthwise convolutions go the other way (MobileNetV3-L b1:
# 0.53 ms channels-last against 0.63 NCHW; EfficientNet-B0 b32: 2.85 against 3.44).
FP32_DENSE_REASON = (
    "fp32 on the GPU with dense convolutions only: the library's fp32 convolution kernels run NCHW "
    "natively and are faster there (ResNet-50 on the H200: 10.5 ms NCHW against 11.8 ms "
    "channels-last at batch 32); channels-last is kept in fp32 where depthwise convolutions are "
    f'(rule {FP32_DENSE_RULE}; fusion.disable ["{FP32_DENSE_RULE}"] runs the region channels-last)'
)


def to_channels_last(
    graph: Graph,
    log: RuleLog,
    precision: str = "fp32",
    device: str = "cpu",
    disabled: frozenset[str] = frozenset(),
) -> None:
    """Rewrite the 2-D convolutions of `graph` and their neighbourhood to NHWC (see module doc).
    In fp32 on the GPU a region of dense convolutions only stays NCHW (FP32_DENSE_REASON) unless
    FP32_DENSE_RULE is disabled."""
    convs = []
    for n in graph.nodes:
        if n.op_type != "Conv":
            continue
        reason = _conv_reason(graph, n)
        if reason is None:
            convs.append(n)
        else:
            log.not_fired.append(NotFired(RULE, [node_label(n)], reason))
    if not convs:
        return
    if (
        FP32_DENSE_RULE not in disabled
        and precision == "fp32"
        and device.startswith("cuda")
        and not any(is_depthwise(graph, n) for n in convs)
    ):
        log.fired[FP32_DENSE_RULE] = log.fired.get(FP32_DENSE_RULE, 0) + len(convs)
        log.not_fired.append(NotFired(RULE, [node_label(n) for n in convs], FP32_DENSE_REASON))
        return
    rw = _Rewriter(graph)
    graph_outputs = {o.name for o in graph.outputs}
    # What the 1-D convs read: the model's permute from NLC to their NCL input is absorbed.
    reads_1d = {n.inputs[0] for n in convs if len(graph.spec(n.inputs[0]).shape) == 3}
    rename: dict[str, str] = {}  # a model Transpose to NHWC of a value with a twin: the twin itself
    hoisted = _hoisted(graph, [n for n in convs if len(graph.spec(n.inputs[0]).shape) == 4])
    for node in graph.nodes:
        node.inputs = [rename.get(x, x) for x in node.inputs]
        op = node.op_type
        perm = tuple(int(p) for p in node.attrs.get("perm", ())) if op == "Transpose" else ()
        out = node.outputs[0] if node.outputs else ""
        if perm == TO_NHWC and node.inputs[0] in rw.twin and out not in graph_outputs:
            # The model's own permute to NHWC (ConvNeXt, channels-last blocks): already there.
            rename[out] = rw.twin[node.inputs[0]]
        elif perm == TO_NCHW and out not in graph_outputs and len(graph.spec(out).shape) == 4:
            # The model's permute back to NCHW: its input is the NHWC form of its output, so what
            # follows stays in the region; the Transpose is made again only where an op needs it.
            rw.twin[out] = node.inputs[0]
            rw.converted_outputs.add(out)
        elif perm == TOKENS and node.inputs[0] in rw.twin and out not in graph_outputs:
            # Tokens back from a 1-D conv's [N, C, L] (a transformer's conv block): its twin's
            # row, viewed as [N, L, C].
            rw.view(rw.twin[node.inputs[0]], graph.spec(out).shape, out)
        elif perm == TOKENS and out in reads_1d and out not in graph_outputs:
            # Tokens [N, L, C] into a 1-D conv: the input's view as one image row is the twin of
            # the [N, C, L] value. Only there: any other transpose of the last two axes of a
            # 3-D value (attention's keys) is not a layout change.
            rw.twin[out] = rw.view(node.inputs[0], _nhwc_shape(graph.spec(out).shape))
            rw.converted_outputs.add(out)
        elif op == "Conv" and node in convs:
            x = rw.nhwc_input(node.inputs[0])
            w_name = node.inputs[1]
            w = graph.constants[w_name]
            attrs = dict(node.attrs)
            if w.ndim == 3:  # a 1-D conv: the 2-D conv of its twin, one image row
                w, attrs = w[:, :, None], _row_attrs(attrs)
            new_w = rw.fresh(w_name)
            graph.add_constant(new_w, np.ascontiguousarray(w.transpose(0, 2, 3, 1)), graph.spec(w_name).dtype)
            attrs.setdefault("kernel_shape", list(w.shape[2:]))
            ins = [x, new_w, *node.inputs[2:3]]
            rw.out.append(Node(node.id, NHWC_CONV, ins, [rw.new_output(node.outputs[0])], attrs, node.name))
        elif (
            op in POOLS
            and node.inputs[0] in rw.twin
            and len([o for o in node.outputs if o]) == 1
            and len(graph.spec(node.inputs[0]).shape) == 4
        ):
            ins = [rw.twin[node.inputs[0]]]
            rw.out.append(
                Node(node.id, POOLS[op], ins, [rw.new_output(node.outputs[0])], dict(node.attrs), node.name)
            )
        elif op in GLOBAL_POOLS and node.inputs[0] in rw.twin and len(graph.spec(node.inputs[0]).shape) == 4:
            axes = graph.add_constant(f"{node.id}_axes", np.array([1, 2], dtype=np.int64), "int64")
            ins = [rw.twin[node.inputs[0]], axes]
            out = rw.new_output(node.outputs[0])
            rw.out.append(Node(node.id, GLOBAL_POOLS[op], ins, [out], {"keepdims": 1}, node.name))
        elif op in ROW_REDUCTIONS and node.inputs[0] in rw.twin and (axes_nchw := _reduce_axes(graph, node)):
            # A reduction written out (timm's x.mean((2, 3))): the same axes, numbered in NHWC.
            keep = int(node.attrs.get("keepdims", 1))
            nhwc_axes = np.array(sorted(TO_NHWC.index(a) for a in axes_nchw), dtype=np.int64)
            axes = graph.add_constant(f"{node.id}_axes", nhwc_axes, "int64")
            ins = [rw.twin[node.inputs[0]], axes]
            # keepdims=0 leaves the kept axes in NHWC order: the same value only if that order is
            # the NCHW one (reducing H and W leaves [N, C] either way).
            out = rw.new_output(node.outputs[0]) if keep else node.outputs[0]
            attrs = {k: v for k, v in node.attrs.items() if k != "axes"} | {"keepdims": keep}
            rw.out.append(Node(node.id, op, ins, [out], attrs, node.name))
        elif op == "Pad" and node.inputs[0] in rw.twin and (pads := _nhwc_pads(graph, node)) is not None:
            ins = [rw.twin[node.inputs[0]], graph.add_constant(f"{node.id}_pads", pads, "int64")]
            ins += node.inputs[2:3]  # the value; the axes are all four now
            out = rw.new_output(node.outputs[0])
            rw.out.append(Node(node.id, "Pad", ins, [out], dict(node.attrs), node.name))
        elif op == "LRN" and node.inputs[0] in rw.twin and len(graph.spec(node.inputs[0]).shape) == 4:
            # A window over the channels: in NHWC neighbouring channels are neighbouring elements.
            ins = [rw.twin[node.inputs[0]]]
            out = rw.new_output(node.outputs[0])
            rw.out.append(Node(node.id, LRN_NHWC, ins, [out], dict(node.attrs), node.name))
        elif (
            op == "Concat"
            and len(graph.spec(node.outputs[0]).shape) == 4
            and any(x in rw.twin for x in node.inputs)
        ):
            axis = int(node.attrs.get("axis", 0)) % 4
            ins = [rw.nhwc_input(x) for x in node.inputs]
            attrs = {**node.attrs, "axis": TO_NHWC.index(axis)}
            rw.out.append(Node(node.id, "Concat", ins, [rw.new_output(node.outputs[0])], attrs, node.name))
        elif op == "GroupNormalization" and node.inputs[0] in rw.twin and _one_group(graph, node):
            # One group normalizes each sample over all of its elements, whatever their order: in
            # NHWC that is LayerNormalization from axis 1, with the per-channel scale and bias
            # broadcast along the last axis (PoolFormer's norms, before its channels-last pool).
            ins = [rw.twin[node.inputs[0]], *node.inputs[1:3]]
            attrs = {"axis": 1, "epsilon": float(node.attrs.get("epsilon", 1e-5))}
            out = rw.new_output(node.outputs[0])
            rw.out.append(Node(node.id, "LayerNormalization", ins, [out], attrs, node.name))
        elif _pointwise_ok(graph, node, rw.twin) or node.id in hoisted:
            ins = []
            for x in node.inputs:
                if not x or (x not in rw.twin and x not in graph.constants and graph.spec(x).numel == 1):
                    ins.append(x)
                elif x in graph.constants and len(graph.spec(x).shape) <= len(graph.spec(out).shape):
                    ins.append(rw.constant(x, len(graph.spec(out).shape)))
                else:
                    ins.append(rw.nhwc_input(x))
            out = rw.new_output(node.outputs[0])
            rw.out.append(Node(node.id, op, ins, [out], dict(node.attrs), node.name))
        else:
            for x in node.inputs:
                _back_to_nchw(rw, x)
            rw.out.append(node)
    for o in graph.outputs:
        _back_to_nchw(rw, o.name)
    graph.nodes = rw.out
    log.fired[RULE] = log.fired.get(RULE, 0) + len(convs)


def _nhwc_pads(graph: Graph, node: Node) -> np.ndarray | None:
    """A 4-D Pad's pads (constants) for its input's NHWC twin: the begins of N, H, W, C, then their
    ends; None where they are not constants."""
    if len(graph.spec(node.inputs[0]).shape) != 4 or len([o for o in node.outputs if o]) != 1:
        return None
    per_dim = pad_per_dim(graph, node)
    if per_dim is None:
        return None
    nhwc = [per_dim[a] for a in TO_NHWC]
    return np.array([b for b, _ in nhwc] + [e for _, e in nhwc], dtype=np.int64)


def _row_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """A 1-D Conv's attributes as its 2-D conv over one image row's: kernel (1, K), strides
    (1, s), dilations (1, d), pads (0, begin, 0, end)."""
    out = dict(attrs)
    for key in ("kernel_shape", "strides", "dilations"):
        if key in attrs:
            out[key] = [1, *(int(v) for v in attrs[key])]
    if "pads" in attrs:
        begin, end = (int(v) for v in attrs["pads"])
        out["pads"] = [0, begin, 0, end]
    return out


def _back_to_nchw(rw: _Rewriter, name: str) -> None:
    """Make the NCHW value `name` exist again (a Transpose of its twin) if only its twin was produced."""
    if name in rw.converted_outputs:
        rw.converted_outputs.discard(name)
        spec = rw.graph.spec(name)
        if len(spec.shape) == 3:  # the twin's row, viewed as tokens, transposed
            tokens = rw.view(rw.twin[name], (spec.shape[0], spec.shape[2], spec.shape[1]))
            rw.out.append(Node(rw.node_id(), "Transpose", [tokens], [name], {"perm": list(TOKENS)}))
            return
        rw.out.append(Node(rw.node_id(), "Transpose", [rw.twin[name]], [name], {"perm": list(TO_NCHW)}))
