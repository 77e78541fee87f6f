"""Triton source for a row group: reductions over one run of axes with their prologue and epilogue.

A row group's iteration space is the reduced input's shape viewed as (outer, R, inner): R is the
product of the reduced axes, inner of the axes after them. Three layouts:

- trailing (inner == 1): one program per row of R contiguous elements, held in registers;
- strided (inner > 1, e.g. Softmax over channels of NCHW, mean over H, W of NHWC): one program per
  (outer, block of inner) holds an R × BLOCK_I tile and reduces down its columns (stride inner);
- groups (GroupNormalization): [N, C, *S] viewed as N·G rows of C/G·S contiguous elements, the
  per-channel parameters indexed by channel = g·C/G + col // S.

The program runs the pointwise prologue, any number of reductions (Softmax, LogSoftmax,
LayerNormalization, RMSNormalization, InstanceNormalization, GroupNormalization, ReduceMean/Sum/Max/Min,
ReduceL1/L2/SumSquare,
GlobalAverage/MaxPool), and the pointwise epilogue, with one load of each input and one store of
each output. Values are either full (the row space's shape) or reduced (one per row or column).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opfuse.codegen.emitters import EMITTERS
from opfuse.codegen.epilogue import TileRead, computed_a_tile, dot_precision, folded_row_coords, k_loop
from opfuse.codegen.fragments import (
    KernelSource,
    concat_comments,
    concat_parts,
    module_imports,
    module_title,
    node_comment,
    part_lanes,
    row_input_index,
    split_literals,
)
from opfuse.codegen.index_map import index_map_load, table_args
from opfuse.codegen.resize import resize_load
from opfuse.codegen.select import emit_concat
from opfuse.codegen.source import SourceBuffer, channel_run, float_literal, guarded_load, power_run
from opfuse.codegen.window import PoolTaps, Window
from opfuse.graph import Graph, Node
from opfuse.ir.index_map import IndexMap
from opfuse.ir.ops import NHWC_CONV, NHWC_POOLS, ROW_REDUCTIONS, is_depthwise
from opfuse.ir.queries import next_pow2, scalar_constant
from opfuse.ir.resize import ResizeGather
from opfuse.ir.rows import TILE, RowSpace, is_item_space, row_head, row_space
from opfuse.ir.support import conv_params, gemm_dims, pool_params

NEG_INF = 'float("-inf")'


def rows_per_program(rows: int, block: int, elements: int) -> int:
    """Rows of a trailing row kernel per program for a tile of about `elements` (a power of two),
    never more rows than there are."""
    return max(1, min(next_pow2(rows), elements // block))


def _prod(dims: tuple[int, ...] | list[int]) -> int:
    return int(np.prod(dims, dtype=np.int64))


def _view_row_expr(view: Any, full: tuple[int, ...], split: int | None) -> str:
    """Row `row`'s elements in the buffer behind a folded layout view: the row dims at the view's
    strides, the row itself one run at its last dim's step (`cols`, contiguous where that is 1),
    from the view's offset."""
    k = len(full) - 1 if split is None else split
    row_strides = [_prod(full[d + 1 : k]) for d in range(k)]
    terms = [str(view.offset)] if view.offset else []
    for d in range(k):
        if full[d] == 1:
            continue
        coord = _coord("row", row_strides[d], full[d])
        terms.append(f"{coord} * {view.strides[d]}" if view.strides[d] != 1 else coord)
    step = view.strides[-1]
    return " + ".join([*terms, f"cols * {step}" if step != 1 else "cols"])


def _coord(var: str, div: int, size: int) -> str:
    return f"(({var} // {div}) % {size})" if div > 1 else f"({var} % {size})"


def _tiled_input_expr(shape: tuple[int, ...], space: RowSpace) -> tuple[str | None, str | None]:
    """(index expression, mask) of an input broadcast to a strided row space: `outer` indexes the
    leading dims, `rr` ([BLOCK_R, 1]) the reduced ones, `ii` ([1, BLOCK_I]) the trailing ones."""
    full, rank = space.full, len(space.full)
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    strides = [_prod(padded[d + 1 :]) for d in range(rank)]
    terms: list[str] = []
    used: list[str] = []
    for lo, hi, var in ((0, space.first, "outer"), (space.first, space.end, "rr"), (space.end, rank, "ii")):
        live = [d for d in range(lo, hi) if padded[d] != 1]
        if not live:
            continue
        used.append(var)
        if padded[lo:hi] == full[lo:hi]:  # the whole block: one flat index into it
            terms.append(f"{var} * {strides[hi - 1]}" if strides[hi - 1] != 1 else var)
            continue
        for d in live:
            coord = _coord(var, _prod(full[d + 1 : hi]), full[d])
            terms.append(f"{coord} * {strides[d]}" if strides[d] != 1 else coord)
    mask = {("rr", "ii"): "mask", ("rr",): "rmask", ("ii",): "imask"}.get(
        tuple(v for v in used if v != "outer")
    )
    return (" + ".join(terms) if terms else None), mask


def _group_input_expr(shape: tuple[int, ...], space: RowSpace) -> tuple[str | None, bool]:
    """(index expression, is_vector) of an input broadcast to [N, C, *S] read as N·G rows."""
    full, rank, g = space.full, len(space.full), space.groups
    cpg, s = full[1] // g, _prod(full[2:])
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    strides = [_prod(padded[d + 1 :]) for d in range(rank)]
    if padded == full:
        return f"row * {space.r} + cols", True
    terms = []
    if padded[0] != 1:
        terms.append(f"(row // {g}) * {strides[0]}")
    if padded[1] != 1:
        channel = f"((row % {g}) * {cpg} + cols // {s})" if s > 1 else f"((row % {g}) * {cpg} + cols)"
        terms.append(f"{channel} * {strides[1]}" if strides[1] != 1 else channel)
    if padded[2:] == full[2:] and s > 1:
        terms.append(f"(cols % {s}) * {strides[-1]}" if strides[-1] != 1 else f"(cols % {s})")
    else:
        for d in range(2, rank):
            if padded[d] != 1:
                coord = _coord(f"(cols % {s})", _prod(full[d + 1 :]), full[d])
                terms.append(f"{coord} * {strides[d]}" if strides[d] != 1 else coord)
    if not terms:
        return None, False
    return " + ".join(terms), any("cols" in t for t in terms)


def _depthwise_tile(
    buf: SourceBuffer,
    graph: Graph,
    dw: Node,
    ptr: dict[str, str],
    tiled: bool,
    concat: Node | None = None,
    whole: bool = False,
) -> None:
    """The depthwise conv's (or pool's) output on the tile, rounded to the model's type as the
    stored output would be (fp32 multiply-adds over the window; a pool's maximum or average as
    `PoolTaps` computes it for the pool template). Tiled (a reduction over H, W): image `outer`,
    pixels `rr`, channels `ii`. Trailing (a LayerNorm over the channels): pixels `row` (image,
    height, width flattened), channels `cols`. `whole` (a norm over each image): image `row`, its
    pixels and channels flattened along `cols`. `concat`: the conv's input is that channel Concat
    (RDNet's dense features), each channel loaded from the part that holds it (the others masked
    off)."""
    pool = PoolTaps.of(graph, dw) if dw.op_type in NHWC_POOLS.values() else None
    d = pool_params(graph, dw) if pool is not None else conv_params(graph, dw)
    win = Window.of(d)
    taps = win.taps
    # (pointer, first channel, channels) of each input the taps load from
    sources = concat_parts(graph, concat)[1] if concat is not None else [(dw.inputs[0], 0, d["C"])]
    parts = [(ptr[v], first, width) for v, first, width in sources]
    x = parts[0][0]
    if tiled:
        img, pixel, chan, tile, chan_ok = "outer", "rr", "ii", "(BLOCK_R, BLOCK_I)", "imask"
    elif whole:
        img, pixel, chan, tile, chan_ok = "row", "pix", "chn", "(BLOCK_M, BLOCK_R)", "cmask"
        buf.line(f"pix = cols // {d['C']}")
        buf.line(f"chn = cols % {d['C']}")
    else:
        img, pixel, chan, tile, chan_ok = "img", "row", "cols", "(BLOCK_M, BLOCK_R)", f"(cols < {d['C']})"
        buf.line(f"img = row // {d['OH'] * d['OW']}")
    buf.line(f"oh = ({pixel} // {d['OW']}) % {d['OH']}" if not tiled else f"oh = {pixel} // {d['OW']}")
    buf.line(f"ow = {pixel} % {d['OW']}")
    if pool is not None:
        assert not tiled, "a pool on a strided row tile"
        pool.emit_start(buf, "dacc", "BLOCK_R", "dcount", tile)
    else:
        buf.line(f"dacc = tl.zeros({tile}, dtype=tl.float32)")
    fill = pool.fill if pool is not None else "0.0"
    buf.line(f"for t in tl.static_range(0, {taps}):")
    with buf.indent():
        win.emit_tap(buf, win.origin("oh", "ow"), "t", "mask" if tiled else "cmask", ("ih", "iw", "ok"))
        pixel_at = f"(({img} * {d['H']} + ih) * {d['W']} + iw)"
        loads = []
        for p, first, width in parts:
            if len(parts) == 1:
                loads.append(f"tl.load({p} + {pixel_at} * {width} + {chan}, mask=ok, other={fill})")
                continue
            local, held = part_lanes(chan, first, width, d["C"])
            mask = f"ok & {held}" if held else "ok"
            loads.append(
                f"tl.load({p} + {pixel_at} * {width} + {local}, mask={mask}, other=0.0).to(tl.float32)"
            )
        buf.line(f"xv = {' + '.join(loads)}")
        if pool is not None:
            pool.emit_tap(buf, "dacc", "xv", "dcount", "ih", "iw")
        else:
            buf.line(f"wv = tl.load({ptr[dw.inputs[1]]} + {chan} * {taps} + t, mask={chan_ok}, other=0.0)")
            buf.line("dacc = dacc + xv.to(tl.float32) * wv.to(tl.float32)")
    if pool is not None:  # lanes off the tile (no tap counted, or every tap -inf) hold 0
        pool.emit_mean(buf, "dacc", "dcount")
        buf.line(f"dacc = tl.where({chan_ok}, dacc, 0.0)")
    elif len(dw.inputs) > 2 and dw.inputs[2]:
        buf.line(
            f"dacc = dacc + tl.load({ptr[dw.inputs[2]]} + {chan}, mask={chan_ok}, other=0.0).to(tl.float32)"
        )
    buf.line(f"dwv = dacc.to({x}.dtype.element_ty).to(tl.float32)")


def _gemm_tile(
    buf: SourceBuffer,
    graph: Graph,
    mm: Node,
    ptr: dict[str, str],
    precision: str,
    a_ops: list[Node],
    a_loads: list[str],
    a_literals: dict[str, str],
    views: dict[str, Any],
    strided: tuple[int, int] | None = None,
) -> None:
    """The GEMM's output on the tile, rounded to the model's type as the stored product would be:
    A's rows [M, K] times B [K, N] (or [N, K], Gemm's transB), BLOCK_K at a time, into a float32
    accumulator. The trailing layout's tile is BLOCK_M rows `row` by all N columns `cols` (a
    reduction over the columns); the `strided` one's ((R, INNER)) is the R rows of item `outer`
    (`rr`: an image's pixels, a sequence's tokens) by BLOCK_I columns `ii` (a reduction over those
    rows). With `a_ops`, A's tiles are computed by those pointwise ops from `a_loads` (read
    through `views` where folded) instead of loaded. A dense NHWC conv (the implicit GEMM of
    ir.support.gemm_dims) loads A through its window and adds its bias."""
    m, n, k, trans_b = gemm_dims(graph, mm)
    b = ptr[mm.inputs[1]]
    sbk, sbn = (1, k) if trans_b else (n, 1)
    conv = mm.op_type == NHWC_CONV
    if strided is not None:  # rows of one item, a block of columns: the tile `rr` x `ii`
        r, inner = strided
        buf.line(f"rm = outer * {r} + tl.arange(0, BLOCK_R)")
        buf.line(f"rn = (pid % (({inner} + BLOCK_I - 1) // BLOCK_I)) * BLOCK_I + tl.arange(0, BLOCK_I)")
        buf.line("rk = tl.arange(0, BLOCK_K)")
        buf.line("acc = tl.zeros((BLOCK_R, BLOCK_I), dtype=tl.float32)")
    else:
        buf.line("rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)")
        buf.line("rn = tl.arange(0, BLOCK_R)")
        buf.line("rk = tl.arange(0, BLOCK_K)")
        buf.line("acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)")
    d = conv_params(graph, mm) if conv else {}
    window = conv and not _pixelwise(d)
    if window:
        buf.line(f"img = (rm // {d['OH'] * d['OW']})[:, None]")
        buf.line(f"oh = ((rm // {d['OW']}) % {d['OH']})[:, None]")
        buf.line(f"ow = (rm % {d['OW']})[:, None]")

    def a_tile() -> None:
        if a_ops:
            a_shape = tuple(graph.spec(mm.inputs[0]).shape)
            coords = folded_row_coords(a_shape, "rm[:, None]")
            coords[len(a_shape) - 1] = "kk[None, :]"
            buf.line(f"a_ok = (rm[:, None] < {m}) & (kk[None, :] < {k})")
            pointers = [ptr[x] for x in a_loads]
            computed_a_tile(
                buf, graph, a_ops, mm.inputs[0], a_loads, pointers, a_literals, a_shape, coords, views,
                f"{b}.dtype.element_ty",
            )  # fmt: skip
            return
        if window:
            _window_a_tile(buf, d, ptr[mm.inputs[0]], m, k)
            return
        a_ok = f"(rm[:, None] < {m}) & (kk[None, :] < {k})"
        a_at = f"rm[:, None] * {k} + kk[None, :]"
        buf.line(f"a_tile = {guarded_load(ptr[mm.inputs[0]], a_at, a_ok, run=power_run(k))}")

    b_tile = TileRead.strided(b, sbk, sbn)
    if conv and int(mm.attrs.get("group", 1)) > 1:
        b_tile, k = _block_diagonal(d, int(mm.attrs["group"]), b)
    k_loop(buf, k, n, b_tile, dot_precision(graph.spec(mm.inputs[0]).dtype, precision), a_tile)
    if conv and len(mm.inputs) > 2 and mm.inputs[2]:
        bias = ptr[mm.inputs[2]]
        buf.line(f"acc = acc + tl.load({bias} + rn, mask=rn < {n}, other=0.0).to(tl.float32)[None, :]")
    rounded = b if a_ops else ptr[mm.inputs[0]]  # the model's type (A's, where A is loaded)
    buf.line(f"gmv = acc.to({rounded}.dtype.element_ty).to(tl.float32)")


def _on_tiles_gemm(graph: Graph, node: Node) -> bool:
    """A GEMM the row kernel computes on its tiles: a MatMul, a Gemm or an NHWC conv (a depthwise
    conv is a window of its own, `_depthwise_tile`)."""
    if node.op_type == NHWC_CONV:
        return not is_depthwise(graph, node)
    return node.op_type in ("MatMul", "Gemm")


def _block_diagonal(d: dict[str, int], groups: int, w: str) -> tuple[TileRead, int]:
    """A grouped conv's weight read as the dense one it stands for: K spans every input channel
    of every tap, and B's entry for input channel c and output channel n is the weight where both
    are of the same group, 0 elsewhere (the tile multiplies `groups` times the products it needs;
    tuning weighs that against the library's grouped conv). `d`: the conv's `conv_params`.
    Returns B's read and the dense K."""
    cg, og = d["C"] // groups, d["CO"] // groups
    taps = d["KH"] * d["KW"]
    c = f"(kk[:, None] % {d['C']})"
    offset = f"rn[None, :] * {taps * cg} + (kk[:, None] // {d['C']}) * {cg} + {c} % {cg}"
    return TileRead(w, offset, mask=f"({c} // {cg} == rn[None, :] // {og})"), taps * d["C"]


def _pixelwise(d: dict[str, int]) -> bool:
    """A 1x1 conv of stride 1, unpadded (`d`: its `conv_params`): a GEMM of the NHWC buffer as it
    lies ([pixels, C])."""
    geometry = (d["KH"], d["KW"], d["SH"], d["SW"], d["PH"], d["PW"])
    return geometry == (1, 1, 1, 1, 0, 0) and (d["H"], d["W"]) == (d["OH"], d["OW"])


def _window_a_tile(buf: SourceBuffer, d: dict[str, int], x: str, m: int, k: int) -> None:
    """A conv's A tile (im2col, never written): for output pixel `rm` (its `img`, `oh`, `ow`) and
    K index `kk` = (kh * KW + kw) * C + c, the input at the tap's pixel, zero outside the image."""
    c, win = d["C"], Window.of(d)
    buf.line(f"tap = (kk // {c})[None, :]")
    ih, iw = win.tap(win.origin("oh", "ow"), "tap")
    buf.line(f"ih = {ih}")
    buf.line(f"iw = {iw}")
    buf.line(f"a_ok = (rm[:, None] < {m}) & (kk[None, :] < {k}) & {win.inside('ih', 'iw')}")
    at = f"((img * {d['H']} + ih) * {d['W']} + iw) * {c} + (kk % {c})[None, :]"
    buf.line(f"a_tile = {guarded_load(x, at, 'a_ok', run=channel_run(c))}")


def _gather_tile(buf: SourceBuffer, graph: Graph, gather: Node, ptr: dict[str, str], j: int) -> str:
    """The looked-up rows on the tile, `gt{j}`: each row's index (negative ones count from the end,
    those out of range clamped into the table, as the library's Gather does on a GPU; the CPU
    checks them before the launch: INDEX_CHECKS), then that row of the table across `cols`."""
    table, ids = ptr[gather.inputs[0]], ptr[gather.inputs[1]]
    v, n = graph.spec(gather.inputs[0]).shape
    buf.line(f"gid{j} = tl.load({ids} + row, mask=rowmask, other=0).to(tl.int64)")
    buf.line(f"gid{j} = tl.where(gid{j} < 0, gid{j} + {v}, gid{j})")
    buf.line(f"gid{j} = tl.minimum(tl.maximum(gid{j}, 0), {v - 1})")
    buf.line(f"gt{j} = tl.load({table} + gid{j} * {n} + cols, mask=cmask, other=0.0).to(tl.float32)")
    return f"gt{j}"


@dataclass
class _RowKernel:
    """One row group as the template writes it: its row space, layout and loads."""

    graph: Graph
    nodes: list[Node]
    space: RowSpace
    tiled: bool  # the strided layout: an R x BLOCK_I tile per program
    multi: bool  # the trailing layout: BLOCK_M rows per program
    views: dict[str, Any]
    literals: dict[str, str]
    tensor_inputs: list[str]
    window: Node | None  # a depthwise conv computed on the tile
    gemm: Node | None  # or a GEMM computed on the tile, its columns the row (multi layout)
    gathers: list[Node]  # or Gathers of tables' rows, each row one row of the tile (multi layout)
    prologue_args: list[str]  # the prologue's operands: input, weight (and bias)
    # The item layout: a norm over each item (its pixels and channels), held as the strided
    # layout's R x BLOCK_I tile with every channel in one block, reduced over both axes; `space`
    # is then the tile's (outer, R pixels, inner channels) and `count` the elements per item.
    item: bool = False
    count: int = 0
    tables: dict[str, str] = field(default_factory=dict)  # index tables of IndexMap views: their args

    @property
    def n(self) -> int:
        """Elements each reduction is over: a row's, or an item's in the item layout."""
        return self.count if self.item else self.space.r

    @property
    def block(self) -> int:
        # A GEMM on a strided tile: its rows are the tile's R, and tl.dot takes at least 16.
        return (
            max(16, next_pow2(self.space.r))
            if self.tiled and self.gemm is not None
            else next_pow2(self.space.r)
        )

    @property
    def mask(self) -> str:
        return "mask" if self.item else "rmask" if self.tiled else "cmask"

    @property
    def slot(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.tensor_inputs)}

    def reduce(self, op: str, expr: str, pad: str) -> str:
        keep = ", keep_dims=True" if self.tiled or self.multi else ""
        if self.item:  # the item's channels, then its pixels
            return (
                f"{op}({op}(tl.where(mask, {expr}, {pad}), axis=1, keep_dims=True), axis=0, keep_dims=True)"
            )
        return f"{op}(tl.where({self.mask}, {expr}, {pad}), axis={1 if self.multi else 0}{keep})"


def generate_rowwise(
    kernel_id: str,
    nodes: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    group_id: str,
    full: tuple[int, ...],
    split: int | None = None,
    views: dict[str, Any] | None = None,
    prologue: list[Node] | None = None,
    precision: str = "fp32",
) -> KernelSource:
    """`views`: full-shaped inputs read through folded layout ops ({value: StridedView}), rows at
    their strides in the buffer behind them, each row contiguous there. `prologue`: the node whose
    output, the group's full-shaped input, is computed on the tile instead of loaded: a depthwise
    conv (NHWC; fusion/rules/depthwise_reduction.py) or a GEMM whose columns are the row
    (fusion/rules/gemm_reduction.py). `precision`: the job's, for a GEMM's dot."""
    views = views or {}
    space = row_space(graph, row_head(graph, nodes))
    assert space.full == tuple(full) and split in (None, -1, space.first), (full, split, space)
    tiled = space.inner > 1 and not space.groups
    # A channel Concat the depthwise conv reads (depthwise_reduction): its inputs loaded in turn.
    # (A GEMM's prologue may hold a Concat along K: computed_a_tile reads that one in parts.)
    gemm = next((n for n in prologue or [] if _on_tiles_gemm(graph, n)), None)
    # A GEMM before a norm over each item (gemm_reduction's item form): the item as pixels by
    # channels, the strided layout's tile with every channel in one block.
    item = gemm is not None and is_item_space(space)
    count = space.r
    if item:
        space, tiled = RowSpace(space.full, space.first, len(full) - 1), True
    concat = None if gemm else next((n for n in prologue or [] if n.op_type == "Concat"), None)
    prologue = [n for n in prologue or [] if n is not concat]
    first = prologue[0] if prologue else None
    # Pointwise ops computing the GEMM's A on its tiles (operand_prologue, inside gemm_reduction).
    a_ops = [n for n in prologue or [] if n is not gemm] if gemm is not None else []
    gathers = [n for n in prologue or [] if n.op_type == "Gather"]
    assert not gathers or len(gathers) == len(prologue or []), "Gathers and another prologue"
    window = first if gemm is None and not gathers else None
    assert window is None or (len(full) == 4 and (space.first, space.end) in ((1, 3), (3, 4), (1, 4))), space
    # Gathers make the rows of a trailing tile; a GEMM makes the tile of either layout (its
    # columns the row, or its rows of one item the strided tile's R).
    assert not gathers or (not tiled and not space.groups and space.first == len(full) - 1), space
    assert gemm is None or (not space.groups and (tiled or space.first == len(full) - 1)), space
    made_by_a = {o for n in a_ops for o in n.outputs}
    a_reads = [x for x in inputs if any(x in n.inputs for n in a_ops)]
    a_literals, a_loads = split_literals(graph, a_reads)
    prologue_args = list(
        dict.fromkeys(
            x for n in prologue or [] if n not in a_ops for x in n.inputs[:3] if x and x not in made_by_a
        )
    )
    prologue_args += [x for x in a_loads if x not in prologue_args]
    if concat is not None:  # the parts, not the Concat's output, which no buffer holds
        prologue_args = [
            *(x for x in concat.inputs if x),
            *(x for x in prologue_args if x != concat.outputs[0]),
        ]
    # Reduction axes are compile-time facts already in the code, not data to load.
    axes_only = {
        n.inputs[1] for n in nodes if n.op_type in ROW_REDUCTIONS and len(n.inputs) > 1 and n.inputs[1]
    }
    axes_only -= {x for n in nodes if n.op_type not in ROW_REDUCTIONS for x in n.inputs}
    # A Concat (a normalization's input) loads its inputs at offsets of their own, rows whole.
    selected = {x for n in nodes if n.op_type == "Concat" for x in n.inputs if x}
    assert not selected or not tiled, "a Concat in a row kernel over strided columns"
    literals, tensor_inputs = split_literals(
        graph, inputs, skip=axes_only, tensors=set(prologue_args) | selected
    )
    rk = _RowKernel(
        graph, nodes, space, tiled, not tiled and not space.groups, views, literals, tensor_inputs, window,
        gemm, gathers, prologue_args, item, count,
    )  # fmt: skip
    rk.tables = table_args(tensor_inputs, views)  # Gathers the loads compute (pad_gather)
    args = (
        [f"in{i}" for i in range(len(tensor_inputs))]
        + list(rk.tables.values())
        + [f"out{i}" for i in range(len(outputs))]
    )
    buf = SourceBuffer()
    _row_header(buf, rk, kernel_id, group_id, [*([concat] if concat else []), *prologue])
    if gathers:  # checked on the CPU before each launch (runtime/executor.py)
        checks = [(tensor_inputs.index(g.inputs[1]), graph.spec(g.inputs[0]).shape[0]) for g in gathers]
        buf.line(f"INDEX_CHECKS = {checks}")
    config = _row_configs(buf, rk, args)
    regs: dict[str, str] = {}
    with buf.indent():
        _row_indices(buf, rk)
        ptr = {x: f"in{tensor_inputs.index(x)}" for x in prologue_args}
        if window is not None:
            # A norm over each image (PoolFormer's): the image's pixels and channels one row.
            _depthwise_tile(buf, graph, window, ptr, tiled, concat, is_item_space(space))
            regs[window.outputs[0]] = "dwv"
        if gemm is not None:
            strided = (space.r, space.inner) if tiled else None
            _gemm_tile(buf, graph, gemm, ptr, precision, a_ops, a_loads, a_literals, views, strided)
            regs[gemm.outputs[0]] = "gmv"
            # The row nodes may read the product through a reshape (gemm_reduction): the same tile.
            regs.update(
                {
                    x: "gmv"
                    for x, v in views.items()
                    if not isinstance(v, IndexMap) and getattr(v, "base", None) == gemm.outputs[0]
                }
            )
        for j, g in enumerate(gathers):
            regs[g.outputs[0]] = _gather_tile(buf, graph, g, ptr, j)
        _row_loads(buf, rk, regs)
        regs.update(literals)
        for j, n in enumerate(nodes):
            _row_node(buf, rk, n, f"v{j}", [regs.get(x, "") if x else "" for x in n.inputs])
            regs[n.outputs[0]] = f"v{j}"
        _row_stores(buf, rk, outputs, regs)
    buf.line()
    buf.line()
    buf.line(f"def launch({', '.join(args)}, config=None):")
    with buf.indent():
        buf.line("c = CONFIG if config is None else config")
        if tiled:
            grid = '(ROWS * triton.cdiv(INNER, c["BLOCK_I"]),)'
        elif rk.multi:
            grid = '(triton.cdiv(ROWS, c["BLOCK_M"]),)'
        else:
            grid = "(ROWS,)"
        buf.line(f"fused_rowwise[{grid}]({', '.join(args)}, **c)")
    passed = [views[x].base if x in views else x for x in tensor_inputs] + list(rk.tables)
    return KernelSource(kernel_id, "rowwise", buf.getvalue(), passed, list(outputs), config)


def _row_header(
    buf: SourceBuffer, rk: _RowKernel, kernel_id: str, group_id: str, prologue: list[Node]
) -> None:
    space = rk.space
    rows, r, inner = space.outer, space.r, space.inner
    module_title(buf, f"row kernel {kernel_id} for group {group_id}.")
    if rk.tiled:
        what = f"{rows} x {inner} columns of {r} elements at stride {inner}"
    elif space.groups:
        what = f"{rows} rows of {r} elements ({space.groups} groups of channels per item)"
    else:
        what = f"{rows} rows of {r} elements"
    buf.line(f"# {len(rk.nodes) + len(prologue)} ONNX nodes over {what} (shape {list(space.full)}):")
    for n in prologue:
        if rk.gemm is not None and n is not rk.gemm:
            what = "A of the GEMM computed"
        elif rk.gemm is not None:
            what = (
                "conv (an implicit GEMM), its channels the row,"
                if n.op_type == NHWC_CONV
                else "GEMM, its columns the row,"
            )
        elif rk.gathers:
            what = "the table's rows looked up"
        elif n.op_type == "Concat":
            what = "the depthwise conv's input read from its parts"
        else:
            what = "pool" if n.op_type in NHWC_POOLS.values() else "depthwise conv"
        buf.line(node_comment(n, f"prologue: {what} on the tiles"))
    for n in rk.nodes:
        buf.line(node_comment(n))
    concat_comments(buf, rk.graph, rk.nodes, rk.slot)
    module_imports(buf)


def _row_configs(buf: SourceBuffer, rk: _RowKernel, args: list[str]) -> dict[str, Any]:
    """ROWS, R (INNER), CONFIG, INTERPRETER_CONFIG and the kernel's signature."""
    rows, r, inner, block = rk.space.outer, rk.space.r, rk.space.inner, rk.block
    buf.line(f"ROWS = {rows}")
    buf.line(f"R = {r}")
    config: dict[str, Any]
    if rk.tiled and rk.gemm is not None:
        # A GEMM on the strided tile: tl.dot's 16 columns at least, R rows; its K loop BLOCK_K at
        # a time.
        k = gemm_dims(rk.graph, rk.gemm)[2]
        upcast = rk.graph.spec(rk.gemm.inputs[0]).dtype == "bfloat16"  # as codegen/gemm.py
        bk = min(64, max(16, next_pow2(k)))
        if rk.item:  # every channel of the item in one block (tuning keeps it: ITEM_TILE)
            bi = interp_bi = max(16, next_pow2(inner))
            buf.line("ITEM_TILE = True")
        else:
            bi = max(16, min(next_pow2(inner), TILE // block))
            interp_bi = max(16, min(next_pow2(inner), (1 << 16) // block))
        config = {"BLOCK_R": block, "BLOCK_I": bi, "BLOCK_K": bk, "UPCAST": False}
        config["num_warps"] = 4 if block * bi <= 4096 else 8
        interp = {
            "BLOCK_R": block,
            "BLOCK_I": interp_bi,
            "BLOCK_K": min(256, max(16, next_pow2(k))),
            "UPCAST": upcast,
        }
        buf.line(f"INNER = {inner}")
        consts = "BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr"
    elif rk.tiled:
        # Columns are contiguous: a block of them per program keeps loads coalesced on the GPU;
        # the interpreter takes wide blocks (fewer programs to step through).
        bi = min(next_pow2(inner), max(1, TILE // block))
        config = {"BLOCK_R": block, "BLOCK_I": bi, "num_warps": 4 if block * bi <= 2048 else 8}
        interp = {"BLOCK_R": block, "BLOCK_I": min(next_pow2(inner), max(bi, (1 << 16) // block))}
        buf.line(f"INNER = {inner}")
        consts = "BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr"
    elif rk.gemm is not None:
        # A GEMM on the tile: tl.dot takes at least 16 rows; its K loop BLOCK_K at a time.
        k = gemm_dims(rk.graph, rk.gemm)[2]
        upcast = rk.graph.spec(rk.gemm.inputs[0]).dtype == "bfloat16"  # as codegen/gemm.py
        config = {"BLOCK_M": 16, "BLOCK_R": block, "BLOCK_K": min(64, max(16, next_pow2(k))), "UPCAST": False}
        config["num_warps"] = 4 if 16 * block <= 4096 else 8
        interp = {"BLOCK_M": max(16, rows_per_program(rows, block, 1 << 16)), "BLOCK_R": block}
        interp.update(BLOCK_K=min(256, max(16, next_pow2(k))), UPCAST=upcast)
        consts = "BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr"
    elif rk.multi:
        # BLOCK_M rows per program: one by default; short rows (ConvNeXt's 96 channels) may share
        # a program where the tuner measures it faster (codegen.tuning_space.rowwise_candidates).
        config = {"BLOCK_M": 1, "BLOCK_R": block, "num_warps": 4 if block <= 2048 else 8}
        interp = {"BLOCK_M": rows_per_program(rows, block, 1 << 16), "BLOCK_R": block}
        consts = "BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr"
    else:
        config = {"BLOCK_R": block, "num_warps": 4 if block <= 2048 else 8}
        interp = {"BLOCK_R": block}
        consts = "BLOCK_R: tl.constexpr"
    buf.line(f"CONFIG = {config}".replace("'", '"'))
    buf.line(f"INTERPRETER_CONFIG = {interp}".replace("'", '"'))
    buf.line()
    buf.line()
    buf.line("@triton.jit")
    buf.line(f"def fused_rowwise({', '.join(args)}, {consts}):")
    return config


def _row_indices(buf: SourceBuffer, rk: _RowKernel) -> None:
    """The program's rows (or columns and outer index) and their masks."""
    rows, r, inner = rk.space.outer, rk.space.r, rk.space.inner
    if rk.tiled:
        blocks = f"(({inner} + BLOCK_I - 1) // BLOCK_I)"
        buf.line("pid = tl.program_id(0).to(tl.int64)")
        buf.line(f"outer = pid // {blocks}")
        buf.line(f"ii = (pid % {blocks}) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]")
        buf.line("rr = tl.arange(0, BLOCK_R)[:, None]")
        buf.line(f"rmask = rr < {r}")
        buf.line(f"imask = ii < {inner}")
        buf.line("mask = rmask & imask")
    elif rk.multi:
        buf.line("row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
        buf.line("cols = tl.arange(0, BLOCK_R)[None, :]")
        buf.line(f"rowmask = row < {rows}")
        buf.line(f"cmask = (cols < {r}) & rowmask")
    else:
        buf.line("row = tl.program_id(0).to(tl.int64)")
        buf.line("cols = tl.arange(0, BLOCK_R)")
        buf.line(f"cmask = cols < {r}")


def _row_loads(buf: SourceBuffer, rk: _RowKernel, regs: dict[str, str]) -> None:
    """Each tensor input loaded once, `x{i}`, at its index in the row space."""
    graph, nodes, space, full = rk.graph, rk.nodes, rk.space, rk.space.full
    read = {x for n in nodes for x in n.inputs if x}
    selected = {x for n in nodes if n.op_type == "Concat" for x in n.inputs if x}
    selected_only = selected - {x for n in nodes if n.op_type != "Concat" for x in n.inputs if x}
    per_channel = {x for n in nodes if n.op_type == "InstanceNormalization" for x in n.inputs[1:3] if x}
    group_params = {x for n in nodes if n.op_type == "GroupNormalization" for x in n.inputs[1:3] if x}
    for i, name in enumerate(rk.tensor_inputs):
        if name in rk.prologue_args and name not in read:
            continue  # the prologue's operands only
        if name in selected_only:
            continue  # loaded by the Concat's selection
        regs[name] = f"x{i}"
        shape = graph.spec(name).shape
        if name in per_channel:  # InstanceNormalization scale/bias: one value per channel (axis 1)
            buf.line(f"x{i} = tl.load(in{i} + (row % {full[1]})).to(tl.float32)")
            continue
        if name in group_params and shape != (full[1],):  # opset 18: one value per group
            buf.line(f"x{i} = tl.load(in{i} + (row % {space.groups})).to(tl.float32)")
            continue
        if name in group_params:  # opset 21: one value per channel
            shape = (full[1],) + (1,) * (len(full) - 2)
        view = rk.views.get(name)
        if isinstance(view, ResizeGather | IndexMap):  # gathered from a Resize's input, or
            if rk.tiled:  # loaded through a Pad or a Gather (pad_gather)
                at, gather_mask = _tiled_input_expr(space.load_shape(shape), space)
            else:
                at, gather_mask = f"(row * {_prod(full[space.first :])} + cols)", "cmask"
            lines: list[str] = []
            if isinstance(view, ResizeGather):
                value = resize_load(
                    f"g{i}", f"in{i}", view, lines, "tl.int64", f"({at})", gather_mask or "cmask"
                )
            else:
                value = index_map_load(
                    f"m{i}", f"in{i}", view, lines, f"({at})", gather_mask or "cmask", rk.tables
                )
            for text in lines:
                buf.line(text)
            buf.line(f"x{i} = {value}")
            continue
        if rk.tiled:
            idx, load_mask = _tiled_input_expr(space.load_shape(shape), space)
        elif space.groups:
            idx, vector = _group_input_expr(shape, space)
            load_mask = "cmask" if vector else None
        elif name in rk.views:
            idx, load_mask = _view_row_expr(rk.views[name], full, space.first), "cmask"
        else:
            idx, vector = row_input_index(space.load_shape(shape), full, space.first)
            load_mask = "cmask" if vector else ("rowmask" if rk.multi and idx is not None else None)
        if idx is None:
            buf.line(f"x{i} = tl.load(in{i}).to(tl.float32)")
        elif load_mask:
            buf.line(f"x{i} = tl.load(in{i} + {idx}, mask={load_mask}, other=0.0).to(tl.float32)")
        else:
            buf.line(f"x{i} = tl.load(in{i} + {idx}).to(tl.float32)")


def _row_node(buf: SourceBuffer, rk: _RowKernel, n: Node, v: str, a: list[str]) -> None:
    """Node `n` as register `v`, from its inputs' registers `a`: a pointwise op, the Concat's
    selection, a reduction or a normalization over the row."""
    graph, r, reduce = rk.graph, rk.n, rk.reduce
    if n.op_type in EMITTERS:
        scalars = [scalar_constant(graph, x) if x else None for x in n.inputs]
        buf.line(f"{v} = {EMITTERS[n.op_type](a, n, scalars)}  # {n.op_type}")
    elif n.op_type == "Concat":  # the full-shaped tile: rows lie contiguous, R apart
        emit_concat(
            buf, graph, n, v, rk.slot, rk.views, "tl.int64", f"(row * {r} + cols)", "cmask", rk.tables
        )
    elif n.op_type in ("ReduceSum", "ReduceMean", "GlobalAveragePool"):
        buf.line(f"{v} = {reduce('tl.sum', a[0], '0.0')}  # {n.op_type}")
        if n.op_type != "ReduceSum":
            buf.line(f"{v} = {v} / {r}.0")
    elif n.op_type in ("ReduceL1", "ReduceL2", "ReduceSumSquare"):  # sums of |x| or x², in float32
        term = f"tl.abs({a[0]})" if n.op_type == "ReduceL1" else f"{a[0]} * {a[0]}"
        buf.line(f"{v} = {reduce('tl.sum', term, '0.0')}  # {n.op_type}")
        if n.op_type == "ReduceL2":
            buf.line(f"{v} = tl.sqrt({v})")
    elif n.op_type in ("ReduceMax", "ReduceMin", "GlobalMaxPool"):
        op, pad = ("tl.min", 'float("inf")') if n.op_type == "ReduceMin" else ("tl.max", NEG_INF)
        buf.line(f"{v} = {reduce(op, a[0], pad)}  # {n.op_type}")
    elif n.op_type in ("Softmax", "LogSoftmax"):
        buf.line(f"{v}_max = {reduce('tl.max', a[0], NEG_INF)}  # {n.op_type}")
        buf.line(f"{v}_exp = tl.exp({a[0]} - {v}_max)")
        buf.line(f"{v}_sum = {reduce('tl.sum', f'{v}_exp', '0.0')}")
        if n.op_type == "Softmax":
            buf.line(f"{v} = {v}_exp / {v}_sum")
        else:
            buf.line(f"{v} = {a[0]} - {v}_max - tl.log({v}_sum)")
    elif n.op_type == "RMSNormalization":  # x / sqrt(mean(x²) + eps) * scale, in float32
        eps = float_literal(float(n.attrs.get("epsilon", 1e-5)))
        buf.line(f"{v}_ms = {reduce('tl.sum', f'{a[0]} * {a[0]}', '0.0')} / {r}.0  # {n.op_type}")
        buf.line(f"{v} = ({a[0]} * (1.0 / tl.sqrt({v}_ms + {eps}))) * {a[1]}")
    elif n.op_type in ("LayerNormalization", "InstanceNormalization", "GroupNormalization"):
        eps = float_literal(float(n.attrs.get("epsilon", 1e-5)))
        buf.line(f"{v}_mean = {reduce('tl.sum', a[0], '0.0')} / {r}.0  # {n.op_type}")
        buf.line(f"{v}_diff = tl.where({rk.mask}, {a[0]} - {v}_mean, 0.0)")
        buf.line(
            f"{v}_rstd = 1.0 / tl.sqrt({reduce('tl.sum', f'{v}_diff * {v}_diff', '0.0')} / {r}.0 + {eps})"
        )
        expr = f"{v}_diff * {v}_rstd"
        if len(a) > 1 and a[1]:
            expr = f"({expr}) * {a[1]}"
        if len(a) > 2 and a[2]:
            expr = f"{expr} + {a[2]}"
        buf.line(f"{v} = {expr}")
    else:  # pragma: no cover - the planner admits only the ops above
        raise AssertionError(n.op_type)


def _row_stores(buf: SourceBuffer, rk: _RowKernel, outputs: list[str], regs: dict[str, str]) -> None:
    """Each output stored once: full-shaped ones over the tile, reduced ones one per row or column."""
    rows, r, inner = rk.space.outer, rk.space.r, rk.space.inner
    for i, name in enumerate(outputs):
        whole = rk.graph.spec(name).numel == rows * r * inner
        value = f"{regs[name]}.to(out{i}.dtype.element_ty)"
        if rk.tiled and whole:
            buf.line(f"tl.store(out{i} + outer * {r * inner} + rr * {inner} + ii, {value}, mask=mask)")
        elif rk.tiled:
            assert not rk.item, "an item-reduced output of the item layout (gemm_reduction refuses it)"
            buf.line(f"tl.store(out{i} + outer * {inner} + ii, {value}, mask=imask)")
        elif whole and r != 1:
            buf.line(f"tl.store(out{i} + row * {r} + cols, {value}, mask=cmask)")
        elif rk.multi:
            buf.line(f"tl.store(out{i} + row, {value}, mask=rowmask)")
        else:
            buf.line(f"tl.store(out{i} + row, {value})")
