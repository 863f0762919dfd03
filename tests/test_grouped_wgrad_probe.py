"""benchmarks/probes/grouped_wgrad_accumulate_probe.py's kernel is right before a GPU times it: in
Triton's interpreter against fp64 (written and accumulated, an empty expert, garbage rows past the
last offset), and its GPU form compiles for Hopper with tensor-core (wgmma) instructions."""

import pytest

pytest.importorskip("triton")
from triton_probes import check_in_interpreter, probe_module, sm90_ptx  # noqa: E402


def test_the_fused_grouped_weight_gradient_kernel_is_exact_in_the_interpreter():
    check_in_interpreter("grouped_wgrad_accumulate_probe.py")


def test_the_fused_grouped_weight_gradient_kernel_compiles_for_sm90():
    probe = probe_module("grouped_wgrad_accumulate_probe")
    signature = {
        "dy_ptr": "*bf16", "x_ptr": "*bf16", "offsets_ptr": "*i32", "out_ptr": "*fp32", "N": "i32", "K": "i32",
        "stride_dy": "i64", "stride_x": "i64", "ACCUMULATE": "constexpr", "BLOCK_N": "constexpr",
        "BLOCK_K": "constexpr", "BLOCK_M": "constexpr", "INTERPRETED": "constexpr", "PRELOAD": "constexpr",
    }  # fmt: skip
    bn, bk, bm, warps, stages, preload = probe.CONFIGS[1]
    values = {"ACCUMULATE": True, "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_M": bm, "INTERPRETED": False, "PRELOAD": preload}
    assert "wgmma.mma_async" in sm90_ptx(probe._grouped_wgrad_acc_kernel, signature, values, warps, stages)
