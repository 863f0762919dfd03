"""The time and memory model's constants (`Assumptions`), each with the measurement behind it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """The time and memory model's constants. Each one's measurement, with its figures, date,
    machine, commit and command: docs/measurements.md, "The planner's calibration"."""

    gemm_eff: float = 0.72
    """GEMM + attention FLOP/s as a fraction of the dense BF16 peak. Measured: bench-8e's profile
    on one H200."""
    hbm_eff: float = 0.6
    """Achieved fraction of HBM bandwidth for the memory-bound kernels counted as passes: the
    element-wise work (`ew_passes`, calibrated with it) and autocast's weight casts. Measured:
    torch's fused AdamW on one H200."""
    ew_passes: float = 4.5
    """Element-wise traffic as passes over each micro-batch's saved block activations (norms,
    RoPE, SwiGLU, routing, permutations), plus one pass over the logits and the loss's copies.
    Measured: bench-8e's profile on one H200."""
    eager_ew_factor: float = 2.4
    """How many times longer the element-wise kernels of eager blocks take than the compiled passes
    (unfused, fp32 intermediates): train.compile=false, or the exact all-to-all's graph break.
    Measured: bench-8e eager on one H200, sweep-8l-8:4 and -128:4 bare on one H100."""
    nosync_passes: float = 9.0
    """The sync-free dispatcher's index and mask kernels at ep > 1, forward and backward, as passes
    over the routed rows it moves per MoE layer and micro-batch (wire rows × d_model × 2 B) at
    `hbm_eff`, where they run outside a compiled block (eager blocks, the overlapped exchange).
    Measured: profiled rehearsals of sweep-8l-8:4 and -128:4 at dp8·ep8 on one H100."""
    link_eff: float = 0.33
    """Achieved fraction of a link's one-way bandwidth by NCCL's collectives. Measured: two H200s
    over NVLink."""
    fsdp_overlap: float = 0.66
    """Fraction of the compute time that hides FSDP's all-gathers and reduce-scatters (the ddp
    stack's all-to-alls count as exposed unless overlapped, its data-parallel reductions by
    `dp_tail`). Measured: bench-tiny64e-l6's FSDP step on two H200s."""
    cp_attention_eff: float = 0.275
    """Under context parallelism: each chunk's attention over its key prefix, forward and backward,
    as a fraction of the dense BF16 peak for its causal FLOPs (half the MFU formula's attention
    term). Measured: profiled rehearsals of long-small32e-64k's cp ranks on one H200."""
    ns_eff: float = 0.679
    """optim.name=muon: Newton–Schulz's batched bf16 GEMMs (one triangle of the symmetric products
    from 1,024 rows) and the Frobenius norm before them, as a fraction of the dense BF16 peak for
    the iterations' full FLOPs. Measured: benchmarks/probes/muon_step_probe.py --ns-only over
    bench-tiny64e-l6's matrices on one H100 (bench-8e's larger ones: 0.79)."""
    muon_bytes: float = 32.0
    """optim.name=muon: HBM traffic per element Muon updates besides its Newton–Schulz iterations,
    as bytes at `param_pass_eff` (its two compiled kernels move 24 B; the time taken is 32 B's).
    Measured: benchmarks/probes/muon_step_probe.py on one H200."""
    recompute_cost: tuple[float, float] = (0.28, 0.47)
    """Extra step time of selective recompute of compiled blocks and of full recompute, as a
    fraction of the recomputed blocks' compute (selective recompute of eager blocks is counted
    pass by pass in `step_time`). Measured: bench-8e on one H200."""
    fp8_gemm_speedup: float = 1.7
    """Row-wise FP8 products (fast accumulation in forward and backward) over BF16 ones, on the
    FLOPs FP8 takes. Measured: bench-8e's FP8 and BF16 profiles on one H200."""
    fp8_quant_passes: float = 2.0
    """moetrain's row-wise quantization (its Triton quantizers) as passes over block activations
    and weights, scaled by the share of FLOPs FP8 takes. Measured: bench-8e's FP8 profile on one
    H200."""
    mxfp8_quant_passes: float = 10.0
    """The same for train.fp8=mxfp8 (plain torch operations in eager islands). Not measured: the
    figure row-wise FP8 had with plain torch quantizers, taken as a floor."""
    overlap_slowdown: float = 0.23
    """With parallel.overlap_chunks: how much an all-to-all running under compute slows that
    compute, as a fraction of its duration (NCCL's kernels hold SMs and HBM bandwidth). A one-GPU
    proxy, not measured on two or more: benchmarks/overlap_probe.py."""
    chunk_bytes: float = 4.1
    """With parallel.overlap_chunks > 1: the device time the chunks add, as bytes of HBM traffic
    per local expert parameter and micro-batch; the host's launches are not modelled. Measured:
    benchmarks/overlap_probe.py on one H200."""
    param_pass_eff: float = 0.86
    """Achieved fraction of HBM bandwidth for moetrain's passes over every local parameter: the
    Triton AdamW kernel and the gradients' copies, adds and fp32 accumulation. Measured:
    benchmarks/step_bytes_probe.py on one H200."""
    torch_adamw_eff: float = 0.69
    """The same for torch's fused AdamW over fp32 parameters and moments (the embedding, norms and
    routers with bf16 weights; everything without). Measured: the same probe."""
    norm_eff: float = 0.7
    """The same for the clipping norm's pass over the gradients (`sum_squares` on CUDA). Measured:
    the same probe."""
    group_tile_rows: float = 64.0
    """Rows of work each expert's group adds to its grouped GEMMs beyond its own: the last, partial
    tile of its rows, half a 128-row tile. Measured: benchmarks/step_bytes_probe.py on one H200."""
    dp_tail: bool = True
    """The ddp stack's data-parallel reductions run under the rest of the last backward; only the
    buckets backward finishes last (the embedding's, on the first pipeline rank) and what the
    backward cannot cover are exposed. False: every reduction counted in full. Measured:
    traced sweep-8l-8 at dp2·ep2 on two H200s."""
    workspace_gib: float = 1.0
    """Allocator and kernel work space on top of the accounted tensors."""
