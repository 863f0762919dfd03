"""What the Triton probes' tests share: a probe's `--check` run in Triton's interpreter, and a
kernel compiled for Hopper (sm90) to see that its products use tensor cores (wgmma)."""

import os
import subprocess
import sys
from pathlib import Path

PROBES = Path(__file__).resolve().parents[1] / "benchmarks/probes"


def check_in_interpreter(probe: str) -> None:
    """`python benchmarks/probes/PROBE --check` with TRITON_INTERPRET=1 prints {"check": "ok"}."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(PROBES / probe), "--check"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0 and '"check": "ok"' in result.stdout, result.stderr[-3000:]


def probe_module(name: str):
    """A probe imported as a module (its kernels and configurations)."""
    sys.path.insert(0, str(PROBES))
    return __import__(name)


def sm90_ptx(kernel, signature: dict[str, str], constexprs: dict, warps: int, stages: int) -> str:
    """`kernel` compiled for sm90 with `signature` (name → type, "constexpr" for the values in
    `constexprs`): its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = list(signature)
    source = triton.compiler.ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()}
    )
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
