"""`ShardedAdamW` (`parallel.shard_optimizer=true`): AdamW whose state is sharded over the
data-parallel ranks (ZeRO-1/2 style), for the ddp stack's resident-expert layout.

Legend: N elements of a bucket's flat buffer (padded to a multiple of G), G ranks of the bucket's
group (dp for dense parameters, edp for expert parameters), S = N / G elements of this rank's
shard of the bucket.

One optimizer step:
 1. backward: gradients accumulate into flat buckets, as in `GradReducer`; during the last
    micro-batch's backward each finished bucket is reduce-scattered over its group (async), so
    this rank receives the summed gradient of its shard only (the means: `loss_scale` = 1/dp);
 2. `clip_grad_norm()`: the global norm from the shards (one all-reduce), then scale the shards
    (or hand the factor to the update);
 3. `step()`: the update rule on this rank's shards — fp32 master weights and the rule's state
    exist for the shard only — then all-gather the updated shards into the flat parameter
    buffers, of which every parameter is a view: every rank holds the full parameters again.

Memory: the optimizer state is 1/dp of the dense parameters' and 1/edp of the local experts' (a
rank holds 1/dp of the single-device state, plus at most G − 1 padding elements per bucket). The
gradient buckets stay full size (they accumulate over micro-batches), and so do the parameters.
After `finish()` the reduced gradient lives only in the shards: `p.grad` still holds this rank's
local, unreduced sum until `zero_grad()`.

With optim.grad_dtype=bf16 the buckets and shards are bf16, the reduce-scatter sums in bf16 and
the clipping factor multiplies the gradient inside the update, in fp32, as the replicated
optimizer's does: with clipping off the two step bit for bit alike.

With optim.name=muon the blocks' matrices are bucketed apart (`muon` buckets) and step by `Muon`
(src/moetrain/optim/muon.py) over the pieces of them this rank's shards hold (`_muon_parts`), the
direction of each such bucket all-gathered (`_whole_directions`).

Checkpoints: each rank saves and loads only its shards (`checkpoint_tensors`,
`checkpoint_masters`), a parameter's piece of a bucket shard a `FlatShard` of its entry: no
moment and no master is ever gathered.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from moetrain.model.transformer import canonical_name
from moetrain.optim.base import FlatShard, StepHooks, param_groups, use_fused
from moetrain.optim.grad_reducer import Bucket, GradReducer
from moetrain.optim.muon import LocalMatrices, MatrixShape, Muon, MuonConfig, muon_matrices
from moetrain.optim.rule import UpdateGroup
from moetrain.optim.split_master import is_split_candidate, split_fp32
from moetrain.parallel.dims import ParallelState

if TYPE_CHECKING:
    from moetrain.optim.config import OptimConfig

# torch 2.13 renamed these two collectives (the old names warn); older supported versions have
# only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass
class _ShardedBucket(Bucket):
    """A `GradReducer` bucket (`flat` = the N gradients) plus the flat parameter buffer and this
    rank's shard [lo, lo + S) of both."""

    params_N: torch.Tensor | None = None
    grad_S: torch.Tensor | None = None
    lo_S: torch.Tensor | None = None
    """Split buckets: the int16 remainders of this rank's shard (the bf16 parameters are `params_N`)."""
    offsets: list[int] = dataclasses.field(default_factory=list)
    """Start of each parameter in the flat buffers."""
    lo: int = 0
    muon: bool = False
    """Muon's matrices (optim.name=muon), stepped by `ShardedAdamW.muon`."""

    @property
    def hi(self) -> int:
        return self.lo + self.grad_S.numel()

    def pieces(self):
        """(parameter, its offset, [start, end) of it in this rank's shard: empty where start ≥ end)."""
        for p, off in zip(self.params, self.offsets):
            yield p, off, max(off, self.lo), min(off + p.numel(), self.hi)


class _ShardedGradReducer(GradReducer):
    """`GradReducer`'s bucketing and overlap, with reduce-scatter in place of all-reduce, padded
    buckets, and parameters moved into flat buffers alongside their gradients. Split buckets
    (optim.bf16_weights) hold bf16 parameters: their gradients are filled by `store`'s hook
    (copied at a step's first backward, added later), and the 16-bit remainders of this rank's
    shard are kept in `lo_S` (src/moetrain/optim/split_master.py). With optim.grad_dtype=bf16 every
    bucket's gradients are bf16 and filled by that hook."""

    buckets: list[_ShardedBucket]
    bucket_every_parameter = True  # the parameters live in the buckets' flat buffers

    def _make_bucket(self, params: list[nn.Parameter], group, is_split: bool) -> _ShardedBucket:
        G = dist.get_world_size(group) if group is not None else 1
        numel = sum(p.numel() for p in params)
        N = math.ceil(numel / G) * G
        S = N // G
        device = params[0].device
        if any(p.dtype != params[0].dtype for p in params):
            raise ValueError("ShardedAdamW needs one parameter dtype per bucket; got a mix.")
        # Padding stays zero in all buffers: zero gradient, zero moments, so zero update.
        grads_N = torch.zeros(N, dtype=self.grad_dtype, device=device)
        params_N = torch.zeros(N, dtype=torch.bfloat16 if is_split else params[0].dtype, device=device)
        lo_N = torch.zeros(N, dtype=torch.int16, device=device) if is_split else None
        lo = (dist.get_rank(group) if group is not None else 0) * S
        # Alone in its group the shard is the whole bucket: no copy, no collective.
        grad_S = grads_N[lo : lo + S] if G == 1 else torch.zeros(S, dtype=self.grad_dtype, device=device)
        bucket = _ShardedBucket(grads_N, params, group, params_N=params_N, grad_S=grad_S, lo=lo, split=is_split)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                if is_split:
                    hi_part, lo_part = split_fp32(p.detach().flatten())
                    params_N[offset : offset + n].copy_(hi_part)
                    lo_N[offset : offset + n].copy_(lo_part)
                    p.data = params_N[offset : offset + n].view(p.shape)
                else:
                    params_N[offset : offset + n].copy_(p.detach().flatten())
                    p.data = params_N[offset : offset + n].view_as(p)
                grad = grads_N[offset : offset + n].view(p.shape)
                if is_split or p.dtype != grads_N.dtype:  # before the counting hook
                    self.store.add(p, grad)
                    bucket.hooked = True
                else:
                    p.grad = grad
                bucket.offsets.append(offset)
                offset += n
                p.register_post_accumulate_grad_hook(lambda _p, b=bucket: self._on_grad_ready(b))
        if is_split:
            bucket.lo_S = lo_N[lo : lo + S].clone()
        return bucket

    def _launch(self, bucket: _ShardedBucket) -> None:
        bucket.launched = True
        if bucket.group is not None:
            bucket.work = _reduce_scatter(bucket.grad_S, bucket.flat, group=bucket.group, async_op=True)


class ShardedAdamW(StepHooks):
    """The update rule (`OptimConfig.rule`), weight decay per `param_groups`, with the state
    sharded over the data-parallel ranks. Build it after the model is materialized and
    initialized: it moves every parameter into a flat buffer (values kept) and attaches the
    gradient hooks."""

    def __init__(
        self,
        model: nn.Module,
        state: ParallelState,
        cfg: OptimConfig,
        bucket_bytes: int = 25 * 2**20,
        *,
        bf16_weights: bool = False,
    ):
        self.rule = cfg.rule()
        self.lr = cfg.lr
        # The squared gradient norm sums over every rank: dp shards, and pipeline stages.
        self.norm_group = state.group("pp", "dp", "cp")
        split_ids = is_split_candidate(model) if bf16_weights else set()
        grad_dtype = cfg.grad_dtype.dtype
        self.shapes: dict[int, MatrixShape] = muon_matrices(model) if cfg.name == "muon" else {}
        """optim.name=muon: the matrices Muon steps (id → their shape as a batch of matrices)."""
        self.reduction = _ShardedGradReducer(
            model, state, bucket_bytes, split_ids=split_ids, grad_dtype=grad_dtype, apart=set(self.shapes)
        )
        """The reduce-scatter into the shards; its `loss_scale` (1/dp) makes the reduced shards the means."""
        self.buckets = self.reduction.buckets
        for b in self.buckets:
            b.muon = bool(self.shapes) and id(b.params[0]) in self.shapes
        self.names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
        # fp32 buckets: an fp32 master shard; split buckets: the bf16 shard of `params_N` and `lo_S`.
        self.master_S = [
            None if b.split else b.params_N[b.lo : b.hi].to(torch.float32, copy=True) for b in self.buckets
        ]
        moments = cfg.moments_dtype.dtype
        self.low_grads = grad_dtype != torch.float32
        self.state_S = [
            {k: torch.zeros_like(b.grad_S, dtype=moments) for k in (("momentum",) if b.muon else self.rule.state)}
            for b in self.buckets
        ]
        """Each bucket's shard of the optimizer state by key: the rule's `state`; Muon's buckets, the
        "momentum"."""
        self._groups = self._rule_groups(param_groups(model, cfg.weight_decay)[0]["params"], cfg.weight_decay)
        parts, self._muon_grads = self._muon_parts()
        self.muon = Muon(MuonConfig.of(cfg), parts, gather=self._whole_directions)
        # Fused (the default on CUDA): the update runs on the device, the skip decision and the
        # clipping factor stay there (no host sync).
        device = self.buckets[0].grad_S.device if self.buckets else torch.device("cpu")
        self.fused = use_fused(cfg, device)
        self._step_t = torch.zeros((), dtype=torch.float32, device=device)
        """Updates made: the step count of every parameter's state."""

    def _rule_groups(self, decayed: list[nn.Parameter], weight_decay: float) -> list[UpdateGroup]:
        """This rank's shards as the update rule's groups, views of the live buffers: the pieces of
        the fp32 buckets' shards that belong to one parameter each, those that weight decay
        applies to (`decayed`) and the others; then the split buckets' shards (every split
        parameter is a matrix: weight decay applies)."""
        decay_ids = {id(p) for p in decayed}
        # weight decay or not → (bucket, the parameter's slice of the bucket's shard)
        pieces: dict[bool, list[tuple[int, slice]]] = {True: [], False: []}
        for i, b in enumerate(self.buckets):
            if b.split or b.muon:
                continue
            for p, _, start, end in b.pieces():
                if start < end:
                    pieces[id(p) in decay_ids].append((i, slice(start - b.lo, end - b.lo)))

        def cut(tensors, decay):
            return [tensors[i][piece] for i, piece in pieces[decay]]

        groups = [
            UpdateGroup(
                cut(self.master_S, decay),
                cut([b.grad_S for b in self.buckets], decay),
                tuple(cut([s.get(k) for s in self.state_S], decay) for k in self.rule.state),
                weight_decay=weight_decay if decay else 0.0,
            )
            for decay in (True, False)
        ]
        split = [b for b in self.buckets if b.split]
        groups.append(
            UpdateGroup(
                [b.params_N[b.lo : b.hi] for b in split],
                [b.grad_S for b in split],
                tuple([s[k] for b, s in zip(self.buckets, self.state_S) if b.split] for k in self.rule.state),
                weight_decay=weight_decay,
                los=[b.lo_S for b in split],
            )
        )
        return groups

    # ---- gradients -------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.reduction.zero_grad()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the (reduced) gradient, as a device tensor (no host sync). One
        all-reduce over all ranks counts every element once: each lies in exactly one shard of
        its group (dp, or edp for the experts, whose ep ranks hold different ones), and pipeline
        stages hold different parameters."""
        grads = [b.grad_S for b in self.buckets]
        # the norms of bf16 shards computed in fp32
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32) if self.low_grads else torch._foreach_norm(grads)
        sq = torch.stack(norms).square().sum()
        if self.norm_group is not None:
            dist.all_reduce(sq, group=self.norm_group)
        return sq.sqrt()

    def grad_parts(self) -> list[tuple[str, torch.Tensor, bool]]:
        """Each parameter's range in this rank's shards (`Optimizer.grad_parts`): every element
        lies in one shard of its group, so every rank counts its parts."""
        parts = []
        for b in self.buckets:
            for p, _, start, end in b.pieces():
                if start < end:
                    parts.append((self.names[id(p)], b.grad_S[start - b.lo : end - b.lo], True))
        return parts

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Bring the gradient shards to a global norm of at most `max_norm` (math.inf: no
        clipping; `_clip`); return the norm before clipping (device tensor, no host sync)."""
        total = self.grad_norm()
        self._clip([b.grad_S for b in self.buckets], total, max_norm)
        return total

    # ---- the update ------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        self.lr = lr

    @torch.no_grad()
    def _update(self, skip: torch.Tensor | None) -> None:
        """The update rule on this rank's shards, then all-gather the parameters. `skip`
        (a device bool, equal on all ranks): no update, and the all-gather writes the parameters
        with their unchanged values. Fused, it is decided on the device; otherwise read on the
        host (one sync per step)."""
        coef, self._clip_coef = self._clip_coef, None
        self.rule.update(self._groups, self._step_t, lr=self.lr, grad_coef=coef, skip=skip, fused=self.fused)
        self.muon.step(self._muon_grads, self.lr, coef, skip)
        self._all_gather_params()

    def _muon_parts(self) -> tuple[list[LocalMatrices], list[torch.Tensor]]:
        """`Muon`'s parts, one per parameter of the `muon` buckets: the piece of it in this rank's
        shard (master and momentum; empty where the shard holds none of it), and its gradient."""
        parts, grads = [], []
        for b, master_S, state_S in zip(self.buckets, self.master_S, self.state_S):
            for p, off, start, end in b.pieces() if b.muon else ():
                cut = slice(start - b.lo, max(start, end) - b.lo)
                momentum = state_S["momentum"][cut]
                parts.append(LocalMatrices(self.shapes[id(p)], master_S[cut], momentum, start - off, b.group))
                grads.append(b.grad_S[cut])
        return parts, grads

    def _whole_directions(self, directions: list[torch.Tensor]) -> list[torch.Tensor]:
        """`Muon`'s gather: each `muon` bucket's direction, its pieces laid into a shard and
        all-gathered over the bucket's group; each parameter's whole direction a view of it."""
        whole, rest = [], iter(directions)
        for b in (b for b in self.buckets if b.muon):
            pieces = [next(rest) for _ in b.params]
            u_S = pieces[0].new_zeros(b.grad_S.numel())
            for u, off in zip(pieces, b.offsets):
                start = max(off, b.lo) - b.lo
                u_S[start : start + u.numel()].copy_(u)
            u_N = self._gather(b, u_S)
            whole += [u_N[off : off + p.numel()] for p, off in zip(b.params, b.offsets)]
        return whole

    def _all_gather_params(self) -> None:
        works = []
        for b, master in zip(self.buckets, self.master_S):
            if b.split:  # the update wrote the bf16 shard in place; half the bytes of fp32
                if b.group is not None:
                    works.append(_all_gather(b.params_N, b.params_N[b.lo : b.hi].clone(), group=b.group, async_op=True))
            elif b.group is None:
                b.params_N.copy_(master)
            else:
                # For fp32 parameters `.to` is a no-op: the input is the master shard itself,
                # never a slice of the output buffer.
                works.append(_all_gather(b.params_N, master.to(b.params_N.dtype), group=b.group, async_op=True))
        for w in works:
            w.wait()

    # ---- state -----------------------------------------------------------------------------------
    def grad_bytes(self) -> int:
        """Bytes of gradient storage this rank holds: the buckets and the reduce-scatter's
        output shards (where they are not part of the bucket)."""
        tensors = [b.flat for b in self.buckets]
        # alone in its group (G = 1) a bucket's shard is a view of it
        tensors += [b.grad_S for b in self.buckets if b.group is not None and dist.get_world_size(b.group) > 1]
        return sum(t.numel() * t.element_size() for t in tensors)

    def memory_bytes(self) -> int:
        """Bytes of optimizer state held by this rank: fp32 master shards (or the remainders of
        split ones) and the state shards."""
        tensors = [m for m in self.master_S if m is not None] + [t for s in self.state_S for t in s.values()]
        tensors += [b.lo_S for b in self.buckets if b.split]
        return sum(t.numel() * t.element_size() for t in tensors)

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor | FlatShard]]:
        """Per parameter, the pieces of its state in this rank's bucket shards (`FlatShard`s over
        `state_S`, absent where the shard holds none of the parameter) and the live step count
        "step" (one 0-d tensor shared by all; none for Muon's). No copy, no communication."""
        out: dict[str, dict[str, torch.Tensor | FlatShard]] = {}
        for b, state_S in zip(self.buckets, self.state_S):
            for p, off, start, end in b.pieces():
                entry: dict[str, torch.Tensor | FlatShard] = {} if b.muon else {"step": self._step_t}
                if start < end:
                    for key, shard_S in state_S.items():
                        entry[key] = FlatShard(tuple(p.shape), start - off, values=shard_S[start - b.lo : end - b.lo])
                out[self.names[id(p)]] = entry
        return out

    def checkpoint_masters(self) -> dict[str, FlatShard]:
        """The split parameters' fp32 masters as the pieces this rank's shards hold: the bf16
        weights (`params_N`, whole on every rank) and the remainders (`lo_S`) of that range.
        Parameters the shard does not reach get an empty shard."""
        out = {}
        for b in (b for b in self.buckets if b.split):
            for p, off, start, end in b.pieces():
                if start < end:
                    shard = FlatShard(
                        tuple(p.shape), start - off, hi=b.params_N[start:end], lo=b.lo_S[start - b.lo : end - b.lo]
                    )
                else:
                    shard = FlatShard(tuple(p.shape), 0, hi=b.params_N[:0], lo=b.lo_S[:0])
                out[self.names[id(p)]] = shard
        return out

    @torch.no_grad()
    def checkpoint_loaded(self) -> None:
        """After a load into `checkpoint_tensors()` / `checkpoint_masters()` (or the weights
        alone): the step count from the loaded "step", the fp32 master shards from the loaded
        weights, and each split bucket's bf16 weights all-gathered from the ranks that loaded
        their ranges (collective over the bucket's group; one bucket shard in flight at a time)."""
        for b, master in zip(self.buckets, self.master_S):
            if not b.split:  # split masters are loaded in place (`checkpoint_masters`)
                master.copy_(b.params_N[b.lo : b.hi])
            elif b.group is not None:
                _all_gather(b.params_N, b.params_N[b.lo : b.hi].clone(), group=b.group)

    def _gather(self, b: _ShardedBucket, shard_S: torch.Tensor) -> torch.Tensor:
        if b.group is None:
            return shard_S.clone()
        full_N = shard_S.new_empty(b.flat.numel())
        _all_gather(full_N, shard_S, group=b.group)
        return full_N
