"""Launch configurations of the FP8 quantizer kernels (moetrain/model/fp8_kernels.py) timed on
bench-8e's operand shapes, one GPU: each (kernel, configuration, shape) as achieved GB/s of the
bytes it must move. Prints one JSON line per measurement. Usage: python benchmarks/fp8_quant_probe.py
"""

import itertools
import json

import torch
import triton

from moetrain.model import fp8_kernels as k

SHAPES = [(32768, 4096), (32768, 8192), (8, 8192, 4096)]


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def report(kernel, config, shape, seconds, nbytes):
    print(json.dumps({"kernel": kernel, "config": config, "shape": shape, "us": round(seconds * 1e6, 1),
                      "GBps": round(nbytes / seconds / 1e9)}), flush=True)


def main():
    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        B = shape[0] if len(shape) == 3 else 1
        R, C = shape[-2], shape[-1]
        x_RC = x.reshape(-1, C)
        q = torch.empty(x_RC.shape, dtype=torch.float8_e4m3fn, device="cuda")
        scale = torch.empty(x_RC.shape[0], dtype=torch.float32, device="cuda")
        amax = torch.zeros((B, C), dtype=torch.float32, device="cuda")
        n = x.numel()
        for rows, warps, col_amax in itertools.product((1, 2, 4, 8, 16), (4, 8), (False, True)):
            if rows == 1 and col_amax:
                continue

            def run(rows=rows, warps=warps, col_amax=col_amax):
                k._rows_kernel[(triton.cdiv(R, rows), B)](
                    x_RC, q, scale, amax, x_RC.stride(0), q.stride(0), R, C=C, BLOCK=C, ROWS=rows,
                    COL_AMAX=col_amax, num_warps=warps,
                )

            report("rows", {"rows": rows, "warps": warps, "col_amax": col_amax}, shape, timed(run), 3 * n)
        x_BRC = x if x.dim() == 3 else x.unsqueeze(0)
        for chunk, tile_r, tile_c, warps in itertools.product((256, 512, 1024), (32, 64), (128, 256), (4, 8)):
            if tile_r > chunk:
                continue

            def run(chunk=chunk, tile_r=tile_r, tile_c=tile_c, warps=warps):
                k._col_amax_kernel[(triton.cdiv(C, tile_c), triton.cdiv(R, chunk), B)](
                    x_BRC, amax, x_BRC.stride(0), x_BRC.stride(1), R=R, C=C, CHUNK_R=chunk, BLOCK_R=tile_r,
                    BLOCK_C=tile_c, num_warps=warps,
                )

            report("col_amax", {"chunk": chunk, "tile_r": tile_r, "tile_c": tile_c, "warps": warps}, shape, timed(run), 2 * n)
        q_BCR = torch.empty((B, C, R), dtype=torch.float8_e4m3fn, device="cuda")
        scale_BC = torch.empty((B, C), dtype=torch.float32, device="cuda")
        for tile_r, tile_c, warps in itertools.product((64, 128, 256), (32, 64, 128), (4, 8)):

            def run(tile_r=tile_r, tile_c=tile_c, warps=warps):
                k._cols_transposed_kernel[(triton.cdiv(C, tile_c), triton.cdiv(R, tile_r), B)](
                    x_BRC, amax, q_BCR, scale_BC, x_BRC.stride(0), x_BRC.stride(1), R=R, C=C, BLOCK_R=tile_r,
                    BLOCK_C=tile_c, num_warps=warps,
                )

            report("transpose", {"tile_r": tile_r, "tile_c": tile_c, "warps": warps}, shape, timed(run), 3 * n)


if __name__ == "__main__":
    main()
