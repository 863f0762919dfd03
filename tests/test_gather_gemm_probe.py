"""The gather-GEMM probe's kernel (benchmarks/probes/gather_gemm_probe.py) is right before a GPU
times it: its gathered-A and scattered-C products against torch's in Triton's interpreter, and it
compiles for Hopper with tensor-core (wgmma) instructions at each launch it tries."""

import pytest

pytest.importorskip("triton")
from triton_probes import check_in_interpreter, probe_module, sm90_ptx  # noqa: E402


def test_the_gathered_grouped_products_match_torch_in_the_interpreter():
    check_in_interpreter("gather_gemm_probe.py")


@pytest.mark.parametrize("gather,scatter", [(True, False), (False, True)])
def test_the_gathered_grouped_product_compiles_for_sm90(gather, scatter):
    probe = probe_module("gather_gemm_probe")
    pointers = ("a_ptr", "a_idx_ptr", "b_ptr", "c_ptr", "c_idx_ptr", "offs_ptr")
    types = ("*bf16", "*i64", "*bf16", "*bf16", "*i64", "*i32")
    signature = {**dict(zip(pointers, types)), "stride_am": "i64", "stride_bg": "i64", "stride_cm": "i64"}
    names = ("N", "K", "G", "GATHER_A", "SCATTER_C", "BM", "BN", "BK", "GROUP_M")
    signature.update({n: "constexpr" for n in names})
    BM, BN, BK, warps, stages, group_m = probe.CONFIGS[0]
    values = dict(zip(names, (8192, 4096, 16, gather, scatter, BM, BN, BK, group_m)))
    assert "wgmma.mma_async" in sm90_ptx(probe._grouped_kernel, signature, values, warps, stages)
