"""Bounds checks for generated kernels in Triton's interpreter (OPFUSE_CHECK_BOUNDS=1).

On the GPU a kernel that reads or writes outside its tensors fails only where the address leaves
mapped memory ("illegal memory access", often in a later, innocent call), or silently reads a
neighbour's bytes. In the interpreter every load, store and atomic is a numpy array of addresses,
so each can be checked: with the checks on, every element a kernel touches (its mask's lanes; every
lane of a load inside a loop, which the GPU pipelines and whose masked-off lanes' addresses it
issues too) must lie inside one of the tensors passed to that launch, each tensor's own extent (a view of the
executor's arena covers its own bytes, not the arena's). A touch outside raises `OutOfBounds`,
naming the kernel, the access and the nearest tensor, and is kept in `violations`. The test
suite turns the checks on and fails a test that left a violation (tests/conftest.py), so every
kernel every test runs in its own process is checked, at the interpreter's configs and,
in tests that ask for them (OPFUSE_INTERPRET_GPU_CONFIGS), at the GPU's.

The compiled kernel also reads what the interpreter does not model: a load whose offsets carry
`tl.max_contiguous` / `tl.multiple_of` hints (codegen.source.in_bounds) is vectorized by them, a
run of lanes read from its first lane's address. A hint the offsets break reads memory no lane
addresses, which no check of the lanes sees. So each hint is held to the tile it is given
(`check_hint`): every run is contiguous and starts at a multiple of its length, or is all zeros
(masked-off lanes: the compiled load's mask covers the run), or is cut by its mask.

This patches the interpreter of the pinned Triton (pyproject.toml) and only in the process that
calls `install()`; compiled kernels are never touched.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import numpy as np

_state = threading.local()
_installed = False
# Every violation this process saw, in order: the kernel's launch raises too, but a caller may
# catch that (a fused group that fails runs unfused), so the test suite also reads this list.
violations: list[str] = []


class OutOfBounds(RuntimeError):
    """A generated kernel touched memory outside the tensors of its launch."""


def enabled() -> bool:
    return os.environ.get("OPFUSE_CHECK_BOUNDS") == "1"


def _extent(t: Any) -> tuple[int, int] | None:
    """[first byte, one past the last byte] of a tensor view, from its sizes and strides."""
    if not hasattr(t, "data_ptr") or not hasattr(t, "stride"):
        return None
    size = t.element_size()
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    lo = hi = 0
    for n, s in zip(t.shape, t.stride(), strict=True):
        if s >= 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    start = t.data_ptr() + lo * size
    return (start, t.data_ptr() + (hi + 1) * size)


def _ranges(names: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, int, str]]:
    out = []
    for i, a in enumerate(args):
        e = _extent(a)
        if e is not None:
            out.append((*e, names[i] if i < len(names) else f"argument {i}"))
    for k, a in kwargs.items():
        e = _extent(a)
        if e is not None:
            out.append((*e, k))
    return sorted(out)


def check(addresses: np.ndarray, mask: np.ndarray | None, itemsize: int, what: str) -> None:
    """Raise OutOfBounds where an active lane's element is not inside one tensor of the launch."""
    ranges = getattr(_state, "ranges", None)
    if ranges is None:
        return
    a = np.asarray(addresses, dtype=np.uint64).reshape(-1)
    if mask is not None:
        m = np.broadcast_to(np.asarray(mask, dtype=bool), np.asarray(addresses).shape).reshape(-1)
        a = a[m]
    if a.size == 0:
        return
    starts, ends = _state.starts, _state.ends
    end = a + np.uint64(itemsize)
    # The range that starts last at or before each address; ranges may overlap (two views of one
    # buffer), so an element outside it is checked against all of them.
    i = np.searchsorted(starts, a, side="right").astype(np.int64) - 1
    ok = (i >= 0) & (end <= ends[np.maximum(i, 0)])
    if ok.all():
        return
    rest, rest_end = a[~ok], end[~ok]
    inside = ((rest[:, None] >= starts[None, :]) & (rest_end[:, None] <= ends[None, :])).any(axis=1)
    if not inside.all():
        bad = rest[~inside]
        message = _describe(int(bad[0]), itemsize, what, ranges, int(bad.size))
        violations.append(message)
        raise OutOfBounds(message)


def check_hint(data: Any, key: str, values: Any) -> None:
    """Hold a contiguity (`tt.contiguity`: runs of `values[d]` consecutive offsets along axis d)
    or divisibility (`tt.divisibility`: each run's first offset a multiple of `values[d]`) hint to
    the integer tile it is given; a run whose lanes are all 0 (masked off by `in_bounds`) claims
    nothing, and a run some of whose lanes are masked off is held on the rest (its masked lanes
    are where its first lane's run would put them). Raises OutOfBounds, and keeps the violation."""
    a = np.asarray(data)
    if a.ndim == 0 or a.dtype.kind not in "iu":
        return
    values = [values] if np.isscalar(values) else list(values)
    for axis, run in enumerate(int(v) for v in values):
        if run <= 1 or axis >= a.ndim or a.shape[axis] % run:
            continue
        runs = np.moveaxis(a, axis, -1).reshape(-1, run).astype(np.int64)
        live = runs != 0
        lanes = np.arange(run, dtype=np.int64)
        # Each run's first offset, as its live lanes put it.
        first = np.where(live, runs - lanes, 0).max(axis=1)
        if key == "tt.contiguity":
            bad = (live & (runs != first[:, None] + lanes)).any(axis=1)
        else:
            bad = live.any(axis=1) & (first % run != 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            kernel = getattr(_state, "kernel", "a kernel")
            message = (
                f"{kernel}: a {'max_contiguous' if key == 'tt.contiguity' else 'multiple_of'} hint of "
                f"{run} along axis {axis} that {int(bad.sum())} run(s) break; one is {runs[i].tolist()}"
            )
            violations.append(message)
            raise OutOfBounds(message)


def _describe(addr: int, itemsize: int, what: str, ranges: list[tuple[int, int, str]], bad: int) -> str:
    kernel = getattr(_state, "kernel", "a kernel")
    near = min(ranges, key=lambda r: min(abs(addr - r[0]), abs(addr - r[1])))
    s, e, name = near
    return (
        f"{kernel}: {'an' if what[0] in 'aeiou' else 'a'} {what} of {bad} element(s) outside every tensor of the launch; one is at "
        f"element {(addr - s) // itemsize} of {name!r}, which has {(e - s) // itemsize} elements of "
        f"{itemsize} bytes"
    )


@functools.lru_cache(maxsize=4096)
def _loop_lines(filename: str, function: str) -> frozenset[int]:
    """The source lines of `function` in `filename` that lie inside a loop's body."""
    try:
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    lines: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == function:
            for node in ast.walk(fn):
                if isinstance(node, (ast.For, ast.While)) and node.body and not _unrolled(node):
                    lines.update(range(node.body[0].lineno, (node.end_lineno or node.lineno) + 1))
    return frozenset(lines)


def _unrolled(loop: ast.For | ast.While) -> bool:
    """A `for ... in tl.static_range(...)`: unrolled when the kernel compiles, so no loop the GPU
    pipelines (a loop around it still is)."""
    it = getattr(loop, "iter", None)
    return isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "static_range"


def _in_loop(kernel: str | None) -> bool:
    """Whether the load being made comes from a line inside a loop of the kernel's function: the
    loads Triton may pipeline on the GPU (cp.async on Hopper), which issue the addresses of
    masked-off lanes too."""
    if kernel is None:
        return False
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != kernel:
        frame = frame.f_back
    if frame is None:
        return False
    return frame.f_lineno in _loop_lines(frame.f_code.co_filename, kernel)


@contextmanager
def every_lane(kernels: frozenset[str]) -> Iterator[None]:
    """Within this block, the loads of the kernels named (their jitted functions' names) are
    checked on every lane, masked-off ones too: a gather must not even address memory outside its
    tensor for a lane it does not read (codegen.source.in_bounds; the GPU's pipelined loads were
    seen issuing such addresses)."""
    previous: frozenset[str] = getattr(_state, "every_lane", frozenset())
    _state.every_lane = kernels
    try:
        yield
    finally:
        _state.every_lane = previous


def install() -> None:
    """Check every load, store and atomic of the interpreter in this process (idempotent)."""
    global _installed
    if _installed:
        return
    from triton.runtime import interpreter as ti

    builder_cls = ti.InterpreterBuilder
    grid_cls = ti.GridExecutor
    call = grid_cls.__call__

    def grid_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        keys = ("ranges", "starts", "ends", "kernel")
        previous = [getattr(_state, k, None) for k in keys]
        ranges = _ranges(list(self.arg_names), args, kwargs)
        _state.ranges, _state.kernel = ranges, getattr(self.fn, "__name__", "a kernel")
        _state.starts = np.array([r[0] for r in ranges], dtype=np.uint64)  # once per launch
        _state.ends = np.array([r[1] for r in ranges], dtype=np.uint64)
        try:
            return call(self, *args, **kwargs)
        finally:
            for k, v in zip(keys, previous, strict=True):
                setattr(_state, k, v)

    load = builder_cls.create_masked_load
    store = builder_cls.create_masked_store
    rmw = builder_cls.create_atomic_rmw
    cas = builder_cls.create_atomic_cas

    def masked_load(self: Any, ptrs: Any, mask: Any, other: Any, *rest: Any) -> Any:
        size = np.dtype(ti._get_np_dtype(ptrs.get_element_ty())).itemsize
        kernel = getattr(_state, "kernel", None)
        every = kernel in getattr(_state, "every_lane", frozenset()) or _in_loop(kernel)
        check(ptrs.data, None if every else mask.data, size, "load" if not every else "load (every lane)")
        return load(self, ptrs, mask, other, *rest)

    def masked_store(self: Any, ptrs: Any, value: Any, mask: Any, *rest: Any) -> Any:
        check(ptrs.data, mask.data, value.data.dtype.itemsize, "store")
        return store(self, ptrs, value, mask, *rest)

    def atomic_rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *rest: Any) -> Any:
        check(ptr.data, mask.data, val.data.dtype.itemsize, "atomic")
        return rmw(self, op, ptr, val, mask, *rest)

    def atomic_cas(self: Any, ptr: Any, cmp: Any, val: Any, *rest: Any) -> Any:
        check(ptr.data, None, val.data.dtype.itemsize, "atomic compare-and-swap")
        return cas(self, ptr, cmp, val, *rest)

    set_attr = ti.TensorHandle.set_attr

    def hinted(self: Any, key: str, value: Any) -> Any:
        if key in ("tt.contiguity", "tt.divisibility"):
            check_hint(self.data, key, value)
        return set_attr(self, key, value)

    ti.TensorHandle.set_attr = hinted
    grid_cls.__call__ = grid_call
    builder_cls.create_masked_load = masked_load
    builder_cls.create_masked_store = masked_store
    builder_cls.create_atomic_rmw = atomic_rmw
    builder_cls.create_atomic_cas = atomic_cas
    _installed = True
