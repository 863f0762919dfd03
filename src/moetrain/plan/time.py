"""Step time by part (`step_time`) and the bytes each collective moves (`communication`)."""

from __future__ import annotations

import dataclasses
import math

from moetrain.model.config import Fp8, TransformerConfig
from moetrain.model.counting import flops_per_token, kv_elements, moe_forward_flops, mtp_flops_per_token
from moetrain.model.fp8_choice import fp8_flops_per_token
from moetrain.parallel.config import DispatcherKind, Recompute
from moetrain.plan.calibration import Assumptions
from moetrain.plan.hardware import GPU
from moetrain.plan.layout import BUCKET_BYTES, Layout, compiled_blocks, rows_per_token, uses_bf16_weights
from moetrain.plan.memory import RankMemory, deferred_expert_grads, expert_operand_bytes
from moetrain.train.config import RunConfig

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

EXPOSED_PARTS = {
    "expert_all_to_all": ("expert_all_to_all",),
    "dp_reductions": ("dp_reduction", "optimizer_all_gather", "muon_all_gather"),
    "fsdp_exposed": ("fsdp",),
    "pipeline_sends": ("pipeline_send_recv",),
    "context_exchange": ("context_exchange",),
}
"""The parts of `PEER_PARTS` that are communication — the exposed part of a transfer, what
compute does not hide — and the transfers (`Communication.seconds`) each is part of."""
PEER_PARTS = ("pipeline_bubble", *EXPOSED_PARTS)
"""`StepTime.parts` split into what a rank computes alone (`COMPUTE_PARTS`) and what its peers
add: communication as exposed (after the overlap the model grants; `Assumptions.link_eff`,
`overlap_slowdown`, `dp_tail`, `fsdp_overlap`) and the pipeline's bubble."""


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


def _ring(n: int) -> float:
    """A ring collective's bytes per rank over n ranks, as a fraction of the buffer (each way)."""
    return (n - 1) / n if n > 1 else 0.0


def communication(cfg: RunConfig, L: Layout, rank: RankMemory, spec: GPU, assume: Assumptions) -> Communication:
    """Bytes each collective of a step sends from `rank`, and their time."""
    m = cfg.model
    t = L.tokens(cfg.data.seq_len)
    _, wire_rows = rows_per_token(cfg, L)

    def net(span: int) -> float:
        return spec.nvlink_bytes_s if span <= spec.gpus_per_node else spec.network_bytes_s

    moe_layers = _moe_layers(m, rank)
    comm, comm_t = {}, {}
    if not L.fsdp and L.ep > 1:
        a2a = 4 * L.micro_batches * moe_layers * t * wire_rows * m.d_model * 2 * _ring(L.ep)
        comm["expert_all_to_all"] = a2a
        comm_t["expert_all_to_all"] = a2a / (net(L.ep) * assume.link_eff)
    dense_b, expert_b = 4 * rank.dense_local, 4 * rank.expert_local
    grad_elem = 2 if cfg.optim.grad_dtype.value == "bf16" else 4  # the reductions' dtype (optim.grad_dtype)
    if L.fsdp:
        gathered = 4 if cfg.precision.dtype.value == "fp32" else 2  # bf16 all-gathers under bf16 compute
        ag = 2 * L.micro_batches * gathered * rank.local * _ring(L.replicas)  # forward and backward all-gathers
        rs = grad_elem * rank.local * _ring(L.replicas)
        comm["fsdp_all_gather"], comm["fsdp_reduce_scatter"] = ag, rs
        comm_t["fsdp"] = (ag + rs) / (net(L.replicas) * assume.link_eff)
    elif L.replicas > 1:
        dense_g, expert_g = grad_elem * rank.dense_local, grad_elem * rank.expert_local
        if L.shard_optimizer:
            red = dense_g * _ring(L.replicas) + expert_g * _ring(L.edp)  # reduce-scatter
            gather = dense_b * _ring(L.replicas) + expert_b * _ring(L.edp)  # all-gather of updated parameters
            comm["dp_reduce_scatter"], comm["optimizer_all_gather"] = red, gather
        else:
            red = 2 * (dense_g * _ring(L.replicas) + expert_g * _ring(L.edp))
            gather = 0.0
            comm["dp_all_reduce"] = red
        comm_t["dp_reduction"] = red / (net(L.replicas) * assume.link_eff)
        comm_t["optimizer_all_gather"] = gather / (net(L.replicas) * assume.link_eff)
    if L.cp > 1:
        comm["context_all_gather"] = _context_bytes(cfg, L, rank, t)
        comm_t["context_exchange"] = comm["context_all_gather"] / (net(L.cp) * assume.link_eff)
    if cfg.optim.name.value == "muon":
        # in bf16 over the ranks that share them: the orthogonalized matrices (each rank computed
        # its share), and before that the update directions of the sharded optimizer's Muon
        # buckets and of FSDP's non-expert matrices (its experts stay whole where they are)
        experts = 0.0 if L.fsdp else rank.expert_local * _ring(L.edp)
        gathers = 2 if L.fsdp or L.shard_optimizer else 1
        comm["muon_all_gather"] = 2 * gathers * (rank.muon_dense_local * _ring(L.replicas) + experts)
        comm_t["muon_all_gather"] = comm["muon_all_gather"] / (net(L.replicas) * assume.link_eff)
    if L.pp > 1:
        sends = 2 * L.micro_batches * L.stages_per_rank * t * m.d_model * (1 + m.mtp_depth) * 4
        comm["pipeline_send_recv"] = sends
        comm_t["pipeline_send_recv"] = sends / (net(L.replicas * L.pp) * assume.link_eff)
    return Communication(comm, comm_t)


def _context_bytes(cfg: RunConfig, L: Layout, rank: RankMemory, t: int) -> float:
    """Context parallelism's key/value exchange (src/moetrain/parallel/context_parallel.py): per
    attention layer and micro-batch, forward all-gathers this rank's keys and values
    (`kv_elements` per token) and backward reduce-scatters their gradients — (cp − 1) shards sent
    each — and a fully recomputed layer gathers again."""
    m = cfg.model
    a = 4 if cfg.precision.dtype.value == "fp32" else 2
    shard = t * kv_elements(m) * a
    passes = 2.0
    if L.recompute == Recompute.full.value:
        passes += math.ceil(m.n_layers / L.recompute_every) / m.n_layers
    return L.micro_batches * rank.layers * passes * shard * (L.cp - 1)


def _gemm_time(
    cfg: RunConfig, L: Layout, rank: RankMemory, spec: GPU, assume: Assumptions, fpt: float
) -> tuple[float, float, float]:
    """(GEMM and attention, the grouped GEMMs' partial tiles, the GEMM rate in FLOP/s). Under
    context parallelism the attention runs at its own measured rate (`cp_attention_eff`). With
    deferred expert weight gradients their GEMM has one partial tile per expert a step."""
    m = cfg.model
    t = L.tokens(cfg.data.seq_len)
    stage_share = rank.layers / m.n_layers if L.pp > 1 else 1.0
    tokens = t * L.micro_batches * stage_share
    gemm_rate = spec.bf16_flops * assume.gemm_eff
    # the products row-wise FP8 takes run `fp8_gemm_speedup` faster; mxfp8 computes its products
    # from dequantized operands (the bf16 rate; src/moetrain/model/fp8.py)
    fp8_fpt = _fp8_flops_per_token(cfg, L)[0]
    fp8_saved = fp8_fpt * tokens * (1 - 1 / assume.fp8_gemm_speedup) / gemm_rate
    if L.cp > 1:
        attention = fpt - flops_per_token(m, cfg.data.seq_len, attention=False)
        t_attention = attention / 2 * tokens / (spec.bf16_flops * assume.cp_attention_eff)
        t_gemm = (fpt - attention) * tokens / gemm_rate + t_attention - fp8_saved
    else:
        t_gemm = fpt * tokens / gemm_rate - fp8_saved
    if rank.last and m.mtp_depth:  # the multi-token prediction modules and their losses
        t_gemm += mtp_flops_per_token(m, cfg.data.seq_len) * t * L.micro_batches / gemm_rate
    # each local expert's rows end in a partial tile of its grouped GEMMs (`group_tile_rows`)
    local_experts = m.moe.num_experts / (1 if L.fsdp else L.ep)
    expert_flops = 3 * moe_forward_flops(m.moe, m.d_model)[0] * t * _moe_layers(m, rank) * L.micro_batches
    t_tiles = expert_flops * local_experts * assume.group_tile_rows / (t * m.moe.top_k) / gemm_rate if t else 0.0
    if deferred_expert_grads(cfg, L):  # the weight gradients' third: one GEMM per step, not per micro-batch
        t_tiles *= (2 + 1 / L.micro_batches) / 3
    return t_gemm, t_tiles, gemm_rate


def _fp8_flops_per_token(cfg: RunConfig, L: Layout) -> tuple[float, float]:
    """(FLOPs per token of the products row-wise FP8 takes, of all the blocks' and the LM head's):
    `fp8_choice.fp8_flops_per_token` at the layout's rows per micro-batch; (0, 1) without it."""
    if cfg.precision.fp8 != Fp8.rowwise:
        return 0.0, 1.0
    return fp8_flops_per_token(
        cfg.model, L.tokens(cfg.data.seq_len), cfg.precision.fp8_select, cfg.precision.fp8_lm_head
    )


def _muon_time(cfg: RunConfig, L: Layout, rank: RankMemory, spec: GPU, assume: Assumptions) -> tuple[float, float]:
    """(Muon's elements this rank updates, the seconds of its step) with optim.name=muon: the
    Newton–Schulz iterations at their measured rate (`Assumptions.ns_eff`) over this rank's
    share of the matrices (÷ dp·cp dense, ÷ edp experts, FSDP's experts ÷ dp·cp; the replicated
    optimizer then updates every local matrix) — and the element-wise passes
    of src/moetrain/optim/muon.py over each element it updates (`Assumptions.muon_bytes`)."""
    if cfg.optim.name.value != "muon":
        return 0.0, 0.0
    if L.fsdp:
        flops = (rank.ns_dense + rank.ns_experts) / L.replicas
        updated = (rank.muon_dense_local + rank.expert_local) / L.replicas
    else:
        flops = rank.ns_dense / L.replicas + rank.ns_experts / L.edp
        shard = (L.replicas, L.edp) if L.shard_optimizer else (1, 1)
        updated = rank.muon_dense_local / shard[0] + rank.expert_local / shard[1]
    ns = cfg.optim.muon_ns_steps * flops / (spec.bf16_flops * assume.ns_eff)
    return updated, ns + assume.muon_bytes * updated / (spec.hbm_bytes_s * assume.param_pass_eff)


def _optimizer_time(cfg: RunConfig, L: Layout, rank: RankMemory, spec: GPU, assume: Assumptions) -> float:
    """The optimizer step over the elements this rank updates: AdamW's bytes per element (fp32
    moments 28 B, bf16 moments 20 B; 2 B less reading bf16 gradients, not FSDP's fp32 shards),
    the split masters and every bf16-moment update by moetrain's Triton kernel, the rest by
    torch's fused AdamW, each at its measured rate (with optim.name=muon, Muon's matrices
    instead: `_muon_time`; optim.name=lion: one moment's read and write less, none by torch's
    fused kernel); then the clipping norm reads each gradient."""
    bf16_weights = uses_bf16_weights(cfg)
    low_moments = cfg.optim.moments_dtype.value == "bf16"
    low_grads = cfg.optim.grad_dtype.value == "bf16"
    passes = spec.hbm_bytes_s * assume.param_pass_eff
    lion = cfg.optim.name.value == "lion"
    adamw_bytes = (
        (20 if low_moments else 28) - (2 if low_grads and not L.fsdp else 0) - lion * (4 if low_moments else 8)
    )
    if L.fsdp:
        updated, embedding = rank.local / L.replicas, rank.embedding_local / L.replicas
    elif L.shard_optimizer:
        updated = rank.dense_local / L.replicas + rank.expert_local / L.edp
        embedding = rank.embedding_local / L.replicas
    else:
        updated, embedding = rank.local, rank.embedding_local
    muon_updated, t_muon = _muon_time(cfg, L, rank, spec, assume)
    adamw_updated = updated - muon_updated
    by_torch = 0.0 if low_moments or lion else (embedding if bf16_weights else adamw_updated)  # fp32 AdamW and moments
    torch_rate = spec.hbm_bytes_s * assume.torch_adamw_eff
    t_optimizer = adamw_bytes * ((adamw_updated - by_torch) / passes + by_torch / torch_rate) + t_muon
    one_kept = bf16_weights and L.micro_batches == 1 and not L.fsdp  # one backward's bf16 gradient, as it is
    norm_elem = 2 if (low_grads and not L.fsdp) or one_kept else 4
    return t_optimizer + norm_elem * updated / (spec.hbm_bytes_s * assume.norm_eff)


def _cast_time(cfg: RunConfig, L: Layout, rank: RankMemory, spec: GPU, assume: Assumptions) -> float:
    """The weights' casts and the gradients' copies and accumulation over the micro-batches. With
    deferred expert weight gradients the experts' gradient arrives once a step (no accumulation),
    and every micro-batch's expert operands are copied once into expert order
    (src/moetrain/model/expert_grads.py; the update's 2 bytes less per bf16 expert gradient are not
    counted)."""
    fp32 = cfg.precision.dtype.value == "fp32"
    low_grads = cfg.optim.grad_dtype.value == "bf16"
    hbm = spec.hbm_bytes_s * assume.hbm_eff
    deferred = deferred_expert_grads(cfg, L)
    n, later = L.micro_batches, L.micro_batches - 1
    expert_later = 0 if deferred else later  # backwards after the first that reach an expert weight
    t_copy = 2 * expert_operand_bytes(cfg, L, rank.moe_layers, n) / hbm if deferred else 0.0
    divisor = L.replicas if L.fsdp else 1
    dense, experts = (rank.local - rank.expert_local) / divisor, rank.expert_local / divisor

    def autocast_bytes(later: int) -> float:
        # per local parameter: autocast's fp32→bf16 weight cast every micro-batch (6 B), the
        # bf16→fp32 gradient cast every backward that gives it one (6 B), accumulation into
        # .grad from the second such backward on (12 B)
        return 6 * n + 6 * (1 + later) + 12 * later

    t_casts = 0.0 if fp32 else (dense * autocast_bytes(later) + experts * autocast_bytes(expert_later)) / hbm
    if uses_bf16_weights(cfg):
        # What a step's gradients cost beyond the GEMMs that make them (src/moetrain/optim/split_master.py,
        # grad_reducer.py): a bucketed gradient (dense ones at dp > 1; experts' at edp > 1 or under
        # the sharded optimizer) is copied into its bucket at the first backward — bf16 into fp32
        # 6 B, into a bf16 bucket (optim.grad_dtype=bf16) 4 B — and later backwards add into it
        # (fp32 += bf16 10 B; bf16 += bf16 6 B); an unbucketed one is kept as backward made it
        # (0 B), the second backward sums the two into fp32 (8 B), later ones add (10 B); bf16: 6 B.
        dense_bucketed = L.bucketed(rank.dense_local, 0.0)
        expert_bucketed = L.bucketed(rank.dense_local, rank.expert_local) - dense_bucketed

        def grad_bytes(bucketed: float, kept: float, later: int) -> float:
            if low_grads:
                return bucketed * 4 + (bucketed + kept) * 6 * later
            return bucketed * (6 + 10 * later) + kept * ((8 + 10 * (later - 1)) if later else 0)

        t_bytes = grad_bytes(dense_bucketed, rank.local - rank.expert_local - dense_bucketed, later)
        t_bytes += grad_bytes(expert_bucketed, rank.expert_local - expert_bucketed, expert_later)
        t_casts = t_bytes / (spec.hbm_bytes_s * assume.param_pass_eff)
    elif low_grads and not L.fsdp:  # the fp32 gradient rounded into the store (6 B), then bf16 += fp32 (8 B)
        weight_casts = 0 if fp32 else 12 * n
        t_casts = (dense * (weight_casts + 6 + 8 * later) + experts * (weight_casts + 6 + 8 * expert_later)) / hbm
    return t_casts + t_copy


def _elementwise_time(cfg: RunConfig, L: Layout, rank: RankMemory, spec: GPU, assume: Assumptions) -> float:
    """Element-wise passes over the saved activations (eager blocks: `eager_ew_factor` times
    theirs), the loss's, and the sync-free dispatcher's index and mask kernels at ep > 1 where
    they run outside a compiled block (eager blocks, or the overlapped exchange, whose experts and
    shared expert compile alone; compiled blocks fuse them)."""
    hbm = spec.hbm_bytes_s * assume.hbm_eff
    eager_bytes = 0.0 if compiled_blocks(cfg) else rank.blocks_none
    block_passes = assume.ew_passes * (rank.blocks_none + (assume.eager_ew_factor - 1) * eager_bytes)
    t_elementwise = L.micro_batches * (block_passes + rank.loss_traffic) / hbm
    eager_dispatch = not compiled_blocks(cfg) or L.overlap_chunks > 0
    if L.ep > 1 and L.dispatcher == DispatcherKind.nosync.value and eager_dispatch:
        _, wire_rows = rows_per_token(cfg, L)
        wire = L.tokens(cfg.data.seq_len) * wire_rows * cfg.model.d_model * 2 * rank.moe_layers
        t_elementwise += L.micro_batches * assume.nosync_passes * wire / hbm
    return t_elementwise


def _recompute_time(
    cfg: RunConfig, L: Layout, assume: Assumptions, t_casts: float, t_elementwise: float, t_all: float
) -> float:
    """Recompute's extra time; `t_all`: the recomputed blocks' compute without it."""
    if L.recompute == Recompute.none.value:
        return 0.0
    m = cfg.model
    share = math.ceil(m.n_layers / L.recompute_every) / m.n_layers
    if L.recompute == Recompute.selective.value and not compiled_blocks(cfg):
        # eager blocks keep every matmul's output: backward re-runs the forward's element-wise
        # kernels (a third of their passes) and its weight casts (half of those bytes)
        return share * (t_casts / 2 + t_elementwise / 3)
    cost = assume.recompute_cost[0 if L.recompute == Recompute.selective.value else 1]
    return cost * share * t_all


def _chunk_time(cfg: RunConfig, L: Layout, rank: RankMemory, spec: GPU, assume: Assumptions) -> float:
    """parallel.overlap_chunks = n > 1 (src/moetrain/parallel/overlapped_dispatcher.py): the device
    time the chunks add, per expert parameter and micro-batch (`Assumptions.chunk_bytes`)."""
    if not (L.overlap_chunks > 1 and L.ep > 1):
        return 0.0
    return L.micro_batches * assume.chunk_bytes * rank.expert_local / (spec.hbm_bytes_s * assume.hbm_eff)


def step_time(
    cfg: RunConfig, L: Layout, rank: RankMemory, comm: Communication, spec: GPU, assume: Assumptions
) -> StepTime:
    """One step of `rank`: compute and memory-bound work, then the communication that is not
    hidden, the pipeline bubble; MFU and tokens per GPU."""
    t = L.tokens(cfg.data.seq_len)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)  # FLOPs per token (the MFU formula's)
    t_gemm, t_tiles, gemm_rate = _gemm_time(cfg, L, rank, spec, assume, fpt)
    t_optimizer = _optimizer_time(cfg, L, rank, spec, assume)
    t_casts = _cast_time(cfg, L, rank, spec, assume)
    t_elementwise = _elementwise_time(cfg, L, rank, spec, assume)
    t_fp8 = 0.0
    if cfg.precision.fp8 != Fp8.none:
        rowwise = cfg.precision.fp8 == Fp8.rowwise
        chosen, every = _fp8_flops_per_token(cfg, L) if rowwise else (1.0, 1.0)
        local_params = rank.local / (L.replicas if L.fsdp else 1)
        passes = assume.fp8_quant_passes if rowwise else assume.mxfp8_quant_passes
        hbm = spec.hbm_bytes_s * assume.hbm_eff
        t_fp8 = chosen / every * passes * L.micro_batches * (rank.blocks_none + 4 * local_params) / hbm
    t_blocks = t_gemm + t_tiles + t_casts + t_elementwise + t_fp8  # what recompute repeats a share of
    t_recompute = _recompute_time(cfg, L, assume, t_casts, t_elementwise, t_blocks)
    t_chunks = _chunk_time(cfg, L, rank, spec, assume)
    compute = t_blocks + t_recompute + t_chunks
    per_mb = compute / L.micro_batches
    t_bubble = (L.pp - 1) / L.stages_per_rank * per_mb if L.pp > 1 else 0.0
    seconds = comm.seconds
    t_dp = _exposed_dp_reduction(cfg, L, rank, seconds.get("dp_reduction", 0.0), compute, assume)
    t_dp += seconds.get("optimizer_all_gather", 0.0) + seconds.get("muon_all_gather", 0.0)
    t_fsdp = max(0.0, seconds.get("fsdp", 0.0) - compute * assume.fsdp_overlap)
    t_a2a = seconds.get("expert_all_to_all", 0.0)
    if L.overlap_chunks and t_a2a:
        t_a2a = _overlapped_exchange_time(cfg, L, rank, t_a2a, t, gemm_rate, assume)
    t_pp = seconds.get("pipeline_send_recv", 0.0)
    t_cp = seconds.get("context_exchange", 0.0)  # not overlapped: each layer waits for its keys
    step = compute + t_optimizer + t_bubble + t_dp + t_fsdp + t_a2a + t_pp + t_cp
    tokens_per_device = t * L.micro_batches * (1.0 if L.pp == 1 else 1.0 / L.pp)
    compute_parts = (t_gemm, t_tiles, t_casts, t_elementwise, t_fp8, t_recompute, t_chunks, t_optimizer)
    parts = dict(zip(COMPUTE_PARTS + PEER_PARTS, (*compute_parts, t_bubble, t_a2a, t_dp, t_fsdp, t_pp, t_cp)))
    return StepTime(parts, step, fpt * tokens_per_device / step / spec.bf16_flops, tokens_per_device)


def _exposed_dp_reduction(
    cfg: RunConfig, L: Layout, rank: RankMemory, t_red: float, compute: float, assume: Assumptions
) -> float:
    """What the ddp stack's data-parallel reduction (all-reduce, or the sharded optimizer's
    reduce-scatter) of `t_red` seconds adds to the step (`Assumptions.dp_tail`): each bucket's
    starts as soon as the last backward has finished its gradients, so only the buckets finished
    last are exposed — the embedding's on the first pipeline rank, else one bucket — and whatever
    of the rest the last backward (two-thirds of a micro-batch's compute) cannot cover."""
    if not assume.dp_tail or not t_red or L.fsdp:
        return t_red
    grad_elem = 2 if cfg.optim.grad_dtype.value == "bf16" else 4
    tail_params = rank.embedding_local if rank.first else min(BUCKET_BYTES / grad_elem, rank.dense_local)
    sent = rank.dense_local * _ring(L.replicas) + rank.expert_local * _ring(L.edp)
    tail = t_red * tail_params * _ring(L.replicas) / sent if sent else 0.0
    backward = 2 / 3 * compute / L.micro_batches
    return tail + max(0.0, t_red - tail - backward)


def _overlapped_exchange_time(
    cfg: RunConfig, L: Layout, rank: RankMemory, t_a2a: float, t: int, gemm_rate: float, assume: Assumptions
) -> float:
    """The expert all-to-all's cost with parallel.overlap_chunks = n (src/moetrain/parallel/overlapped_dispatcher.py),
    from its full time `t_a2a`. Per MoE layer and micro-batch, A is one direction's time (a
    quarter of the layer's: dispatch and return, forward and backward), a = A / n a chunk's,
    s and e the shared expert's and the experts' GEMM time (forward; backward 2×). One pass
    exposes the first transfer (a, less what the shared expert covers in forward; in backward
    the first return has nothing under it), and what the communication stream cannot fit under
    the compute: max(a + max(0, a − s), 2A − s − e). The rest runs under compute, which it slows
    by `overlap_slowdown` of its duration."""
    m = cfg.model
    A = t_a2a / (4 * L.micro_batches * _moe_layers(m, rank))
    a = A / L.overlap_chunks
    experts, shared = moe_forward_flops(m.moe, m.d_model)
    s_f, e_f = shared * t / gemm_rate, experts * t / gemm_rate
    exposed = sum(max(a + max(0.0, a - s), 2 * A - s - e) for s, e in ((s_f, e_f), (2 * s_f, 2 * e_f)))
    exposed = min(exposed, 4 * A)
    per_layer = exposed + assume.overlap_slowdown * (4 * A - exposed)
    return t_a2a * per_layer / (4 * A)


def _moe_layers(m: TransformerConfig, rank: RankMemory) -> float:
    """MoE layers of `rank`: its share of the model's (the dense ones come first)."""
    return sum(1 for i in range(m.n_layers) if i >= m.num_dense_layers) * rank.layers / max(1, m.n_layers)
