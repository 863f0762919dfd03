"""benchmarks/probes/grouped_wgrad_accumulate_probe.py's kernel is right before a GPU times it: in
Triton's interpreter against fp64 (written and accumulated, an empty expert, garbage rows past the
last offset), and its GPU form compiles for Hopper with tensor-core (wgmma) instructions."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "benchmarks/probes/grouped_wgrad_accumulate_probe.py"
triton = pytest.importorskip("triton")


def test_the_fused_grouped_weight_gradient_kernel_is_exact_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(PROBE), "--check"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0 and '"check": "ok"' in result.stdout, result.stderr[-3000:]


def test_the_fused_grouped_weight_gradient_kernel_compiles_for_sm90():
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, str(PROBE.parent))
    from grouped_wgrad_accumulate_probe import CONFIGS, _grouped_wgrad_acc_kernel

    signature = {
        "dy_ptr": "*bf16", "x_ptr": "*bf16", "offsets_ptr": "*i32", "out_ptr": "*fp32", "N": "i32", "K": "i32",
        "stride_dy": "i64", "stride_x": "i64", "ACCUMULATE": "constexpr", "BLOCK_N": "constexpr",
        "BLOCK_K": "constexpr", "BLOCK_M": "constexpr", "INTERPRETED": "constexpr", "PRELOAD": "constexpr",
    }  # fmt: skip
    names = list(signature)
    bn, bk, bm, warps, stages, preload = CONFIGS[1]
    values = {"ACCUMULATE": True, "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_M": bm, "INTERPRETED": False, "PRELOAD": preload}
    source = triton.compiler.ASTSource(
        fn=_grouped_wgrad_acc_kernel, signature=signature, constexprs={(names.index(n),): v for n, v in values.items()}
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    assert "wgmma.mma_async" in compiled.asm["ptx"]
