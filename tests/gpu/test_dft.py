"""A half-precision signal whose transformed lengths are powers of two is transformed in half
precision on the GPU (cuFFT's half plans, as PyTorch runs torch.fft on it), with no cast kernel
either side; any other length is widened to float32. Every element against numpy's float64 FFT.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from opfuse.runtime.ops import run_op

pytestmark = pytest.mark.gpu


@pytest.fixture
def library_dtypes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[torch.dtype]]:
    """The dtype of every signal handed to the library's transforms."""
    seen: list[torch.dtype] = []
    for name in ("fft", "ifft", "rfft", "irfft", "fftn", "ifftn"):
        original = getattr(torch.fft, name)

        def spy(signal: torch.Tensor, *args: Any, _f: Callable[..., Any] = original, **kwargs: Any) -> Any:
            seen.append(signal.dtype)
            return _f(signal, *args, **kwargs)

        monkeypatch.setattr(torch.fft, name, spy)
    yield seen


def _half(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).half().cuda()


def _close(got: torch.Tensor, want: np.ndarray) -> None:
    """Every element within half precision's error of an FFT of this length (about 1e-3 of the
    signal's scale), and the whole within 3e-3 relative L2."""
    g = got.float().cpu().numpy()
    assert g.shape == want.shape and np.all(np.isfinite(g))
    scale = float(np.sqrt(np.mean(want**2)))
    np.testing.assert_allclose(g, want, rtol=0, atol=6e-3 * scale)
    assert np.linalg.norm(g - want) <= 3e-3 * np.linalg.norm(want)


def _pairs(z: np.ndarray) -> np.ndarray:
    return np.stack([z.real, z.imag], axis=-1)


def test_a_real_signal_of_power_of_two_lengths_is_transformed_in_half(
    library_dtypes: list[torch.dtype],
) -> None:
    x = _half((2, 16, 64, 1), 0)
    (out,) = run_op("opfuse.DFTN", [x], {"axes": [1, 2]})
    assert out.dtype == torch.float16 and library_dtypes == [torch.float16]
    _close(out, _pairs(np.fft.fftn(x.double().cpu().numpy()[..., 0], axes=(1, 2))))


def test_a_complex_signal_and_its_inverse_in_half(library_dtypes: list[torch.dtype]) -> None:
    x = _half((3, 32, 8, 2), 1)
    z = x.double().cpu().numpy()
    signal = z[..., 0] + 1j * z[..., 1]
    (fwd,) = run_op("DFT", [x, None, torch.tensor(1)], {})
    (inv,) = run_op("DFT", [x, None, torch.tensor(1)], {"inverse": 1})
    assert library_dtypes == [torch.complex32, torch.complex32]
    _close(fwd, _pairs(np.fft.fft(signal, axis=1)))
    _close(inv, _pairs(np.fft.ifft(signal, axis=1)))


def test_one_sided_transforms_in_half(library_dtypes: list[torch.dtype]) -> None:
    x = _half((2, 64, 4, 1), 2)
    real = x.double().cpu().numpy()[..., 0]
    (half_spectrum,) = run_op("DFT", [x, None, torch.tensor(1)], {"onesided": 1})
    _close(half_spectrum, _pairs(np.fft.rfft(real, axis=1)))
    (back,) = run_op("DFT", [half_spectrum, torch.tensor(64), torch.tensor(1)], {"inverse": 1, "onesided": 1})
    spectrum = half_spectrum.double().cpu().numpy()
    _close(back, np.fft.irfft(spectrum[..., 0] + 1j * spectrum[..., 1], n=64, axis=1)[..., None])
    assert library_dtypes == [torch.float16, torch.complex32]


def test_other_lengths_are_widened_to_float32(library_dtypes: list[torch.dtype]) -> None:
    x = _half((2, 12, 64, 1), 3)
    (out,) = run_op("opfuse.DFTN", [x], {"axes": [1, 2]})
    assert out.dtype == torch.float16 and library_dtypes == [torch.float32]
    _close(out, _pairs(np.fft.fftn(x.double().cpu().numpy()[..., 0], axes=(1, 2))))


def test_fourier_mixing_compiles_and_verifies_in_fp16(tmp_path: Any) -> None:
    """FNet's token mixing (the default export: a DFT per axis, merged into one transform) in fp16:
    the transform runs in half precision and the compile's verification passes."""
    import opfuse
    from tests.unit.test_default_export import FourierMixing, export

    torch.manual_seed(0)
    x = torch.randn(2, 16, 16)
    model = export(FourierMixing(), (x,), tmp_path / "m.onnx")
    cm = opfuse.compile(model, precision="fp16", device="cuda", tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True
    assert [s.op_type for s in cm.plan.steps if s.kind == "op" and "DFT" in s.op_type] == ["opfuse.DFTN"]
