"""The launch configs tuning tries for each template's kernels, around the kernel's own start config
(codegen picks it from the shapes): the template registry's `candidates` of each entry.

Each function takes the kernel (its kind, start config and source) and lists the overrides timed;
`opfuse.tuning.candidates` asks the registry for them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

from opfuse.codegen.fragments import allowed_splits
from opfuse.codegen.rowwise import rows_per_program
from opfuse.ir.queries import next_pow2
from opfuse.ir.rows import MIN_TILED_COLUMNS

# A row kernel's GEMM accumulator (BLOCK_M x next_pow2(N) float32) tried at most this large.
GEMM_ROW_TILE = 16384


class KernelLike(Protocol):
    """What the candidates read of a kernel (runtime.plan.KernelInfo has these fields)."""

    kind: str
    config: dict[str, Any]
    source: str


Candidates = Callable[[KernelLike], list[dict[str, Any]]]


# Variations tried around each kernel's own starting config (codegen picks it from the shapes).
CANDIDATES: dict[str, list[dict[str, Any]]] = {
    "gemm": [
        {},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
        # Large tiles for big GEMMs on Hopper (8 warps: two warpgroups of wgmma), and a deep K
        # tile for few rows and long K (a decoder's MLP at batch 1). Where one does not fit in
        # shared memory (float32 operands) it fails to compile and loses.
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    ],
    "conv": [
        {},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    ],
    # Max pooling (codegen/pool.py): [pixels, channels] tiles, channels contiguous.
    "pool": [
        {},
        {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 2},
        {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
        {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4},
        {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
    ],
    # Two chained GEMVs (codegen/chain.py): rows are the batch; the column tile sets how many
    # programs share the work, each computing the hidden vector again.
    "chain": [
        {},
        {"BLOCK_N": 32, "BLOCK_K": 64},
        {"BLOCK_N": 128, "BLOCK_K": 64},
        {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64},
    ],
    "attention": [
        {},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    ],
    "pointwise": [{"BLOCK": b, "num_warps": w} for b, w in [(1024, 4), (2048, 8), (4096, 8), (512, 4)]],
    "rowwise": [{"num_warps": w} for w in (2, 4, 8, 16)],
}


# The depthwise template (no tensor cores, one multiply-add per tap and channel): the conv tiles
# with its runtime window loop (the default form, measured on the H200), and smaller tiles with
# the loop unrolled (UNROLL: its loads issue together, more registers held), for enough programs
# at batch 1.
DEPTHWISE_CANDIDATES: list[dict[str, Any]] = [
    *CANDIDATES["conv"],
    *(
        {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": 1, "UNROLL": True}
        for m, n, w in [(32, 64, 4), (16, 64, 2), (32, 32, 2), (64, 32, 4)]
    ),
]
# Rows per program a row kernel of short rows tries, as tiles of this many elements: one row per
# program (the default, as measured on the H200 for the zoo), or a tile of 1024 or 2048
# (ConvNeXt-T's LayerNorm over 96 channels at batch 32 moved 0.6 TB/s one row per program).
ROW_TILES = (1024, 2048)


def split_k_candidates(k: KernelLike) -> list[dict[str, Any]]:
    """The split-K configs of a conv or GEMM kernel with the SPLIT_K constexpr whose output tiles
    are few (SPLIT_K_TILES); tiles of 16 rows where the rows are 16 or fewer (GEMV-shaped: a
    network's last stage, or its classifier, at batch 1), with 32 columns too for a GEMM."""
    found = re.search(r"\bM=(\d+) N=(\d+) K=(\d+)\.?$", k.source, re.MULTILINE)  # the template's header
    if k.kind not in ("conv", "gemm") or "SPLIT_K" not in k.config or found is None:
        return []
    m, n, kk = (int(v) for v in found.groups())
    out: list[dict[str, Any]] = []
    tiles_tried = [(64, 64), (32, 64), (16, 64)] + ([(16, 32)] if k.kind == "gemm" else [])
    for bm, bn in tiles_tried:
        if bm > max(16, next_pow2(m)) or (bm == 16 and m > 16):
            continue  # rows the tile would leave empty; 16 only for a few pixels (GEMV-shaped)
        for split in allowed_splits(-(-m // bm) * -(-n // bn), kk):
            out.append({"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": split, "num_warps": 4, "num_stages": 3})
    return out


def fixed(kind: str) -> Candidates:
    """The same candidates for every kernel of a template (CANDIDATES[kind])."""
    return lambda k: CANDIDATES[kind]


def gemm_candidates(k: KernelLike) -> list[dict[str, Any]]:
    """A GEMM that pools its A operand (BLOCK_P: pooled_gemm) also tries 16 and 32 pixels per step;
    one of few output tiles, split-K (split_k_candidates)."""
    pooled = [{"BLOCK_P": p} for p in (16, 32) if p != k.config["BLOCK_P"]] if "BLOCK_P" in k.config else []
    return CANDIDATES["gemm"] + pooled + split_k_candidates(k)


def chain_candidates(k: KernelLike) -> list[dict[str, Any]]:
    """A chain that pools its input (BLOCK_P: pooled_gemm) also tries 16 and 32 pixels per step."""
    if "BLOCK_P" in k.config:
        return CANDIDATES["chain"] + [{"BLOCK_P": p} for p in (16, 32) if p != k.config["BLOCK_P"]]
    return CANDIDATES["chain"]


def conv_candidates(k: KernelLike) -> list[dict[str, Any]]:
    """The depthwise template (the only one with UNROLL) has its own (DEPTHWISE_CANDIDATES); a
    conv whose K loop can be split (SPLIT_K) tries the tiles unsplit, and where its tiles are too
    few for the GPU, split-K."""
    if "UNROLL" in k.config:
        return DEPTHWISE_CANDIDATES
    if "SPLIT_K" in k.config:
        # The tiles are tried whole (its start may be split: start_split), the splits after them.
        whole = [c if not c else {**c, "SPLIT_K": 1} for c in CANDIDATES["conv"]]
        return whole + split_k_candidates(k)
    return CANDIDATES["conv"]


def rowwise_candidates(k: KernelLike) -> list[dict[str, Any]]:
    """A row kernel that may hold several rows per program (BLOCK_M in its config) tries one, and
    tiles of ROW_TILES elements, with 4 and 8 warps each (2 more for one row); a strided one
    (BLOCK_I) also half and a quarter of its columns per program, never under MIN_TILED_COLUMNS;
    one that computes a GEMM on its tiles (BLOCK_K) its row (or column) and K tiles with 4 and 8
    warps."""
    if "BLOCK_I" in k.config and "BLOCK_K" in k.config:
        # A GEMM on a strided tile (its rows an item's R): tl.dot's 16 columns at least; a norm
        # over each item (ITEM_TILE) holds every channel in its one block.
        bi = int(k.config["BLOCK_I"])
        item = re.search(r"^ITEM_TILE = True$", k.source, re.MULTILINE) is not None
        widths = [bi] if item else [b for b in (bi, bi // 2, bi // 4) if b >= 16]
        return [
            {"BLOCK_I": b, "BLOCK_K": bk, "num_warps": w} for b in widths for bk in (32, 64) for w in (4, 8)
        ]
    if "BLOCK_I" in k.config:
        # A strided row kernel: fewer adjacent columns per program, more programs (a squeeze-
        # excitation pool at batch 1, with its depthwise conv computed on the tiles, has few).
        bi = int(k.config["BLOCK_I"])
        narrower = [b for b in (bi // 2, bi // 4) if b >= MIN_TILED_COLUMNS]
        return CANDIDATES["rowwise"] + [{"BLOCK_I": b, "num_warps": w} for b in narrower for w in (4, 8)]
    if "BLOCK_M" not in k.config:
        return CANDIDATES["rowwise"]
    block = int(k.config["BLOCK_R"])
    found = re.search(r"^ROWS = (\d+)$", k.source, re.MULTILINE)  # the generated module's row count
    rows = int(found.group(1)) if found else 1 << 30
    if "BLOCK_K" in k.config:
        # A GEMM on the tiles (fusion/rules/gemm_reduction.py): tl.dot's 16 rows at least, as many
        # as there are, within GEMM_ROW_TILE accumulator elements; K tiles of 32 and 64.
        ms = [m for m in (16, 32, 64) if m == 16 or (m * block <= GEMM_ROW_TILE and m <= next_pow2(rows))]
        return [{"BLOCK_M": m, "BLOCK_K": bk, "num_warps": w} for m in ms for bk in (32, 64) for w in (4, 8)]
    sizes = sorted({rows_per_program(rows, block, tile) for tile in ROW_TILES} - {1})
    one = [{"BLOCK_M": 1, "num_warps": w} for w in (2, 4, 8, 16)]
    return one + [{"BLOCK_M": m, "num_warps": w} for m in sizes for w in (4, 8)]
