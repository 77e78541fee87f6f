"""The interpreter's bounds checks (opfuse/runtime/bounds.py): a kernel that touches memory outside
the tensors of its launch raises, naming the kernel and the tensor, and is recorded; masked-off
lanes and reads inside a view pass."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the checks patch Triton's interpreter"
)


@pytest.fixture
def checked() -> Iterator[Any]:
    """The checker, with what a test's deliberate violations add to its record removed again (the
    suite fails a test that leaves one: tests/conftest.py)."""
    from opfuse.runtime import bounds

    bounds.install()
    seen = len(bounds.violations)
    yield bounds
    del bounds.violations[seen:]


def _copy_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x, y, n, shift, BLOCK: tl.constexpr, MASKED: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if MASKED:
            tl.store(y + o, tl.load(x + o + shift, mask=o < n), mask=o < n)
        else:
            tl.store(y + o, tl.load(x + o + shift))

    return copy


def _add_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def count(c, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.atomic_add(c + o, 1, mask=o < n)

    return count


def test_masked_lanes_and_reads_inside_a_view_pass(checked: Any) -> None:
    copy = _copy_kernel()
    rng = np.random.default_rng(0)
    base = torch.from_numpy(rng.standard_normal(40).astype(np.float32))
    view = base[7:17]  # a view of a larger buffer, as kernel outputs are views of the arena
    out = torch.empty(10)
    copy[(1,)](view, out, 10, 0, BLOCK=16, MASKED=True)
    assert torch.equal(out, view)
    before = len(checked.violations)
    copy[(1,)](view, out, 10, 0, BLOCK=16, MASKED=True)
    assert len(checked.violations) == before


@pytest.mark.parametrize("shift", [0, -3])
def test_a_load_outside_its_tensor_raises_even_inside_the_same_buffer(checked: Any, shift: int) -> None:
    copy = _copy_kernel()
    base = torch.from_numpy(np.random.default_rng(1).standard_normal(64).astype(np.float32))
    view = base[8:18]  # the bytes either side belong to the buffer, not to this tensor
    out = torch.empty(16)
    before = len(checked.violations)
    masked = shift != 0  # shifted: only the first lanes fall before the view
    with pytest.raises(Exception, match=r"copy: a load of .* outside every tensor") as info:
        copy[(1,)](view, out, 10, shift, BLOCK=16, MASKED=masked)
    assert "'x', which has 10 elements of 4 bytes" in str(info.value)
    assert len(checked.violations) == before + 1
    expected = "element -3 of 'x'" if shift else "element 10 of 'x'"
    assert expected in checked.violations[-1]


def test_an_atomic_outside_its_tensor_raises(checked: Any) -> None:
    count = _add_kernel()
    c = torch.zeros(8, dtype=torch.int32)
    count[(1,)](c, 8, BLOCK=8)
    assert c.tolist() == [1] * 8
    with pytest.raises(Exception, match="count: an atomic"):
        count[(1,)](c, 12, BLOCK=16)


def test_an_element_inside_an_earlier_overlapping_tensor_passes(checked: Any) -> None:
    copy = _copy_kernel()
    base = torch.from_numpy(np.random.default_rng(2).standard_normal(48).astype(np.float32))
    src = base[:16].clone()
    out = base[4:20]  # starts inside the buffer x below reads: x's reads past 4 are inside x, not out
    before = len(checked.violations)
    x = base[:32]
    x[:16] = src
    copy[(1,)](x, out, 16, 0, BLOCK=16, MASKED=False)
    assert torch.equal(base[4:20], src)
    assert len(checked.violations) == before


@pytest.mark.parametrize("stride, pool", [(2, False), (1, False), (1, True)])
def test_conv_gathers_address_only_their_input_on_every_lane(
    checked: Any, monkeypatch: pytest.MonkeyPatch, stride: int, pool: bool
) -> None:
    """The implicit-GEMM conv's window taps in the padding (and the max-pool's before it) are
    masked off, and their addresses are kept inside the input too (codegen.source.in_bounds):
    at the GPU's tile sizes, where rows and channels fill the tiles exactly, no lane of a
    conv's loads, masked or not, addresses outside its tensor. Unclamped, the last image's taps
    below the bottom edge address past the input's end (halonet26t at batch 32: an illegal
    memory access on the GPU)."""
    from onnx import helper

    import opfuse
    from tests.builders import tiny_model, weights

    monkeypatch.setenv("OPFUSE_INTERPRET_GPU_CONFIGS", "1")
    c, size = 64, 16
    out = (size - 1) // stride + 1
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[stride] * 2)]
    src = "x"
    if pool:
        nodes.insert(0, helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        nodes[1].input[0] = "p"
    nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    model = tiny_model(
        nodes,
        {src: [2, c, size, size]},
        {"y": [2, c, out, out]},
        {"w": weights(c, c, 3, 3) * 0.1, "b": weights(c, seed=1)},
    )
    cm = opfuse.compile(model, input_shapes={"x": [2, c, size, size]}, device="cpu", verify=False)
    assert any(k.kind == "conv" for k in cm.plan.kernels.values())
    x = np.random.default_rng(0).standard_normal((2, c, size, size)).astype(np.float32)
    with checked.every_lane(frozenset({"fused_conv"})):
        cm.run({"x": x})


def _sum_kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def looped_sum(x, y, n, BLOCK: tl.constexpr, GUARDED: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, n, BLOCK):
            o = k0 + tl.arange(0, BLOCK)
            if GUARDED:
                acc += tl.load(x + tl.where(o < n, o, 0), mask=o < n, other=0.0)
            else:
                acc += tl.load(x + o, mask=o < n, other=0.0)
        tl.store(y + tl.arange(0, BLOCK), acc)

    @triton.jit
    def unrolled_sum(x, y, n, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(0, 2):
            o = k * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x + o, mask=o < n, other=0.0)
        tl.store(y + tl.arange(0, BLOCK), acc)

    return looped_sum, unrolled_sum


def test_a_load_inside_a_loop_keeps_every_lane_inside_its_tensor(checked: Any) -> None:
    """Triton pipelines a loop's loads on the GPU, and those issue masked-off lanes' addresses
    too: inside a loop every lane is checked. The last block's lanes past the tensor fail
    unless the kernel keeps them at offset 0 (codegen.source.guarded_load); outside a loop, and
    in a `tl.static_range` (unrolled when the kernel compiles), only the active lanes are."""
    looped, unrolled = _sum_kernels()
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal(20).astype(np.float32))
    expected = torch.zeros(16)
    expected += x[:16]
    expected[:4] += x[16:]
    for kernel, extra in ((looped, {"GUARDED": True}), (unrolled, {})):
        y = torch.empty(16)
        before = len(checked.violations)
        kernel[(1,)](x, y, 20, BLOCK=16, **extra)
        assert torch.allclose(y, expected)
        assert len(checked.violations) == before
    with pytest.raises(Exception, match=r"looped_sum: a load \(every lane\) of 12 element\(s\) outside"):
        looped[(1,)](x, torch.empty(16), 20, BLOCK=16, GUARDED=False)
    assert "element 20 of 'x'" in checked.violations[-1]


def _hinted_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def hinted(x, y, n, start, BLOCK: tl.constexpr, RUN: tl.constexpr):
        o = start + tl.arange(0, BLOCK)
        ok = o < n
        at = tl.max_contiguous(tl.multiple_of(tl.where(ok, o, 0), RUN), RUN)
        tl.store(y + tl.arange(0, BLOCK), tl.load(x + at, mask=ok, other=0.0))

    return hinted


@pytest.mark.parametrize(
    "start, n, broken", [(0, 16, False), (8, 16, False), (0, 12, False), (4, 16, True), (0, 13, False)]
)
def test_a_vectorizing_hint_is_held_to_its_offsets(checked: Any, start: int, n: int, broken: bool) -> None:
    """A load's contiguity and alignment hints (what the compiled kernel vectorizes by, reading a
    run of lanes from its first lane's address) must hold on the offsets: runs of 8 from a
    multiple of 8, masked off whole (all 0), or in part (n = 13: the compiled load's mask then
    varies within the run, and the compiler narrows the load to it). A run that starts off a
    multiple of 8 (start 4) raises."""
    hinted = _hinted_kernel()
    x = torch.from_numpy(np.random.default_rng(3).standard_normal(32).astype(np.float32))
    y = torch.empty(16)
    before = len(checked.violations)
    if broken:
        with pytest.raises(Exception, match=r"hinted: a (max_contiguous|multiple_of) hint of 8"):
            hinted[(1,)](x, y, n, start, BLOCK=16, RUN=8)
        assert len(checked.violations) == before + 1
    else:
        hinted[(1,)](x, y, n, start, BLOCK=16, RUN=8)
        assert len(checked.violations) == before
        want = torch.where(torch.arange(start, start + 16) < n, x[start : start + 16], 0.0)
        assert torch.equal(y, want)
