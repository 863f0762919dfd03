"""A sync-free expert-parallel dispatcher: fixed-size all-to-all buffers near the exact exchange's
size, no host round trip (docs/architecture.md, "Dispatcher memory": the sizes, drops and floor).

Legend: N tokens on this rank, K top-k, M = N·K assignments (row n·K + k: token order), D model
dim, E experts in all, R = ep ranks of the expert-parallel group, L = E / R experts on this rank,
C = ceil(capacity_factor · M / R) and P = ceil(spill_factor · M / R) rows, W = C + P rows per
(source, destination) pair of the exchange, X the R × R routing counts (X[s, d]: assignments of
rank s to rank d's experts).

`AllToAllDispatcher` reads its split sizes on the host once per layer: the CPU waits for the
router and the step cannot be captured in a CUDA graph. Here the splits are equal, fixed by N,
K, R and two factors. One MoE layer:

1. counts: an all-gather of R integers gives every rank all of X, on the device.
2. rank s fills its block for each destination d with its first assignments to d (token order):
   the first C always, up to P more ("spill" rows) while d has room. Room is pooled at d: its
   experts take R·C rows, the C of every source's block plus spill rows in source order while
   the rows other sources leave unused (Σ_r max(0, C − X[r, d])) last. Every rank computes the
   same answer from X, so the sender sends zeros in place of the rows that will not be kept.
3. beside each row travels an int64 key (local expert, source rank, rank among that source's
   assignments to d), or padding. d sorts its R·W keys and keeps the first R·C rows: grouped by
   local expert, source-major, token order within (the exact dispatcher's order), then padding,
   past the last offset, where the grouped GEMM skips it: its output rows (and input-gradient
   rows) may hold anything, never read.
4. combine undoes 3, sends the buffers back, and weights and sums each token's kept copies.

A dropped assignment (its pair's block full, or its destination's R·C rows) outputs zero, the
top-k weights not renormalized (the Switch Transformer's convention); `dropped_tokens()` counts
them on the device. `capacity_factor=None` is the padded mode, C = M: dropless whatever the
routing, at R × the exact dispatcher's bytes.

The garbage of padding rows never reaches a result: combine gathers only kept assignments' rows
and zero-fills dropped ones by mask (not a product, which would turn NaN garbage into NaN), and
in backward the mask that zero-fills unsent rows in dispatch also drops their gradient before it
reaches `x`. Numerics: the buffer is destination-major, token order within, in every mode, so
each token's copies reach its gradient in the same order and, whenever nothing is dropped, the
results are the padded mode's bit for bit (on CPU).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from moetrain.model.permute import fused, inverse_permutation, weight_grad
from moetrain.parallel.config import DEFAULT_CAPACITY_FACTOR, DEFAULT_SPILL_FACTOR
from moetrain.parallel.exact_dispatchers import ExpertParallelDispatcher, wire_dtype_of

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
"""all_gather_single where torch has it (2.13 deprecates all_gather_tensor), else all_gather_tensor."""


def capacity_rows(assignments: int, ep: int, capacity_factor: float | None, min_rows: int = 0) -> int:
    """C for a source with M = `assignments`: ceil(capacity_factor · M / ep), at least
    ceil(min_rows / ep) (ep·C ≥ min_rows), at most M, which never drops (the padded mode's layout,
    and its C: capacity_factor None lets all M go to one peer)."""
    if capacity_factor is None:
        return assignments
    return min(max(_ceil(capacity_factor * assignments / ep), _ceil(min_rows / ep)), assignments)


def block_rows(assignments: int, ep: int, capacity_factor: float | None, spill_factor: float, min_rows: int = 0) -> int:
    """W = C + P, P = ceil(spill_factor · M / ep) spill rows: the rows of each (source,
    destination) block of the exchange, at most M."""
    C = capacity_rows(assignments, ep, capacity_factor, min_rows)
    return min(C + _ceil(spill_factor * assignments / ep), assignments)


class NoSyncState(NamedTuple):
    """What `combine` needs to undo `dispatch`."""

    slot_NK: torch.Tensor
    """Send-buffer row of each assignment; 0 for dropped ones (see keep_NK)."""
    keep_NK: torch.Tensor
    """Whether each assignment was sent and kept by its destination."""
    src_S: torch.Tensor
    """The assignment each send-buffer row holds (any, where the row is empty: see filled_S)."""
    filled_S: torch.Tensor
    regroup_idx_C: torch.Tensor
    """The R·C received rows the experts get (source-major buffer rows), in local-expert-major
    order, padding last."""
    inv_S: torch.Tensor | None = None
    """Each received row's place in that order (≥ R·C: padding the experts do not get)."""


class _Plan(NamedTuple):
    """One exchange's routing, before any row moves."""

    state: NoSyncState
    """regroup_idx_C is filled in on arrival (`_arrivals`)."""
    key_S: torch.Tensor
    """The key beside each send-buffer row (module docstring, 3)."""


class NoSyncDispatcher(ExpertParallelDispatcher):
    """Expert-parallel dispatch with fixed-size buffers and equal all-to-all splits, no
    device-to-host synchronization (the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        ep_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup | None,
        capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR,
        spill_factor: float = DEFAULT_SPILL_FACTOR,
        min_rows: int = 0,
    ):
        super().__init__(num_experts, ep_group, dp_group)
        # ParallelConfig.validate
        assert capacity_factor is None or capacity_factor > 0, capacity_factor
        assert spill_factor >= 0 and min_rows >= 0, (spill_factor, min_rows)
        self.capacity_factor = capacity_factor
        self.spill_factor = spill_factor
        self.min_rows = min_rows
        """The fewest rows R·C the experts get (parallel.capacity_min_rows; 0 here unless given)."""
        self.ep_rank = dist.get_rank(ep_group)
        self._dropped: torch.Tensor | None = None

    def capacity(self, num_tokens: int, top_k: int) -> int:
        """C: each source's guaranteed rows at a destination; R·C rows reach the experts."""
        return self._rows(num_tokens * top_k)[0]

    def block_rows(self, num_tokens: int, top_k: int) -> int:
        """W = C + P: rows of each (source, destination) block of the exchange."""
        return self._rows(num_tokens * top_k)[1]

    def _rows(self, M: int, n: int = 1) -> tuple[int, int]:
        """(C, W) of each of n exchanges of M assignments in all: 1/n of the capacity, spill and
        floor each (the padded mode has one)."""
        factor = self.capacity_factor and self.capacity_factor / n
        C = capacity_rows(M, self.ep, factor, self.min_rows / n)
        return C, block_rows(M, self.ep, factor, self.spill_factor / n, self.min_rows / n)

    def dispatch(
        self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, NoSyncState]:
        """Returns the received rows sorted by local expert, padding last (R·C, D), the int32 end
        offset of each local expert's rows (L,), and the state for `combine`."""
        M = topk_ids_NK.numel()
        C, W = self._rows(M)
        plan = self._plan(topk_ids_NK, tokens_per_expert_E, C, W)

        # 2. Equal splits: every shape is known without looking at the routing.
        splits = [W] * self.ep
        key_recv_S = funcol.all_to_all_single(plan.key_S, splits, splits, group=self.ep_group)
        x_recv_SD = funcol.all_to_all_single_autograd(self._send_rows(x_ND, plan), splits, splits, group=self.ep_group)
        ((regroup_idx_C, inv_S, offsets_L),) = self._arrivals(key_recv_S.unsqueeze(0), C, M)
        x_local_CD = _Regroup.apply(x_recv_SD, regroup_idx_C, inv_S)
        return x_local_CD, offsets_L, plan.state._replace(regroup_idx_C=regroup_idx_C, inv_S=inv_S)

    def _plan(
        self,
        topk_ids_NK: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        C: int,
        W: int,
        chunk_M: torch.Tensor | None = None,
        n: int = 1,
    ) -> _Plan:
        """1. Each assignment's rank among this rank's assignments to its destination (token
        order), how many of them its destination keeps, and the send buffer's map. `chunk_M`: the
        exchange (of n, each of C and W rows) each assignment takes part in, whose experts are a
        1/n of each rank's (by experts) or all of them (by tokens); the buffer is exchange-major
        (n, R, W), and the state's slot_NK indexes the whole. Counts the drops (`dropped_tokens`)."""
        R, L = self.ep, self.num_local_experts
        M, device = topk_ids_NK.numel(), topk_ids_NK.device
        expert_M = topk_ids_NK.flatten()
        pair_M = expert_M // L if chunk_M is None else chunk_M * R + expert_M // L  # (exchange, destination)
        if chunk_M is None:  # one exchange: the router's counts, summed by destination
            counts_P = tokens_per_expert_E.view(R, L).sum(1)
        else:
            counts_P = torch.zeros(n * R, dtype=torch.int64, device=device)
            counts_P.scatter_add_(0, pair_M, torch.ones_like(pair_M))
        # X of every exchange, (R, n, R): X[s, i, d] source s's count for destination d in exchange i
        # (one all-gather; contiguous: torch 2.11's all_gather_tensor asserts it)
        X = _all_gather(counts_P.contiguous(), 0, group=self.ep_group).view(R, n, R) if W > C else None
        kept_P = (counts_P.view(n, R).clamp(max=C) + self._spill_kept(X, C, W)).flatten()
        start_P = counts_P.cumsum(0) - counts_P
        order_M = pair_M.argsort(stable=True)  # exchange-major, destination-major, token order within
        rank_in_pair_M = torch.arange(M, device=device) - start_P[pair_M[order_M]]
        pos_M = torch.empty_like(rank_in_pair_M).index_copy_(0, order_M, rank_in_pair_M)
        keep_NK = (pos_M < kept_P[pair_M]).view_as(topk_ids_NK)
        slot_NK = torch.where(keep_NK, (pair_M * W + pos_M).view_as(topk_ids_NK), 0)

        # The same map read from the buffer's side, as a gather (no duplicate writes): row (d, c)
        # holds the c-th assignment to d, if d keeps it; beside it travels its key, whose expert
        # is the exchange's (the remainder by its G = L / n or L experts: they divide L).
        G = self._experts_of(n)
        c_W = torch.arange(W, device=device)
        filled_PW = c_W < kept_P.unsqueeze(1)
        src_PW = order_M[(start_P.unsqueeze(1) + c_W).clamp_(max=M - 1)]
        key_PW = expert_M[src_PW].remainder_(G).mul_(R * M).add_(self.ep_rank * M + c_W)
        key_S = key_PW.masked_fill_(~filled_PW, G * R * M).flatten()  # padding: G·R·M
        self._dropped = None if self.capacity_factor is None else M - keep_NK.sum()
        return _Plan(NoSyncState(slot_NK, keep_NK, src_PW.flatten(), filled_PW.flatten(), None), key_S)

    @staticmethod
    def _send_rows(x_ND: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """The send buffer (R·W, D) in the wire dtype; each token's copies in buffer order
        (destination, then k), the order backward sums them in."""
        st = plan.state
        top_k = st.slot_NK.shape[1]
        by_slot_NK, sort_NK = st.slot_NK.sort(dim=1)
        return _SendRows.apply(
            x_ND, st.src_S // top_k, st.filled_S, by_slot_NK, st.keep_NK.gather(1, sort_NK), wire_dtype_of(x_ND)
        )

    def _experts_of(self, n: int) -> int:
        """G: the local experts of each of n exchanges (L / n where n divides L, else all L)."""
        L = self.num_local_experts
        return L // n if L % n == 0 else L

    def _arrivals(self, key_recv_nS: torch.Tensor, C: int, M: int) -> list[tuple[torch.Tensor, ...]]:
        """3. For each of n exchanges' received keys (n, R·W): the R·C rows its experts get
        (received rows in local-expert-major order, padding last), each received row's place in
        that order (≥ R·C: padding the experts do not get), and the int32 end offset of each of
        its G experts' rows; one sort for all n."""
        n, S = key_recv_nS.shape
        R, G = self.ep, self._experts_of(n)
        # Keys are unique but for padding (G·R·M), which sorts last: the first R·C of an exchange
        # are every kept row (the senders keep at most that many), by local expert, then source,
        # then token. Exchange i's keys are shifted past exchange i−1's.
        shift_n1 = torch.arange(n, device=key_recv_nS.device).unsqueeze(1)
        order_nS = (key_recv_nS + shift_n1 * (G * R * M + 1)).flatten().argsort(stable=True)
        inv_nS = inverse_permutation(order_nS).view(n, S) - shift_n1 * S
        order_nS = order_nS.view(n, S) - shift_n1 * S
        # A scatter, not bincount: bincount's output size is data (a sync). Padding counts as G.
        expert_nS = key_recv_nS // (R * M) + shift_n1 * (G + 1)
        rows_nG = torch.zeros(n * (G + 1), dtype=torch.int64, device=key_recv_nS.device)
        rows_nG = rows_nG.scatter_add_(0, expert_nS.flatten(), torch.ones_like(expert_nS.flatten())).view(n, G + 1)
        offsets_nG = rows_nG[:, :G].cumsum(1).to(torch.int32)
        return [(order_nS[i, : R * C], inv_nS[i], offsets_nG[i]) for i in range(n)]

    def _spill_kept(self, X_RnR: torch.Tensor | None, C: int, W: int) -> torch.Tensor:
        """How many of this rank's rows beyond C each destination keeps in each exchange (n, R):
        its rows in [C, W), after those of lower ranks, while the rows other sources leave unused
        last. `X_RnR`: the counts (None when there are no spill rows, W = C)."""
        if X_RnR is None:
            return 0
        R = self.ep
        unused_nD = R * C - X_RnR.clamp(max=C).sum(0)
        extra_RnR = X_RnR.clamp(max=W) - X_RnR.clamp(max=C)
        before_nD = (extra_RnR.cumsum(0) - extra_RnR)[self.ep_rank]
        return torch.minimum(extra_RnR[self.ep_rank], (unused_nD - before_nD).clamp(min=0))

    def combine(self, y_local_CD: torch.Tensor, state: NoSyncState, topk_weights_NK: torch.Tensor) -> torch.Tensor:
        """(R·C, D) in local-expert order -> each token's weighted sum over its copies (N, D);
        dropped assignments add nothing. Padding rows of `y_local_CD` may hold anything."""
        splits = [state.src_S.numel() // self.ep] * self.ep
        # the experts' rows back in the received buffer's places (R·W, D), as a gather
        y_back_SD = _Ungroup.apply(y_local_CD, state.regroup_idx_C, state.inv_S)
        y_back_SD = funcol.all_to_all_single_autograd(y_back_SD, splits, splits, group=self.ep_group)
        return _CombineRows.apply(y_back_SD, topk_weights_NK, *state[:4], None)  # slot, keep, src, filled

    def dropped_tokens(self) -> torch.Tensor | None:
        """Assignments dropped in the last dispatch (device int64 scalar); None in the padded
        mode, which never drops."""
        return self._dropped


# --- the gathers, both ways (as src/moetrain/model/permute.py: no scatter-add, no zero fill; `fused`
# on a GPU) ---------------------------------------------------------------------------------------


@fused
def _gather_filled(x_ND: torch.Tensor, token_S: torch.Tensor, filled_S: torch.Tensor, dtype: torch.dtype):
    """x_SD[j] = x_ND[token_S[j]] in `dtype`, zero where not filled (zeros, not a copy of some
    token: module docstring); cast first, so half the bytes are gathered."""
    return x_ND.to(dtype).index_select(0, token_S).masked_fill_(~filled_S.unsqueeze(-1), 0)


@fused
def _sum_kept(grad_SD: torch.Tensor, slot_NK: torch.Tensor, keep_NK: torch.Tensor, dtype: torch.dtype):
    """grad_x[n] = Σ_k grad_SD[slot[n, k]] over the kept copies, in `dtype` (by mask: a dropped
    copy's row, row 0, may be anything, NaN included)."""
    N, K = slot_NK.shape
    grad_NKD = grad_SD.index_select(0, slot_NK.flatten()).view(N, K, -1).to(dtype)
    return grad_NKD.masked_fill_(~keep_NK.unsqueeze(-1), 0).sum(1)


@fused
def _gather_prefix_grad(grad_CD: torch.Tensor, inv_S: torch.Tensor) -> torch.Tensor:
    """The gradient of rows `idx_C` (a prefix of the permutation whose inverse is `inv_S`) back
    in place, zero on the rows left out."""
    kept = grad_CD.shape[0]
    return grad_CD.index_select(0, inv_S.clamp(max=kept - 1)).masked_fill_((inv_S >= kept).unsqueeze(-1), 0)


@fused
def _combine_kept(y_SD, w_NK, slot_NK, keep_NK, add_ND) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's kept copies (N, K, D), their weighted sum (N, D), plus `add_ND` where given:
    the shared expert's output, added in the same kernel); by mask: the row of a dropped copy
    (row 0) may be anything, NaN included."""
    N, K = slot_NK.shape
    y_NKD = y_SD.index_select(0, slot_NK.flatten()).view(N, K, -1).masked_fill_(~keep_NK.unsqueeze(-1), 0)
    y_ND = (y_NKD * w_NK.unsqueeze(-1).to(y_NKD.dtype)).sum(1)
    return y_NKD, y_ND if add_ND is None else y_ND + add_ND


@fused
def _spread_grad(grad_ND, w_NK, src_S, filled_S, dtype: torch.dtype) -> torch.Tensor:
    """grad_y_SD[j] = w · grad_y at the assignment row j holds, zero for empty rows, in y's
    `dtype` (a gradient arriving in fp32 would otherwise cross the exchange in fp32)."""
    N, K = w_NK.shape
    grad_NKD = (grad_ND.unsqueeze(1) * w_NK.unsqueeze(-1).to(dtype)).to(dtype)
    return grad_NKD.view(N * K, -1).index_select(0, src_S).masked_fill_(~filled_S.unsqueeze(-1), 0)


_weight_grad = fused(weight_grad)


class _SendRows(torch.autograd.Function):
    """Send-buffer rows (`_gather_filled`); backward: each token's kept copies summed in buffer
    order (`_sum_kept`), in x's dtype."""

    @staticmethod
    def forward(ctx, x_ND, token_S, filled_S, slot_NK, keep_NK, dtype):
        ctx.save_for_backward(slot_NK, keep_NK)
        ctx.x_dtype = x_ND.dtype
        return _gather_filled(x_ND, token_S, filled_S, dtype)

    @staticmethod
    def backward(ctx, grad_SD):
        return _sum_kept(grad_SD, *ctx.saved_tensors, ctx.x_dtype), None, None, None, None, None


class _Regroup(torch.autograd.Function):
    """The experts' rows: received rows `idx_C`; backward `_gather_prefix_grad`."""

    @staticmethod
    def forward(ctx, x_SD, idx_C, inv_S):
        ctx.save_for_backward(inv_S)
        return x_SD.index_select(0, idx_C)

    @staticmethod
    def backward(ctx, grad_CD):
        (inv_S,) = ctx.saved_tensors
        return _gather_prefix_grad(grad_CD, inv_S), None, None


class _Ungroup(torch.autograd.Function):
    """`_Regroup` undone, as a gather (a scatter's kernel is the slower): y_SD[j] = y_CD[inv_S[j]]
    (clamped: a padding row takes a copy of some row, never read). Backward: the kept rows'
    gradients, gathered back into the experts' order."""

    @staticmethod
    def forward(ctx, y_CD, idx_C, inv_S):
        ctx.save_for_backward(idx_C)
        return y_CD.index_select(0, inv_S.clamp(max=y_CD.shape[0] - 1))

    @staticmethod
    def backward(ctx, grad_SD):
        (idx_C,) = ctx.saved_tensors
        return grad_SD.index_select(0, idx_C), None, None


class _CombineRows(torch.autograd.Function):
    """y_ND[n] = Σ_k w[n, k] · y_SD[slot[n, k]] (+ add_ND[n]) over kept copies (`_combine_kept`).
    Backward: `_spread_grad`, grad_w in fp32 (`weight_grad`: the router's gradient is not rounded
    to bf16), and grad_y for add_ND."""

    @staticmethod
    def forward(ctx, y_SD, w_NK, slot_NK, keep_NK, src_S, filled_S, add_ND):
        y_NKD, y_ND = _combine_kept(y_SD, w_NK, slot_NK, keep_NK, add_ND)
        ctx.save_for_backward(y_NKD, w_NK, src_S, filled_S)
        return y_ND

    @staticmethod
    def backward(ctx, grad_ND):
        y_NKD, w_NK, src_S, filled_S = ctx.saved_tensors
        grad_y_SD = _spread_grad(grad_ND, w_NK, src_S, filled_S, y_NKD.dtype) if ctx.needs_input_grad[0] else None
        grad_w_NK = _weight_grad(grad_ND, y_NKD, w_NK.dtype) if ctx.needs_input_grad[1] else None
        return grad_y_SD, grad_w_NK, None, None, None, None, grad_ND if ctx.needs_input_grad[6] else None


def _ceil(x: float) -> int:
    """ceil, forgiving float noise (1.1 · 30 / 3 is 11.000000000000002)."""
    return math.ceil(round(x, 9))
