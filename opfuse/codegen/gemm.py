"""Triton GEMM template with a fused epilogue (bias, activation, residual add, scale, cast).

A [M, K] (any leading dims folded into M) times B [K, N] (or [N, K] for Gemm transB), accumulated
in float32 registers tile by tile; the epilogue runs on the accumulator tile before its one store,
so the bias-add, activation and residual never round-trip through memory.

A MatMul whose B has batch dims too ([..., M, K] @ [..., K, N], batch dims broadcast) is the
batched form (`generate_batched_gemm`): each program computes one tile of one batch entry, both
operands read with strides, so a Transpose or head-splitting Reshape before either is never copied.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opfuse.codegen.epilogue import (
    TileRead,
    accumulator_epilogue,
    computed_a_tile,
    dot_precision,
    emit_dot,
    emit_launch,
    emit_stores,
    folded_row_coords,
    k_loop,
    pooled_a_tile,
    pooled_pixels,
    split_k_launch,
    split_k_reduction,
)
from opfuse.codegen.fragments import (
    KernelSource,
    matmul_tile_config,
    module_imports,
    module_title,
    node_comment,
    row_input_index,
    split_literals,
)
from opfuse.codegen.index_map import index_map_load, index_map_offset, with_borders
from opfuse.codegen.source import SourceBuffer, float_literal, guarded_load, power_run
from opfuse.graph import Graph, Node
from opfuse.ir.index_map import IndexMap
from opfuse.ir.ops import NHWC_CONV
from opfuse.ir.queries import contiguous_strides, next_pow2
from opfuse.ir.support import gemm_dims, is_batched

# The last op of a prologue that pools A (pooled_gemm); any other prologue is pointwise ops that
# compute A at the tile's own coordinates (operand_prologue).
POOLS = ("ReduceMean", "GlobalAveragePool")


@dataclass
class _Gemm:
    """One GEMM group as the template writes it: its dimensions, operands and loads."""

    graph: Graph
    anchor: Node
    epilogue: list[Node]
    prologue: list[Node]
    m: int
    n: int
    k: int
    trans_b: bool
    c_name: str
    a_view: Any
    pool: Node | None
    literals: dict[str, str]
    extra: list[str]
    pool_literals: dict[str, str]
    pool_loads: list[str]
    epilogue_reads: set[str]
    # A through an index map (a window partition with its Pad): each Pad's inside mask over the
    # rows `rm` and its value (codegen/index_map.py), outermost first; set by _a_rows.
    a_borders: list[tuple[str, float]] = field(default_factory=list)


def _read_gemm(
    anchor: Node,
    epilogue: list[Node],
    inputs: list[str],
    graph: Graph,
    views: dict[str, Any],
    prologue: list[Node],
) -> _Gemm:
    m, n, k, trans_b = gemm_dims(graph, anchor)
    a_name, b_name = anchor.inputs[0], anchor.inputs[1]
    # Gemm's C, or the bias of a conv GEMV (pooled_gemm: an NHWC 1x1 conv of a 1x1 map).
    c_name = (
        anchor.inputs[2]
        if anchor.op_type in ("Gemm", NHWC_CONV) and len(anchor.inputs) > 2 and anchor.inputs[2]
        else ""
    )
    epilogue_reads = {x for node in epilogue for x in node.inputs if x}
    a_view = None if prologue else views.get(a_name)
    pool = prologue[-1] if prologue and prologue[-1].op_type in POOLS else None
    pool_axes = {pool.inputs[1]} if pool is not None and len(pool.inputs) > 1 and pool.inputs[1] else set()
    made = {o for node in prologue for o in node.outputs}
    pool_inputs = [x for x in inputs if any(x in node.inputs for node in prologue) and x not in pool_axes]
    # The anchor's operands are loaded tile by tile; the epilogue loads them again only if it reads
    # them (a strided A through its own pointer, at the output index: it is output-shaped then).
    operands_only = {a_name, b_name} - epilogue_reads
    if a_view is not None:
        operands_only.add(a_name)
    operands_only |= pool_axes | made
    if pool is not None:
        # The layout ops between the pool and A (Flatten, or the Reshape and its shape operand the
        # default exporter writes) are folded away: what only they read is never loaded.
        read = {x for node in [*prologue, anchor, *epilogue] for x in node.inputs if x}
        operands_only |= {x for x in inputs if x not in read}
    literals, extra = split_literals(graph, inputs, skip=operands_only, tensors={c_name} - {""})
    if a_view is not None:
        extra = [x for x in extra if x not in (a_view.base, a_name)]
    pool_literals, pool_loads = split_literals(graph, pool_inputs)
    extra = [x for x in extra if x not in pool_loads and x not in pool_literals]
    return _Gemm(
        graph, anchor, epilogue, prologue, m, n, k, trans_b, c_name, a_view, pool, literals, extra,
        pool_literals, pool_loads, epilogue_reads,
    )  # fmt: skip


def generate_gemm(
    kernel_id: str,
    anchor: Node,
    epilogue: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    group_id: str,
    precision: str,
    views: dict[str, Any] | None = None,
    prologue: list[Node] | None = None,
) -> KernelSource:
    """`views`: the A operand read through folded layout ops ({A: StridedView}), or a prologue's
    inputs. `prologue`: a global average pool (pointwise ops, then a mean over H and W of an NHWC
    tensor) whose result is A: each A tile is computed as the mean over the pixels
    (fusion/rules/pooled_gemm.py); or pointwise ops whose result is A, computed at each A tile's
    coordinates (fusion/rules/operand_prologue.py)."""
    views = views or {}
    if is_batched(graph, anchor):
        return generate_batched_gemm(
            kernel_id, anchor, epilogue, inputs, outputs, graph, group_id, precision, views, prologue or []
        )
    gm = _read_gemm(anchor, epilogue, inputs, graph, views, prologue or [])
    m, n, k, pool = gm.m, gm.n, gm.k, gm.pool
    a_args = [f"p{i}" for i in range(len(gm.pool_loads))] if gm.prologue else ["a"]
    a_name = anchor.inputs[0]
    if gm.prologue:
        a_inputs = [views[x].base if x in views else x for x in gm.pool_loads]
    else:
        a_inputs = [gm.a_view.base if gm.a_view is not None else a_name]
    tensor_inputs = [*a_inputs, anchor.inputs[1], *_passed(gm.extra, views)]
    args = (
        [*a_args, "b"] + [f"in{i}" for i in range(len(gm.extra))] + [f"out{i}" for i in range(len(outputs))]
    )
    fn = "fused_gemm"
    buf = SourceBuffer()
    module_title(buf, f"GEMM kernel {kernel_id} for group {group_id}, M={m} N={n} K={k}.")
    role = (
        "prologue: the pool computed on A's tiles" if pool is not None else "prologue: computed on A's tiles"
    )
    for node in gm.prologue:
        buf.line(node_comment(node, role))
    buf.line(node_comment(anchor, "anchor"))
    for node in epilogue:
        buf.line(node_comment(node, "epilogue"))
    module_imports(buf)
    # Split-K (a tuning choice, split_k_candidates): the few column tiles of a GEMV-shaped GEMM
    # (a classifier head at batch 1: one row by 1000 columns, K 2048) share the K loop.
    split = "split_k" not in graph.disabled
    config = _gemm_head(buf, gm, fn, args + (["partials", "lock"] if split else []), split)
    with buf.indent():
        _grouped_tile(buf, m, n)
        a_rows = _a_rows(buf, gm)
        _gemm_k_loop(buf, gm, a_rows, dot_precision(graph.spec(a_name).dtype, precision), views, split)
        if split:
            split_k_reduction(buf, "pid", split_axis=1)
            buf.line("if last:")
    with buf.indent(), buf.indent() if split else contextlib.nullcontext():
        buf.line("row = rm[:, None]")
        buf.line("cols = rn[None, :]")
        buf.line(f"mask = (row < {m}) & (cols < {n})")
        regs: dict[str, str] = {}
        _gemm_epilogue(buf, gm, regs, views)
        emit_stores(buf, outputs, regs, f"row * {n} + cols")
    tiles = f'triton.cdiv({m}, c["BLOCK_M"]) * triton.cdiv({n}, c["BLOCK_N"])'
    if split:
        split_k_launch(buf, fn, args, [tiles])
    else:
        emit_launch(buf, fn, args, f"({tiles},)")
    return KernelSource(kernel_id, "gemm", buf.getvalue(), tensor_inputs, list(outputs), config)


def _gemm_head(buf: SourceBuffer, gm: _Gemm, fn: str, args: list[str], split: bool = False) -> dict[str, Any]:
    """CONFIG, INTERPRETER_CONFIG and the kernel's signature (GROUP_M, BLOCK_P for a pool, and
    SPLIT_K where `split`)."""
    m, n, k, pool = gm.m, gm.n, gm.k, gm.pool
    config: dict[str, Any] = {**matmul_tile_config(m, n, k), "GROUP_M": 8, "UPCAST": False}
    if split:
        config["SPLIT_K"] = 1
    pool_pixels = 0
    if pool is not None:  # pixels of the pool summed per step (a third tile dimension)
        pool_pixels = pooled_pixels(gm.graph, pool)
        config["BLOCK_P"] = min(64, next_pow2(pool_pixels))
    buf.line(f"CONFIG = {config!r}")
    bm, bn, bk = (min(128, max(16, next_pow2(x))) for x in (m, n, k))
    # Triton's CPU interpreter multiplies bfloat16 tiles wrongly; there they are widened first.
    upcast = gm.graph.spec(gm.anchor.inputs[0]).dtype == "bfloat16"
    pool_block = f', "BLOCK_P": {next_pow2(pool_pixels)}' if pool is not None else ""
    pool_block += ', "SPLIT_K": 1' if split else ""
    buf.line(
        f'INTERPRETER_CONFIG = {{"BLOCK_M": {bm}, "BLOCK_N": {bn}, "BLOCK_K": {bk}, "GROUP_M": 1, "UPCAST": {upcast}{pool_block}}}'
    )
    buf.line()
    buf.line()
    buf.line("@triton.jit")
    buf.line(
        f"def {fn}({', '.join(args)}, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,"
    )
    more = (", BLOCK_P: tl.constexpr" if pool else "") + (", SPLIT_K: tl.constexpr" if split else "")
    buf.line(f"        GROUP_M: tl.constexpr, UPCAST: tl.constexpr{more}):")
    return config


def _grouped_tile(buf: SourceBuffer, m: int, n: int, batched: bool = False) -> None:
    """The program's output tile in grouped order, its rows `rm` and columns `rn`, and `acc`.
    `batched`: the programs of batch entry `bid` follow those of entry bid - 1 (one grid axis:
    the others are limited to 65535 programs)."""
    buf.line("pid = tl.program_id(0)")
    buf.line(f"num_m = tl.cdiv({m}, BLOCK_M)")
    buf.line(f"num_n = tl.cdiv({n}, BLOCK_N)")
    if batched:
        buf.line("bid = (pid // (num_m * num_n)).to(tl.int64)  # the batch entry")
        buf.line("pid = pid % (num_m * num_n)")
    buf.line("# grouped ordering: GROUP_M row-tiles share each B column-tile while it is in L2")
    buf.line("per_group = GROUP_M * num_n")
    buf.line("first_m = (pid // per_group) * GROUP_M")
    buf.line("group_m = tl.minimum(num_m - first_m, GROUP_M)")
    buf.line("pid_m = first_m + (pid % per_group) % group_m")
    buf.line("pid_n = (pid % per_group) // group_m")
    buf.line("rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)")
    buf.line("rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
    buf.line("rk = tl.arange(0, BLOCK_K)")
    buf.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")


def _a_step(gm: _Gemm) -> str:
    """`kk`'s step through A: K contiguous, or (A read transposed through its view) its stride."""
    sk = 1 if gm.a_view is None or isinstance(gm.a_view, IndexMap) else int(gm.a_view.strides[-1])
    return "" if sk == 1 else f" * {sk}"


def _a_rows(buf: SourceBuffer, gm: _Gemm) -> tuple[str, int, int]:
    """Where A's row `rm` starts: rm * K, or (A through folded layout ops) `a_row`; and the run of
    contiguous elements its tiles may claim (`in_bounds`) with its axis: along K (1), or along M
    (0) where the view steps K by a stride and M by one (A transposed)."""
    a_view = gm.a_view
    if a_view is None:
        return f"rm[:, None] * {gm.k}", power_run(gm.k), 1
    if isinstance(a_view, IndexMap):
        return _a_rows_mapped(buf, gm, a_view)
    # Row m of A lives at a_row[m] in the buffer behind the folded layout ops.
    lead, strides = a_view.shape[:-1], a_view.strides[:-1]
    terms = [str(a_view.offset)] if a_view.offset else []
    for d, (size, stride) in enumerate(zip(lead, strides, strict=True)):
        if size == 1:
            continue
        inner = int(np.prod(lead[d + 1 :], dtype=np.int64))
        coord = f"(rm // {inner})" if inner > 1 else "rm"
        if d > 0:
            coord = f"({coord} % {size})"
        terms.append(f"{coord} * {stride}")
    buf.line(f"a_row = {' + '.join(terms) or '0 * rm'}  # A through {len(a_view.nodes)} folded layout op(s)")
    sk = int(a_view.strides[-1])
    if sk == 1:
        run = power_run(a_view.offset, *(s for n, s in zip(lead, strides, strict=True) if n != 1))
        return "a_row[:, None]", run, 1
    # K strided: rows consecutive in memory along A's innermost row dim where its stride is 1,
    # in runs that start at multiples of the run wherever every other step is one too.
    steps = [(n, s) for n, s in zip(lead, strides, strict=True) if n != 1]
    if not steps or steps[-1][1] != 1:
        return "a_row[:, None]", 1, 0
    run = power_run(a_view.offset, sk, steps[-1][0], *(s for _, s in steps[:-1]))
    return "a_row[:, None]", run, 0


def _a_rows_mapped(buf: SourceBuffer, gm: _Gemm, a_view: IndexMap) -> tuple[str, int, int]:
    """A through an index map that leaves K alone (fusion/pad_gather.py; IndexMap.rows): row `rm`
    walked back through the layout ops and Pads to its row of the buffer behind them, `a_row` its
    start; `a_in` the rows inside every Pad (the others are its border: its value, no load)."""
    rows = a_view.rows()
    if rows is None:  # the planner asks for rows() first
        raise ValueError("the GEMM template reads A through an index map only where K is left alone")
    lines: list[str] = []
    idx, held, gm.a_borders = index_map_offset("am", rows, lines, "rm", f"(rm < {gm.m})")
    for text in lines:
        buf.line(text)
    buf.line(
        f"a_row = {f'({idx}) * {gm.k}' if idx != '0' else '0 * rm'}  # A through {len(rows.steps)} layout op(s)"
    )
    buf.line(f"a_in = {held}")
    return "a_row[:, None]", power_run(gm.k), 1


def _gemm_k_loop(
    buf: SourceBuffer,
    gm: _Gemm,
    a_rows: tuple[str, int, int],
    prec: str,
    views: dict[str, Any],
    split: bool = False,
) -> None:
    m, n, k = gm.m, gm.n, gm.k
    sbk, sbn = (1, k) if gm.trans_b else (n, 1)

    def a_tile() -> None:
        if gm.pool is not None:
            pooled_a_tile(buf, gm.graph, gm.prologue, gm.pool_loads, gm.pool_literals, m, k)
        elif gm.prologue:
            a_shape = tuple(gm.graph.spec(gm.anchor.inputs[0]).shape)
            coords = folded_row_coords(a_shape, "rm[:, None]")
            coords[len(a_shape) - 1] = "kk[None, :]"
            buf.line(f"a_ok = (rm[:, None] < {m}) & (kk[None, :] < {k})")
            _computed_a_tile(buf, gm, a_shape, coords, views)
        else:
            a_ok = f"(rm[:, None] < {m}) & (kk[None, :] < {k})"
            offset = f"{a_rows[0]} + kk[None, :]{_a_step(gm)}"
            held = f"{a_ok} & a_in[:, None]" if isinstance(gm.a_view, IndexMap) else a_ok
            buf.line(f"a_tile = {guarded_load('a', offset, held, run=a_rows[1], axis=a_rows[2])}")
            # A Pad's border rows take its value (lanes outside the tile stay 0 for the dot).
            filled = with_borders("a_tile", [(f"({ok})[:, None]", fill) for ok, fill in gm.a_borders])
            if filled != "a_tile":
                buf.line(f"a_tile = tl.where({a_ok}, {filled}, 0.0)")

    k_loop(buf, k, n, TileRead.strided("b", sbk, sbn), prec, a_tile, split, split_axis=1)


def _computed_a_tile(
    buf: SourceBuffer, gm: _Gemm, a_shape: tuple[int, ...], coords: dict[int, str], views: dict[str, Any]
) -> None:
    pointers = [f"p{j}" for j in range(len(gm.pool_loads))]
    computed_a_tile(
        buf, gm.graph, gm.prologue, gm.anchor.inputs[0], gm.pool_loads, pointers, gm.pool_literals,
        a_shape, coords, views, "b.dtype.element_ty",
    )  # fmt: skip


def _gathered_epilogue_inputs(
    buf: SourceBuffer, extra: list[str], views: dict[str, Any], n: int, regs: dict[str, str]
) -> None:
    """Epilogue inputs read through a constant Pad (pad_gather: {input: IndexMap}, each of the
    output's shape), loaded at the output's elements `row * n + cols` where `mask` holds; their
    registers go into `regs`, so the epilogue's own loads skip them."""
    for i, name in enumerate(extra):
        view = views.get(name)
        if isinstance(view, IndexMap):
            lines: list[str] = []
            value = index_map_load(f"e{i}", f"in{i}", view, lines, f"(row * {n} + cols)", "mask")
            for text in lines:
                buf.line(text)
            buf.line(f"x{i} = {value}")
            regs[name] = f"x{i}"


def _passed(extra: list[str], views: dict[str, Any]) -> list[str]:
    """The tensors a kernel is handed for its epilogue inputs: an index map's buffer behind it."""
    return [views[x].base if isinstance(views.get(x), IndexMap) else x for x in extra]


def _gemm_epilogue(buf: SourceBuffer, gm: _Gemm, regs: dict[str, str], views: dict[str, Any]) -> None:
    """The epilogue on `acc`: a strided A the epilogue reads too, Gemm's alpha and C, the nodes."""
    graph, anchor, m = gm.graph, gm.anchor, gm.m
    out_shape = graph.spec(anchor.outputs[0]).shape
    a_name = anchor.inputs[0]

    def index_of(name: str) -> tuple[str | None, str]:
        idx, vector = row_input_index(graph.spec(name).shape, out_shape)
        return idx, ("mask" if vector else f"row < {m}")

    def on_acc(regs: dict[str, str]) -> None:
        if gm.a_view is not None and a_name in gm.epilogue_reads:
            if isinstance(gm.a_view, IndexMap):  # the planner refuses it
                raise ValueError("an epilogue reads A, which the GEMM loads through an index map")
            buf.line(
                f"xa = tl.load(a + a_row[:, None] + cols{_a_step(gm)}, mask=mask, other=0.0).to(tl.float32)"
            )
            regs[a_name] = "xa"
        if anchor.op_type == NHWC_CONV and gm.c_name:
            buf.line(f"acc = acc + {regs[gm.c_name]}")
        if anchor.op_type == "Gemm":
            alpha = float(anchor.attrs.get("alpha", 1.0))
            beta = float(anchor.attrs.get("beta", 1.0))
            if alpha != 1.0:
                buf.line(f"acc = acc * {float_literal(alpha)}")
            if gm.c_name:
                term = regs[gm.c_name] if beta == 1.0 else f"{float_literal(beta)} * {regs[gm.c_name]}"
                buf.line(f"acc = acc + {term}")

    _gathered_epilogue_inputs(buf, gm.extra, views, gm.n, regs)
    accumulator_epilogue(
        buf, graph, anchor.outputs[0], gm.epilogue, gm.extra, index_of, gm.literals, regs, on_acc
    )


@dataclass
class _Operand:
    """A batched GEMM operand as the kernel reads it: the buffer, where the operand starts in it,
    and its strides (a view's, or the value's own contiguous ones)."""

    base: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    def run(self, axis: int) -> int:
        """The run `in_bounds` may claim along `axis` (-1: the operand's last, -2: the one
        before) of its 2-D tiles, from tile starts that are multiples of 8: 1 unless that axis
        has stride 1; else every other stride and the offset are multiples of it."""
        if self.strides[axis] != 1:
            return 1
        others = [s for d, s in enumerate(self.strides) if d != len(self.strides) + axis]
        return power_run(self.offset, *others)

    def batch_offset(self, batch: tuple[int, ...]) -> str:
        """Where batch entry `bid` (numbered over the output's batch dims) starts: the operand's
        batch dims broadcast from the right, a dim of 1 (or a missing one) read at stride 0."""
        own = self.shape[:-2]
        terms = [str(self.offset)] if self.offset else []
        for d in range(len(batch)):
            od = d - (len(batch) - len(own))
            if od < 0 or own[od] == 1:
                continue
            inner = int(np.prod(batch[d + 1 :], dtype=np.int64))
            coord = f"(bid // {inner})" if inner > 1 else "bid"
            if d > 0:
                coord = f"({coord} % {batch[d]})"
            terms.append(f"{coord} * {self.strides[od]}")
        return " + ".join(terms) or "0"


def _operand(graph: Graph, name: str, views: dict[str, Any]) -> _Operand:
    view = views.get(name)
    if view is not None:
        return _Operand(view.base, tuple(view.shape), tuple(view.strides), view.offset)
    shape = tuple(graph.spec(name).shape)
    return _Operand(name, shape, contiguous_strides(shape))


def generate_batched_gemm(
    kernel_id: str,
    anchor: Node,
    epilogue: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    group_id: str,
    precision: str,
    views: dict[str, Any],
    prologue: list[Node] | None = None,
) -> KernelSource:
    """[..., M, K] @ [..., K, N] with the epilogue, one grid axis over (batch entry, tile). Either
    operand may be a view (`views`: {operand: StridedView}) read from the buffer behind it, or A
    computed on its tiles by pointwise ops (`prologue`, their inputs in `views` where folded);
    the output [batch..., M, N] is contiguous, its rows numbered `row = bid * M + rm` so the
    epilogue addresses its inputs as over any GEMM's folded rows."""
    a_name, b_name = anchor.inputs[0], anchor.inputs[1]
    prologue = prologue or []
    a, b = _operand(graph, a_name, views), _operand(graph, b_name, views)
    out_shape = tuple(graph.spec(anchor.outputs[0]).shape)
    batch = out_shape[:-2]
    nb = int(np.prod(batch, dtype=np.int64))
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    epilogue_reads = {x for node in epilogue for x in node.inputs if x}
    made = {o for node in prologue for o in node.outputs}
    operands_only = ({a_name, b_name} - epilogue_reads) | made
    prologue_inputs = [x for x in inputs if any(x in node.inputs for node in prologue)]
    a_literals, a_loads = split_literals(graph, prologue_inputs)
    literals, extra = split_literals(graph, inputs, skip=operands_only | set(prologue_inputs))
    gm = _Gemm(
        graph, anchor, epilogue, prologue, m, n, k, False, "", None, None, literals, extra, a_literals,
        a_loads, epilogue_reads,
    )  # fmt: skip
    a_args = [f"p{i}" for i in range(len(a_loads))] if prologue else ["a"]
    a_inputs = [views[x].base if x in views else x for x in a_loads] if prologue else [a.base]
    args = [*a_args, "b"] + [f"in{i}" for i in range(len(extra))] + [f"out{i}" for i in range(len(outputs))]
    fn = "fused_gemm"
    buf = SourceBuffer()
    module_title(buf, f"batched GEMM kernel {kernel_id} for group {group_id}, {nb} x M={m} N={n} K={k}.")
    for node in prologue:
        buf.line(node_comment(node, "prologue: computed on A's tiles"))
    buf.line(node_comment(anchor, "anchor"))
    for node in epilogue:
        buf.line(node_comment(node, "epilogue"))
    module_imports(buf)
    config = _gemm_head(buf, gm, fn, args)
    with buf.indent():
        _grouped_tile(buf, m, n, batched=True)
        if not prologue:
            buf.line(f"a_at = {a.batch_offset(batch)}")
        buf.line(f"b_at = {b.batch_offset(batch)}")
        sam, sak = a.strides[-2], a.strides[-1]
        sbk, sbn = b.strides[-2], b.strides[-1]
        prec = dot_precision(graph.spec(a_name).dtype, precision)
        buf.line(f"for k0 in range(0, {k}, BLOCK_K):")
        with buf.indent():
            buf.line("kk = k0 + rk")
            buf.line(f"a_ok = (rm[:, None] < {m}) & (kk[None, :] < {k})")
            if prologue:
                _computed_a_tile(buf, gm, a.shape, _batched_coords(a.shape, batch), views)
            else:
                a_at = f"a_at + rm[:, None] * {sam} + kk[None, :] * {sak}"
                buf.line(f"a_tile = {guarded_load('a', a_at, 'a_ok', run=a.run(-1))}")
            buf.line(f"b_ok = (kk[:, None] < {k}) & (rn[None, :] < {n})")
            b_run, b_axis = (b.run(-1), 1) if sbn == 1 else (b.run(-2), 0)
            b_at = f"b_at + kk[:, None] * {sbk} + rn[None, :] * {sbn}"
            buf.line(f"b_tile = {guarded_load('b', b_at, 'b_ok', run=b_run, axis=b_axis)}")
            emit_dot(buf, "acc", "a_tile", "b_tile", prec)
        buf.line(f"row = bid * {m} + rm[:, None]  # the output's rows, batch entries one after the other")
        buf.line("cols = rn[None, :]")
        buf.line(f"mask = (rm[:, None] < {m}) & (cols < {n})")
        regs: dict[str, str] = {}

        def index_of(name: str) -> tuple[str | None, str]:
            idx, vector = row_input_index(graph.spec(name).shape, out_shape)
            return idx, ("mask" if vector else f"row < {nb * m}")

        _gathered_epilogue_inputs(buf, extra, views, n, regs)
        accumulator_epilogue(buf, graph, anchor.outputs[0], epilogue, extra, index_of, literals, regs)
        emit_stores(buf, outputs, regs, f"row * {n} + cols")
    emit_launch(buf, fn, args, f'({nb} * triton.cdiv({m}, c["BLOCK_M"]) * triton.cdiv({n}, c["BLOCK_N"]),)')
    inputs_ = [*a_inputs, b.base, *_passed(extra, views)]
    return KernelSource(kernel_id, "gemm", buf.getvalue(), inputs_, list(outputs), config)


def _batched_coords(shape: tuple[int, ...], batch: tuple[int, ...]) -> dict[int, str]:
    """Each axis of a batched operand [..., M, K] as an expression: its batch axes decoded from
    the batch entry `bid` (numbered over the output's `batch`, broadcast from the right), M from
    `rm`, K from `kk`."""
    coords: dict[int, str] = {len(shape) - 2: "rm[:, None]", len(shape) - 1: "kk[None, :]"}
    shift = len(batch) - (len(shape) - 2)
    for od in range(len(shape) - 2):
        d = od + shift
        inner = int(np.prod(batch[d + 1 :], dtype=np.int64))
        coord = f"(bid // {inner})" if inner > 1 else "bid"
        coords[od] = f"({coord} % {batch[d]})" if d > 0 else coord
    return coords
