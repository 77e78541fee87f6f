"""What the anchor templates (GEMM, NCHW and NHWC conv) share: the K loop's steps and the epilogue
on the accumulator tile.

Each template computes `acc` ([BLOCK_M, BLOCK_N], float32) by `dot_step`s (in `k_loop` where K
is one flat range) and defines `mask` over the output tile; then `accumulator_epilogue` loads its
extra inputs once each (at an index the template knows) and runs the epilogue nodes in registers,
and every group output is stored once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from opfuse.codegen.emitters import EMITTERS
from opfuse.codegen.fragments import broadcast_offset, concat_parts, part_lanes
from opfuse.codegen.source import SourceBuffer, guarded_load, power_run
from opfuse.graph import Graph, Node
from opfuse.ir.ops import FLOAT_TYPES
from opfuse.ir.queries import contiguous_strides, scalar_constant
from opfuse.ir.rows import row_space

# For an extra input: (offset expression, or None for a single element; load mask).
IndexOf = Callable[[str], tuple[str | None, str]]


def emit_loads(buf: SourceBuffer, extra: list[str], index_of: IndexOf, regs: dict[str, str]) -> None:
    """`x{i} = in{i}[...]` for each extra input, in float32; records each register in `regs`. An
    input already in `regs` (a Resize's gather, computed by the template) is not loaded again."""
    for i, name in enumerate(extra):
        if name in regs:
            continue
        idx, mask = index_of(name)
        if idx is None:
            buf.line(f"x{i} = tl.load(in{i}).to(tl.float32)")
        else:
            buf.line(f"x{i} = tl.load(in{i} + {idx}, mask={mask}, other=0.0).to(tl.float32)")
        regs[name] = f"x{i}"


def emit_nodes(
    buf: SourceBuffer, graph: Graph, nodes: list[Node], regs: dict[str, str], prefix: str = "v"
) -> None:
    """One line per pointwise node, `v{j}` (`prefix`), reading the registers of its inputs."""
    for j, node in enumerate(nodes):
        a_exprs = [regs[x] if x else "" for x in node.inputs]
        consts = [scalar_constant(graph, x) if x else None for x in node.inputs]
        buf.line(f"{prefix}{j} = {EMITTERS[node.op_type](a_exprs, node, consts)}  # {node.op_type}")
        regs[node.outputs[0]] = f"{prefix}{j}"


def dot_precision(dtype: str, precision: str) -> str:
    """tl.dot's precision argument: float32 operands in IEEE fp32, or TF32 where the job asks."""
    if dtype != "float32":
        return ""
    return ', input_precision="tf32"' if precision == "tf32" else ', input_precision="ieee"'


def emit_dot(buf: SourceBuffer, acc: str, a: str, b: str, prec: str) -> None:
    """`acc += a @ b` on tensor cores; with UPCAST in fp32 (the CPU interpreter multiplies
    bfloat16 tiles wrongly)."""
    buf.line("if UPCAST:")
    with buf.indent():
        buf.line(f'{acc} = tl.dot({a}.to(tl.float32), {b}.to(tl.float32), {acc}, input_precision="ieee")')
    buf.line("else:")
    with buf.indent():
        buf.line(f"{acc} = tl.dot({a}, {b}, {acc}{prec})")


@dataclass(frozen=True)
class TileRead:
    """A [K, N] operand tile's read: pointer `ptr`, element offsets `offset` (of `kk` or `ci`
    and `rn`), and the run of contiguous elements `in_bounds` may claim along `axis` (0: along K,
    1: along N)."""

    ptr: str
    offset: str
    run: int = 1
    axis: int = 0
    mask: str = ""  # lanes read besides those inside [K, N] (0 elsewhere: a block-diagonal B)

    @staticmethod
    def strided(ptr: str, sbk: int, sbn: int) -> TileRead:
        """B [K, N] at strides (sbk, sbn), one of them 1 (row-major, or transposed): its tiles at
        `kk`, `rn`, vector loads claimed along the axis of stride 1."""
        run, axis = (power_run(sbk), 1) if sbn == 1 else (power_run(sbn), 0)
        return TileRead(ptr, f"kk[:, None] * {sbk} + rn[None, :] * {sbn}", run, axis)


def dot_step(buf: SourceBuffer, b: TileRead, mask: str, prec: str) -> None:
    """One step of a K loop once `a_tile` is loaded: the B tile `b`, 0 outside `mask` (its every
    lane addressing inside B: `guarded_load`), multiplied into `acc`."""
    buf.line(f"b_tile = {guarded_load(b.ptr, b.offset, mask, run=b.run, axis=b.axis)}")
    emit_dot(buf, "acc", "a_tile", "b_tile", prec)


def k_loop(
    buf: SourceBuffer,
    k: int,
    n: int,
    b: TileRead,
    prec: str,
    a_tile: Callable[[], None],
    split: bool = False,
    split_axis: int = 2,
) -> None:
    """The K loop over one flat range, BLOCK_K at a time (`kk`): `a_tile()` writes the A tile's
    load, the B tile `b` (of `kk` and `rn`) is read inside [K, N]. `split`: a kernel with the
    SPLIT_K constexpr, whose program s along grid axis `split_axis` takes every SPLIT_K-th block
    from the s-th (the whole loop where SPLIT_K is 1)."""
    if split:
        buf.line("if SPLIT_K == 1:")
        with buf.indent():
            k_loop(buf, k, n, b, prec, a_tile)
        buf.line("else:")
        with buf.indent():
            buf.line(f"for k0 in range(tl.program_id({split_axis}) * BLOCK_K, {k}, SPLIT_K * BLOCK_K):")
            with buf.indent():
                _k_step(buf, k, n, b, prec, a_tile)
        return
    buf.line(f"for k0 in range(0, {k}, BLOCK_K):")
    with buf.indent():
        _k_step(buf, k, n, b, prec, a_tile)


def _k_step(buf: SourceBuffer, k: int, n: int, b: TileRead, prec: str, a_tile: Callable[[], None]) -> None:
    buf.line("kk = k0 + rk")
    a_tile()
    inside = f"(kk[:, None] < {k}) & (rn[None, :] < {n})"
    dot_step(buf, b, f"{inside} & {b.mask}" if b.mask else inside, prec)


def accumulator_epilogue(
    buf: SourceBuffer,
    graph: Graph,
    anchor_out: str,
    epilogue: list[Node],
    extra: list[str],
    index_of: IndexOf,
    literals: dict[str, str],
    regs: dict[str, str],
    on_acc: Callable[[dict[str, str]], None] | None = None,
) -> None:
    """The epilogue on `acc`: the extra inputs loaded, `on_acc(regs)` (the anchor's own last terms:
    a bias, Gemm's alpha and C), then the epilogue nodes with the anchor's output in `acc`."""
    emit_loads(buf, extra, index_of, regs)
    regs.update(literals)
    if on_acc is not None:
        on_acc(regs)
    regs[anchor_out] = "acc"
    emit_nodes(buf, graph, epilogue, regs)


def emit_stores(
    buf: SourceBuffer,
    outputs: list[str],
    regs: dict[str, str],
    dst: str,
    mask: str = "mask",
    skip: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Each output `out{i}` stored at `dst`, but those in `skip` (stored elsewhere in the kernel)."""
    for i, name in enumerate(outputs):
        if name in skip:
            continue
        buf.line(f"tl.store(out{i} + {dst}, {regs[name]}.to(out{i}.dtype.element_ty), mask={mask})")


def split_k_reduction(
    buf: SourceBuffer,
    tile: str = "tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)",
    split_axis: int = 2,
) -> None:
    """SPLIT_K > 1: store this program's partial tile (float32) in its slot of `partials`, count it in at
    the tile's `lock`; the program that arrives last sums the SPLIT_K slots in order (the same sum
    whichever program is last), sets the counter back to 0 for the next launch and runs the
    epilogue (`last`). The barriers order every thread's store before the count, and the count
    before any thread's loads. `tile`: the output tile's number; `split_axis`: the grid axis of
    the program's part of K."""
    buf.line("if SPLIT_K > 1:")
    with buf.indent():
        buf.line(f"tile = {tile}")
        buf.line("part = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
        buf.line("slots = partials + tile.to(tl.int64) * SPLIT_K * BLOCK_M * BLOCK_N")
        buf.line(
            f'tl.store(slots + tl.program_id({split_axis}) * BLOCK_M * BLOCK_N + part, acc, cache_modifier=".cg")'
        )
        buf.line("tl.debug_barrier()")
        buf.line('arrived = tl.atomic_add(lock + tile, 1, sem="acq_rel", scope="gpu")')
        buf.line("tl.debug_barrier()")
        buf.line("last = arrived == SPLIT_K - 1")
        buf.line("if last:")
        with buf.indent():
            buf.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
            buf.line("for s in range(0, SPLIT_K):")
            with buf.indent():
                buf.line('acc += tl.load(slots + s * BLOCK_M * BLOCK_N + part, cache_modifier=".cg")')
            buf.line('tl.atomic_xchg(lock + tile, 0, sem="relaxed", scope="gpu")')
    buf.line("else:")
    with buf.indent():
        buf.line("last = True")


def split_k_launch(buf: SourceBuffer, fn: str, args: list[str], tiles: list[str]) -> None:
    """The module's `launch`, with the split-K scratch: per device and tiling, a float32 slot per
    (tile, split) and an int32 counter per tile, made once (the counters zeroed) and reused by every
    launch; the last program of a tile leaves its counter at 0 again. The grid is `tiles` (its
    axes of output tiles, of the launch config `c`), then SPLIT_K. The scratch is the caller's
    (`scratch`: the Executor's dict, shared by its steps, which run one after another, so two plans
    running at once, or two CUDA graphs replayed on two streams, never share counters), else the
    module's (SCRATCH: a tuning worker, one launch at a time)."""
    buf.line()
    buf.line()
    buf.line("SCRATCH = {}")
    buf.line("USES_SCRATCH = True  # launch() takes `scratch`: the Executor passes its own")
    buf.line()
    buf.line()
    buf.line(f"def launch({', '.join(args)}, config=None, scratch=None):")
    with buf.indent():
        buf.line("c = CONFIG if config is None else config")
        buf.line("store = SCRATCH if scratch is None else scratch")
        buf.line(f'grid = ({", ".join(tiles)}, c["SPLIT_K"])')
        buf.line(f'key = (str({args[0]}.device), grid, c["BLOCK_M"] * c["BLOCK_N"])')
        buf.line("if key not in store:")
        with buf.indent():
            buf.line("import torch")
            buf.line("")
            buf.line(f"tiles = {' * '.join(f'grid[{i}]' for i in range(len(tiles)))}")
            buf.line('slots = tiles * c["SPLIT_K"] * c["BLOCK_M"] * c["BLOCK_N"] if c["SPLIT_K"] > 1 else 1')
            buf.line(
                f"store[key] = (torch.empty(slots, dtype=torch.float32, device={args[0]}.device), "
                f"torch.zeros(tiles, dtype=torch.int32, device={args[0]}.device))"
            )
        buf.line("partials, lock = store[key]")
        buf.line(f"{fn}[grid]({', '.join(args)}, partials, lock, **c)")


def emit_launch(buf: SourceBuffer, fn: str, args: list[str], grid: str) -> None:
    """The module's `launch(*tensors, config=None)`; `grid` may use the config as `c`."""
    buf.line()
    buf.line()
    buf.line(f"def launch({', '.join(args)}, config=None):")
    with buf.indent():
        buf.line("c = CONFIG if config is None else config")
        buf.line(f"grid = {grid}")
        buf.line(f"{fn}[grid]({', '.join(args)}, **c)")


def folded_row_coords(shape: tuple[int, ...], rows: str) -> dict[int, str]:
    """Each leading axis of `shape` (all but the last) decoded from the folded row index `rows`."""
    lead = shape[:-1]
    coords: dict[int, str] = {}
    for d, size in enumerate(lead):
        inner = int(np.prod(lead[d + 1 :], dtype=np.int64))
        coord = f"({rows} // {inner})" if inner > 1 else rows
        coords[d] = f"({coord} % {size})" if d > 0 else coord
    return coords


def computed_a_tile(
    buf: SourceBuffer,
    graph: Graph,
    prologue: list[Node],
    a_name: str,
    loads: list[str],
    pointers: list[str],
    literals: dict[str, str],
    a_shape: tuple[int, ...],
    coords: dict[int, str],
    views: dict[str, Any],
    dtype: str,
) -> None:
    """`a_tile` computed by a GEMM's pointwise prologue (fusion/rules/operand_prologue.py): each
    input (`loads`, at `pointers`) loaded at the tile's coordinates of A (`coords`: A's axis ->
    expression, `a_ok` the tile's mask), broadcast from the right, or through its view's strides;
    the ops in float32; the result rounded to `dtype`, as the stored A would be, and 0 outside
    the tile (an op of a masked lane, a division by the 0 loaded there, must not reach the sum).
    The GEMM templates and the row kernel's GEMM (codegen/rowwise.py) share it.

    A Concat along K (operand_prologue admits one for a GEMM) is its parts' loads added up: each
    part is loaded at K minus its first column, masked to its own columns (0 elsewhere)."""
    regs = dict(literals)
    last = len(a_shape) - 1
    concats = [n for n in prologue if n.op_type == "Concat"]
    part_of = {x: (start, length) for n in concats for x, start, length in concat_parts(graph, n)[1]}
    for j, name in enumerate(loads):
        view = views.get(name)
        shape = tuple(view.shape if view is not None else graph.spec(name).shape)
        strides = tuple(view.strides) if view is not None else contiguous_strides(shape)
        shift = len(a_shape) - len(shape)
        at, ok = dict(coords), "a_ok"
        if name in part_of:
            at[last], held = part_lanes(coords[last], *part_of[name], a_shape[-1])
            ok = f"a_ok & {held}" if held else ok
        terms = [str(view.offset)] if view is not None and view.offset else []
        for d, (size, stride) in enumerate(zip(shape, strides, strict=True)):
            if size != 1:
                terms.append(f"{at[shift + d]} * {stride}" if stride != 1 else at[shift + d])
        floating = graph.spec(name).dtype in FLOAT_TYPES
        up, zero = (".to(tl.float32)", "0.0") if floating else ("", "0")
        if terms:
            # Along K (the tile's columns, from a multiple of the K block) an input of A's last
            # size at stride 1 runs contiguously: its loads may be vector loads (in_bounds).
            contiguous = shape[-1] == a_shape[-1] != 1 and strides[-1] == 1 and name not in part_of
            others = [st for size, st in zip(shape[:-1], strides[:-1], strict=True) if size != 1]
            run = power_run(view.offset if view is not None else 0, *others) if contiguous else 1
            buf.line(f"q{j} = {guarded_load(pointers[j], ' + '.join(terms), ok, zero, run)}{up}")
        else:
            buf.line(f"q{j} = tl.load({pointers[j]}){up}")
        regs[name] = f"q{j}"
    for node in concats:  # its parts, each 0 outside its own columns
        regs[node.outputs[0]] = "(" + " + ".join(regs[x] for x in node.inputs if x) + ")"
    emit_nodes(buf, graph, [n for n in prologue if n.op_type != "Concat"], regs, prefix="u")
    buf.line(f"a_tile = tl.where(a_ok, {regs[a_name]}, 0.0).to({dtype})")


def pooled_pixels(graph: Graph, pool: Node) -> int:
    """The pixels a global average pool (NHWC or NCHW) averages."""
    full = graph.spec(pool.inputs[0]).shape
    return int(np.prod(full[1:3] if row_space(graph, pool).first == 1 else full[2:4]))


def pooled_a_tile(
    buf: SourceBuffer,
    graph: Graph,
    prologue: list[Node],
    loads: list[str],
    literals: dict[str, str],
    m: int,
    k: int,
    model_type: str = "b.dtype.element_ty",
) -> None:
    """`a_tile`: rows `rm` (images) and columns `kk` (channels) of the mean over the pixels of the
    prologue's pointwise ops (NHWC or NCHW), loaded through pointers `p0`, `p1`... (one per name
    in `loads`), rounded to the model's type (`model_type`) as the stored pooled value would be.
    Each image's channels are summed in float32 over [BLOCK_P pixels, channels] tiles, one image
    after the other (at most POOLED_GEMM_MAX_ROWS): a tile of every row block
    would hold BLOCK_M images where only these are real (that form spilled registers and ran
    11x slower than the split form on the H200)."""
    pool = prologue[-1]
    hw = "hw[:, None]"
    full = tuple(graph.spec(pool.inputs[0]).shape)
    nhwc = row_space(graph, pool).first == 1
    if nhwc:
        _, h, w, _c = full
        coords = {0: "i", 1: f"({hw} // {w})", 2: f"({hw} % {w})", 3: "kk[None, :]"}
    else:  # NCHW: the channels at stride H*W
        _, _c, h, w = graph.spec(pool.inputs[0]).shape
        coords = {0: "i", 1: "kk[None, :]", 2: f"({hw} // {w})", 3: f"({hw} % {w})"}
    buf.line("psum = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)")
    buf.line(f"for i in tl.static_range(0, {m}):  # each image's pool: rows past M are never read")
    with buf.indent():
        buf.line("isum = tl.zeros((BLOCK_K,), dtype=tl.float32)")
        buf.line(f"for hw0 in range(0, {h * w}, BLOCK_P):  # BLOCK_P pixels at a time")
        with buf.indent():
            buf.line("hw = hw0 + tl.arange(0, BLOCK_P)")
            buf.line(f"p_ok = ({hw} < {h * w}) & (kk[None, :] < {k})")
            regs = dict(literals)
            for j, name in enumerate(loads):
                idx = broadcast_offset(graph.spec(name).shape, coords)
                if idx is None:
                    buf.line(f"q{j} = tl.load(p{j}).to(tl.float32)")
                else:
                    run = power_run(full[3]) if nhwc and tuple(graph.spec(name).shape) == full else 1
                    buf.line(f"q{j} = {guarded_load(f'p{j}', idx, 'p_ok', run=run)}.to(tl.float32)")
                regs[name] = f"q{j}"
            emit_nodes(buf, graph, prologue[:-1], regs, prefix="u")
            buf.line(f"isum += tl.sum(tl.where(p_ok, {regs[pool.inputs[0]]}, 0.0), axis=0)")
        buf.line("psum += tl.where(rm[:, None] == i, isum[None, :], 0.0)")
    buf.line(f"a_tile = (psum / {h * w}.0).to({model_type})")
