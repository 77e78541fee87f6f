"""`pad_prologue`: an anchor's template reads through the Pad before it.

Applied inside the anchor rule (anchor_epilogue.py) to an NHWC conv without an input scale: the
Pad that only the conv reads (an NHWC Pad, or an NCHW Pad then the region's Transpose to NHWC)
becomes the conv's prologue, and the template maps each padded pixel to the one it copies
(reflect, edge) or fills (constant). Refused, with the reason, where the template cannot read
through that Pad.

`layout_prologue` (`input_transpose`) is the same read without a Pad: the region's Transpose of
an NCHW tensor that only the conv reads (the image, at a network's stem) is no copy; the template
reads the NCHW tensor, a plane a channel.
"""

from __future__ import annotations

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.fusion.views import VIEW_THROUGH
from opfuse.graph import Graph, Node
from opfuse.ir.ops import FLAT_CONV_CHANNELS, NHWC_CONV, is_depthwise
from opfuse.ir.support import PAD_MODES, pad_per_dim, spatial_pad_reason
from opfuse.passes.rules import NotFired, node_label

PAD_RULE = names.PAD_PROLOGUE


def input_pad(
    graph: Graph,
    conv: Node,
    taken: set[str],
    producers: dict[str, Node],
    consumers: dict[str, list[Node]],
    not_fused: list[NotFired],
) -> list[Node]:
    """The Pad before an NHWC conv, read by nothing else: the conv template reads the unpadded
    tensor, each padded pixel mapped to the one it copies (reflect, edge) or filled (constant).
    Either an NHWC Pad (of a value already channels-last: passes/layout.py), read by any NHWC
    conv, depthwise too; or an NCHW Pad, then the region's Transpose to NHWC, read by a dense or
    grouped conv a plane a channel. Reflection padding before every 3x3 conv is how image-to-image
    generators and segmentation heads keep their borders, and TResNet's blur pools theirs."""
    direct = producers.get(conv.inputs[0]) if conv.op_type == NHWC_CONV else None
    t = (
        None
        if direct is not None and direct.op_type == "Pad"
        else _region_transpose(graph, conv, taken, producers, consumers)
    )
    pad = direct if t is None else producers.get(t.inputs[0])  # an NHWC Pad: the conv's input itself
    if pad is None or pad.op_type != "Pad":
        return []
    reader, reads = (conv, [pad]) if t is None else (t, [pad, t])
    if pad.id in taken or pad.outputs[0] in {o.name for o in graph.outputs}:
        return []
    if [c.id for c in consumers.get(pad.outputs[0], [])] != [reader.id]:
        return []
    why = pad_prologue_reason(graph, pad, nhwc=reader is conv)
    if why is not None:
        not_fused.append(NotFired(PAD_RULE, [node_label(pad), node_label(conv)], why))
        return []
    return reads


def input_transpose(
    graph: Graph,
    conv: Node,
    taken: set[str],
    producers: dict[str, Node],
    consumers: dict[str, list[Node]],
) -> list[Node]:
    """The region's Transpose to NHWC before a conv of few input channels (its flat K loop), of a
    computed or input 4-D NCHW tensor, read by nothing else (layout_prologue): the conv template
    reads the NCHW tensor in place, a plane a channel, and the Transpose is no copy. Every
    channels-last network's stem reads the image so."""
    t = _region_transpose(graph, conv, taken, producers, consumers)
    if t is None or t.inputs[0] in graph.constants:
        return []
    if graph.spec(conv.inputs[0]).shape[3] >= FLAT_CONV_CHANNELS:
        # Wider inputs are read a channel block at a time, contiguous in NHWC only: the copy
        # pays for itself there. A first layer's flat K loop gathers a few channels either way.
        return []
    source = producers.get(t.inputs[0])
    if source is not None and source.op_type in VIEW_THROUGH:
        # A view (a channel part of a Split, often of an NHWC buffer turned back): read where it
        # lies (anchor_epilogue's channel window) or copied once, never made NCHW for this read.
        return []
    return [t]


def _region_transpose(
    graph: Graph,
    conv: Node,
    taken: set[str],
    producers: dict[str, Node],
    consumers: dict[str, list[Node]],
) -> Node | None:
    """The region's Transpose to NHWC that makes a dense or grouped NHWC conv's input, with no
    other reader (the depthwise template loads channels as the contiguous axis: not for it)."""
    if conv.op_type != NHWC_CONV or is_depthwise(graph, conv):
        return None
    t = producers.get(conv.inputs[0])
    if t is None or t.op_type != "Transpose" or t.id in taken:
        return None
    if [int(a) for a in t.attrs.get("perm", ())] != [0, 2, 3, 1]:
        return None
    if t.outputs[0] in {o.name for o in graph.outputs}:
        return None
    return t if [c.id for c in consumers.get(t.outputs[0], [])] == [conv.id] else None


def pad_prologue_reason(graph: Graph, pad: Node, nhwc: bool = False) -> str | None:
    """None if a conv's input tiles can be read through this Pad (NCHW, or `nhwc`), else why not."""
    mode = str(pad.attrs.get("mode", "constant"))
    x = graph.spec(pad.inputs[0])
    if mode not in PAD_MODES:
        return f"Pad mode {mode!r}: the conv reads through constant, reflect and edge padding"
    if len(x.shape) != 4:
        return "not a 4-D Pad"
    why = spatial_pad_reason(graph, pad, nhwc)
    if why is not None:
        return why
    per_dim = pad_per_dim(graph, pad)
    assert per_dim is not None
    if mode == "reflect" and any(max(per_dim[a]) >= x.shape[a] for a in ((1, 2) if nhwc else (2, 3))):
        return "a reflection wider than the image"
    if len(pad.inputs) > 2 and pad.inputs[2]:
        value = graph.constants.get(pad.inputs[2])
        if value is None or value.size != 1 or not np.isfinite(np.asarray(value, dtype=np.float64)).all():
            return "the pad value is not a finite constant"
    return None
