"""What tuning tries: the launch configs of each kernel kind, around the kernel's own start config.

`candidates(k)` lists the overrides timed for kernel `k`; `fallback_configs(k)` the configs tried
in order where its start config does not compile on the device.
"""

from __future__ import annotations

import re
from typing import Any

from opfuse.codegen.rowwise import rows_per_program
from opfuse.ir.rows import MIN_TILED_COLUMNS
from opfuse.runtime.plan import KernelInfo
from opfuse.tuning.cache import config_key

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


# Split-K (codegen/conv.py), for a conv whose output tiles are fewer than SPLIT_K_TILES (about the
# H200's 132 SMs): its K loop shared among 2, 4 or 8 programs per tile, at most SPLIT_K_PROGRAMS
# programs in all and at least SPLIT_K_MIN_K of K each.
SPLIT_K_TILES = 128
SPLIT_K_PROGRAMS = 512
SPLIT_K_MIN_K = 256


def split_k_candidates(k: KernelInfo) -> list[dict[str, Any]]:
    found = re.search(r"; M=(\d+) N=(\d+) K=(\d+)$", k.source, re.MULTILINE)  # the template's header
    if k.kind != "conv" or "SPLIT_K" not in k.config or found is None:
        return []
    m, n, kk = (int(v) for v in found.groups())
    out: list[dict[str, Any]] = []
    for bm, bn in ((64, 64), (32, 64)):
        tiles = -(-m // bm) * -(-n // bn)
        for split in (2, 4, 8):
            if tiles < SPLIT_K_TILES and tiles * split <= SPLIT_K_PROGRAMS and kk // split >= SPLIT_K_MIN_K:
                out.append({"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_K": split, "num_warps": 4, "num_stages": 3})
    return out


def candidates(k: KernelInfo) -> list[dict[str, Any]]:
    """The configs tried for kernel `k`, each an override of its default config. The depthwise
    template has its own (DEPTHWISE_CANDIDATES). A row kernel that may hold several rows per
    program (BLOCK_M in its config) tries one, and tiles of ROW_TILES elements, with 4 and 8 warps
    each (2 more for one row); a strided one (BLOCK_I) also half and a quarter of its columns per
    program, never under MIN_TILED_COLUMNS. A GEMM that pools its A operand (BLOCK_P) also tries 16
    and 32 pixels per step. A conv whose tiles are too few for the GPU also tries split-K."""
    if k.kind == "conv" and "UNROLL" in k.config:  # only the depthwise template has the flag
        return DEPTHWISE_CANDIDATES
    if k.kind == "gemm" and "BLOCK_P" in k.config:
        # A GEMM that pools its A operand (pooled_gemm): also fewer or more pixels per step.
        return CANDIDATES["gemm"] + [{"BLOCK_P": p} for p in (16, 32) if p != k.config["BLOCK_P"]]
    if k.kind == "rowwise" and "BLOCK_I" in k.config:
        # A strided row kernel: fewer adjacent columns per program, more programs (a squeeze-
        # excitation pool at batch 1, with its depthwise conv computed on the tiles, has few).
        bi = int(k.config["BLOCK_I"])
        narrower = [b for b in (bi // 2, bi // 4) if b >= MIN_TILED_COLUMNS]
        return CANDIDATES["rowwise"] + [{"BLOCK_I": b, "num_warps": w} for b in narrower for w in (4, 8)]
    if k.kind == "conv" and "SPLIT_K" in k.config:
        return CANDIDATES["conv"] + split_k_candidates(k)
    if k.kind != "rowwise" or "BLOCK_M" not in k.config:
        return CANDIDATES.get(k.kind, [])
    block = int(k.config["BLOCK_R"])
    found = re.search(r"^ROWS = (\d+)$", k.source, re.MULTILINE)  # the generated module's row count
    rows = int(found.group(1)) if found else 1 << 30
    sizes = sorted({rows_per_program(rows, block, tile) for tile in ROW_TILES} - {1})
    one = [{"BLOCK_M": 1, "num_warps": w} for w in (2, 4, 8, 16)]
    return one + [{"BLOCK_M": m, "num_warps": w} for m in sizes for w in (4, 8)]


def fallback_configs(k: KernelInfo) -> list[dict[str, Any]]:
    """The configs a kernel tries, in order, where its starting config fails to compile (on the GPU,
    a tile whose pipeline stages do not fit in the device's shared memory: a conv with a window
    prologue buffers every tap's load): one pipeline stage, then also half the K tile, then its
    tuning candidates."""
    start = dict(k.config)
    tries: list[dict[str, Any]] = []
    if int(start.get("num_stages", 1)) > 1:
        tries.append({**start, "num_stages": 1})
    if int(start.get("BLOCK_K", 0)) > 16:
        tries.append({**start, "num_stages": 1, "BLOCK_K": int(start["BLOCK_K"]) // 2})
    tries += [{**start, **c} for c in candidates(k)]
    out: list[dict[str, Any]] = []
    seen = {config_key(start)}
    for c in tries:
        if config_key(c) not in seen:
            seen.add(config_key(c))
            out.append(c)
    return out
