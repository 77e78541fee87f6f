"""Triton flash attention: scores, mask, online softmax and the value product in one kernel.

Each program owns BLOCK_M query rows of one (batch, head) and streams the keys and values in
BLOCK_N tiles, keeping a running max and sum (online softmax) so the Sq × Sk score matrix never
exists in memory. Q, K, V and the output are addressed through strides, which folds the
head split and merge (Reshape/Transpose) into indexing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from opfuse.codegen.epilogue import dot_precision, emit_nodes
from opfuse.codegen.fragments import KernelSource, module_imports, module_title, node_comment
from opfuse.codegen.source import SourceBuffer, float_literal, guarded_load, power_run
from opfuse.graph import Graph, Node
from opfuse.ir.queries import contiguous_strides, next_pow2, scalar_constant
from opfuse.ir.views import AttentionMatch, StridedView


def _four_d(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[list[int], list[int]]:
    if len(shape) == 3:
        return [shape[0], 1, shape[1], shape[2]], [strides[0], 0, strides[1], strides[2]]
    return list(shape), list(strides)


def _broadcast(shape: list[int], strides: list[int], target: list[int]) -> list[int]:
    """Stride 0 along dims where this operand has size 1 and the iteration space does not."""
    return [0 if (s == 1 and t != 1) else st for s, st, t in zip(shape, strides, target, strict=True)]


def _mask_strides(graph: Graph, name: str, rank: int) -> list[int]:
    """A mask's strides over the kernel's [B, H, rows, columns], where the scores have `rank` (3:
    [B, rows, columns], the head axis being the kernel's own). The mask broadcasts against the
    scores from the right, as ONNX broadcasts: a rank-3 mask of rank-3 scores is per batch, not per
    head."""
    shape = tuple(graph.spec(name).shape)
    while len(shape) > rank and shape[0] == 1:  # scores of rank 5+, their batch dims merged
        shape = shape[1:]
    padded = (1,) * (rank - len(shape)) + shape
    strides = contiguous_strides(padded)
    out = [0 if padded[d] == 1 else strides[d] for d in range(rank)]
    return out if rank == 4 else [out[0], 0, out[1], out[2]]


def _literal(value: float) -> str:
    if math.isinf(value):
        return 'float("-inf")' if value < 0 else 'float("inf")'
    return float_literal(value)


@dataclass(frozen=True)
class _Geometry:
    """The attention's sizes and each operand's strides, broadcast to [B, H, rows, columns]."""

    b: int
    h: int
    sq: int
    sk: int
    d: int
    dv: int
    qst: list[int]
    kst: list[int]  # Kᵀ: [B, H, D, Sk]
    vst: list[int]
    ost: list[int]
    # Q's and Kᵀ's parts (AttentionMatch.q_parts, k_parts): (first head dim, width, strides).
    q_parts: list[tuple[int, int, list[int]]]
    k_parts: list[tuple[int, int, list[int]]]

    @property
    def dp(self) -> int:
        return max(16, next_pow2(self.d))

    @property
    def dvp(self) -> int:
        return max(16, next_pow2(self.dv))


def _geometry(m: AttentionMatch) -> _Geometry:
    qs, qst = _four_d(m.q.shape, m.q.strides)
    ks, kst = _four_d(m.k.shape, m.k.strides)
    vs, vst = _four_d(m.v.shape, m.v.strides)
    os_, ost = _four_d(m.out.shape, m.out.strides)
    b, h, sq, d = os_[0], os_[1], qs[2], qs[3]
    sk, dv = ks[3], vs[3]

    def parts(views: list[StridedView], axis: int, target: list[int]) -> list[tuple[int, int, list[int]]]:
        out, first = [], 0
        for v in views:
            shape, strides = _four_d(v.shape, v.strides)
            width = shape[axis]
            out.append(
                (first, width, _broadcast(shape, strides, [*target[:axis], width, *target[axis + 1 :]]))
            )
            first += width
        return out

    return _Geometry(
        b, h, sq, sk, d, dv,
        _broadcast(qs, qst, [b, h, sq, d]),
        _broadcast(ks, kst, [b, h, d, sk]),
        _broadcast(vs, vst, [b, h, sk, dv]),
        ost,
        parts(m.q_parts, 3, [b, h, sq, d]),
        parts(m.k_parts, 2, [b, h, d, sk]),
    )  # fmt: skip


def generate_attention(
    kernel_id: str, m: AttentionMatch, nodes: list[Node], graph: Graph, group_id: str, precision: str
) -> KernelSource:
    g = _geometry(m)
    dtype = graph.spec(m.q.base).dtype
    q_args = [f"q{i}" for i in range(len(m.q_parts))] or ["q"]
    k_args = [f"k{i}" for i in range(len(m.k_parts))] or ["k"]
    args = [*q_args, *k_args, "v", *(["mask"] if m.mask else []), *(["cond"] if m.cond else []), "o"]
    fn = "fused_attention"
    buf = SourceBuffer()
    module_title(buf, f"flash-attention kernel {kernel_id} for group {group_id}.")
    buf.line(f"# batch {g.b}, heads {g.h}, queries {g.sq}, keys {g.sk}, head dim {g.d}, value dim {g.dv}")
    for n in nodes:
        buf.line(node_comment(n))
    module_imports(buf)
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "UPCAST": False, "num_warps": 4, "num_stages": 2}
    buf.line(f"CONFIG = {config!r}")
    bm, bn = min(128, max(16, next_pow2(g.sq))), min(128, max(16, next_pow2(g.sk)))
    upcast = dtype == "bfloat16"  # the CPU interpreter multiplies bfloat16 tiles wrongly
    buf.line(f'INTERPRETER_CONFIG = {{"BLOCK_M": {bm}, "BLOCK_N": {bn}, "UPCAST": {upcast}}}')
    buf.line()
    buf.line()
    buf.line("@triton.jit")
    buf.line(
        f"def {fn}({', '.join(args)}, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):"
    )
    with buf.indent():
        _query_tile(buf, m, g)
        buf.line(f"for n0 in range(0, {g.sk}, BLOCK_N):")
        with buf.indent():
            _key_block(buf, m, g, graph, dot_precision(dtype, precision))
        if m.nan_guard:
            buf.line(
                "out = tl.where(l_i[:, None] > 0.0, acc / l_i[:, None], 0.0)  # fully masked rows give 0"
            )
        else:
            buf.line("out = acc / l_i[:, None]")
        if m.epilogue:
            regs = {x: "out" for x in m.epilogue[0].inputs if x and scalar_constant(graph, x) is None}
            for n in m.epilogue:  # the ops' scalar constants, as literals
                for x in n.inputs:
                    c = scalar_constant(graph, x) if x else None
                    if c is not None:
                        regs[x] = _literal(c)
            emit_nodes(buf, graph, m.epilogue, regs, prefix="e")
            buf.line(f"out = {regs[m.epilogue[-1].outputs[0]]}")
        ost = g.ost
        buf.line(
            f"tl.store(o + b * {ost[0]} + h * {ost[1]} + rm[:, None] * {ost[2]} + rdv[None, :] * {ost[3]}, "
            f"out.to(o.dtype.element_ty), mask=(rm[:, None] < {g.sq}) & (rdv[None, :] < {g.dv}))"
        )
    buf.line()
    buf.line()
    buf.line(f"def launch({', '.join(args)}, config=None):")
    with buf.indent():
        buf.line("c = CONFIG if config is None else config")
        buf.line(f'{fn}[(triton.cdiv({g.sq}, c["BLOCK_M"]), {g.b * g.h})]({", ".join(args)}, **c)')
    inputs = m.inputs()
    return KernelSource(kernel_id, "attention", buf.getvalue(), inputs, [m.out.base], config)


def _query_tile(buf: SourceBuffer, m: AttentionMatch, g: _Geometry) -> None:
    """The program's (batch, head) and query rows, their Q tile, and the online softmax's state."""
    qst = g.qst
    buf.line("pid_m = tl.program_id(0)")
    buf.line("bh = tl.program_id(1).to(tl.int64)")
    buf.line(f"b = bh // {g.h}")
    buf.line(f"h = bh % {g.h}")
    buf.line("rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
    buf.line(f"rd = tl.arange(0, {g.dp})")
    buf.line(f"rdv = tl.arange(0, {g.dvp})")
    if not g.q_parts:
        buf.line(
            f"q_tile = tl.load(q + {m.q.offset} + b * {qst[0]} + h * {qst[1]} + rm[:, None] * {qst[2]} + rd[None, :] * {qst[3]}, "
            f"mask=(rm[:, None] < {g.sq}) & (rd[None, :] < {g.d}), other=0.0)"
        )
    for i, ((first, width, st), view) in enumerate(zip(g.q_parts, m.q_parts, strict=True)):
        # Each input of the Concat fills its columns of the tile; the others' lanes load 0.
        cols = f"(rd[None, :] - {first})" if first else "rd[None, :]"
        ok = f"(rm[:, None] < {g.sq}) & (rd[None, :] >= {first}) & (rd[None, :] < {first + width})"
        at = f"{view.offset} + b * {st[0]} + h * {st[1]} + rm[:, None] * {st[2]} + {cols} * {st[3]}"
        part = guarded_load(f"q{i}", at, ok)
        buf.line(f"q_tile = {part}" if i == 0 else f"q_tile += {part}")
    buf.line("if UPCAST:")
    with buf.indent():
        buf.line("q_tile = q_tile.to(tl.float32)")
    buf.line('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)')
    buf.line("l_i = tl.zeros([BLOCK_M], tl.float32)")
    buf.line(f"acc = tl.zeros([BLOCK_M, {g.dvp}], tl.float32)")


def _tile_load(
    ptr: str, offset: int, strides: Sequence[int], axes: tuple[str, str], mask: str, other: str = "0.0"
) -> str:
    """A tile of the key loop at (batch b, head h, rows, columns) through `strides` (each lane's
    address inside the tensor: `guarded_load`), vector loads claimed along the axis of stride 1."""
    b, h, s2, s3 = strides
    at = f"{offset} + b * {b} + h * {h} + {axes[0]} * {s2} + {axes[1]} * {s3}"
    if s3 == 1:
        return guarded_load(ptr, at, mask, other, run=power_run(offset, b, h, s2), axis=1)
    if s2 == 1:
        return guarded_load(ptr, at, mask, other, run=power_run(offset, b, h, s3), axis=0)
    return guarded_load(ptr, at, mask, other)


def _key_block(buf: SourceBuffer, m: AttentionMatch, g: _Geometry, graph: Graph, prec: str) -> None:
    """One block of keys: the K and V tiles, the scores (scaled, masked), the online softmax's
    update of the running maximum, sum and output."""
    kst, vst, sq, sk = g.kst, g.vst, g.sq, g.sk
    rank = len(m.q.shape)  # the scores' rank: Q's (Q and K have one rank)
    buf.line("rn = n0 + tl.arange(0, BLOCK_N)")
    buf.line(f"k_ok = (rd[:, None] < {g.d}) & (rn[None, :] < {sk})")
    if not g.k_parts:
        buf.line(f"k_tile = {_tile_load('k', m.k.offset, kst, ('rd[:, None]', 'rn[None, :]'), 'k_ok')}")
    for i, ((first, width, st), view) in enumerate(zip(g.k_parts, m.k_parts, strict=True)):
        rows = f"(rd[:, None] - {first})" if first else "rd[:, None]"
        ok = f"k_ok & (rd[:, None] >= {first}) & (rd[:, None] < {first + width})"
        part = _tile_load(f"k{i}", view.offset, st, (rows, "rn[None, :]"), ok)
        buf.line(f"k_tile = {part}" if i == 0 else f"k_tile += {part}")
    buf.line(f"v_ok = (rn[:, None] < {sk}) & (rdv[None, :] < {g.dv})")
    buf.line(f"v_tile = {_tile_load('v', m.v.offset, vst, ('rn[:, None]', 'rdv[None, :]'), 'v_ok')}")
    buf.line("if UPCAST:")
    with buf.indent():
        buf.line('s = tl.dot(q_tile, k_tile.to(tl.float32), input_precision="ieee")')
    buf.line("else:")
    with buf.indent():
        buf.line(f"s = tl.dot(q_tile, k_tile{prec})")
    buf.line(f"s = s * {float_literal(m.scale)}")
    if m.mask or m.cond:
        buf.line(f"s_ok = (rm[:, None] < {sq}) & (rn[None, :] < {sk})")
    if m.mask:
        ms = _mask_strides(graph, m.mask, rank)
        buf.line(
            f"s = s + {_tile_load('mask', 0, ms, ('rm[:, None]', 'rn[None, :]'), 's_ok')}.to(tl.float32)"
        )
    if m.cond:
        cs = _mask_strides(graph, m.cond, rank)
        buf.line(f"keep = {_tile_load('cond', 0, cs, ('rm[:, None]', 'rn[None, :]'), 's_ok', other='0')}")
        buf.line(f"s = tl.where(keep != 0, s, {_literal(m.fill)})")
    buf.line(f's = tl.where(rn[None, :] < {sk}, s, float("-inf"))')
    buf.line("m_new = tl.maximum(m_i, tl.max(s, 1))")
    buf.line('m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows masked so far')
    buf.line("p = tl.exp(s - m_safe[:, None])")
    buf.line("alpha = tl.exp(m_i - m_safe)")
    buf.line("l_i = l_i * alpha + tl.sum(p, 1)")
    buf.line("if UPCAST:")
    with buf.indent():
        buf.line('acc = acc * alpha[:, None] + tl.dot(p, v_tile.to(tl.float32), input_precision="ieee")')
    buf.line("else:")
    with buf.indent():
        buf.line(f"acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile{prec})")
    buf.line("m_i = m_new")
