"""Muon's triangle kernel (`symmetric_product`, src/moetrain/optim/triton_kernels.py) is right
before a GPU runs it: through benchmarks/probes/ns_symmetric_probe.py's check in Triton's
interpreter, against fp64 (shapes not a multiple of the tile, with and without the added term)
and Newton–Schulz through it against torch's products; and it compiles for Hopper with
tensor-core (wgmma) instructions at the launch Muon uses."""

import pytest

pytest.importorskip("triton")
from triton_probes import check_in_interpreter, sm90_ptx  # noqa: E402


def test_the_triangle_product_and_its_newton_schulz_are_exact_in_the_interpreter():
    check_in_interpreter("ns_symmetric_probe.py")


def test_the_triangle_product_compiles_for_sm90():
    from moetrain.optim.triton_kernels import SYMMETRIC_LAUNCH, _symmetric_kernel

    signature = {
        "y_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16", "stride_yk": "i64", "stride_ys": "i64",
        "stride_zk": "i64", "stride_ok": "i64", "alpha": "fp32", "beta": "fp32", "S": "constexpr",
        "L": "constexpr", "HAS_Z": "constexpr", "BLOCK": "constexpr", "BLOCK_K": "constexpr",
    }  # fmt: skip
    block, block_k, warps, stages = SYMMETRIC_LAUNCH
    values = {"S": 1024, "L": 1024, "HAS_Z": True, "BLOCK": block, "BLOCK_K": block_k}
    assert "wgmma.mma_async" in sm90_ptx(_symmetric_kernel, signature, values, warps, stages)
