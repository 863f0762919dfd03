"""benchmarks/probes/ns_symmetric_probe.py's triangle kernel is right before a GPU times it: in
Triton's interpreter against fp64 (shapes not a multiple of the tile, with and without the added
term) and Newton–Schulz through it against moetrain's, and its GPU form compiles for Hopper with
tensor-core (wgmma) instructions."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "benchmarks/probes/ns_symmetric_probe.py"
triton = pytest.importorskip("triton")


def test_the_triangle_product_and_its_newton_schulz_are_exact_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(PROBE), "--check"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0 and '"check": "ok"' in result.stdout, result.stderr[-3000:]


def test_the_triangle_product_compiles_for_sm90():
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, str(PROBE.parent))
    from ns_symmetric_probe import CONFIGS, _sym_kernel

    signature = {
        "y_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16", "stride_yk": "i64", "stride_ys": "i64",
        "stride_zk": "i64", "stride_ok": "i64", "alpha": "fp32", "beta": "fp32", "S": "constexpr",
        "L": "constexpr", "HAS_Z": "constexpr", "BLOCK": "constexpr", "BLOCK_K": "constexpr", "UPCAST": "constexpr",
    }  # fmt: skip
    names = list(signature)
    block, block_k, warps, stages = CONFIGS[0]
    values = {"S": 1024, "L": 1024, "HAS_Z": True, "BLOCK": block, "BLOCK_K": block_k, "UPCAST": False}
    source = triton.compiler.ASTSource(
        fn=_sym_kernel, signature=signature, constexprs={(names.index(n),): v for n, v in values.items()}
    )
    options = {"num_warps": warps, "num_stages": stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert "wgmma.mma_async" in compiled.asm["ptx"]
