"""Pieces every template is built from: the kernel's record, literals and tensors, index
arithmetic, the kernel module's header and its jitted function's signature.

Templates import these (and `source`, `emitters`, `epilogue`) and never one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from opfuse.codegen.source import SourceBuffer, float_literal
from opfuse.graph import Graph
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
            literals[name] = float_literal(value)
        elif name not in loaded:
            loaded.append(name)
    return literals, loaded


def matmul_tile_config(m: int, n: int, k: int) -> dict[str, int]:
    """A starting tile for an M×N×K product on the GPU, before any tuning: 64×64×32 (measured the
    better default on the H200 for the zoo), shrunk where the problem is smaller (batch 1)."""
    bm = min(64, max(16, next_pow2(m)))
    bn = min(64, max(32, next_pow2(n)))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}


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
    """Offset into a tensor that broadcasts against the 4-D output, from the output coordinates."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    strides = [int(np.prod(padded[d + 1 :], dtype=np.int64)) for d in range(4)]
    terms = [
        f"{coords[d]} * {strides[d]}" if strides[d] != 1 else coords[d] for d in range(4) if padded[d] != 1
    ]
    return " + ".join(terms) if terms else None


def row_input_index(
    shape: tuple[int, ...], full: tuple[int, ...], split: int | None = None
) -> tuple[str | None, bool]:
    """(index expression, is_vector) for loading an input broadcast to `full` from row `row`.

    Dims before `split` (default: the last axis) index rows; the trailing dims are the row,
    addressed by `cols`. An input either covers the whole row or is constant along it.
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
    vector = trailing == whole and prod(whole) != 1
    if not vector and any(t != 1 for t in trailing):
        raise ValueError(f"input of shape {shape} varies along only part of the row {whole}")
    if vector:
        terms.append("cols")
    if not terms:
        return None, False
    return " + ".join(terms), vector
