"""What the NHWC conv template (codegen/conv.py) reads off its group before it writes a line: the
epilogue's Concat and Split, the prologue (a Pad, an input scale, a depthwise conv or a max or
average pool on the input tiles), the shortcut, the kernel's arguments and which of its loop
forms it takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opfuse.codegen.conv_fragments import TapInput, pad_geometry, tap_segments
from opfuse.codegen.epilogue import dot_precision
from opfuse.codegen.fragments import split_literals
from opfuse.graph import Graph, Node
from opfuse.ir.ops import FLAT_CONV_CHANNELS, NHWC_CONV, NHWC_POOLS, has_shortcut, is_depthwise
from opfuse.ir.resize import ResizeGather
from opfuse.ir.support import centre_tap, conv_params, input_scale_operands, input_scale_reason, pool_params
from opfuse.ir.views import StridedView


@dataclass
class NhwcConv:
    """One NHWC conv group as its template writes it (`nhwc_conv`)."""

    graph: Graph
    anchor: Node
    prologue: list[Node]
    epilogue: list[Node]  # without the Concat and the Split, which the stores write
    outputs: list[str]
    views: dict[str, Any]
    p: dict[str, int]
    prec: str
    depthwise: bool
    groups: int  # the conv's group attribute: 1, the channels (depthwise), or between (grouped)
    m: int
    n: int
    k: int
    x_name: str
    w_name: str
    b_name: str = ""
    sx_name: str = ""  # a 1x1 shortcut conv summed in (passes/shortcut_conv.py): input, weight
    sw_name: str = ""
    scale: str = ""  # x = act * scale: the kernel reads act and scales each loaded tile
    scale_index: str = ""
    pad: Node | None = None  # a Pad, then the Transpose to NHWC; or that Transpose alone (NCHW x)
    window: Node | None = None  # a depthwise conv or a pool computed as the tiles are loaded
    dw_w: str = ""
    dw_b: str = ""
    pool_out: str = ""  # the pooled tensor, where others read it too (stored from the centre tap)
    centre: int | None = None
    pooled: bool = False  # the template's loops, each tile loaded as the pool's maximum or average
    concat: Node | None = None
    split: Node | None = None
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)  # value -> (first column, columns)
    copied: list[str] = field(default_factory=list)  # the Concat's inputs the kernel copies
    literals: dict[str, str] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)  # tensors the epilogue loads
    flat: bool = False  # one flat K loop, cin = k % C (few input channels: a first layer)
    small_index: bool = False  # every offset fits int32 (codegen/conv.py sets it)
    segments: list[tuple[int, int, int, int, int, int]] | None = None
    splittable: bool = False
    # A Concat before a 1x1 conv (fusion/rules/concat_prologue.py): each input, its first channel
    # and its channels, read in turn by the K loop; the ops between (`act`) applied to each tile,
    # their per-channel constants (`act_consts`) loaded at the input's channels.
    pieces: list[tuple[str, int, int]] = field(default_factory=list)
    act: list[Node] = field(default_factory=list)
    act_consts: list[str] = field(default_factory=list)
    # Pointwise ops computing the conv's input (fusion/rules/operand_prologue.py): each tap's
    # tile computed from their inputs (`op_loads`, read through `views` where folded).
    ops: list[Node] = field(default_factory=list)
    op_loads: list[str] = field(default_factory=list)
    op_literals: dict[str, str] = field(default_factory=dict)
    # x a window of channels of a wider NHWC buffer, read in place (fusion/rules/anchor_epilogue.py
    # `channel_window_input`): the buffer, its channels (each pixel's stride) and the window's
    # first channel. "": x is a buffer of its own.
    x_base: str = ""
    x_stride: int = 0
    x_offset: int = 0
    # A pool whose windows tile the map, on the output tile (fusion/rules/anchor_epilogue.py
    # `pool_tail`): the rows run window by window (`m` counts the pixels of whole windows only),
    # and the pooled tile is the kernel's one output. `tail_p`: the pool's pool_params.
    tail: Node | None = None
    tail_p: dict[str, int] = field(default_factory=dict)

    @property
    def grouped(self) -> bool:
        """Groups of several channels each (ResNeXt's, RegNet's): the block-diagonal K loop."""
        return self.groups > 1 and not self.depthwise

    @property
    def gathers(self) -> dict[int, ResizeGather]:
        """The epilogue's inputs that are Resizes gathered from their input (fusion/resize.py),
        by their place in `extra`."""
        return {i: g for i, x in enumerate(self.extra) if isinstance(g := self.views.get(x), ResizeGather)}

    @property
    def tap(self) -> TapInput:
        pad = self.pad
        padding = pad_geometry(self.graph, pad, pad.outputs[0] == self.anchor.inputs[0]) if pad else None
        return TapInput(self.p, padding, self.x_stride, self.x_offset)

    @property
    def args(self) -> list[str]:
        if self.ops:
            first = [f"xo{i}" for i in range(len(self.op_loads))]
        else:
            first = [f"xp{i}" for i in range(len(self.pieces))] if self.pieces else ["x"]
        return (
            first
            + ["w"]
            + [f"pc{j}" for j in range(len(self.act_consts))]
            + (["xs", "ws"] if self.sx_name else [])
            + (["sc"] if self.scale else [])
            + (["dw"] if self.dw_w else [])
            + (["db"] if self.dw_b else [])
            + [f"in{i}" for i in range(len(self.extra))]
            + [f"cat{i}" for i in range(len(self.copied))]
            + [f"out{i}" for i in range(len(self.outputs))]
        )

    @property
    def largest_offset(self) -> int:
        """The largest element offset the kernel computes: its input's, its output's (or the
        Concat's it writes) and those of the tensors it copies into the Concat."""
        p, graph = self.p, self.graph
        cat_width = graph.spec(self.concat.outputs[0]).shape[3] if self.concat is not None else self.n
        cat_bases = [graph.spec(self.views[x].base if x in self.views else x).numel for x in self.copied]
        x_extent = graph.spec(self.x_base).numel if self.x_base else p["N"] * p["H"] * p["W"] * p["C"]
        windows = [graph.spec(self._buffer(x)).numel for x in self.extra]  # windows of wider buffers
        return max(x_extent, self.m * cat_width, *cat_bases, *windows)

    def _buffer(self, name: str) -> str:
        """The buffer an epilogue input is loaded from: the wider one behind a channel window."""
        view = self.views.get(name)
        return view.base if isinstance(view, StridedView) else name

    @property
    def tensor_inputs(self) -> list[str]:
        gathers = self.gathers
        if self.ops:
            first = [self.views[x].base if x in self.views else x for x in self.op_loads]
        else:
            first = [v for v, _, _ in self.pieces] if self.pieces else [self.x_base or self.x_name]
        return [
            *first,
            self.w_name,
            *self.act_consts,
            *([self.sx_name, self.sw_name] if self.sx_name else []),
            *([self.scale] if self.scale else []),
            *(v for v in (self.dw_w, self.dw_b) if v),
            *(gathers[i].base if i in gathers else self._buffer(x) for i, x in enumerate(self.extra)),
            *(self.views[x].base if x in self.views else x for x in self.copied),
        ]


def _split_parts(graph: Graph, split: Node, epilogue: list[Node]) -> dict[str, tuple[int, int]]:
    """A Split of the output channels: each part, or the last op of the chain after it, is stored
    from its own columns of the tile; a tensor of the part's shape that the chain reads besides
    (a residual) is loaded at the part's own elements, its columns less the part's first."""
    parts: dict[str, tuple[int, int]] = {}
    at = 0
    for o, size in zip(split.outputs, graph.constants[split.inputs[1]].tolist(), strict=True):
        parts[o], at = (at, int(size)), at + int(size)
    for node in epilogue:
        part = next((parts[x] for x in node.inputs if x in parts), None)
        if part is None:
            continue
        shape = graph.spec(node.outputs[0]).shape
        for x in node.inputs:
            if x and x not in parts and graph.spec(x).shape == shape:
                parts[x] = part  # a side input of the part's shape (a constant too)
        parts[node.outputs[0]] = part
    return parts


def _read_prologue(cv: NhwcConv) -> None:
    prologue, graph = cv.prologue, cv.graph
    if prologue and prologue[0].op_type in (NHWC_CONV, *NHWC_POOLS.values()):
        cv.window = prologue[0]
        cv.x_name = cv.window.inputs[0]
        if cv.window.op_type == NHWC_CONV:
            cv.dw_w = cv.window.inputs[1]
            cv.dw_b = cv.window.inputs[2] if len(cv.window.inputs) > 2 else ""
    elif prologue and prologue[0].op_type == "Concat":
        concat = prologue[0]
        cv.x_name, at = "", 0
        for x in concat.inputs:
            if x:
                channels = int(graph.spec(x).shape[3])
                cv.pieces.append((x, at, channels))
                at += channels
        cv.act = prologue[1:]
        cv.act_consts = list(
            dict.fromkeys(
                x for n in cv.act for x in n.inputs if x in graph.constants and graph.constants[x].size > 1
            )
        )
    elif prologue and prologue[0].op_type in ("Pad", "Transpose"):
        # Pad (NCHW) -> Transpose to NHWC -> conv: the kernel reads the unpadded NCHW tensor, the
        # padded pixel mapped to the one it copies (reflect, edge) or filled (constant); an NHWC
        # Pad -> conv the same, of the unpadded NHWC tensor. The Transpose alone
        # (layout_prologue): the kernel reads the NCHW tensor, a plane a channel.
        cv.pad = prologue[0]
        cv.x_name = cv.pad.inputs[0]
    elif prologue and (len(prologue) > 1 or input_scale_reason(graph, prologue[0], cv.anchor) is not None):
        # Pointwise ops computing the input (an input scale is one Mul the template folds itself).
        cv.ops, cv.x_name = list(prologue), ""
        made = {o for n in prologue for o in n.outputs}
        reads = list(dict.fromkeys(x for n in prologue for x in n.inputs if x and x not in made))
        cv.op_literals, cv.op_loads = split_literals(graph, reads)
    elif prologue:
        cv.x_name, cv.scale = input_scale_operands(graph, prologue[0], cv.anchor)
        s_shape = graph.spec(cv.scale).shape
        terms = ([f"img[:, None] * {s_shape[3]}"] if s_shape[0] != 1 else []) + (
            ["ci[None, :]"] if s_shape[3] != 1 else []
        )
        cv.scale_index = " + ".join(terms) or "0"
    # A pool before any conv but a plain 1x1 one (wider, strided or padded: its pixels are not the
    # pool's), or whose output others read too (the conv then stores it, from its centre tap), is
    # computed in the template's own loops; before a plain 1x1 conv, in the window prologue's.
    anchor, p = cv.anchor, cv.p
    cv.pool_out = anchor.inputs[0] if cv.window is not None and anchor.inputs[0] in cv.outputs else ""
    cv.centre = centre_tap(graph, anchor) if cv.pool_out else None
    window = (p["KH"], p["KW"], p["SH"], p["SW"], p["PH"], p["PW"])
    plain = window == (1, 1, 1, 1, 0, 0) and (p["OH"], p["OW"]) == (p["H"], p["W"])
    cv.pooled = (
        cv.window is not None
        and cv.window.op_type in NHWC_POOLS.values()
        and (not plain or bool(cv.pool_out))
    )


def _read_loads(cv: NhwcConv, inputs: list[str]) -> None:
    """The literals and the tensors the epilogue loads: not those only the loops read."""
    epilogue_reads = {x for node in cv.epilogue for x in node.inputs if x}
    split_sizes = {cv.split.inputs[1]} if cv.split is not None else set()
    pad_operands = set(cv.pad.inputs[1:]) if cv.pad is not None else set()
    loop_operands = {cv.x_name, cv.w_name, cv.sx_name, cv.sw_name, cv.scale, cv.dw_w, cv.dw_b}
    loop_operands |= {v for v, _, _ in cv.pieces} | set(cv.act_consts) | set(cv.op_loads)
    loop_operands |= {o for n in cv.ops for o in n.outputs}
    operands_only = {*loop_operands, *cv.copied, *split_sizes, *pad_operands} - {""} - epilogue_reads
    tensors = {cv.b_name} - {""}
    cv.literals, extra = split_literals(cv.graph, inputs, skip=operands_only, tensors=tensors)
    cv.extra = [e for e in extra if e not in (cv.scale, cv.dw_w, cv.dw_b)]


def _read_loop_form(cv: NhwcConv) -> None:
    """Which K loop the kernel runs (codegen/conv.py writes each)."""
    graph = cv.graph
    # Few input channels (a network's first layer): one flat K loop, cin = k % C. Otherwise a loop
    # over the KH*KW window positions, each reading contiguous blocks of channels (the window
    # prologue has its own loop over channel blocks).
    cv.flat = cv.p["C"] < FLAT_CONV_CHANNELS and cv.window is None and not cv.pieces and not cv.grouped
    window_loop = not (
        cv.depthwise or cv.grouped or cv.flat or cv.pieces or (cv.window is not None and not cv.pooled)
    )
    if window_loop and cv.w_name in graph.constants and not cv.pool_out:
        cv.segments = tap_segments(graph.constants[cv.w_name])
    # Split-K (a tuning choice): the plain window loop, and a shortcut's second loop after it (each
    # split among the programs of a tile); none of the forms with loops of their own (prologues,
    # zero weight segments).
    cv.splittable = (
        not (cv.depthwise or cv.grouped or cv.flat or cv.segments or cv.pooled or cv.pieces)
        and cv.window is None
        and "split_k" not in graph.disabled
    )


def nhwc_conv(
    anchor: Node,
    epilogue: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    precision: str,
    prologue: list[Node],
    views: dict[str, Any],
) -> NhwcConv:
    """The group of an `opfuse.ConvNHWC` anchor, read for its template."""
    p = conv_params(graph, anchor)
    # A channel Concat the kernel writes: its result at its offset, the other inputs copied.
    concat = next((node for node in epilogue if node.op_type == "Concat"), None)
    epilogue = [node for node in epilogue if node is not concat]
    split = next((node for node in epilogue if node.op_type == "Split"), None)
    epilogue = [node for node in epilogue if node is not split]
    tail = epilogue[-1] if epilogue and epilogue[-1].op_type in NHWC_POOLS.values() else None
    epilogue = epilogue[:-1] if tail is not None else epilogue
    depthwise = is_depthwise(graph, anchor)
    groups = int(anchor.attrs.get("group", 1))
    cv = NhwcConv(
        graph=graph,
        anchor=anchor,
        prologue=prologue,
        epilogue=epilogue,
        outputs=outputs,
        views=views,
        p=p,
        prec=dot_precision(graph.spec(anchor.inputs[0]).dtype, precision),
        depthwise=depthwise,
        groups=groups,
        m=p["N"] * p["OH"] * p["OW"],
        n=p["CO"],
        k=p["C"] // groups * p["KH"] * p["KW"],  # a weight row: its group's channels at each tap
        x_name=anchor.inputs[0],
        w_name=anchor.inputs[1],
        b_name=anchor.inputs[2] if len(anchor.inputs) > 2 and anchor.inputs[2] else "",
        concat=concat,
        split=split,
        parts=_split_parts(graph, split, epilogue) if split is not None else {},
    )
    if tail is not None:
        if concat is not None or split is not None or depthwise or has_shortcut(anchor):
            raise ValueError(
                "a pool on the output tile needs a plain conv: no Concat, Split, shortcut or depthwise"
            )
        cv.tail, cv.tail_p = tail, pool_params(graph, tail)
        tp = cv.tail_p
        cv.m = p["N"] * tp["OH"] * tp["OW"] * tp["KH"] * tp["KW"]
    if has_shortcut(anchor):
        cv.sx_name, cv.sw_name = anchor.inputs[3], anchor.inputs[4]
    if concat is not None:
        made = {anchor.outputs[0], *(o for node in epilogue for o in node.outputs)}
        cv.copied = list(dict.fromkeys(x for x in concat.inputs if x and x not in made))
    _read_prologue(cv)
    _read_loads(cv, inputs)
    _read_loop_form(cv)
    _read_channel_window(cv)
    if cv.tail is not None and cv.gathers:
        raise ValueError("a pool on the output tile with a gathered input")
    return cv


def _read_channel_window(cv: NhwcConv) -> None:
    """x read in place as a window of a wider NHWC buffer's channels, where the group folded its
    layout ops (a channel Split between the channels-last region's Transposes). The window, flat
    and depthwise loops' pixel offsets take the buffer's channel count (`TapInput.pixel_stride`);
    the other loop forms address x as a buffer of its own, and the planner folds no such input
    for them."""
    view = cv.views.get(cv.anchor.inputs[0])
    if not isinstance(view, StridedView) or not (xc := view.channel_window()):
        return  # no view, or another (a Concat's copied input): x is read as a buffer of its own
    if cv.x_name != cv.anchor.inputs[0] or cv.grouped or cv.pooled or cv.ops:
        raise ValueError("a channel window of a wider buffer as the input of a conv with its own input loop")
    cv.x_base, cv.x_stride, cv.x_offset = view.base, xc, int(view.offset)
