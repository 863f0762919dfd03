"""Launch configurations of the FP8 quantizer kernels (src/moetrain/model/fp8_kernels.py) timed on
bench-8e's operand shapes, one GPU: each (kernel, configuration, shape) as achieved GB/s of the
bytes it must move. Prints one JSON line per measurement. Usage: python benchmarks/probes/fp8_quant_probe.py
"""

import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import window_ms  # noqa: E402

from moetrain.model import fp8_kernels as k  # noqa: E402

SHAPES = [(32768, 4096), (32768, 8192), (8, 8192, 4096)]


def timed(fn, reps=20):
    """Seconds per call: one warm-up call, then one window of `reps` back to back."""
    fn()
    torch.cuda.synchronize()
    return window_ms(fn, calls=reps, windows=1) / 1e3


def report(kernel, config, shape, seconds, nbytes):
    print(
        json.dumps(
            {
                "kernel": kernel,
                "config": config,
                "shape": shape,
                "us": round(seconds * 1e6, 1),
                "GBps": round(nbytes / seconds / 1e9),
            }
        ),
        flush=True,
    )


def main():
    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        B = shape[0] if len(shape) == 3 else 1
        R, C = shape[-2], shape[-1]
        x_RC = x.reshape(-1, C)
        q = torch.empty(x_RC.shape, dtype=torch.float8_e4m3fn, device="cuda")
        scale = torch.empty(x_RC.shape[0], dtype=torch.float32, device="cuda")
        amax = torch.zeros((B, C), dtype=torch.float32, device="cuda")
        x_BRC = x if x.dim() == 3 else x.unsqueeze(0)
        n = x.numel()
        for warps in (4, 8):

            def run(warps=warps, x_RC=x_RC, q=q, scale=scale, C=C):
                k._rows_kernel[(x_RC.shape[0],)](
                    x_RC, q, scale, x_RC.stride(0), q.stride(0), C=C, BLOCK=C, num_warps=warps
                )

            report("rows", {"warps": warps}, shape, timed(run), 3 * n)
        for chunk, tile_r, tile_c, warps in itertools.product((256, 512, 1024), (32, 64), (128, 256), (4, 8)):
            if tile_r > chunk:
                continue

            def run(chunk=chunk, tile_r=tile_r, tile_c=tile_c, warps=warps, x_BRC=x_BRC, amax=amax, R=R, C=C, B=B):
                k._col_amax_kernel[(triton.cdiv(C, tile_c), triton.cdiv(R, chunk), B)](
                    x_BRC,
                    amax,
                    x_BRC.stride(0),
                    x_BRC.stride(1),
                    R=R,
                    C=C,
                    CHUNK_R=chunk,
                    BLOCK_R=tile_r,
                    BLOCK_C=tile_c,
                    num_warps=warps,
                )

            config = {"chunk": chunk, "tile_r": tile_r, "tile_c": tile_c, "warps": warps}
            report("col_amax", config, shape, timed(run), 2 * n)
        q_BCR = torch.empty((B, C, R), dtype=torch.float8_e4m3fn, device="cuda")
        scale_BC = torch.empty((B, C), dtype=torch.float32, device="cuda")
        for tile_r, tile_c, warps in itertools.product((64, 128, 256), (32, 64, 128), (4, 8)):

            def run(
                tile_r=tile_r,
                tile_c=tile_c,
                warps=warps,
                x_BRC=x_BRC,
                amax=amax,
                q_BCR=q_BCR,
                s_BC=scale_BC,
                R=R,
                C=C,
                B=B,
            ):
                k._cols_transposed_kernel[(triton.cdiv(C, tile_c), triton.cdiv(R, tile_r), B)](
                    x_BRC,
                    amax,
                    q_BCR,
                    s_BC,
                    x_BRC.stride(0),
                    x_BRC.stride(1),
                    R=R,
                    C=C,
                    BLOCK_R=tile_r,
                    BLOCK_C=tile_c,
                    num_warps=warps,
                )

            report("transpose", {"tile_r": tile_r, "tile_c": tile_c, "warps": warps}, shape, timed(run), 3 * n)


if __name__ == "__main__":
    main()
