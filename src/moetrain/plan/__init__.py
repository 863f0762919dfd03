"""`moetrain plan`: per-GPU memory, communication and step time of a run on N GPUs, without a GPU.

The run is checked and laid out by the trainer's own code (`RunConfig.build_dims`), and its
parameter groups are counted on a meta-device build of the model (nothing is allocated, so the
trillion-parameter presets plan instantly). Then three typed steps, each a function:

    memory_per_rank   → [RankMemory]      parameters, gradients, optimizer state, activations, peak
    communication     → Communication     bytes sent per step and their time, by collective
    step_time         → StepTime          compute, memory-bound work, exposed communication

Legend: P parameters, t tokens per rank per micro-batch (rows × seq_len), m micro-batches per
optimizer step, D d_model, E experts, K top-k, H expert hidden, Hs shared hidden, Hd dense
hidden, V vocabulary, hq/hkv query/key-value heads of hd dims, ep/dp/pp/v the layout
(src/moetrain/parallel/dims.py), edp = dp / ep.

Memory per GPU (the peak of torch's allocated bytes; what `moetrain bench` reports), for the
pipeline rank that needs most:
- weights: fp32, 4 B × local parameters (experts ÷ ep; a pipeline rank holds its stages' blocks,
  the first also the embedding, the last the final norm and LM head; the FSDP stack ÷ dp);
- gradients: fp32, 4 B × local parameters (the FSDP stack ÷ dp; with several micro-batches it
  also keeps the unsharded gradients between them, 4 B × the local parameters before sharding);
  with optim.grad_dtype=bf16 2 B on the ddp stack (its buckets, or the gradients made per step at
  dp = 1) and 2 B for FSDP's unsharded ones (its shards stay fp32);
- optimizer: AdamW's two fp32 moments, 8 B × local parameters; the sharded optimizer keeps
  12 B (master + moments) per element of its shard (÷ dp dense, ÷ edp experts), with
  optim.bf16_weights 10 B (remainder + moments; the weights then 2 B, whole); FSDP ÷ dp; with
  optim.moments_dtype=bf16 the moments take 4 B instead of 8 everywhere;
- activations: what autograd keeps for backward, per block and token (`_block_bytes`), for the
  micro-batches a rank holds at once (1 without a pipeline; 1F1B: pp − rank, interleaved ×
  (1 + (pp − 1)/(pp·v)), GPipe: all m), plus on the last stage the loss's logits — one chunk's
  bf16 logits and their gradient (c × V × 4 B, c = compute.loss_chunk_tokens) with the hidden
  states' fp32 gradient (t × D × 4 B) held for backward; with the plain path (chunks off, or a
  pipeline) all of them, bf16, their fp32 copy and log-softmax (t × V × 10 B) —, plus autocast's
  bf16 weight copies of blocks that do not
  recompute (2 B × their parameters; kept from forward to backward) — none with optim.bf16_weights
  (CUDA's default with the replicated optimizer: bf16 weights + 16-bit remainders, 4 B as fp32
  weights take; gradients bf16, 2 B, until a second micro-batch or a reducer bucket makes them fp32)
  —, plus with parallel.overlap_chunks one exchange's buffer (the overlapped exchange writes it
  while compute runs);
- the peak is the larger of "weights + optimizer + everything saved at the start of backward
  (and the gradients, when they are kept across micro-batches or in reducer buckets)" and
  "weights + optimizer + gradients + the optimizer step's work space";
- while a checkpoint is saved or loaded: weights + optimizer + the gradient buckets that persist
  + a pipeline's receive buffers + what the save or load allocates on the device
  (`save_temporaries`, `load_temporaries`: each rank writes and reads only its own parts, so
  nothing but a split master's one-block join).
The activation terms are an account of the saved tensors of the compiled bf16 step (eager adds
the norms' and SwiGLU's fp32 intermediates: `compile=false`); they were checked against the peaks
measured on one H200 (docs/measurements.md, "The planner against measured peaks").

Step time: GEMM and attention FLOPs (the MFU formula's, src/moetrain/model/counting.py) at a
fraction `gemm_eff` of the GPU's dense BF16 peak (row-wise FP8: `fp8_gemm_speedup` faster, plus
its quantization passes; mxfp8's emulated products at the BF16 rate), plus each local expert's
partial last tile in its grouped GEMMs (`group_tile_rows` rows of work per expert and GEMM); the
passes over every local parameter at their measured rates (`param_pass_eff`, `torch_adamw_eff`,
`norm_eff`): the optimizer (AdamW: 28 B per element it updates, 20 B with bf16 moments, 2 B less
reading bf16 gradients; moetrain's Triton kernel for split masters and bf16 moments, torch's fused
AdamW for the rest), the clipping norm (one read of each gradient) and the gradients' copies and
accumulation (without optim.bf16_weights: per micro-batch the fp32→bf16 weight casts and the
gradient casts, 12 B per local parameter, and from the second micro-batch accumulation into
.grad, 12 B, at `hbm_eff`; with it, per gradient a `GradReducer` buckets — dense ones at dp > 1,
experts' at edp > 1 or under the sharded optimizer — a copy into the bucket at the first backward,
6 B into fp32 and 4 B into bf16 (optim.grad_dtype=bf16), then 10 B or 6 B per later backward; an
unbucketed one is kept as backward made it, then 8 B for the second backward and 10 B for later
ones, or 6 B in bf16); element-wise kernels at `hbm_eff` (`ew_passes` passes over each
micro-batch's saved block activations and one over the logits; eager blocks `eager_ew_factor`
times that; the sync-free dispatcher's index and mask kernels at ep > 1, `nosync_passes` over
its routed rows); the measured cost of recompute
(`recompute_cost`); and communication: the expert all-to-all and the sharded optimizer's
all-gather count in full (measured: not hidden) — the all-to-all less what
parallel.overlap_chunks hides (`_overlapped_exchange_time`: an assumed `overlap_slowdown`, no
multi-GPU measurement yet) plus the chunks' own device time (`chunk_bytes`, measured on one
H200) —; the ddp stack's data-parallel reductions only for the buckets backward finishes last
(`dp_tail`: the embedding's, measured on two H200s) and what the last backward cannot cover;
FSDP's transfers beyond what `fsdp_overlap` of the compute hides, the pipeline's bubble ((pp −
1)/v micro-batches' compute) and sends. Host time is not modeled: the step is taken to be device
time (compiled blocks keep the host ahead; the overlapped exchange's eager per-chunk work is
measured per layer on one H200 in docs/measurements.md). Links: NVLink within a node of
`gpus_per_node`, the node's network (per GPU) across nodes, at `link_eff` of their one-way
bandwidth. The constants are assumptions, stated in
`GPUS` and `Assumptions` with what each was calibrated on (one and two H200s); treat step time
and MFU as ±25% (docs/measurements.md, "The planner against measured peaks" and "One-GPU
tokens/s", compares them with measured runs)."""

from moetrain.parallel.config import LAYOUT_WORDS, layout_legend
from moetrain.plan.calibration import Assumptions
from moetrain.plan.estimate import PEAK_ERROR, Plan, capacity_floor, device_capacity_floor, plan
from moetrain.plan.hardware import GIB, GPU, GPUS, plan_gpu
from moetrain.plan.layout import (
    BUCKET_BYTES,
    Layout,
    ParamGroups,
    compiled_blocks,
    layout_of,
    rows_per_token,
    uses_bf16_weights,
)
from moetrain.plan.memory import (
    EntrySizes,
    RankMemory,
    checkpoint_state_bytes,
    load_temporaries,
    memory_per_rank,
    save_temporaries,
)
from moetrain.plan.report import layouts_text, legend_lines, more_gpus_json, more_gpus_text, report, to_json
from moetrain.plan.search import MAX_GPUS, MoreGpus, fewest_gpus, larger_counts, suggest, with_layout
from moetrain.plan.time import (
    COMPUTE_PARTS,
    EXPOSED_PARTS,
    PEER_PARTS,
    Communication,
    StepTime,
    communication,
    step_time,
)

__all__ = [
    "Assumptions",
    "capacity_floor",
    "device_capacity_floor",
    "BUCKET_BYTES",
    "COMPUTE_PARTS",
    "EXPOSED_PARTS",
    "LAYOUT_WORDS",
    "MAX_GPUS",
    "MoreGpus",
    "PEAK_ERROR",
    "Communication",
    "EntrySizes",
    "GIB",
    "GPU",
    "GPUS",
    "Layout",
    "PEER_PARTS",
    "ParamGroups",
    "Plan",
    "RankMemory",
    "StepTime",
    "checkpoint_state_bytes",
    "communication",
    "compiled_blocks",
    "fewest_gpus",
    "larger_counts",
    "layout_legend",
    "layouts_text",
    "legend_lines",
    "more_gpus_json",
    "more_gpus_text",
    "layout_of",
    "load_temporaries",
    "memory_per_rank",
    "plan",
    "plan_gpu",
    "report",
    "rows_per_token",
    "save_temporaries",
    "step_time",
    "suggest",
    "to_json",
    "uses_bf16_weights",
    "with_layout",
]
