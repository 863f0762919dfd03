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
(moetrain/parallel/dims.py), edp = dp / ep.

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
  bf16 logits and their gradient (c × V × 4 B, c = train.loss_chunk_tokens) with the hidden
  states' fp32 gradient (t × D × 4 B) held for backward; with the plain path (chunks off, or a
  pipeline) all of them, bf16, their fp32 copy and log-softmax (t × V × 10 B) —, plus autocast's
  bf16 weight copies of blocks that do not
  recompute (2 B × their parameters; kept from forward to backward) — none with optim.bf16_weights
  (CUDA's default with the replicated optimizer: bf16 weights + 16-bit remainders, 4 B as fp32
  weights take; gradients bf16, 2 B, until a second micro-batch or a reducer bucket makes them fp32)
  —, plus with parallel.overlap_chunks one exchange's buffer (the pipelined exchange writes it
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
measured on one H200 (docs/benchmarks.md, "The planner against measured peaks").

Step time: GEMM and attention FLOPs (the MFU formula's, moetrain/model/counting.py) at a
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
parallel.overlap_chunks hides (`_pipelined_exchange_time`: an assumed `overlap_slowdown`, no
multi-GPU measurement yet) plus the chunks' own device time (`chunk_bytes`, measured on one
H200) —; the ddp stack's data-parallel reductions only for the buckets backward finishes last
(`dp_tail`: the embedding's, measured on two H200s) and what the last backward cannot cover;
FSDP's transfers beyond what `fsdp_overlap` of the compute hides, the pipeline's bubble ((pp −
1)/v micro-batches' compute) and sends. Host time is not modeled: the step is taken to be device
time (compiled blocks keep the host ahead; the pipelined exchange's eager per-chunk work is
measured per layer on one H200 in docs/benchmarks.md). Links: NVLink within a node of
`gpus_per_node`, the node's network (per GPU) across nodes, at `link_eff` of their one-way
bandwidth. The constants are assumptions, stated in
`GPUS` and `Assumptions` with what each was calibrated on (one and two H200s); treat step time
and MFU as ±25% (docs/benchmarks.md, "The planner against measured peaks" and "One-GPU
tokens/s", compares them with measured runs)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import torch

from moetrain.errors import ConfigError
from moetrain.model.config import Fp8, TransformerConfig
from moetrain.model.counting import flops_per_token
from moetrain.model.experts import GroupedExperts
from moetrain.optim.split_master import is_split_candidate
from moetrain.parallel.config import DispatcherKind, PipelineSchedule, Recompute, Stack
from moetrain.parallel.nosync_dispatcher import block_rows, capacity_rows, chunks_by_experts
from moetrain.parallel.pipeline import stage_layers
from moetrain.train.config import RunConfig
from moetrain.train.dcp_shards import PIECE

GIB = 2**30
_BUCKET_BYTES = 25 * 2**20
"""The gradient buckets' size (`GradReducer`'s default)."""


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    """What torch can allocate: the device's memory as nvidia-smi reports it, less ~1.5 GiB of
    CUDA context and NCCL buffers (not counted in torch's allocated bytes)."""
    bf16_flops: float
    """Dense BF16 tensor-core peak, FLOP/s (MFU's denominator; FP8 GEMMs run at twice this)."""
    hbm_bytes_s: float
    nvlink_bytes_s: float
    """Per GPU, one direction."""
    network_bytes_s: float
    """Per GPU, one direction, across nodes (one NIC per GPU)."""
    gpus_per_node: int = 8


GPUS: dict[str, GPU] = {
    # H100 SXM 80 GB: NVLink 4 (900 GB/s both directions), ConnectX-7 400 Gb/s per GPU.
    "h100": GPU("H100 SXM", 78.0, 989.4e12, 3.35e12, 450e9, 50e9),
    # H200 SXM 141 GB (nvidia-smi: 143,771 MiB): as H100, more and faster memory.
    "h200": GPU("H200 SXM", 139.0, 989.4e12, 4.8e12, 450e9, 50e9),
    # B200 180 GB: NVLink 5 (1.8 TB/s both directions), ConnectX-7 400 Gb/s per GPU.
    "b200": GPU("B200", 177.0, 2250e12, 8.0e12, 900e9, 50e9),
    # B300 288 GB (275 GiB usable, as Olmo-core reports it): ConnectX-8 800 Gb/s per GPU.
    "b300": GPU("B300", 275.0, 2250e12, 8.0e12, 900e9, 100e9),
}


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """The time and memory model's constants. Each one's measurement, with its figures, date,
    machine, commit and command: docs/benchmarks.md, "The planner's calibration"."""

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
    eager_ew_factor: float = 2.45
    """How many times longer the element-wise kernels of eager blocks take than the compiled passes
    (unfused, fp32 intermediates): train.compile=false, or the exact all-to-all's graph break;
    with the pipelined exchange (parallel.overlap_chunks) the experts' share runs eagerly in
    compiled blocks too. Measured: bench-8e eager, and the rehearsed rank 0 of sweep-8l-8 at
    dp8·ep8, on one H200."""
    nosync_passes: float = 34.0
    """The sync-free dispatcher's index and mask kernels at ep > 1 (the gathers into and out of the
    wire buffers, masking of the rows no token filled, the regroup by local expert, forward and
    backward) as passes over the routed rows it moves per MoE layer and micro-batch (wire rows ×
    d_model × 2 B) at `hbm_eff`, where they run eagerly: in eager blocks and with the pipelined
    exchange, which compile leaves out (compiled blocks without it fuse them; not counted).
    Measured: the profiled rehearsal of rank 0 of sweep-8l-8 and -128 at dp8·ep8 on one H200
   ."""
    link_eff: float = 0.33
    """Achieved fraction of a link's one-way bandwidth by NCCL's collectives. Measured: two H200s
    over NVLink."""
    symm_link_eff: float = 0.083
    """The same for NVSHMEM's all-to-all-v kernels (`parallel.dispatcher=symm`). Measured:
    sweep-8l-8 at ep2 on two H200s."""
    fsdp_overlap: float = 0.66
    """Fraction of the compute time that hides FSDP's all-gathers and reduce-scatters (the ddp
    stack's all-to-alls count as exposed unless pipelined, its data-parallel reductions by
    `dp_tail`). Measured: bench-tiny64e-l6's FSDP step on two H200s."""
    recompute_cost: tuple[float, float] = (0.28, 0.47)
    """Extra step time of selective recompute of compiled blocks and of full recompute, as a
    fraction of the recomputed blocks' compute (selective recompute of eager blocks is counted
    pass by pass in `step_time`). Measured: bench-8e on one H200."""
    fp8_gemm_speedup: float = 1.45
    """Row-wise FP8 GEMMs over BF16 ones. Measured: bench-8e's profile on one H200."""
    fp8_quant_passes: float = 10.0
    """moetrain's row-wise quantization as passes over block activations and weights. Measured:
    bench-8e with the compiled quantizers on one H200."""
    overlap_slowdown: float = 0.23
    """With parallel.overlap_chunks: how much an all-to-all running under compute slows that
    compute, as a fraction of its duration (NCCL's kernels hold SMs and HBM bandwidth). Not
    measured on two or more GPUs; the value is a one-GPU proxy: an MoE layer's compute beside
    NCCL all-to-alls of a 1-rank group, benchmarks/overlap_probe.py."""
    chunk_bytes: tuple[float, float] = (4.1, 7.1)
    """With parallel.overlap_chunks: the device time the chunks add, as bytes of HBM traffic per
    local expert parameter and micro-batch, for chunks by experts and (per chunk beyond the
    first) by tokens; the host's launches are not modelled. Measured:
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
    tile of its rows, half a 128-row tile (smaller experts lose more than this counts).
    Measured: benchmarks/step_bytes_probe.py at sweep-8l's per-rank shape on one H200."""
    dp_tail: bool = True
    """The ddp stack's data-parallel reductions run under the rest of the last backward; only the
    buckets backward finishes last (the embedding's, on the first pipeline rank) and what the
    backward cannot cover are exposed. False: every reduction counted in full. Measured:
    traced sweep-8l-8 at dp2·ep2 on two H200s."""
    workspace_gib: float = 1.0
    """Allocator and kernel work space on top of the accounted tensors."""


@dataclasses.dataclass
class Layout:
    stack: str
    dp: int
    ep: int
    pp: int
    stages_per_rank: int
    schedule: str
    shard_optimizer: bool
    dispatcher: str
    capacity_factor: float | None
    """nosync: rows through each rank's experts ÷ the balanced load; None = padded (ep×)."""
    spill_factor: float
    """nosync: spill rows per pair on the wire beyond the capacity, ÷ the balanced share."""
    capacity_min_rows: int
    """nosync: the fewest rows a rank's experts get (parallel.capacity_min_rows)."""
    overlap_chunks: int
    """nosync: parallel.overlap_chunks (0: the all-to-alls are exposed)."""
    recompute: str
    recompute_every: int
    micro_batches: int
    rows_per_micro_batch: int
    """Sequences per rank per micro-batch."""

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (dp / ep)."""
        return max(1, self.dp // self.ep)

    def bucketed(self, dense: float, experts: float) -> float:
        """Of `dense` and `experts` parameters, those whose gradients the ddp stack keeps in
        buckets (moetrain/optim/grad_reducer.py): none at dp = 1; the dense ones at dp > 1, the
        experts' too unless each lives alone in its group (edp = 1) — the sharded optimizer
        buckets every parameter."""
        if self.stack == Stack.fsdp.value or self.dp == 1:
            return 0.0
        return dense + (experts if self.edp > 1 or self.shard_optimizer else 0.0)

    def describe(self) -> str:
        parts = [f"dp{self.dp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"×v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""))
        text = "·".join(parts) + f" {self.stack}"
        if self.ep > 1:
            text += f" {self.dispatcher}"
            if self.dispatcher == DispatcherKind.nosync.value:
                cf, sf = self.capacity_factor, self.spill_factor
                text += f"(cf {cf:g}" + (f" + spill {sf:g})" if sf else ")") if cf else "(padded)"
                if self.overlap_chunks:
                    text += f" overlap×{self.overlap_chunks}"
        if self.shard_optimizer:
            text += " sharded-optimizer"
        if self.recompute != "none":
            text += f" recompute={self.recompute}" + (
                f"/every {self.recompute_every}" if self.recompute_every > 1 else ""
            )
        return text + f", {self.rows_per_micro_batch} seq × {self.micro_batches} micro-batches per rank"


@dataclasses.dataclass
class Plan:
    layout: Layout
    gpu: GPU
    params_per_device: int
    memory_gib: dict[str, float]
    peak_mem_gib_per_device: float
    fits: bool
    comm_gb_per_step: dict[str, float]
    time_s: dict[str, float]
    step_time_s: float
    mfu: float
    tokens_per_sec_per_device: float
    activations_without_recompute_gib: float
    activations_full_recompute_gib: float
    peak_gib_per_pipeline_rank: list[float]
    save_peak_gib_per_pipeline_rank: list[float]
    load_peak_gib_per_pipeline_rank: list[float]
    params_per_pipeline_rank: list[int]
    save_peak_gib_per_device: float
    """Allocated during a checkpoint save: the training state, the gradient buckets that persist,
    and the temporaries the save makes on the device (`save_temporaries`)."""
    fits_while_saving: bool
    load_peak_gib_per_device: float
    """Allocated while a checkpoint is loaded (a resume): the training state, the gradient
    buckets the optimizer allocates up front, and the load's temporaries (`load_temporaries`)."""
    fits_while_loading: bool
    busiest_rank: int
    """A global rank of the pipeline rank that needs most memory (its stage's first dp rank: the
    ranks of a stage hold alike): the one `moetrain bench --rehearse` runs by default."""

    @property
    def compute_s(self) -> float:
        """The step's parts one rank's own kernels make (`COMPUTE_PARTS`): what a rehearsal
        measures."""
        return sum(self.time_s[k] for k in COMPUTE_PARTS)

    @property
    def peers_s(self) -> dict[str, float]:
        """The parts that need the other ranks (`PEER_PARTS`): what a rehearsal cannot measure."""
        return {k: self.time_s[k] for k in PEER_PARTS}


COMPUTE_PARTS = (
    "gemm_and_attention",
    "expert_gemm_tiles",
    "weight_casts",
    "element_wise",
    "fp8_quantization",
    "recompute",
    "overlap_chunk_grads",
    "optimizer",
)
PEER_PARTS = ("pipeline_bubble", "expert_all_to_all", "dp_reductions", "fsdp_exposed", "pipeline_sends")
"""`StepTime.parts` split into what a rank computes alone and what its peers add: communication
as exposed (after the overlap the model grants; `Assumptions.link_eff`, `overlap_slowdown`,
`dp_tail`, `fsdp_overlap`) and the pipeline's bubble."""


def _block_bytes(
    m: TransformerConfig,
    moe_block: bool,
    recompute: str,
    expert_rows: float,
    compiled: bool,
    fp32: bool,
    exchanged_rows: float = 0.0,
) -> float:
    """Bytes autograd keeps per token for one block's backward (expert_rows: rows through the
    experts per token: K, or more with the sync-free dispatcher's fixed buffers: `_rows_per_token`;
    exchanged_rows: rows per token each direction of the expert all-to-all returns, which
    selective recompute keeps as collective outputs)."""
    a = 4 if fp32 else 2  # matmul inputs/outputs (autocast bf16)
    r = 4  # the residual stream is fp32
    D, hd, hq, hkv = m.d_model, m.resolved_head_dim, m.n_heads, m.n_kv_heads
    if recompute == "full":
        return r * D  # the block's input
    q_k_v = a * (hq + 2 * hkv) * hd
    attn_out = a * hq * hd + 4 * hq  # SDPA output + log-sum-exp
    if recompute == "selective":  # block input + every matmul / attention output
        attn = r * D + q_k_v + attn_out + a * D
        if moe_block:
            moe = m.moe
            # fp32 router logits, the shared expert's and the experts' matmul outputs, and the
            # rows both all-to-alls return
            ffn = 4 * m.moe.num_experts + a * (2 * moe.shared_hidden + D * (moe.shared_hidden > 0))
            ffn += expert_rows * a * (2 * moe.expert_hidden + D) + 2 * exchanged_rows * a * D
        else:
            ffn = a * (2 * m.resolved_dense_hidden + D)
        return attn + ffn
    attn = r * D + a * D + q_k_v + a * (hq + hkv) * hd + attn_out  # norm in, qkv in, q/k before norm, sdpa
    if moe_block:
        moe = m.moe
        ffn = r * D + a * D + 4 * moe.num_experts  # norm input, router/shared input, router probs
        ffn += (
            expert_rows * a * (D + 2 * moe.expert_hidden + moe.expert_hidden + D)
        )  # permuted in, gate/up, act, down out
        ffn += a * 3 * moe.shared_hidden
        hidden_for_eager = expert_rows * moe.expert_hidden + moe.shared_hidden
    else:
        Hd = m.resolved_dense_hidden
        ffn = r * D + a * D + a * 3 * Hd
        hidden_for_eager = Hd
    eager = (
        0 if compiled else 4 * 2 * D + 4 * (hq + hkv) * hd + a * hidden_for_eager
    )  # fp32 norm outputs, qk-norm, silu(gate)
    return attn + ffn + eager


@dataclasses.dataclass(frozen=True)
class ParamGroups:
    """Parameters per kind of module, counted on a meta-device build of the model."""

    embedding: int
    head: int
    """The final norm and the LM head."""
    dense_block: int
    """One dense block (attention, norms, dense MLP)."""
    moe_dense: int
    """The non-expert part of one MoE block (attention, norms, router, shared expert)."""
    moe_experts: int
    """The routed experts of one MoE block, all of them."""

    @classmethod
    def of(cls, m: TransformerConfig) -> ParamGroups:
        return _param_groups(json.dumps(m.to_dict(), sort_keys=True))


@functools.lru_cache(maxsize=64)
def _param_groups(model_json: str) -> ParamGroups:
    """Cached per model config: `suggest` plans hundreds of layouts of one model."""
    model = TransformerConfig.from_dict(json.loads(model_json)).build(device="meta")

    def numel(module) -> int:
        return sum(p.numel() for p in module.parameters())

    dense_block = moe_dense = moe_experts = 0
    for block in model.blocks.values():
        experts = sum(numel(m) for m in block.modules() if isinstance(m, GroupedExperts))
        if experts:
            moe_dense, moe_experts = numel(block) - experts, experts
        else:
            dense_block = numel(block)
    return ParamGroups(
        embedding=numel(model.embed),
        head=numel(model.norm) + numel(model.lm_head),
        dense_block=dense_block,
        moe_dense=moe_dense,
        moe_experts=moe_experts,
    )


def layout_of(cfg: RunConfig, gpus: int) -> Layout:
    """The layout `cfg` asks for on `gpus` GPUs, checked as the trainer checks it."""
    dims = cfg.build_dims(gpus)
    p, tc = cfg.parallel, cfg.train
    schedule = p.pp_schedule.value if dims.pp > 1 else "none"
    return Layout(
        stack=p.stack.value,
        dp=dims.dp,
        ep=dims.ep,
        pp=dims.pp,
        stages_per_rank=dims.stages_per_rank,
        schedule=schedule,
        shard_optimizer=p.shard_optimizer,
        dispatcher=p.dispatcher.value,
        capacity_factor=p.capacity_factor,
        spill_factor=p.spill_factor,
        capacity_min_rows=p.capacity_min_rows,
        overlap_chunks=p.overlap_chunks if p.dispatcher == DispatcherKind.nosync else 0,
        recompute=tc.recompute.value,
        recompute_every=tc.recompute_every,
        micro_batches=tc.grad_accum_steps,
        rows_per_micro_batch=tc.micro_batch_size // dims.dp,
    )


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's parameters and memory (bytes)."""

    rank: int
    layers: int
    first: bool
    last: bool
    local: float
    """Parameters held before FSDP sharding (its experts ÷ ep)."""
    dense_local: float
    expert_local: float
    embedding_local: float
    """The embedding table's parameters (first pipeline rank), in `dense_local`."""
    weights: float
    grads: float
    optimizer: float
    activations: float
    """Saved activations of this layout, with the logits and the bf16 weight copies."""
    peak: float
    blocks_none: float
    """Saved block activations of one micro-batch without recompute."""
    experts_none: float
    """The experts' share of `blocks_none` (their routed rows' tensors)."""
    moe_layers: int
    """MoE blocks this rank holds."""
    recv_buffers: float
    """The pipeline's receive buffers: torch.distributed.pipelining allocates, up front and for
    each micro-batch, one fp32 (rows, seq, d_model) activation buffer for each stage that is not
    the first and one output-gradient buffer for each stage that is not the last, and keeps them
    between steps (they persist when checkpoints are saved)."""
    logits_bytes: float
    """The loss's logits and what it holds for backward (module docstring)."""
    loss_traffic: float
    """Bytes the loss's element-wise kernels read and write per micro-batch."""
    act_none: float
    """Activations of the micro-batches in flight without recompute (with the logits)."""
    act_full: float
    """The same with full recompute."""


@dataclasses.dataclass(frozen=True)
class Communication:
    bytes: dict[str, float]
    """Bytes sent per step by this rank, per collective."""
    seconds: dict[str, float]
    """Their transfer time at the links' achieved rates."""


@dataclasses.dataclass(frozen=True)
class StepTime:
    parts: dict[str, float]
    """Seconds per step, by part (the `time_s` of `Plan`)."""
    step: float
    mfu: float
    tokens_per_device: float
    """Tokens one GPU processes per step (÷ pp: a pipeline's ranks share the step's tokens)."""


def plan(cfg: RunConfig, gpus: int, gpu: str, assume: Assumptions = Assumptions()) -> Plan:
    """Memory, communication and step time of `cfg` on `gpus` GPUs of kind `gpu`."""
    if gpu not in GPUS:
        raise ConfigError(f"--gpu={gpu!r} is not one the planner knows: choose one of {', '.join(GPUS)}.")
    if gpus <= 0:
        raise ConfigError(f"--gpus={gpus} must be a positive number of GPUs.")
    spec, L = GPUS[gpu], layout_of(cfg, gpus)
    groups = ParamGroups.of(cfg.model)
    ranks = memory_per_rank(cfg, L, groups, assume)
    busiest = max(ranks, key=lambda r: r.peak)  # the first of equal peaks
    comm = communication(cfg, L, busiest, spec, assume)
    time = step_time(cfg, L, busiest, comm, spec, assume)
    fsdp = L.stack == Stack.fsdp.value
    peak_gib = busiest.peak / GIB
    memory = {k: round(getattr(busiest, k) / GIB, 2) for k in ("weights", "grads", "optimizer", "activations")}
    memory["workspace"] = assume.workspace_gib
    ws = assume.workspace_gib
    saves = [(checkpoint_state_bytes(L, r) + save_temporaries(cfg, L, r)) / GIB + ws for r in ranks]
    loads = [(checkpoint_state_bytes(L, r) + load_temporaries(cfg, L, r)) / GIB + ws for r in ranks]
    save_gib, load_gib = max(saves), max(loads)
    return Plan(
        layout=L,
        gpu=spec,
        params_per_device=int(busiest.local / (L.dp if fsdp else 1)),
        memory_gib=memory,
        peak_mem_gib_per_device=round(peak_gib, 2),
        fits=peak_gib <= spec.memory_gib,
        comm_gb_per_step={k: round(v / 1e9, 3) for k, v in comm.bytes.items()},
        time_s=time.parts,
        step_time_s=time.step,
        mfu=time.mfu,
        tokens_per_sec_per_device=time.tokens_per_device / time.step,
        activations_without_recompute_gib=busiest.act_none / GIB,
        activations_full_recompute_gib=busiest.act_full / GIB,
        peak_gib_per_pipeline_rank=[round(r.peak / GIB, 2) for r in ranks],
        save_peak_gib_per_pipeline_rank=[round(x, 2) for x in saves],
        load_peak_gib_per_pipeline_rank=[round(x, 2) for x in loads],
        params_per_pipeline_rank=[int(r.local / (L.dp if fsdp else 1)) for r in ranks],
        save_peak_gib_per_device=round(save_gib, 2),
        fits_while_saving=save_gib <= spec.memory_gib,
        load_peak_gib_per_device=round(load_gib, 2),
        fits_while_loading=load_gib <= spec.memory_gib,
        busiest_rank=busiest.rank * L.dp,
    )


def checkpoint_state_bytes(L: Layout, rank: RankMemory) -> float:
    """What `rank` holds between steps, when checkpoints are saved and loaded: weights (FSDP's
    shards only: no block is gathered), optimizer state, and the gradient buckets that persist
    (the ddp stack's reducer's — dense gradients at dp > 1, the experts' at edp > 1 — and the
    sharded optimizer's; other gradients are freed by `zero_grad` and not yet allocated at a
    load). Activations are freed."""
    fsdp = L.stack == Stack.fsdp.value
    weights = 4 * rank.local / L.dp if fsdp else rank.weights
    if fsdp or not rank.local:
        return weights + rank.optimizer + rank.recv_buffers
    # the buckets hold the dense gradients at dp > 1 and the experts' at edp > 1 (`bucketed`);
    # the sharded optimizer buckets every gradient, even at dp = 1
    bucketed = rank.local if L.shard_optimizer else L.bucketed(rank.dense_local, rank.expert_local)
    return weights + rank.optimizer + rank.recv_buffers + rank.grads * bucketed / rank.local


def save_temporaries(cfg: RunConfig, L: Layout, rank: RankMemory) -> float:
    """Device bytes a checkpoint save allocates on `rank` beyond its state. Each rank writes only
    the entries and ranges it holds, from views of the live tensors, one item at a time to host
    memory (moetrain/train/dcp_shards.py; the finiteness check before it reduces each parameter
    to its min and max): nothing is gathered, whatever the stack or the optimizer. Only with
    optim.bf16_weights is there a temporary: each split fp32 master block as it is joined, at most
    the largest split entry (4 B per element), `PIECE` elements at a time (int32 intermediates,
    16 B each)."""
    if not uses_bf16_weights(cfg):
        return 0.0
    return 4.0 * EntrySizes.of(cfg.model).largest_split_entry(rank) + 16.0 * PIECE


def load_temporaries(cfg: RunConfig, L: Layout, rank: RankMemory) -> float:
    """Device bytes a checkpoint load allocates on `rank` beyond its state. DCP reads each stored
    chunk into host memory and copies it into views of the live tensors: nothing, except with
    optim.bf16_weights one read's fp32 temporary of a split master (at most the largest split
    entry) split into its halves `PIECE` elements at a time (20 B each), and then, with the sharded
    optimizer, one bucket shard's bf16 weights copied for their all-gather (2 B per element)."""
    if not uses_bf16_weights(cfg):
        return 0.0
    split = 4.0 * EntrySizes.of(cfg.model).largest_split_entry(rank) + 20.0 * PIECE
    # a bucket holds at most _BUCKET_BYTES of gradients (fp32, or bf16: optim.grad_dtype); its shard
    # is 1/edp of it or less
    grad_elem = 2 if cfg.optim.grad_dtype.value == "bf16" else 4
    shard = 2.0 * min(_BUCKET_BYTES / grad_elem, rank.local) / L.edp if L.shard_optimizer else 0.0
    return max(split, shard)


@dataclasses.dataclass(frozen=True)
class EntrySizes:
    """The largest checkpoint entries optim.bf16_weights splits (elements), counted on a
    meta-device model: what bounds a checkpoint's temporaries."""

    split_block_entry: int
    """In a block (one expert's matrix for stacked experts)."""
    split_head: int
    """The LM head's."""

    @classmethod
    def of(cls, m: TransformerConfig) -> EntrySizes:
        return _entry_sizes(json.dumps(m.to_dict(), sort_keys=True))

    def largest_split_entry(self, rank: RankMemory) -> int:
        return max(self.split_block_entry, self.split_head if rank.last else 0)


@functools.lru_cache(maxsize=64)
def _entry_sizes(model_json: str) -> EntrySizes:
    model = TransformerConfig.from_dict(json.loads(model_json)).build(device="meta")
    experts = {id(p) for mod in model.modules() if isinstance(mod, GroupedExperts) for p in mod.parameters()}
    split = is_split_candidate(model)
    blocks = [
        p.numel() // p.shape[0] if id(p) in experts else p.numel() for p in model.blocks.parameters() if id(p) in split
    ]
    head = [p.numel() for p in model.lm_head.parameters() if id(p) in split]
    return EntrySizes(split_block_entry=max(blocks, default=0), split_head=max(head, default=0))


def _rows_per_token(cfg: RunConfig, L: Layout) -> tuple[float, float]:
    """(expert_rows, wire_rows): rows per token through the experts (their activations) and on
    the all-to-all. nosync (moetrain/parallel/nosync_dispatcher.py) gives the experts
    capacity_factor × K rows and moves (capacity_factor + spill_factor) × K, both at most ep × K
    (the padded mode, capacity_factor=None, is ep × K for both; so is a micro-batch small enough
    for parallel.capacity_min_rows to take every row); symm pads the receive layout
    (ep·K rows per token, most of them skipped by the GEMMs but allocated) and moves exact rows."""
    k = cfg.model.moe.top_k
    if L.ep > 1 and L.dispatcher == DispatcherKind.nosync.value:
        tokens = L.rows_per_micro_batch * cfg.data.seq_len  # per rank and micro-batch
        M = tokens * k
        rows = capacity_rows(M, L.ep, L.capacity_factor, L.capacity_min_rows)
        wire = block_rows(M, L.ep, L.capacity_factor, L.spill_factor, L.capacity_min_rows)
        return L.ep * rows / tokens, L.ep * wire / tokens
    if L.ep > 1 and L.dispatcher == DispatcherKind.symm.value:
        return k * L.ep, k
    return k, k


def compiled_blocks(cfg: RunConfig) -> bool:
    """Whether the blocks run compiled: train.compile, unless the exact all-to-all dispatcher
    reads split sizes on the host — a graph break inside the block, which then keeps
    eager-sized activations (measured: 80.5 GiB vs 80.1 nosync) and runs eager kernels."""
    return cfg.train.compile and not (cfg.parallel.ep > 1 and cfg.parallel.dispatcher == DispatcherKind.alltoall)


def memory_per_rank(cfg: RunConfig, L: Layout, groups: ParamGroups, assume: Assumptions) -> list[RankMemory]:
    """Parameters and memory of each pipeline rank (one entry without a pipeline)."""
    m = cfg.model
    fp32 = cfg.train.precision.value == "fp32"
    compiled = compiled_blocks(cfg)
    S = L.pp * L.stages_per_rank
    layers_per_stage = [len(s) for s in stage_layers(m.n_layers, S)]
    t = L.rows_per_micro_batch * cfg.data.seq_len  # tokens per rank per micro-batch
    fsdp = L.stack == Stack.fsdp.value
    ep_eff = 1 if fsdp else L.ep
    expert_rows, wire_rows = _rows_per_token(cfg, L)
    # selective recompute keeps what the functional all-to-alls return (alltoall, nosync without
    # the pipelined exchange, whose transfers are not functional collectives)
    functional_exchange = L.dispatcher in (DispatcherKind.alltoall.value, DispatcherKind.nosync.value)
    exchanged = wire_rows if ep_eff > 1 and functional_exchange and not L.overlap_chunks else 0.0
    chunk = cfg.train.resolved_loss_chunk_tokens("cuda") if L.pp == 1 else 0  # pipelines: the plain path
    bf16_weights = uses_bf16_weights(cfg)
    out = []
    for r in range(L.pp):
        stages = [r + i * L.pp for i in range(L.stages_per_rank)]
        layer_ids = [i for s in stages for i in range(sum(layers_per_stage[:s]), sum(layers_per_stage[: s + 1]))]
        dense_local = expert_local = 0
        act_per_token = act_none = act_full = experts_none = 0.0
        moe_layers = 0
        cast_bytes = 0.0
        for i in layer_ids:
            is_moe = i >= m.num_dense_layers and m.moe.num_experts > 0
            dense = groups.moe_dense if is_moe else groups.dense_block
            experts = groups.moe_experts / ep_eff if is_moe else 0
            dense_local += dense
            expert_local += experts
            recomputes = L.recompute != "none" and i % L.recompute_every == 0
            mode = L.recompute if recomputes else "none"
            act_per_token += _block_bytes(m, is_moe, mode, expert_rows, compiled, fp32, exchanged)
            act_none += _block_bytes(m, is_moe, "none", expert_rows, compiled, fp32)
            act_full += _block_bytes(m, is_moe, "full", expert_rows, compiled, fp32)
            if is_moe:
                moe_layers += 1
                experts_none += _block_bytes(m, True, "none", expert_rows, compiled, fp32) - _block_bytes(
                    m, True, "none", 0, compiled, fp32
                )
            # no copies: bf16 weights, or FSDP's bf16 all-gather (freed after forward, gathered again)
            if not recomputes and not fp32 and not bf16_weights and not fsdp:
                cast_bytes += 2 * (dense + experts)
        first, last = 0 in stages, S - 1 in stages
        if first:
            dense_local += groups.embedding
        if last:
            dense_local += groups.head
        local = dense_local + expert_local
        if L.pp == 1:
            in_flight = 1.0
        elif L.schedule == PipelineSchedule.gpipe.value:
            in_flight = L.micro_batches
        else:
            in_flight = min(L.micro_batches, L.pp - r)
            if L.stages_per_rank > 1:
                in_flight = min(
                    L.micro_batches * L.stages_per_rank, L.pp * (1 + (L.pp - 1) / (L.pp * L.stages_per_rank))
                )
        # activations: saved tensors of the micro-batches in flight; with recompute, backward
        # rebuilds one block's full activations at a time
        activations = in_flight * t * act_per_token
        # the schedule keeps each stage's fp32 output until its backward (the last stage's output
        # is the logits, counted below)
        feeding = sum(1 for s in stages if s < S - 1) / len(stages)
        activations += in_flight * feeding * t * m.d_model * 4 if L.pp > 1 else 0.0
        if L.overlap_chunks and L.ep > 1 and any(i >= m.num_dense_layers for i in layer_ids):
            # the buffer an exchange in flight writes while compute runs (the pipelined exchange)
            activations += t * wire_rows * m.d_model * (4 if fp32 else 2)
        if L.recompute != "none" and layer_ids:
            activations += t * act_none / len(layer_ids)
        logits = loss_traffic = 0.0
        if last and chunk:  # one chunk's bf16 logits + gradient; the hidden states' fp32 gradient
            logits = min(chunk, t) * m.vocab_size * 4 + t * m.d_model * 4
            loss_traffic = t * m.vocab_size * 6  # the fused kernels: read the logits twice, write the gradient
        elif last:  # bf16 logits, fp32 copy, fp32 log-softmax
            logits = loss_traffic = t * m.vocab_size * 10
        head_grad = 4 * groups.head / (L.dp if fsdp else 1) if last else 0
        # one bf16 copy of each weight per micro-batch in flight: each micro-batch's forward casts
        # its own, and its saved tensors keep it until that micro-batch's backward
        casts = cast_bytes * in_flight
        moments = 4 if cfg.optim.moments_dtype.value == "bf16" else 8  # AdamW's two moments per element
        grad_elem = 2 if cfg.optim.grad_dtype.value == "bf16" else 4  # optim.grad_dtype
        accumulated = 0.0  # FSDP's unsharded gradients, kept between micro-batches
        if fsdp:
            shard = L.dp
            gathered = 4 if fp32 else 2  # two blocks' parameters gathered at once, in the compute dtype
            weights = 4 * local / shard + 2 * gathered * max(groups.moe_dense + groups.moe_experts, groups.dense_block)
            # FSDP casts the reduced shards back to the parameters' fp32; one rank: FSDPAdamW's own
            grads = 4 * local / shard if shard > 1 else grad_elem * local
            if L.micro_batches > 1 and L.dp > 1:
                accumulated = grad_elem * local
            optimizer = moments * local / shard
        else:
            weights = 4 * local  # fp32, or bf16 + the 16-bit remainder (optim.bf16_weights)
            # bf16_weights: one backward's bf16 gradients are kept as they are (2 B)
            bf16_kept = bf16_weights and L.dp == 1 and L.micro_batches == 1
            grads = 2 * local if bf16_kept or grad_elem == 2 else 4 * local
            if L.shard_optimizer:
                shard = dense_local / L.dp + expert_local / L.edp
                if bf16_weights:  # bf16 weights whole; remainders (2 B) and moments sharded
                    weights, optimizer = 2 * local, (2 + moments) * shard
                else:  # fp32 weights whole; fp32 master (4 B) and moments sharded
                    optimizer = (4 + moments) * shard
                # the reduce-scatters' output shards, in the gradient dtype (a view of the bucket
                # where the group has one rank)
                reduced = (dense_local / L.dp if L.dp > 1 else 0) + (expert_local / L.edp if L.edp > 1 else 0)
                grads += grad_elem * reduced
            else:
                optimizer = moments * local
        # gradients are present during backward when they persist: accumulation over micro-batches
        # or a pipeline (micro-batches overlap), else reducer buckets (dp > 1 on the ddp stack:
        # the dense ones, and the experts' unless each lives alone in its group, edp = 1)
        kept_grads = grads if L.micro_batches > 1 else grads * L.bucketed(dense_local, expert_local) / local
        start_of_backward = activations + logits + head_grad + casts + max(kept_grads, accumulated)
        end_of_backward = grads
        # fp32 (t, D) buffers, one per micro-batch: activations for each stage fed by a previous
        # one, output gradients for each stage that feeds a next one
        links = sum(1 for s in stages if s > 0) + sum(1 for s in stages if s < S - 1)
        recv_buffers = links * L.micro_batches * t * m.d_model * 4 if L.pp > 1 else 0.0
        peak = weights + optimizer + recv_buffers + max(start_of_backward, end_of_backward) + assume.workspace_gib * GIB
        out.append(
            RankMemory(
                rank=r,
                layers=len(layer_ids),
                first=first,
                last=last,
                local=local,
                dense_local=dense_local,
                expert_local=expert_local,
                embedding_local=groups.embedding if first else 0,
                weights=weights,
                grads=grads,
                optimizer=optimizer,
                activations=activations + logits + casts,
                peak=peak,
                blocks_none=t * act_none,
                experts_none=t * experts_none,
                moe_layers=moe_layers,
                recv_buffers=recv_buffers,
                logits_bytes=logits,
                loss_traffic=loss_traffic,
                act_none=in_flight * t * act_none + logits,
                act_full=in_flight * t * act_full + logits,
            )
        )
    return out


def uses_bf16_weights(cfg: RunConfig) -> bool:
    """Whether a GPU run of `cfg` trains with optim.bf16_weights (set, or CUDA's default)."""
    amp = None if cfg.train.precision.value == "fp32" else torch.bfloat16
    return cfg.optim.resolved_bf16_weights(cfg.parallel, amp, "cuda")


def _ring(n: int) -> float:
    """A ring collective's bytes per rank over n ranks, as a fraction of the buffer (each way)."""
    return (n - 1) / n if n > 1 else 0.0


def communication(cfg: RunConfig, L: Layout, rank: RankMemory, spec: GPU, assume: Assumptions) -> Communication:
    """Bytes each collective of a step sends from `rank`, and their time."""
    m = cfg.model
    t = L.rows_per_micro_batch * cfg.data.seq_len
    fsdp = L.stack == Stack.fsdp.value
    _, wire_rows = _rows_per_token(cfg, L)

    def net(span: int) -> float:
        return spec.nvlink_bytes_s if span <= spec.gpus_per_node else spec.network_bytes_s

    moe_layers = _moe_layers(m, rank)
    comm, comm_t = {}, {}
    if not fsdp and L.ep > 1:
        a2a = 4 * L.micro_batches * moe_layers * t * wire_rows * m.d_model * 2 * _ring(L.ep)
        comm["expert_all_to_all"] = a2a
        eff = assume.symm_link_eff if L.dispatcher == DispatcherKind.symm.value else assume.link_eff
        comm_t["expert_all_to_all"] = a2a / (net(L.ep) * eff)
    dense_b, expert_b = 4 * rank.dense_local, 4 * rank.expert_local
    grad_elem = 2 if cfg.optim.grad_dtype.value == "bf16" else 4  # the reductions' dtype (optim.grad_dtype)
    if fsdp:
        gathered = 4 if cfg.train.precision.value == "fp32" else 2  # bf16 all-gathers under bf16 compute
        ag = 2 * L.micro_batches * gathered * rank.local * _ring(L.dp)  # forward and backward all-gathers
        rs = grad_elem * rank.local * _ring(L.dp)
        comm["fsdp_all_gather"], comm["fsdp_reduce_scatter"] = ag, rs
        comm_t["fsdp"] = (ag + rs) / (net(L.dp) * assume.link_eff)
    elif L.dp > 1:
        edp = L.edp
        dense_g, expert_g = grad_elem * rank.dense_local, grad_elem * rank.expert_local
        if L.shard_optimizer:
            red = dense_g * _ring(L.dp) + expert_g * _ring(edp)  # reduce-scatter
            gather = dense_b * _ring(L.dp) + expert_b * _ring(edp)  # all-gather of updated parameters
            comm["dp_reduce_scatter"], comm["optimizer_all_gather"] = red, gather
        else:
            red = 2 * (dense_g * _ring(L.dp) + expert_g * _ring(edp))
            gather = 0.0
            comm["dp_all_reduce"] = red
        comm_t["dp_reduction"] = red / (net(L.dp) * assume.link_eff)
        comm_t["optimizer_all_gather"] = gather / (net(L.dp) * assume.link_eff)
    if L.pp > 1:
        sends = 2 * L.micro_batches * L.stages_per_rank * t * m.d_model * 4
        comm["pipeline_send_recv"] = sends
        comm_t["pipeline_send_recv"] = sends / (net(L.dp * L.pp) * assume.link_eff)
    return Communication(comm, comm_t)


def step_time(
    cfg: RunConfig, L: Layout, rank: RankMemory, comm: Communication, spec: GPU, assume: Assumptions
) -> StepTime:
    """One step of `rank`: compute and memory-bound work, then the communication that is not
    hidden, the pipeline bubble; MFU and tokens per GPU."""
    m = cfg.model
    t = L.rows_per_micro_batch * cfg.data.seq_len
    fsdp = L.stack == Stack.fsdp.value
    fp32 = cfg.train.precision.value == "fp32"
    fpt = flops_per_token(m, cfg.data.seq_len)
    stage_share = rank.layers / m.n_layers if L.pp > 1 else 1.0
    model_flops = fpt * t * L.micro_batches * stage_share
    fp8 = cfg.train.fp8 != Fp8.none
    # mxfp8 computes its products from dequantized operands (bf16 rate; moetrain/model/fp8.py)
    gemm_rate = spec.bf16_flops * assume.gemm_eff * (assume.fp8_gemm_speedup if cfg.train.fp8 == Fp8.rowwise else 1.0)
    t_gemm = model_flops / gemm_rate
    # each local expert's rows end in a partial tile of its grouped GEMMs (`group_tile_rows`)
    local_experts = m.moe.num_experts / (1 if fsdp else L.ep)
    expert_flops = 18 * m.moe.top_k * m.d_model * m.moe.expert_hidden * t * _moe_layers(m, rank) * L.micro_batches
    t_tiles = expert_flops * local_experts * assume.group_tile_rows / (t * m.moe.top_k) / gemm_rate if t else 0.0
    hbm = spec.hbm_bytes_s * assume.hbm_eff
    passes = spec.hbm_bytes_s * assume.param_pass_eff
    bf16_weights = uses_bf16_weights(cfg)
    low_moments = cfg.optim.moments_dtype.value == "bf16"
    low_grads = cfg.optim.grad_dtype.value == "bf16"
    # The optimizer step over the elements this rank updates: AdamW's bytes per element (fp32
    # moments 28 B, bf16 moments 20 B; 2 B less reading bf16 gradients, not FSDP's fp32 shards),
    # the split masters and every bf16-moment update by moetrain's Triton kernel, the rest by
    # torch's fused AdamW, each at its measured rate; then the clipping norm reads each gradient.
    adamw_bytes = (20 if low_moments else 28) - (2 if low_grads and not fsdp else 0)
    if fsdp:
        updated, embedding = rank.local / L.dp, rank.embedding_local / L.dp
    elif L.shard_optimizer:
        updated = rank.dense_local / L.dp + rank.expert_local / L.edp
        embedding = rank.embedding_local / L.dp
    else:
        updated, embedding = rank.local, rank.embedding_local
    by_torch = 0.0 if low_moments else (embedding if bf16_weights else updated)  # fp32 AdamW, fp32 moments
    torch_rate = spec.hbm_bytes_s * assume.torch_adamw_eff
    t_optimizer = adamw_bytes * ((updated - by_torch) / passes + by_torch / torch_rate)
    one_kept = bf16_weights and L.micro_batches == 1 and not fsdp  # one backward's bf16 gradient, as it is
    norm_elem = 2 if (low_grads and not fsdp) or one_kept else 4
    t_optimizer += norm_elem * updated / (spec.hbm_bytes_s * assume.norm_eff)
    # Per micro-batch: autocast's fp32→bf16 weight casts and the bf16→fp32 gradient casts (12 B
    # per local parameter), and from the second micro-batch on accumulation into .grad (12 B).
    local_params = rank.local / (L.dp if fsdp else 1)
    t_casts = 0.0 if fp32 else local_params * (12 * L.micro_batches + 12 * (L.micro_batches - 1)) / hbm
    if bf16_weights:
        # What a step's gradients cost beyond the GEMMs that make them (moetrain/optim/split_master.py,
        # grad_reducer.py): a bucketed gradient (dense ones at dp > 1; experts' at edp > 1 or under
        # the sharded optimizer) is copied into its bucket at the first backward — bf16 into fp32
        # 6 B, into a bf16 bucket (optim.grad_dtype=bf16) 4 B — and later backwards add into it
        # (fp32 += bf16 10 B; bf16 += bf16 6 B); an unbucketed one is kept as backward made it
        # (0 B), the second backward sums the two into fp32 (8 B), later ones add (10 B); bf16: 6 B.
        bucketed = L.bucketed(rank.dense_local, rank.expert_local)
        kept = local_params - bucketed
        later = L.micro_batches - 1
        if low_grads:
            t_bytes = bucketed * 4 + local_params * 6 * later
        else:
            t_bytes = bucketed * (6 + 10 * later) + kept * ((8 + 10 * (later - 1)) if later else 0)
        t_casts = t_bytes / passes
    elif low_grads and not fsdp:  # the fp32 gradient rounded into the store (6 B), then bf16 += fp32 (8 B)
        weight_casts = 0 if fp32 else 12 * L.micro_batches
        t_casts = local_params * (weight_casts + 6 + 8 * (L.micro_batches - 1)) / hbm
    # element-wise passes over the saved activations (eager blocks: `eager_ew_factor` times
    # theirs; with the pipelined exchange the experts' share runs eagerly in compiled blocks too),
    # the loss's, and the sync-free dispatcher's index and mask kernels at ep > 1 where they run
    # eagerly (eager blocks, or the pipelined exchange; compiled blocks fuse them)
    if not compiled_blocks(cfg):
        eager_bytes = rank.blocks_none
    else:
        eager_bytes = rank.experts_none if L.overlap_chunks and L.ep > 1 else 0.0
    block_passes = assume.ew_passes * (rank.blocks_none + (assume.eager_ew_factor - 1) * eager_bytes)
    t_elementwise = L.micro_batches * (block_passes + rank.loss_traffic) / hbm
    eager_dispatch = not compiled_blocks(cfg) or L.overlap_chunks > 0
    if L.ep > 1 and L.dispatcher == DispatcherKind.nosync.value and eager_dispatch:
        _, wire_rows = _rows_per_token(cfg, L)
        wire = t * wire_rows * m.d_model * 2 * rank.moe_layers
        t_elementwise += L.micro_batches * assume.nosync_passes * wire / hbm
    t_fp8 = 0.0
    if fp8:
        t_fp8 = assume.fp8_quant_passes * L.micro_batches * (rank.blocks_none + 4 * local_params) / hbm
    t_recompute = 0.0
    if L.recompute != Recompute.none.value:
        share = math.ceil(m.n_layers / L.recompute_every) / m.n_layers
        if L.recompute == Recompute.selective.value and not compiled_blocks(cfg):
            # eager blocks keep every matmul's output: backward re-runs the forward's element-wise
            # kernels (a third of their passes) and its weight casts (half of those bytes)
            t_recompute = share * (t_casts / 2 + t_elementwise / 3)
        else:
            cost = assume.recompute_cost[0 if L.recompute == Recompute.selective.value else 1]
            t_recompute = cost * share * (t_gemm + t_tiles + t_casts + t_elementwise + t_fp8)
    # parallel.overlap_chunks = n (NoSyncDispatcher.pipelined): the device time the chunks add,
    # per expert parameter and micro-batch (`Assumptions.chunk_bytes`); fp32 weights chunked by
    # tokens are also cast once per chunk and their gradients back (12 B more per extra chunk).
    t_chunks = 0.0
    if L.overlap_chunks > 1 and L.ep > 1:
        by_experts = chunks_by_experts(L.overlap_chunks, m.moe.num_experts // L.ep, L.capacity_factor)
        per_param = assume.chunk_bytes[0] if by_experts else assume.chunk_bytes[1] * (L.overlap_chunks - 1)
        if not by_experts and not uses_bf16_weights(cfg) and not fp32:
            per_param += 12 * (L.overlap_chunks - 1)
        t_chunks = L.micro_batches * per_param * rank.expert_local / hbm
    compute = t_gemm + t_tiles + t_casts + t_elementwise + t_fp8 + t_recompute + t_chunks
    per_mb = compute / L.micro_batches
    t_bubble = (L.pp - 1) / L.stages_per_rank * per_mb if L.pp > 1 else 0.0
    seconds = comm.seconds
    t_dp = _exposed_dp_reduction(cfg, L, rank, seconds.get("dp_reduction", 0.0), compute, assume)
    t_dp += seconds.get("optimizer_all_gather", 0.0)
    t_fsdp = max(0.0, seconds.get("fsdp", 0.0) - compute * assume.fsdp_overlap)
    t_a2a = seconds.get("expert_all_to_all", 0.0)
    if L.overlap_chunks and t_a2a:
        t_a2a = _pipelined_exchange_time(cfg, L, rank, t_a2a, t, gemm_rate, assume)
    t_pp = seconds.get("pipeline_send_recv", 0.0)
    step = compute + t_optimizer + t_bubble + t_dp + t_fsdp + t_a2a + t_pp
    tokens_per_device = t * L.micro_batches * (1.0 if L.pp == 1 else 1.0 / L.pp)
    parts = {
        "gemm_and_attention": t_gemm,
        "expert_gemm_tiles": t_tiles,
        "weight_casts": t_casts,
        "element_wise": t_elementwise,
        "fp8_quantization": t_fp8,
        "recompute": t_recompute,
        "overlap_chunk_grads": t_chunks,
        "optimizer": t_optimizer,
        "pipeline_bubble": t_bubble,
        "expert_all_to_all": t_a2a,
        "dp_reductions": t_dp,
        "fsdp_exposed": t_fsdp,
        "pipeline_sends": t_pp,
    }
    return StepTime(parts, step, fpt * tokens_per_device / step / spec.bf16_flops, tokens_per_device)


def _exposed_dp_reduction(
    cfg: RunConfig, L: Layout, rank: RankMemory, t_red: float, compute: float, assume: Assumptions
) -> float:
    """What the ddp stack's data-parallel reduction (all-reduce, or the sharded optimizer's
    reduce-scatter) of `t_red` seconds adds to the step (`Assumptions.dp_tail`): each bucket's
    starts as soon as the last backward has finished its gradients, so only the buckets finished
    last are exposed — the embedding's on the first pipeline rank, else one bucket — and whatever
    of the rest the last backward (two-thirds of a micro-batch's compute) cannot cover."""
    if not assume.dp_tail or not t_red or L.stack == Stack.fsdp.value:
        return t_red
    grad_elem = 2 if cfg.optim.grad_dtype.value == "bf16" else 4
    tail_params = rank.embedding_local if rank.first else min(_BUCKET_BYTES / grad_elem, rank.dense_local)
    sent = rank.dense_local * _ring(L.dp) + rank.expert_local * _ring(L.edp)
    tail = t_red * tail_params * _ring(L.dp) / sent if sent else 0.0
    backward = 2 / 3 * compute / L.micro_batches
    return tail + max(0.0, t_red - tail - backward)


def _pipelined_exchange_time(
    cfg: RunConfig, L: Layout, rank: RankMemory, t_a2a: float, t: int, gemm_rate: float, assume: Assumptions
) -> float:
    """The expert all-to-all's cost with parallel.overlap_chunks = n (NoSyncDispatcher.pipelined),
    from its full time `t_a2a`. Per MoE layer and micro-batch, A is one direction's time (a
    quarter of the layer's: dispatch and return, forward and backward), a = A / n a chunk's,
    s and e the shared expert's and the experts' GEMM time (forward; backward 2×). One pass
    exposes the first transfer (a, less what the shared expert covers in forward; in backward
    the first return has nothing under it), and what the communication stream cannot fit under
    the compute: max(a + max(0, a − s), 2A − s − e). The rest runs under compute, which it slows
    by `overlap_slowdown` of its duration."""
    m = cfg.model
    moe = m.moe
    A = t_a2a / (4 * L.micro_batches * _moe_layers(m, rank))
    a = A / L.overlap_chunks
    s_f = 6 * m.d_model * moe.shared_hidden * t / gemm_rate
    e_f = 6 * m.d_model * moe.expert_hidden * moe.top_k * t / gemm_rate
    exposed = sum(max(a + max(0.0, a - s), 2 * A - s - e) for s, e in ((s_f, e_f), (2 * s_f, 2 * e_f)))
    exposed = min(exposed, 4 * A)
    per_layer = exposed + assume.overlap_slowdown * (4 * A - exposed)
    return t_a2a * per_layer / (4 * A)


def _moe_layers(m: TransformerConfig, rank: RankMemory) -> float:
    """MoE layers of `rank`: its share of the model's (the dense ones come first)."""
    return sum(1 for i in range(m.n_layers) if i >= m.num_dense_layers) * rank.layers / max(1, m.n_layers)


def with_layout(
    cfg: RunConfig,
    gpus: int,
    *,
    pp: int,
    ep: int,
    recompute: str,
    shard_optimizer: bool,
    rows: int,
    dispatcher: str | None = None,
    overlap: int | None = None,
) -> RunConfig | None:
    """A copy of `cfg` with another layout (rows = sequences per GPU per micro-batch; `overlap`:
    parallel.overlap_chunks, the configured one if None, 0 for other dispatchers than nosync),
    or None when the batch cannot be split that way."""
    if gpus % pp:
        return None
    dp = gpus // pp
    micro = rows * dp
    if cfg.train.global_batch_size % micro or cfg.train.global_batch_size // micro < pp:
        return None
    kind = DispatcherKind(dispatcher) if dispatcher else cfg.parallel.dispatcher
    overlap = cfg.parallel.overlap_chunks if overlap is None else overlap
    out = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel,
            pp=pp,
            ep=ep,
            dp=None,
            shard_optimizer=shard_optimizer and dp > 1,
            dispatcher=kind,
            overlap_chunks=overlap if kind == DispatcherKind.nosync and ep > 1 else 0,
            pp_schedule=PipelineSchedule.onef1b,
            pp_stages_per_rank=None,
            stack=Stack.ddp,
        ),
        train=dataclasses.replace(cfg.train, micro_batch_size=micro, recompute=Recompute(recompute), recompute_every=1),
    )
    return out


def suggest(cfg: RunConfig, gpus: int, gpu: str, limit: int = 5) -> list[Plan]:
    """Layouts of the ddp stack that fit the GPU, fastest first: pp (dividing the GPUs, at most
    one block per stage), ep (dividing dp and the experts, at most one node's worth unless the
    experts need more), recompute none/selective/full, the sharded optimizer, and 1 or 2
    sequences per GPU per micro-batch; the configured dispatcher and, for ep > 2, the exact
    all-to-all one when the configured one is nosync's padded mode (its buffers grow with ep);
    with nosync at ep > 1 the configured parallel.overlap_chunks and 1 (the shared expert under
    the dispatch: no chunks, no cost of theirs)."""
    m = cfg.model
    out = []
    for pp in (1, 2, 4, 8, 16, 32):
        if pp > m.n_layers or gpus % pp:
            continue
        dp = gpus // pp
        eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if dp % e == 0 and m.moe.num_experts % e == 0]
        for ep in eps:
            for recompute in ("none", "selective", "full"):
                dispatchers = {cfg.parallel.dispatcher.value}
                if ep > 2 and cfg.parallel.capacity_factor is None:
                    dispatchers.add(DispatcherKind.alltoall.value)
                overlaps = sorted({cfg.parallel.overlap_chunks, 1}) if ep > 1 else [0]
                for rows, dispatcher, overlap in [
                    (r, d, o) for r in (1, 2) for d in sorted(dispatchers) for o in overlaps
                ]:
                    if overlap and dispatcher != DispatcherKind.nosync.value:
                        continue
                    candidate = with_layout(
                        cfg,
                        gpus,
                        pp=pp,
                        ep=ep,
                        recompute=recompute,
                        shard_optimizer=True,
                        rows=rows,
                        dispatcher=dispatcher,
                        overlap=overlap,
                    )
                    if candidate is None:
                        continue
                    try:
                        p = plan(candidate, gpus, gpu)
                    except ConfigError:
                        continue
                    if p.fits:
                        out.append(p)
    out.sort(key=lambda p: -p.tokens_per_sec_per_device)
    return out[:limit]


def report(p: Plan) -> str:
    """The human-readable per-GPU table that `moetrain plan` prints before its JSON line."""
    L, g = p.layout, p.gpu
    lines = [
        f"layout: {L.describe()} on {g.name} ({g.memory_gib:g} GiB usable)",
        f"parameters per GPU: {p.params_per_device / 1e9:.3f}B",
        "memory per GPU (GiB, the pipeline rank that needs most):",
        f"  weights (fp32)      {p.memory_gib['weights']:8.2f}",
        f"  gradients           {p.memory_gib['grads']:8.2f}",
        f"  optimizer state     {p.memory_gib['optimizer']:8.2f}",
        f"  activations         {p.memory_gib['activations']:8.2f}   (this layout, with the logits and bf16 "
        f"weight copies; none: {p.activations_without_recompute_gib:.2f}, full recompute: "
        f"{p.activations_full_recompute_gib:.2f})",
        f"  peak                {p.peak_mem_gib_per_device:8.2f}   -> {'fits' if p.fits else 'does NOT fit'}",
        f"  while saving        {p.save_peak_gib_per_device:8.2f}   -> "
        f"{'fits' if p.fits_while_saving else 'does NOT fit'} (state + gradient buckets + the save's temporaries)",
        f"  while loading       {p.load_peak_gib_per_device:8.2f}   -> "
        f"{'fits' if p.fits_while_loading else 'does NOT fit'} (state + gradient buckets + the load's temporaries)",
    ]
    if len(p.peak_gib_per_pipeline_rank) > 1:
        lines.append("  peak per pipeline rank: " + ", ".join(f"{x:.1f}" for x in p.peak_gib_per_pipeline_rank))
    lines.append("communication per GPU per step (GB sent):")
    lines += [f"  {k:22s} {v:10.3f}" for k, v in p.comm_gb_per_step.items()] or ["  none (one GPU)"]
    lines.append("step time (s), by part:")
    lines += [f"  {k:22s} {v:10.4f}" for k, v in p.time_s.items() if v > 0]
    lines.append(
        f"  step                   {p.step_time_s:10.4f}   tokens/s per GPU {p.tokens_per_sec_per_device:,.0f}, "
        f"MFU {100 * p.mfu:.1f}%"
    )
    return "\n".join(lines)


def to_json(p: Plan, preset: str, gpus: int, gpu: str, suggestions: list[Plan]) -> dict:
    L = p.layout
    return {
        "preset": preset,
        "gpus": gpus,
        "gpu": gpu,
        "layout": L.describe(),
        "dp": L.dp,
        "ep": L.ep,
        "pp": L.pp,
        "stages_per_rank": L.stages_per_rank,
        "stack": L.stack,
        "recompute": L.recompute,
        "micro_batches": L.micro_batches,
        "sequences_per_micro_batch_per_gpu": L.rows_per_micro_batch,
        "params_per_device": p.params_per_device,
        "memory_gib": p.memory_gib,
        "activations_without_recompute_gib": round(p.activations_without_recompute_gib, 2),
        "activations_full_recompute_gib": round(p.activations_full_recompute_gib, 2),
        "peak_mem_gib_per_device": p.peak_mem_gib_per_device,
        "capacity_gib": p.gpu.memory_gib,
        "fits": p.fits,
        "save_peak_gib_per_device": p.save_peak_gib_per_device,
        "fits_while_saving": p.fits_while_saving,
        "load_peak_gib_per_device": p.load_peak_gib_per_device,
        "fits_while_loading": p.fits_while_loading,
        "comm_gb_per_step": p.comm_gb_per_step,
        "step_time_s": round(p.step_time_s, 4),
        "mfu": round(p.mfu, 4),
        "tokens_per_sec_per_device": round(p.tokens_per_sec_per_device, 1),
        "suggested": [
            {
                "layout": s.layout.describe(),
                "peak_mem_gib_per_device": s.peak_mem_gib_per_device,
                "step_time_s": round(s.step_time_s, 4),
                "mfu": round(s.mfu, 4),
            }
            for s in suggestions
        ],
    }
