"""Pieces every template is built from: the kernel's record, literals and tensors, index
arithmetic, the kernel module's header and its jitted function's signature.

Templates import these (and `source`, `emitters`, `epilogue`) and never one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from opfuse.codegen.source import SourceBuffer, comment_text, float_literal
from opfuse.graph import Graph, Node
from opfuse.ir.queries import next_pow2, prod, scalar_constant


@dataclass
class KernelSource:
    id: str
    kind: str
    source: str
    inputs: list[str]  # values passed as tensors, in launch order
    outputs: list[str]
    config: dict[str, Any]


def split_literals(
    graph: Graph,
    names: list[str],
    skip: set[str] | frozenset[str] = frozenset(),
    tensors: set[str] | frozenset[str] = frozenset(),
) -> tuple[dict[str, str], list[str]]:
    """Finite one-element constants become literals in the source; every other input (and each
    name in `tensors`) is loaded as a tensor, in first-use order; names in `skip` are neither."""
    literals: dict[str, str] = {}
    loaded: list[str] = []
    for name in names:
        if name in skip:
            continue
        value = scalar_constant(graph, name)
        if value is not None and np.isfinite(value) and name not in tensors:
            kind = graph.constants[name].dtype.kind
            # An integer or boolean constant (the pointwise template's exact arithmetic) keeps its
            # type: a float literal would turn integer registers into float ones. Any other kind is
            # a float (bfloat16's numpy kind is "V": int() of it made 0.35 the literal 0).
            literals[name] = str(int(value)) if kind in "biu" else float_literal(value)
        elif name not in loaded:
            loaded.append(name)
    return literals, loaded


def matmul_tile_config(m: int, n: int, k: int) -> dict[str, int]:
    """A starting tile for an M×N×K product on the GPU, before any tuning: 64×64×32 (measured the
    better default on the H200 for the zoo), shrunk where the problem is smaller (batch 1)."""
    bm = min(64, max(16, next_pow2(m)))
    bn = min(64, max(32, next_pow2(n)))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}


# Split-K (the candidates in tuning_space.split_k_candidates, the start in start_split; in
# codegen/conv.py: the NHWC template's window loop, the channels-first template of 1-D to 3-D
# convs), for a conv whose output tiles are fewer than SPLIT_K_TILES (about the H200's 132 SMs):
# its K loop shared among 2 to 32 programs per tile, at most SPLIT_K_PROGRAMS programs in all and
# at least SPLIT_K_MIN_K of K each. 16 and 32 are for the GEMV-shaped convs of the last
# stages at batch 1 (r2plus1d_18: 4 pixels by 1152 channels, K 4608, megabytes of weights that 18
# programs streamed at 64 us a conv).
SPLIT_K_TILES = 128
SPLIT_K_PROGRAMS = 512
SPLIT_K_MIN_K = 256
SPLITS = (2, 4, 8, 16, 32)


def allowed_splits(tiles: int, k: int) -> list[int]:
    """The SPLITS a product of `tiles` output tiles and `k` of K may take: none at SPLIT_K_TILES
    tiles or more, at most SPLIT_K_PROGRAMS programs, at least SPLIT_K_MIN_K of K each (smallest
    first: a prefix of SPLITS)."""
    if tiles >= SPLIT_K_TILES:
        return []
    return [s for s in SPLITS if tiles * s <= SPLIT_K_PROGRAMS and k // s >= SPLIT_K_MIN_K]


def start_split(m: int, n: int, k: int, config: dict[str, Any]) -> int:
    """The SPLIT_K a splittable conv starts with, before any tuning, at its start tile `config`: 1,
    unless its output tiles are fewer than SPLIT_K_TILES (about one per SM); then the smallest
    allowed split (allowed_splits) that gives every SM a program, or the largest allowed short of
    that. The GEMV-shaped convs of a video network's last stages at batch 1 otherwise stream
    megabytes of weights through 8 to 18 programs wherever a short budget leaves them untuned
    (r2plus1d_18: 20-65 us a conv)."""
    tiles = -(-m // config["BLOCK_M"]) * -(-n // config["BLOCK_N"])
    allowed = allowed_splits(tiles, k)
    return next((s for s in allowed if tiles * s >= SPLIT_K_TILES), allowed[-1] if allowed else 1)


def kernel_head(
    buf: SourceBuffer,
    fn: str,
    args: list[str],
    config: dict[str, Any],
    m: int,
    n: int,
    k: int,
    dtype: str,
    flags: dict[str, Any] | None = None,
) -> None:
    """CONFIG (the GPU's starting tile), INTERPRETER_CONFIG (large blocks: one numpy pass each on
    the CPU, sized by the M×N×K the kernel sweeps) and the kernel's signature. `flags` are more
    boolean constexprs, at their defaults in both configs."""
    flags = flags or {}
    buf.line(f"CONFIG = {config!r}")
    bm, bn, bk = (
        min(256, max(16, next_pow2(m))),
        min(128, max(16, next_pow2(n))),
        min(128, max(16, next_pow2(k))),
    )
    upcast = dtype == "bfloat16"  # the CPU interpreter multiplies bfloat16 tiles wrongly
    interp = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "UPCAST": upcast, **flags}
    buf.line(f"INTERPRETER_CONFIG = {interp!r}")
    buf.line()
    buf.line()
    buf.line("@triton.jit")
    buf.line(
        f"def {fn}({', '.join(args)}, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,"
    )
    more = "".join(f", {f}: tl.constexpr" for f in flags)
    buf.line(f"        UPCAST: tl.constexpr{more}):")


def broadcast_offset(shape: tuple[int, ...], coords: dict[int, str]) -> str | None:
    """Offset into a row-major tensor that broadcasts against the output whose coordinate along
    axis d is `coords[d]` (as many axes as coordinates); None where it is one element."""
    rank = len(coords)
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    strides = [int(np.prod(padded[d + 1 :], dtype=np.int64)) for d in range(rank)]
    terms = [
        f"{coords[d]} * {strides[d]}" if strides[d] != 1 else coords[d] for d in range(rank) if padded[d] != 1
    ]
    return " + ".join(terms) if terms else None


def row_input_index(
    shape: tuple[int, ...], full: tuple[int, ...], split: int | None = None
) -> tuple[str | None, bool]:
    """(index expression, is_vector) for loading an input broadcast to `full` from row `row`.

    Dims before `split` (default: the last axis) index rows; the trailing dims are the row,
    addressed by `cols`. An input that covers the whole row reads `cols`; one that varies along
    some of the row's dims only (a per-channel constant over a channels-last (H, W, C) row) reads
    each of those dims' coordinate out of `cols`; one constant along the row reads no column.
    """
    rank = len(full)
    k = rank - 1 if split is None else split
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    strides = [prod(padded[d + 1 :]) for d in range(rank)]
    row_strides = [prod(full[d + 1 : k]) for d in range(k)]
    terms = []
    for d in range(k):
        if padded[d] == 1:
            continue
        coord = f"((row // {row_strides[d]}) % {full[d]})" if row_strides[d] > 1 else f"(row % {full[d]})"
        terms.append(f"{coord} * {strides[d]}" if strides[d] != 1 else coord)
    trailing, whole = padded[k:], tuple(full[k:])
    vector = any(t != 1 for t in trailing)
    if vector and trailing == whole:
        terms.append("cols")
    elif vector:
        for d in range(k, rank):
            if padded[d] == 1:
                continue
            inner = prod(full[d + 1 :])
            coord = f"(cols // {inner})" if inner > 1 else "cols"
            coord = f"({coord} % {full[d]})" if d > k else coord
            terms.append(f"{coord} * {strides[d]}" if strides[d] != 1 else coord)
    if not terms:
        return None, False
    return " + ".join(terms), vector


def broadcast_index(
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    strides: tuple[int, ...] | None = None,
    offs: str = "offs",
) -> str | None:
    """Index expression into an input broadcast to out_shape; None for a scalar.

    `strides`: the input read through a folded Transpose/Reshape, as strides into its buffer.
    `offs`: the expression of the output offsets it is read at (a window op's shifted offsets).
    """
    if int(np.prod(in_shape, dtype=np.int64)) == 1:
        return None
    padded = (1,) * (len(out_shape) - len(in_shape)) + tuple(in_shape)
    contiguous = [int(np.prod(padded[d + 1 :], dtype=np.int64)) for d in range(len(padded))]
    if strides is not None:
        given = [0] * (len(padded) - len(strides)) + list(strides)
        if given != contiguous:
            out_strides = [int(np.prod(out_shape[d + 1 :], dtype=np.int64)) for d in range(len(out_shape))]
            terms = []
            for d in range(len(padded)):
                if padded[d] == 1 or given[d] == 0:
                    continue
                coord = (
                    f"(({offs} // {out_strides[d]}) % {out_shape[d]})"
                    if out_strides[d] > 1
                    else f"({offs} % {out_shape[d]})"
                )
                terms.append(f"{coord} * {given[d]}" if given[d] != 1 else coord)
            return "(" + " + ".join(terms) + ")"
    if padded == tuple(out_shape):
        return offs
    # Strides of the (contiguous) input, and of the output's iteration space.
    in_strides = contiguous
    out_strides = [int(np.prod(out_shape[d + 1 :], dtype=np.int64)) for d in range(len(out_shape))]
    live = [d for d in range(len(padded)) if padded[d] != 1]
    # A contiguous trailing block (e.g. a bias over the last dims): offs modulo its size.
    if live == list(range(live[0], len(padded))) and all(padded[d] == out_shape[d] for d in live):
        return f"({offs} % {int(np.prod(padded, dtype=np.int64))})"
    terms = []
    for d in live:
        coord = (
            f"(({offs} // {out_strides[d]}) % {out_shape[d]})"
            if out_strides[d] > 1
            else f"({offs} % {out_shape[d]})"
        )
        terms.append(f"{coord} * {in_strides[d]}" if in_strides[d] != 1 else coord)
    return "(" + " + ".join(terms) + ")"


# -- the kernel module's header: what it is, the nodes it covers (comments), the imports ----------


def module_title(buf: SourceBuffer, title: str) -> None:
    """The first line of every generated module: what kernel it is and for which group."""
    buf.line(f"# Generated by opfuse: {title}")


def node_comment(node: Node, role: str = "", op: str = "") -> str:
    """A header line naming a node the kernel covers: its generated id, its op (or `op`), its name
    escaped for a comment, and its `role` in the kernel."""
    text = f"#   {node.id}: {op or node.op_type} {comment_text(node.name)}"
    return f"{text} ({role})" if role else text


def concat_comments(buf: SourceBuffer, graph: Graph, nodes: list[Node], slot: dict[str, int]) -> None:
    """For each Concat among `nodes`, which kernel input holds which range along its axis."""
    for n in nodes:
        if n.op_type == "Concat":
            axis, parts = concat_parts(graph, n)
            for name, start, length in parts:
                buf.line(f"# in{slot[name]}: {n.id} axis {axis} [{start}, {start + length})")


def module_imports(buf: SourceBuffer) -> None:
    """The header's end: the module imports Triton, then its constants and kernel follow."""
    buf.line("import triton")
    buf.line("import triton.language as tl")
    buf.line()


def part_lanes(coord: str, start: int, length: int, size: int) -> tuple[str, str]:
    """A Concat part read where the Concat's coordinate along its axis is `coord` (of `size`):
    the part's own coordinate, and the condition on the lanes it holds ("" where it holds all)."""
    local = f"({coord} - {start})" if start else coord
    held = [f"({coord} >= {start})"] if start else []
    held += [f"({coord} < {start + length})"] if start + length < size else []
    return local, " & ".join(held)


def concat_parts(graph: Graph, node: Node) -> tuple[int, list[tuple[str, int, int]]]:
    """A Concat's axis (non-negative) and each input's (value, start, length) along it."""
    shape = tuple(graph.spec(node.outputs[0]).shape)
    axis = int(node.attrs.get("axis", 0)) % len(shape)
    parts: list[tuple[str, int, int]] = []
    start = 0
    for x in node.inputs:
        if not x:
            continue
        length = int(graph.spec(x).shape[axis])
        parts.append((x, start, length))
        start += length
    return axis, parts
