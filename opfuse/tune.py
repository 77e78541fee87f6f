"""Tuning on the GPU: launch configs per kernel, and template vs vendor for each anchor group.

Every candidate is timed with CUDA events on random inputs of the kernel's real shapes, in a worker
process (tuning/pool.py): a candidate that fails scores infinity, and one that crashes or hangs the
worker is killed with it instead of the compiler. Results are cached by kernel signature, GPU and
versions, so compiling the same model again reuses them. A time budget bounds the work: kernels not
reached keep their default config.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from opfuse.codegen.rowwise import rows_per_program
from opfuse.ir.rows import MIN_TILED_COLUMNS
from opfuse.runtime.executor import Executor
from opfuse.runtime.plan import KernelInfo, Plan
from opfuse.runtime.tensors import torch_dtype
from opfuse.tuning.pool import CompileJob, CompilePool, Timing, TimingRequest, TuningPool, cuda_graph_ms

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


def _cache_path() -> str:
    root = os.environ.get("OPFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "opfuse")
    os.makedirs(root, exist_ok=True)
    return os.path.join(root, "tuning.json")


def kernel_signature(k: KernelInfo) -> str:
    """What decides a kernel's best config: its code without ids or comments, on this GPU and stack."""
    import triton

    body = "\n".join(
        line
        for line in k.source.splitlines()
        if not line.lstrip().startswith("#") and not line.startswith(("CONFIG", "INTERPRETER_CONFIG"))
    )
    body = re.sub(r"\bk\d+_", "K_", body)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    stack = f"{gpu}|{torch.__version__}|{triton.__version__}"
    return hashlib.sha256(f"{stack}\n{body}".encode()).hexdigest()


def measured(entry: Any) -> bool:
    """Whether a cache entry holds only measurements that ran: every time in it finite. A failure
    (infinity: a config that did not compile, crashed, or a worker that could not start) belongs to
    the compile that met it, never to the cache, where it would mark the kernel bad for every later
    compile on the host."""
    if not isinstance(entry, dict):
        return False
    times = [entry[k] for k in ("ms", "template_ms", "vendor_ms") if k in entry]
    return all(isinstance(t, int | float) and math.isfinite(t) for t in times)


def _read_entries(path: str) -> dict[str, Any]:
    """The file's entries that hold measurements (`measured`); non-finite ones, written by an
    older opfuse, are ignored."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if measured(v)}


class TuningCache:
    def __init__(self) -> None:
        self.path = _cache_path()
        self.data: dict[str, Any] = _read_entries(self.path)
        self.hits = 0

    def get(self, key: str) -> Any:
        if key in self.data:
            self.hits += 1
        return self.data.get(key)

    def put(self, key: str, value: Any) -> None:
        """Keep `value` for later compiles, unless it holds a failure (see `measured`)."""
        if measured(value):
            self.data[key] = value

    def covers(self, plans: Iterable[Plan]) -> bool:
        """Every kernel of `plans` has its config here: each compiled and ran cleanly on this GPU
        before (its binary is in Triton's disk cache), and none needs tuning."""
        return all(kernel_signature(k) in self.data for p in plans for k in p.kernels.values())

    def save(self) -> None:
        """Write this session's entries into the file, merged with what other processes saved
        since it was read (GPU workers and benchmark shards on one host share the file)."""
        with open(f"{self.path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                merged = {**_read_entries(self.path), **self.data}
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(merged, f)
                os.replace(tmp, self.path)
                self.data = merged
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _random_tensor(plan: Plan, name: str, device: torch.device) -> torch.Tensor:
    spec = plan.values[name]
    dtype = torch_dtype(spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, device=device).to(dtype)
    return torch.randint(0, 4, spec.shape, device=device).to(dtype)


def time_launch(fn: Any, reps: int = 10) -> float:
    """Device time of one launch, timed in this process (see tuning.pool.cuda_graph_ms)."""
    return cuda_graph_ms(fn, reps)


def tune_inprocess() -> bool:
    """OPFUSE_TUNE_INPROCESS=1 times candidates in the compiler's own process: faster to start,
    but a candidate that crashes takes the compiler with it."""
    return os.environ.get("OPFUSE_TUNE_INPROCESS", "") == "1"


def config_key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def _request(plan: Plan, k: KernelInfo, config: dict[str, Any]) -> TimingRequest:
    shapes = [(plan.values[x].shape, plan.values[x].dtype) for x in k.inputs]
    out_shapes = [(plan.values[o].shape, plan.values[o].dtype) for o in k.outputs]
    return TimingRequest(k.source, config, shapes, out_shapes)


LEFT_OUT = "not compiled within the tuning budget"
BUDGET_SPENT = "tuning budget spent"  # a kernel's record: left at its default config
NO_WORKER = "the tuning worker could not start (see tuning.error): default config, untuned"


class Precompiled:
    """What `precompile` did: the requests that failed (the tuner never times them), and the
    candidate configs still compiling in the background, which the tuner waits for one kernel at a
    time, in the order they were submitted (the order it tunes in). `deadline`: when tuning ends
    (the budget starts once every kernel the plans need is compiled)."""

    def __init__(
        self,
        failed: dict[tuple[str, str], Timing] | None = None,
        job: CompileJob | None = None,
        index: dict[tuple[str, str], int] | None = None,
        deadline: float | None = None,
        refit: dict[str, tuple[dict[str, Any], str]] | None = None,
        start_error: str | None = None,
    ) -> None:
        self.failed = dict(failed or {})
        # Why compile workers could not start: what they would have compiled is left to the
        # tuner's own worker (it compiles what it times).
        self.start_error = start_error
        self.job = job
        self.index = dict(index or {})
        self.deadline = deadline
        # kernel signature -> (the config it runs at instead, why its start config failed)
        self.refit = dict(refit or {})

    def outcome(self, key: tuple[str, str]) -> Timing | None:
        """None: time this candidate (compiled, or left to whoever times it to compile); a Timing:
        do not, it failed to compile or was left out at the deadline (error LEFT_OUT)."""
        if key in self.failed:
            return self.failed[key]
        i = self.index.get(key)
        if i is None or self.job is None:
            return None
        timing = self.job.wait(i)
        if timing is None and self.job.start_error is not None:
            return None  # no compile worker took it: the tuner's worker compiles it as it times it
        if timing is None:
            return Timing(math.inf, LEFT_OUT)
        if not timing.ok:
            self.failed[key] = timing
            return timing
        return None

    def close(self) -> None:
        """Stop taking candidates and wait for those compiling now (their workers stay usable)."""
        if self.job is not None:
            self.job.cancel()
            results = self.job.results()
            for key, i in self.index.items():
                timing = results[i]
                if timing is not None and not timing.ok:
                    self.failed[key] = timing


def precompile(
    plans: list[Plan],
    cache: TuningCache | None,
    compiler: CompilePool,
    budget_s: float | None = None,
    group_ms: dict[str, float] | None = None,
) -> Precompiled:
    """Compile the plans' kernels in parallel before anything times or runs them.

    First every kernel at the config it will run with unless tuned (its cached config, else its
    default), with no deadline, each run once to check it: the plan needs those anyway. Then the
    tuning budget (`budget_s`) starts, and the candidate configs of the kernels to be tuned (not
    in `cache`) compile in the background, without running, kernels of the groups with the most
    profiled time (`group_ms`) first, while the tuner times those already compiled. The caller
    closes the result when tuning is done.
    """
    must: dict[tuple[str, str], TimingRequest] = {}
    may: list[tuple[float, int, tuple[str, str], TimingRequest]] = []
    seen: set[tuple[str, str]] = set()
    for plan in plans:
        for k in plan.kernels.values():
            sig = kernel_signature(k)
            cached = cache.data.get(sig) if cache is not None else None
            start = dict(cached["config"]) if cached is not None else dict(k.config)
            key = (sig, config_key(start))
            if key not in seen:
                seen.add(key)
                must[key] = _request(plan, k, start)
            if cache is None or cached is not None:
                continue
            for cand in candidates(k):
                config = {**k.config, **cand}
                key = (sig, config_key(config))
                if key not in seen:
                    seen.add(key)
                    weight = (group_ms or {}).get(k.group, 0.0)
                    may.append((-weight, len(may), key, _request(plan, k, config)))
    keys = list(must)
    checked = compiler.submit([must[k] for k in keys])
    failed = {
        key: timing
        for key, timing in zip(keys, checked.results(), strict=True)
        if timing is not None and not timing.ok and not timing.no_worker
    }
    # A start config that does not compile on this device (a float32 conv whose pipeline stages
    # overflow the shared memory) gives way to the first smaller one that does, before the budget
    # starts: tuned or not, the kernel then runs at a config that compiled.
    starts: dict[str, tuple[Plan, KernelInfo]] = {}
    for plan in plans:
        for k in plan.kernels.values():
            sig = kernel_signature(k)
            if (sig, config_key(k.config)) in failed:
                starts.setdefault(sig, (plan, k))
    refit = {
        sig: (config, failed[(sig, config_key(starts[sig][1].config))].error or "")
        for sig, config in first_configs_that_compile(list(starts.values()), compiler).items()
    }
    for plan in plans:
        for k in plan.kernels.values():
            if kernel_signature(k) in refit:
                k.config = dict(refit[kernel_signature(k)][0])
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    may.sort(key=lambda item: item[:2])
    job = compiler.submit([item[3] for item in may], deadline, launch=False)
    index = {item[2]: i for i, item in enumerate(may)}
    return Precompiled(failed, job, index, deadline, refit, checked.start_error)


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


def first_configs_that_compile(
    kernels: list[tuple[Plan, KernelInfo]], compiler: CompilePool
) -> dict[str, dict[str, Any]]:
    """For kernels whose starting config failed to compile (each with the plan it is in): by
    kernel signature, each one's first `fallback_configs` entry that compiled and ran (all
    compiled at once, in parallel). A kernel none of whose configs compiled is left out."""
    requests: list[TimingRequest] = []
    owners: list[tuple[str, dict[str, Any]]] = []
    for plan, k in kernels:
        for config in fallback_configs(k):
            requests.append(_request(plan, k, config))
            owners.append((kernel_signature(k), config))
    found: dict[str, dict[str, Any]] = {}
    for (sig, config), timing in zip(owners, compiler.run(requests) if requests else [], strict=True):
        if sig not in found and timing is not None and timing.ok:
            found[sig] = config
    return found


def tune_kernel_configs(
    plan: Plan,
    executor: Executor,
    cache: TuningCache,
    deadline: float,
    pool: TuningPool | None = None,
    priority: dict[str, float] | None = None,
    precompiled: Precompiled | None = None,
) -> dict[str, Any]:
    """Pick each kernel's fastest launch config; writes it into plan.kernels[*].config.

    Kernels are tuned in order of `priority` (kernel id -> weight, highest first: the profile's
    time of the nodes a kernel replaces), so a budget that runs out leaves the cheap ones untuned.

    Candidates are timed in `pool` (one is made for this call when None; pass one to share its
    worker between calls), or in this process under OPFUSE_TUNE_INPROCESS=1. A kernel one of whose
    candidates killed the worker keeps its default config and is cached as "crashed", so that it
    is not tried again. `precompiled` (from `precompile`): a candidate is timed once it has
    compiled; one that failed to compile, or was left out at the deadline, is not tried.
    """
    own_pool = None
    if tune_inprocess():
        pool = None  # a caller's pool starts its worker on first use: unused, it costs nothing
    elif pool is None:
        pool = own_pool = TuningPool(str(executor.device))
    try:
        return _tune_each(plan, executor, cache, deadline, pool, priority or {}, precompiled or Precompiled())
    finally:
        if own_pool is not None:
            own_pool.close()


def _tune_each(
    plan: Plan,
    executor: Executor,
    cache: TuningCache,
    deadline: float,
    pool: TuningPool | None,
    priority: dict[str, float],
    precompiled: Precompiled,
) -> dict[str, Any]:
    record: dict[str, Any] = {}
    order = sorted(plan.kernels, key=lambda kid: -priority.get(kid, 0.0))  # stable: plan order on ties
    for kid in order:
        k = plan.kernels[kid]
        default = dict(k.config)
        try:
            record[kid] = _tune_one(plan, executor, cache, deadline, pool, precompiled, kid)
        except Exception as exc:  # a fault of tuning this kernel: it is not fused, the compile goes on
            k.config = default
            executor.configs[kid] = dict(default)
            record[kid] = {"config": default, "error": f"{type(exc).__name__}: {_first_line(exc)}"}
    return record


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _tune_one(
    plan: Plan,
    executor: Executor,
    cache: TuningCache,
    deadline: float,
    pool: TuningPool | None,
    precompiled: Precompiled,
    kid: str,
) -> dict[str, Any]:
    """One kernel's tuning record; its chosen config is written into the plan and the executor.
    Only a config that ran, with its finite time, is cached (TuningCache.put)."""
    k = plan.kernels[kid]
    key = kernel_signature(k)
    cached = cache.get(key)
    if cached is not None:
        k.config = dict(cached["config"])
        executor.configs[kid] = dict(k.config)
        out = {"config": k.config, "ms": cached["ms"], "cached": True}
        if "crashed" in cached:
            out["crashed"] = cached["crashed"]
        return out
    if time.perf_counter() > deadline:
        return {"config": k.config, "skipped": BUDGET_SPENT}
    time_candidate = _candidate_timer(plan, executor, kid, pool)
    default = dict(k.config)
    best, best_ms, default_ms = dict(default), math.inf, math.inf
    crashed: str | None = None
    no_worker: str | None = None
    tried: list[dict[str, Any]] = []
    ran: list[tuple[dict[str, Any], float, tuple[float, ...] | None]] = []
    seen: set[str] = set()
    left_out = 0
    for cand in candidates(k):
        config = {**default, **cand}
        if config_key(config) in seen:  # a candidate equal to the default: timed (and votes) once
            continue
        seen.add(config_key(config))
        timing = precompiled.outcome((key, config_key(config))) or time_candidate(config)
        if timing.no_worker:  # says nothing about the kernel: no worker could try it
            no_worker = timing.error or "no worker"
            break
        if timing.error == LEFT_OUT:
            left_out += 1
            continue
        if not timing.ok:
            tried.append({"config": cand, "error": timing.error})
            if timing.killed:  # a bug the default config may share: no more of this kernel
                crashed = timing.error
                break
            continue
        tried.append({"config": cand, "ms": round(timing.ms, 5)})
        ran.append((config, timing.ms, timing.fingerprint))
    outvoted: list[dict[str, Any]] = []
    if crashed is None:
        ran, outvoted, crashed = agreeing_configs(ran, _fingerprint_rtol(plan, k))
    for config, ms, _ in ran:
        if config == default:
            default_ms = min(default_ms, ms)
        if ms < best_ms:
            best, best_ms = config, ms
    if no_worker is not None or (pool is not None and pool.start_error is not None):
        k.config = default  # untuned, as with tuning off: verification checks it as usual
        return {"config": default, "skipped": NO_WORKER}
    if left_out and not ran and crashed is None:  # the deadline came before its candidates
        k.config = default
        return {"config": default, "skipped": BUDGET_SPENT}
    entry: dict[str, Any] = {"config": best, "ms": best_ms}
    if left_out:  # chosen among those compiled in time; cached so, a warm compile keeps it
        entry["left_out"] = left_out
    if outvoted:  # computed something else than the other configs: never chosen
        entry["outvoted"] = outvoted
    if crashed is not None:
        entry = {"config": default, "ms": default_ms, "crashed": crashed}
    k.config = dict(entry["config"])
    executor.configs[kid] = dict(k.config)
    cache.put(key, entry)  # a failure (no config ran, or the default crashed) is not kept
    out = {**entry, "ms": round(entry["ms"], 5), "candidates": len(tried)}
    if not math.isfinite(entry["ms"]) and crashed is None:
        errors = [t["error"] for t in tried if "error" in t]
        out["failed"] = f"no launch config ran ({len(errors)} tried; first: {errors[0] if errors else '?'})"
    return out


def _fingerprint_rtol(plan: Plan, k: KernelInfo) -> float:
    """How far two configs' outputs may differ (rounding, summation order) relative to their norm."""
    narrow = any(plan.values[o].dtype in ("float16", "bfloat16") for o in k.outputs)
    return 2e-2 if narrow else 1e-3


def agreeing_configs(
    ran: list[tuple[dict[str, Any], float, tuple[float, ...] | None]], rtol: float
) -> tuple[list[tuple[dict[str, Any], float, tuple[float, ...] | None]], list[dict[str, Any]], str | None]:
    """The configs to choose from, given what each computed on the same inputs.

    Configs of one kernel compute one function; where they disagree, a compiler bug hit some of
    them (seen on the H200: a depthwise kernel wrong at one tile size, right at others). A strict
    majority that agrees wins and the rest are outvoted; without one, no config is trusted and the
    kernel counts as crashed (its group is not fused). Returns (kept, outvoted configs, crash reason).
    """
    from opfuse.tuning.pool import fingerprints_agree

    printed = [r for r in ran if r[2] is not None]
    clusters: list[list[tuple[dict[str, Any], float, tuple[float, ...] | None]]] = []
    for r in printed:
        for c in clusters:
            if fingerprints_agree(c[0][2] or (), r[2] or (), rtol):
                c.append(r)
                break
        else:
            clusters.append([r])
    if len(clusters) <= 1:
        return ran, [], None
    clusters.sort(key=len, reverse=True)
    if 2 * len(clusters[0]) > len(printed):
        keep = {id(r) for r in clusters[0]}
        return (
            [r for r in ran if r[2] is None or id(r) in keep],
            [r[0] for r in printed if id(r) not in keep],
            None,
        )
    return (
        [],
        [],
        (
            f"its {len(printed)} launch configs computed {len(clusters)} different results on the same "
            "inputs and no majority agrees: a compiler bug at some config; not fused"
        ),
    )


def _candidate_timer(
    plan: Plan, executor: Executor, kid: str, pool: TuningPool | None
) -> Callable[[dict[str, Any]], Timing]:
    """config -> Timing for one kernel: in the worker, or in this process when `pool` is None."""
    k = plan.kernels[kid]
    if pool is not None:
        return lambda config: pool.time(_request(plan, k, config))
    module = executor.modules[kid]
    ins = [_random_tensor(plan, x, executor.device) for x in k.inputs]
    outs = [
        torch.empty(plan.values[o].shape, dtype=torch_dtype(plan.values[o].dtype), device=executor.device)
        for o in k.outputs
    ]

    def in_process(config: dict[str, Any]) -> Timing:
        try:
            return Timing(time_launch(lambda: module.launch(*ins, *outs, config=config)))
        except Exception as exc:  # out of resources, compile errors: this candidate loses
            return Timing(math.inf, type(exc).__name__)

    return in_process


def unsafe_groups(plan: Plan, tuned: dict[str, Any]) -> set[str]:
    """Groups with a kernel that no config ran cleanly in the tuning worker (its default crashed it,
    or every candidate failed to compile or run), or whose tuning raised: not to run in-process."""
    return set(unsafe_reasons(plan, tuned))


def unsafe_reasons(plan: Plan, tuned: dict[str, Any]) -> dict[str, str]:
    """unsafe_groups, each with why (the first of its kernels that made it so)."""
    out: dict[str, str] = {}
    for kid, k in plan.kernels.items():
        rec = tuned.get(kid, {})
        if k.group in out:
            continue
        if "error" in rec:
            out[k.group] = f"tuning its kernel raised {rec['error']}"
        elif ("crashed" in rec or "ms" in rec) and not math.isfinite(rec.get("ms", math.inf)):
            why = rec.get("crashed") or rec.get("failed") or "no launch config ran"
            out[k.group] = f"its generated kernel failed in the tuning worker: {why}"
    return out


def variant_group_times(
    plan: Plan, executor: Executor, feeds: dict[str, Any], tuned: dict[str, Any]
) -> dict[str, float]:
    """Per-group ms of one candidate plan, for the template-vs-vendor choice.

    The plan runs here, step by step: vendor ops are torch ops, and its generated kernels run with
    configs that ran cleanly in the tuning worker. A plan holding a kernel that crashed there is not
    run: its kernel groups take the worker's times, crashed groups and groups with torch op steps
    score infinity (so the choice falls to the template, the default).
    """
    bad = unsafe_groups(plan, tuned)
    per_group: dict[str, float] = {}
    if not bad:
        for step, ms in zip(plan.steps, step_times(executor, feeds), strict=True):
            if step.group:
                per_group[step.group] = per_group.get(step.group, 0.0) + ms
        return per_group
    for step in plan.steps:
        if not step.group:
            continue
        ms = math.inf  # torch op steps are not timed without running the plan
        if step.kind == "kernel" and step.group not in bad:
            ms = float(tuned.get(step.kernel, {}).get("ms", math.inf))
        per_group[step.group] = per_group.get(step.group, 0.0) + ms
    return per_group


def step_times(executor: Executor, feeds: dict[str, Any], reps: int = 5) -> list[float]:
    """Median per-step time over a few synchronized runs."""
    runs = [executor.time_steps(feeds) for _ in range(reps)]
    return [sorted(col)[len(col) // 2] for col in zip(*runs, strict=True)]
