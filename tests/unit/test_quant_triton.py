"""The quantized GEMM kernels (services/engine/kernels/quant_gemm.py) against the torch reference, on the CPU
under TRITON_INTERPRET=1, at toy sizes with N not a multiple of the tile (masked edges) and M odd.

Reference: services/engine/model/quant/formats.py's dequantisation of the same stored tensors (written by the
test quantizers in their checkpoint layouts) and a float32 matmul. Tolerance 1e-4 absolute and relative:
only the summation order differs. Triton's interpreter mis-rounds float32 -> fp8 casts (see
tests/unit/engine/test_triton_kernels.py), so every fp8 value here is quantised by torch; the kernels only read.
As in that module, triton must be imported with TRITON_INTERPRET=1: run this file in its own process.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpret import import_interpreted

(quant_gemm,) = import_interpreted("services.engine.kernels.quant_gemm")

from services.engine.model.quant.formats import dequantize, unpack_int32  # noqa: E402
from services.engine.model.quant.scheme import WeightFormat, WeightScheme  # noqa: E402
from tests.unit import quant_checkpoints as qc  # noqa: E402

M, K, N = 5, 64, 40


@pytest.fixture(autouse=True)
def _interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _weight() -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * K**-0.5


def _x() -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("sym", [True, False])
def test_int4_gemm_equals_the_dequantised_gptq_product(sym: bool) -> None:
    stored, _ = qc.gptq(32, sym=sym)(_weight())
    scheme = WeightScheme(format=WeightFormat.GPTQ, bits=4, group_size=32, symmetric=sym, zero_point_offset=1)
    reference = _x() @ dequantize(scheme, lambda n: stored[n.rsplit(".", 1)[1]], "p", (N, K)).t()
    zeros = (torch.full((K // 32, N), 8.0) if sym else (unpack_int32(stored["qzeros"], 4, 1) + 1).float())
    out = quant_gemm.int4_gemm(_x(), stored["qweight"], stored["scales"].float(), zeros, 32)
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


def test_nvfp4_gemm_equals_the_dequantised_modelopt_product() -> None:
    stored, _ = qc.nvfp4("modelopt")(_weight())
    scheme = WeightScheme(format=WeightFormat.NVFP4_MODELOPT, bits=4, group_size=16)
    reference = _x() @ dequantize(scheme, lambda n: stored[n.rsplit(".", 1)[1]], "p", (N, K)).t()
    out = quant_gemm.nvfp4_gemm(_x(), stored["weight"], stored["weight_scale"], float(stored["weight_scale_2"]))
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


def test_fp8_gemm_equals_the_product_of_the_scaled_fp8_operands() -> None:
    stored, w_decoded = qc.fp8_channel(_weight())
    x = _x()
    x_scale = x.abs().amax(1) / 448.0
    x_fp8 = (x / x_scale[:, None]).to(torch.float8_e4m3fn)  # torch's cast: the interpreter's is not trusted
    reference = (x_fp8.float() * x_scale[:, None]) @ w_decoded.t()
    out = quant_gemm.fp8_gemm(x_fp8, x_scale, stored["weight"], stored["weight_scale"].reshape(N))
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


def test_a_k_that_is_not_a_multiple_of_the_tile_is_refused() -> None:
    stored, _ = qc.gptq(32, sym=True)(_weight())
    with pytest.raises(ValueError, match="K=64 must be a multiple of block_k=48"):
        quant_gemm.int4_gemm(_x(), stored["qweight"], stored["scales"].float(), torch.zeros(2, N), 32, block_k=48)
