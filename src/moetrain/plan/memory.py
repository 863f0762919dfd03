"""Memory per pipeline rank (`memory_per_rank`): weights, gradients, optimizer state, saved
activations, pipeline buffers; and while a checkpoint is saved or loaded."""

from __future__ import annotations

import dataclasses

from moetrain.model.config import TransformerConfig
from moetrain.model.counting import block_saved_bytes, expert_operand_elements, mtp_saved_bytes
from moetrain.parallel.config import DispatcherKind, PipelineSchedule
from moetrain.parallel.pipeline import stage_layers
from moetrain.plan.calibration import Assumptions
from moetrain.plan.hardware import GIB
from moetrain.plan.layout import BUCKET_BYTES, Layout, ParamGroups, compiled_blocks, rows_per_token, uses_bf16_weights
from moetrain.train.config import RunConfig
from moetrain.train.dcp_shards import PIECE


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
    moe_layers: int
    """MoE blocks this rank holds."""
    recv_buffers: float
    """The pipeline's receive buffers: torch.distributed.pipelining allocates, up front and for
    each micro-batch, one fp32 (rows, seq, d_model) activation buffer for each stage that is not
    the first and one output-gradient buffer for each stage that is not the last, and keeps them
    between steps (they persist when checkpoints are saved)."""
    loss_traffic: float
    """Bytes the loss's element-wise kernels read and write per micro-batch."""
    act_none: float
    """Activations of the micro-batches in flight without recompute (with the logits)."""
    act_full: float
    """The same with full recompute."""
    muon_dense_local: float = 0.0
    """Of `dense_local`, the matrices Muon updates (optim.name=muon; the experts are Muon's whole)."""
    ns_dense: float = 0.0
    """FLOPs of one Newton–Schulz iteration over those matrices (whole)."""
    ns_experts: float = 0.0
    """The same over the rank's experts (÷ ep)."""


def checkpoint_state_bytes(L: Layout, rank: RankMemory) -> float:
    """What `rank` holds between steps, when checkpoints are saved and loaded: weights (FSDP's
    shards only: no block is gathered), optimizer state, and the gradient buckets that persist
    (the ddp stack's reducer's — dense gradients at dp > 1, the experts' at edp > 1 — and the
    sharded optimizer's; other gradients are freed by `zero_grad` and not yet allocated at a
    load). Activations are freed."""
    weights = 4 * rank.local / L.replicas if L.fsdp else rank.weights
    if L.fsdp or not rank.local:
        return weights + rank.optimizer + rank.recv_buffers
    # the sharded optimizer buckets every gradient, even at dp = 1
    bucketed = rank.local if L.shard_optimizer else L.bucketed(rank.dense_local, rank.expert_local)
    return weights + rank.optimizer + rank.recv_buffers + rank.grads * bucketed / rank.local


def save_temporaries(cfg: RunConfig, L: Layout, rank: RankMemory) -> float:
    """Device bytes a checkpoint save allocates on `rank` beyond its state. Each rank writes only
    the entries and ranges it holds, from views of the live tensors, one item at a time to host
    memory (src/moetrain/train/dcp_shards.py; the finiteness check before it reduces each parameter
    to its min and max): nothing is gathered, whatever the stack or the optimizer. Only with
    optim.bf16_weights is there a temporary: each split fp32 master block as it is joined, at most
    the largest split entry (4 B per element), `PIECE` elements at a time (int32 intermediates,
    16 B each)."""
    if not uses_bf16_weights(cfg):
        return 0.0
    return 4.0 * ParamGroups.of(cfg.model).largest_split_entry(rank.last) + 16.0 * PIECE


def load_temporaries(cfg: RunConfig, L: Layout, rank: RankMemory) -> float:
    """Device bytes a checkpoint load allocates on `rank` beyond its state. DCP reads each stored
    chunk into host memory and copies it into views of the live tensors: nothing, except with
    optim.bf16_weights one read's fp32 temporary of a split master (at most the largest split
    entry) split into its halves `PIECE` elements at a time (20 B each), and then, with the sharded
    optimizer, one bucket shard's bf16 weights copied for their all-gather (2 B per element)."""
    if not uses_bf16_weights(cfg):
        return 0.0
    split = 4.0 * ParamGroups.of(cfg.model).largest_split_entry(rank.last) + 20.0 * PIECE
    # a bucket holds at most BUCKET_BYTES of gradients (fp32, or bf16: optim.grad_dtype); its shard
    # is 1/edp of it or less
    grad_elem = 2 if cfg.optim.grad_dtype.value == "bf16" else 4
    shard = 2.0 * min(BUCKET_BYTES / grad_elem, rank.local) / L.edp if L.shard_optimizer else 0.0
    return max(split, shard)


@dataclasses.dataclass
class _Blocks:
    """What one pipeline rank's blocks hold and save (`_rank_blocks`): parameters, saved bytes
    per token of one micro-batch (this layout's, without recompute, with full recompute), the bf16
    weight copies of one micro-batch."""

    layer_ids: list[int]
    dense_local: float = 0.0
    expert_local: float = 0.0
    act_per_token: float = 0.0
    act_none: float = 0.0
    act_full: float = 0.0
    moe_layers: int = 0
    cast_bytes: float = 0.0
    muon_dense: float = 0.0
    ns_dense: float = 0.0
    ns_experts: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Model:
    """The per-run facts every pipeline rank's memory reads."""

    compiled: bool
    ep_eff: int
    expert_rows: float
    wire_rows: float
    exchanged: float
    bf16_weights: bool
    a: int
    """Bytes per matmul element: 2 under autocast bf16, 4 in fp32."""

    @classmethod
    def of(cls, cfg: RunConfig, L: Layout) -> _Model:
        ep_eff = 1 if L.fsdp else L.ep
        expert_rows, wire_rows = rows_per_token(cfg, L)
        # selective recompute keeps what the functional all-to-alls return (alltoall, nosync
        # without the overlapped exchange, whose transfers are not functional collectives)
        functional_exchange = L.dispatcher in (DispatcherKind.alltoall.value, DispatcherKind.nosync.value)
        exchanged = wire_rows if ep_eff > 1 and functional_exchange and not L.overlap_chunks else 0.0
        return cls(
            compiled=compiled_blocks(cfg),
            ep_eff=ep_eff,
            expert_rows=expert_rows,
            wire_rows=wire_rows,
            exchanged=exchanged,
            bf16_weights=uses_bf16_weights(cfg),
            a=4 if cfg.precision.dtype.value == "fp32" else 2,
        )


def _rank_blocks(m: TransformerConfig, L: Layout, groups: ParamGroups, x: _Model, layer_ids: list[int]) -> _Blocks:
    b = _Blocks(layer_ids)
    for i in layer_ids:
        is_moe = i >= m.num_dense_layers and m.moe.num_experts > 0
        dense = groups.moe_dense if is_moe else groups.dense_block
        experts = groups.moe_experts / x.ep_eff if is_moe else 0
        b.dense_local += dense
        b.expert_local += experts
        b.muon_dense += groups.muon_moe_dense if is_moe else groups.muon_dense_block
        b.ns_dense += groups.ns_moe_dense if is_moe else groups.ns_dense_block
        b.ns_experts += groups.ns_experts / x.ep_eff if is_moe else 0.0
        recomputes = L.recompute != "none" and i % L.recompute_every == 0
        mode = L.recompute if recomputes else "none"
        b.act_per_token += block_saved_bytes(m, is_moe, mode, x.expert_rows, x.compiled, x.a, x.exchanged, L.cp)
        b.act_none += block_saved_bytes(m, is_moe, "none", x.expert_rows, x.compiled, x.a, cp=L.cp)
        b.act_full += block_saved_bytes(m, is_moe, "full", x.expert_rows, x.compiled, x.a, cp=L.cp)
        b.moe_layers += is_moe
        # no copies: bf16 weights, or FSDP's bf16 all-gather (freed after forward, gathered again)
        if not recomputes and x.a == 2 and not x.bf16_weights and not L.fsdp:
            b.cast_bytes += 2 * (dense + experts)
    return b


def _in_flight(L: Layout, r: int) -> float:
    """Micro-batches whose activations pipeline rank r holds at the start of its first backward."""
    if L.pp == 1:
        return 1.0
    if L.schedule == PipelineSchedule.gpipe.value:
        return L.micro_batches
    if L.stages_per_rank > 1:
        return min(L.micro_batches * L.stages_per_rank, L.pp * (1 + (L.pp - 1) / (L.pp * L.stages_per_rank)))
    return min(L.micro_batches, L.pp - r)


def _saved_activations(
    m: TransformerConfig, L: Layout, x: _Model, b: _Blocks, in_flight: float, stages: list[int], t: int
) -> float:
    """Saved tensors of the micro-batches in flight; with recompute, backward rebuilds one
    block's full activations at a time."""
    activations = in_flight * t * b.act_per_token
    # the schedule keeps each stage's fp32 output until its backward (the last stage's output
    # is the logits, counted apart)
    feeding = sum(1 for s in stages if s < L.num_stages - 1) / len(stages)
    activations += in_flight * feeding * t * m.d_model * 4 if L.pp > 1 else 0.0
    if L.overlap_chunks and L.ep > 1 and any(i >= m.num_dense_layers for i in b.layer_ids):
        # the buffer an exchange in flight writes while compute runs (the overlapped exchange)
        activations += t * x.wire_rows * m.d_model * x.a
    if L.recompute != "none" and b.layer_ids:
        activations += t * b.act_none / len(b.layer_ids)
    return activations


def deferred_expert_grads(cfg: RunConfig, L: Layout) -> bool:
    """Whether the experts' weight gradients wait for the step's last backward
    (compute.defer_expert_weight_grad, which does nothing with one micro-batch)."""
    return cfg.compute.defer_expert_weight_grad and L.micro_batches > 1


def expert_operand_bytes(cfg: RunConfig, L: Layout, moe_layers: int, micro_batches: float) -> float:
    """What the deferred expert weight gradients keep of `micro_batches` micro-batches on a rank
    with `moe_layers` MoE layers: each expert row's `expert_operand_elements`."""
    t = L.tokens(cfg.data.seq_len)
    expert_rows, _ = rows_per_token(cfg, L)
    per_row = expert_operand_elements(cfg.model.moe, cfg.model.d_model)
    element = 4 if cfg.precision.dtype.value == "fp32" else 2
    return micro_batches * t * expert_rows * moe_layers * per_row * element


def _loss_bytes(m: TransformerConfig, t: int, chunk: int) -> tuple[float, float]:
    """(held, traffic) of the last stage's loss per micro-batch: what it holds for backward and
    what its element-wise kernels read and write; with multi-token prediction, each depth's loss
    as much again."""
    losses = 1 + m.mtp_depth
    if chunk:  # one chunk's bf16 logits + gradient; the hidden states' fp32 gradient
        # the fused kernels: read the logits twice, write the gradient
        return losses * (min(chunk, t) * m.vocab_size * 4 + t * m.d_model * 4), losses * t * m.vocab_size * 6
    return losses * t * m.vocab_size * 10, losses * t * m.vocab_size * 10  # bf16 logits, fp32 copy, log-softmax


def _add_mtp(m: TransformerConfig, L: Layout, groups: ParamGroups, x: _Model, b: _Blocks) -> None:
    """The multi-token prediction modules (on the last stage): their parameters, Muon's part of
    them, and what they save per token (`mtp_saved_bytes`)."""
    if not groups.mtp:
        return
    b.dense_local += groups.mtp
    b.muon_dense += groups.muon_mtp
    b.ns_dense += groups.ns_mtp
    b.act_per_token += mtp_saved_bytes(m, L.recompute, x.compiled, x.a, L.cp)
    b.act_none += mtp_saved_bytes(m, "none", x.compiled, x.a, L.cp)
    b.act_full += mtp_saved_bytes(m, "full", x.compiled, x.a)


def _state(
    cfg: RunConfig, L: Layout, groups: ParamGroups, x: _Model, b: _Blocks, local: float, dense_local: float
) -> tuple[float, float, float, float]:
    """(weights, grads, optimizer, accumulated) of one pipeline rank: its stack's and optimizer's
    layout of the parameters, gradients and optimizer state; accumulated: FSDP's unsharded gradients
    kept between micro-batches."""
    moment = 2 if cfg.optim.moments_dtype.value == "bf16" else 4
    moments = moment * (1 if cfg.optim.name.value == "lion" else 2)  # per element: AdamW's two, Lion's one
    muon = cfg.optim.name.value == "muon"  # Muon's matrices keep one momentum: half of AdamW's two
    muon_dense = b.muon_dense if muon else 0.0
    muon_experts = b.expert_local if muon else 0.0
    grad_elem = 2 if cfg.optim.grad_dtype.value == "bf16" else 4  # optim.grad_dtype
    if L.fsdp:
        shard = L.replicas
        gathered = x.a  # two blocks' parameters gathered at once, in the compute dtype
        weights = 4 * local / shard + 2 * gathered * max(groups.moe_dense + groups.moe_experts, groups.dense_block)
        # FSDP casts the reduced shards back to the parameters' fp32; one rank: FSDPAdamW's own
        grads = 4 * local / shard if shard > 1 else grad_elem * local
        accumulated = grad_elem * local if L.micro_batches > 1 and L.replicas > 1 else 0.0
        return weights, grads, moments * (local - (muon_dense + muon_experts) / 2) / shard, accumulated
    weights = 4 * local  # fp32, or bf16 + the 16-bit remainder (optim.bf16_weights)
    # bf16_weights: one backward's bf16 gradients are kept as they are (2 B)
    bf16_kept = x.bf16_weights and L.replicas == 1 and L.micro_batches == 1
    grads = 2 * local if bf16_kept or grad_elem == 2 else 4 * local
    if not L.shard_optimizer:
        return weights, grads, moments * (local - (muon_dense + muon_experts) / 2), 0.0
    shard = dense_local / L.replicas + b.expert_local / L.edp
    muon_shard = muon_dense / L.replicas + muon_experts / L.edp
    if x.bf16_weights:  # bf16 weights whole; remainders (2 B) and moments sharded
        weights, optimizer = 2 * local, 2 * shard + moments * (shard - muon_shard / 2)
    else:  # fp32 weights whole; fp32 master (4 B) and moments sharded
        optimizer = 4 * shard + moments * (shard - muon_shard / 2)
    # the reduce-scatters' output shards, in the gradient dtype (a view of the bucket where the
    # group has one rank)
    reduced = (dense_local / L.replicas if L.replicas > 1 else 0) + (b.expert_local / L.edp if L.edp > 1 else 0)
    return weights, grads + grad_elem * reduced, optimizer, 0.0


def _recv_buffers(L: Layout, stages: list[int], t: int, d_model: int) -> float:
    """`RankMemory.recv_buffers` of the pipeline rank holding `stages`: fp32 (t, d_model) buffers."""
    if L.pp == 1:
        return 0.0
    links = sum(1 for s in stages if s > 0) + sum(1 for s in stages if s < L.num_stages - 1)
    return links * L.micro_batches * t * d_model * 4


def memory_per_rank(cfg: RunConfig, L: Layout, groups: ParamGroups, assume: Assumptions) -> list[RankMemory]:
    """Parameters and memory of each pipeline rank (one entry without a pipeline)."""
    m, x = cfg.model, _Model.of(cfg, L)
    S = L.num_stages
    layers_per_stage = [len(s) for s in stage_layers(m.n_layers, S)]
    t = L.tokens(cfg.data.seq_len)  # tokens per rank per micro-batch
    chunk = cfg.compute.resolved_loss_chunk_tokens("cuda") if L.pp == 1 else 0  # pipelines: the plain path
    out = []
    for r in range(L.pp):
        stages = [r + i * L.pp for i in range(L.stages_per_rank)]
        layer_ids = [i for s in stages for i in range(sum(layers_per_stage[:s]), sum(layers_per_stage[: s + 1]))]
        b = _rank_blocks(m, L, groups, x, layer_ids)
        first, last = 0 in stages, S - 1 in stages
        if last:
            _add_mtp(m, L, groups, x, b)
        dense_local = b.dense_local + (groups.embedding if first else 0) + (groups.head if last else 0)
        local = dense_local + b.expert_local
        in_flight = _in_flight(L, r)
        activations = _saved_activations(m, L, x, b, in_flight, stages, t)
        if deferred_expert_grads(cfg, L):  # kept until the last micro-batch's backward
            activations += expert_operand_bytes(cfg, L, b.moe_layers, L.micro_batches - 1)
        logits, loss_traffic = _loss_bytes(m, t, chunk) if last else (0.0, 0.0)
        # the head's fp32 weight gradient, one per loss (multi-token prediction: 1 + depth)
        head_grad = (1 + m.mtp_depth) * 4 * groups.head / (L.replicas if L.fsdp else 1) if last else 0
        # one bf16 copy of each weight per micro-batch in flight: each micro-batch's forward casts
        # its own, and its saved tensors keep it until that micro-batch's backward
        casts = b.cast_bytes * in_flight
        weights, grads, optimizer, accumulated = _state(cfg, L, groups, x, b, local, dense_local)
        # gradients are present during backward when they persist: accumulation over micro-batches
        # or a pipeline (micro-batches overlap), else reducer buckets (dp > 1 on the ddp stack:
        # the dense ones, and the experts' unless each lives alone in its group, edp = 1)
        kept_grads = grads if L.micro_batches > 1 else grads * L.bucketed(dense_local, b.expert_local) / local
        start_of_backward = activations + logits + head_grad + casts + max(kept_grads, accumulated)
        recv_buffers = _recv_buffers(L, stages, t, m.d_model * (1 + m.mtp_depth))
        peak = weights + optimizer + recv_buffers + max(start_of_backward, grads) + assume.workspace_gib * GIB
        out.append(
            RankMemory(
                rank=r,
                layers=len(layer_ids),
                first=first,
                last=last,
                local=local,
                dense_local=dense_local,
                expert_local=b.expert_local,
                embedding_local=groups.embedding if first else 0,
                weights=weights,
                grads=grads,
                optimizer=optimizer,
                activations=activations + logits + casts,
                peak=peak,
                blocks_none=t * b.act_none,
                moe_layers=b.moe_layers,
                recv_buffers=recv_buffers,
                loss_traffic=loss_traffic,
                act_none=in_flight * t * b.act_none + logits,
                act_full=in_flight * t * b.act_full + logits,
                muon_dense_local=b.muon_dense,
                ns_dense=b.ns_dense,
                ns_experts=b.ns_experts,
            )
        )
    return out
