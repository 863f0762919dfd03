"""A run's layout as the planner sees it (`Layout`, `layout_of`) and what follows from the config alone:
parameters per kind of module, rows per token through the experts and on the wire, compiled blocks,
bf16 weights."""

from __future__ import annotations

import dataclasses

import torch

from moetrain.model import counting
from moetrain.model.config import TransformerConfig
from moetrain.parallel.config import DEFAULT_CAPACITY_MIN_ROWS, DispatcherKind, Stack
from moetrain.parallel.dims import ParallelDims
from moetrain.parallel.nosync_dispatcher import block_rows, capacity_rows
from moetrain.train.config import RunConfig

BUCKET_BYTES = 25 * 2**20
"""The gradient buckets' size (`GradReducer`'s default)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout(ParallelDims):
    """The run's parallel layout with what the planner also chooses: recompute and micro-batching."""

    capacity_min_rows: int
    """nosync: the fewest rows a rank's experts get (parallel.capacity_min_rows; auto is 1024, as
    `capacity_floor` resolves it on a GPU and `apply_expert_parallel` builds it unresolved)."""
    recompute: str
    recompute_every: int
    micro_batches: int
    rows_per_micro_batch: int
    """Sequences per rank per micro-batch (whole ones: a context-parallel rank holds 1/cp of each)."""

    def tokens(self, seq_len: int) -> int:
        """Tokens per rank per micro-batch (t): its rows' positions, 1/cp of each sequence."""
        return self.rows_per_micro_batch * seq_len // self.cp

    @property
    def fsdp(self) -> bool:
        return self.stack == Stack.fsdp.value

    def bucketed(self, dense: float, experts: float) -> float:
        """Of `dense` and `experts` parameters, those whose gradients the ddp stack keeps in
        buckets (src/moetrain/optim/grad_reducer.py): none at dp·cp = 1; the dense ones at dp·cp > 1,
        the experts' too unless each lives alone in its group (edp = 1) — the sharded optimizer
        buckets every parameter."""
        if self.fsdp or self.replicas == 1:
            return 0.0
        return dense + (experts if self.edp > 1 or self.shard_optimizer else 0.0)

    def describe(self) -> str:
        text, every = super().describe(), f"/every {self.recompute_every}" if self.recompute_every > 1 else ""
        if self.recompute != "none":
            text += f" recompute={self.recompute}{every}"
        return text + f", {self.rows_per_micro_batch} seq × {self.micro_batches} micro-batches per rank"

    def to_flags(self, cfg: RunConfig) -> list[str]:
        """The command-line flags that turn `cfg` into this layout."""
        flags = [f"--train.micro_batch_size={self.rows_per_micro_batch * self.dp}"]
        if self.recompute != cfg.compute.recompute.value:
            flags.append(f"--compute.recompute={self.recompute}")
        if self.recompute != "none" and cfg.compute.recompute_every != self.recompute_every:
            flags.append(f"--compute.recompute_every={self.recompute_every}")
        return flags + super().to_flags(cfg.parallel)


@dataclasses.dataclass(frozen=True)
class ParamGroups:
    """Parameters per kind of module, Muon's matrices and the largest split entries: sums over their
    components' declared counts and matrices (src/moetrain/model/counting.py)."""

    embedding: int
    head: int
    """The final norm and the LM head."""
    dense_block: int
    """One dense block (attention, norms, dense MLP)."""
    moe_dense: int
    """The non-expert part of one MoE block (attention, norms, router, shared expert)."""
    moe_experts: int
    """The routed experts of one MoE block, all of them."""
    mtp: int = 0
    """The multi-token prediction modules (model.mtp_depth), all of them: on the last stage."""
    muon_dense_block: int = 0
    """Of `dense_block`, the matrices Muon updates (optim.name=muon; src/moetrain/optim/muon.py)."""
    muon_moe_dense: int = 0
    """Of `moe_dense`, the matrices Muon updates (the routed experts are Muon's whole)."""
    muon_mtp: int = 0
    """Of `mtp`, the matrices Muon updates."""
    ns_dense_block: float = 0.0
    """FLOPs of one Newton–Schulz iteration over one dense block's matrices."""
    ns_moe_dense: float = 0.0
    """The same over one MoE block's non-expert matrices."""
    ns_experts: float = 0.0
    """The same over one MoE block's routed experts, all of them."""
    ns_mtp: float = 0.0
    """The same over the multi-token prediction modules' matrices."""
    split_block_entry: int = 0
    """The largest entry optim.bf16_weights splits in a block (one expert's matrix for stacked
    experts; elements): with `split_head`, what bounds a checkpoint's temporaries."""
    split_head: int = 0
    """The same of the LM head."""

    @classmethod
    def of(cls, m: TransformerConfig) -> ParamGroups:
        D, experts = m.d_model, counting.experts_params(m.moe, m.d_model) if m.num_moe_layers else 0
        dense = counting.block_matrices(m, False) if m.num_dense_layers else []
        moe = counting.block_matrices(m, True) if m.num_moe_layers else []
        mtp = m.mtp_depth * counting.mtp_matrices(m)
        (muon_dense, ns_dense), (muon_moe, ns_moe), (muon_mtp, ns_mtp) = _muon(dense), _muon(moe), _muon(mtp)
        return ParamGroups(
            embedding=counting.embedding_params(m),
            head=D + m.vocab_size * D,
            dense_block=counting.block_params(m, False) if m.num_dense_layers else 0,
            moe_dense=counting.block_params(m, True) - experts if m.num_moe_layers else 0,
            moe_experts=experts,
            mtp=m.mtp_depth * counting.mtp_module_params(m),
            muon_dense_block=muon_dense,
            muon_moe_dense=muon_moe,
            muon_mtp=muon_mtp,
            ns_dense_block=ns_dense,
            ns_moe_dense=ns_moe,
            ns_experts=_muon(moe, experts=True)[1],
            ns_mtp=ns_mtp,
            split_block_entry=max((x.d_in * x.d_out * (2 if x.experts else 1) for x in dense + moe), default=0),
            split_head=m.vocab_size * D,
        )

    def largest_split_entry(self, last: bool) -> int:
        """The largest entry split on a pipeline rank, the `last` one holding the LM head."""
        return max(self.split_block_entry, self.split_head if last else 0)


def _muon(matrices: list[counting.Matrix], experts: bool = False) -> tuple[int, float]:
    """(Muon's parameters, one Newton–Schulz iteration's FLOPs) of those of `matrices` that are
    (`experts`) or are not expert layers: per (m, n) matrix, m ≤ n, X·Xᵀ and the update's product
    2m²n each, A² 2m³."""
    kept = [(x, *sorted((x.d_in, x.d_out))) for x in matrices if bool(x.experts) == experts]
    flops = sum(x.matrices * (4 * lo * lo * hi + 2 * lo**3) for x, lo, hi in kept)
    return sum(x.params for x, _, _ in kept), float(flops)


def layout_of(cfg: RunConfig, gpus: int) -> Layout:
    """The layout `cfg` asks for on `gpus` GPUs, checked as the trainer checks it."""
    dims, p = cfg.build_dims(gpus), cfg.parallel
    return Layout(
        **{f.name: getattr(dims, f.name) for f in dataclasses.fields(ParallelDims)},
        capacity_min_rows=DEFAULT_CAPACITY_MIN_ROWS if p.capacity_min_rows is None else p.capacity_min_rows,
        recompute=cfg.compute.recompute.value,
        recompute_every=cfg.compute.recompute_every,
        micro_batches=cfg.train.grad_accum_steps,
        rows_per_micro_batch=cfg.train.micro_batch_size // dims.dp,
    )


def rows_per_token(cfg: RunConfig, L: Layout) -> tuple[float, float]:
    """(expert_rows, wire_rows): rows per token through the experts (their activations) and on
    the all-to-all. nosync (src/moetrain/parallel/nosync_dispatcher.py) gives the experts
    capacity_factor × K rows and moves (capacity_factor + spill_factor) × K, both at most ep × K
    (the padded mode, capacity_factor=None, is ep × K for both; so is a micro-batch small enough
    for parallel.capacity_min_rows to take every row)."""
    k = cfg.model.moe.top_k
    if L.ep > 1 and L.dispatcher == DispatcherKind.nosync.value:
        tokens = L.tokens(cfg.data.seq_len)  # per rank and micro-batch
        M = tokens * k
        rows = capacity_rows(M, L.ep, L.capacity_factor, L.capacity_min_rows)
        wire = block_rows(M, L.ep, L.capacity_factor, L.spill_factor, L.capacity_min_rows)
        return L.ep * rows / tokens, L.ep * wire / tokens
    return k, k


def compiled_blocks(cfg: RunConfig) -> bool:
    """Whether the blocks run compiled: compute.compile, unless the exact all-to-all dispatcher
    reads split sizes on the host — a graph break inside the block, which then keeps
    eager-sized activations (measured: 80.5 GiB vs 80.1 nosync) and runs eager kernels."""
    return cfg.compute.compile and not (cfg.parallel.ep > 1 and cfg.parallel.dispatcher == DispatcherKind.alltoall)


def uses_bf16_weights(cfg: RunConfig) -> bool:
    """Whether a GPU run of `cfg` trains with optim.bf16_weights (set, or CUDA's default)."""
    amp = None if cfg.precision.dtype.value == "fp32" else torch.bfloat16
    return cfg.optim.resolved_bf16_weights(cfg.parallel, amp, "cuda")
