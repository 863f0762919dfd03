"""A sync-free expert-parallel dispatcher: fixed-size all-to-all buffers, no host round trip.

Legend: N tokens on this rank, K top-k, M = N·K assignments (row n·K + k: token order), D model
dim, E experts in all, R = ep ranks of the expert-parallel group, L = E / R experts on this rank,
C buffer rows per destination rank (the capacity), S = R·C buffer rows sent and received.

`AllToAllDispatcher` (dispatchers.py) sends each peer exactly the rows routed to it, so its
split sizes are data and are read on the host once per layer: the CPU waits for the router, and
the step cannot be captured in a CUDA graph. Here every rank sends every peer C rows whatever the
routing, so every shape follows from N, K, E, R and the capacity factor and the all-to-alls use
equal splits:

1. dispatch: order this rank's assignments by destination rank (stable, so token order within a
   destination). The first C of each destination fill its buffer; the rest are dropped; the
   unused rows are zeros. Beside each row travels one integer: its local expert, or L (padding).
2. The receiver sorts what arrived by that integer (stable; padding sorts last). The grouped GEMM
   sees the rows the exact dispatcher would give it, in the same order, followed by padding rows
   past the last offset, which it skips: they are not computed, and their output rows (and their
   input gradient rows in backward) may hold anything (uninitialized memory on CPU; zeros or
   leftovers with CUDA's kernels). Rows past the last offset are never read.
3. combine undoes 2, sends the same fixed-size buffers back, and gathers each kept assignment's
   row; a dropped assignment gets exact zeros.

That garbage never reaches a result: combine only gathers rows of kept assignments and fills
dropped ones with `where` (not a product, which would turn NaN garbage into NaN), and in backward
the `where` that zero-fills padding rows in dispatch also drops their gradient before it reaches
`x` (a padding row copied from some token would hand that token the garbage).

Buffer size and memory (per MoE layer and rank):
- dropless (`capacity_factor=None`, the default): C = N·K, because one destination may receive
  all of this rank's assignments. Each direction then moves S = ep·N·K rows of D values: send
  and receive buffers of ep·N·K × D each, and the experts' activations are allocated for all S
  rows, against N·K × D for the exact dispatcher: ep times the memory and all-to-all bytes (GEMM
  FLOPs do not grow: padding rows are skipped). The price of no sync; affordable for small ep.
- `capacity_factor=f`: C = min(ceil(f·N·K / ep), N·K), so S ≈ f·N·K rows, f times the exact
  dispatcher's size under perfect balance. Capacity is per destination *rank* (the buffer),
  not per expert. Assignments beyond C for one destination are dropped, last tokens of the
  micro-batch first (GShard/Switch-style drop by position, deterministic). A dropped
  assignment's output is zero: its token keeps its other experts' outputs and the shared
  expert's, and the top-k weights are *not* renormalized over the kept experts (the token's
  routed output just loses that term, as in the Switch Transformer). `dropped_tokens()` counts
  them on the device.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from moetrain.parallel.dispatchers import ExpertParallelDispatcher, wire_dtype


class NoSyncState(NamedTuple):
    """What `combine` needs to undo `dispatch`."""

    slot_M: torch.Tensor
    """Send-buffer row of each assignment (token order); 0 for dropped ones (see keep_M)."""
    keep_M: torch.Tensor
    """Whether each assignment found room in its destination's buffer."""
    regroup_idx_S: torch.Tensor
    """Received rows (source-major) -> local-expert-major order, padding last."""
    num_tokens: int


class NoSyncDispatcher(ExpertParallelDispatcher):
    """Expert-parallel dispatch with fixed-size buffers and equal all-to-all splits: no
    device-to-host synchronization. Dropless by default; with `capacity_factor` it holds about
    `capacity_factor` × the balanced load and drops the overflow (see the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        ep_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup | None,
        capacity_factor: float | None = None,
    ):
        super().__init__(num_experts, ep_group, dp_group)
        assert capacity_factor is None or capacity_factor > 0, capacity_factor  # ParallelConfig.validate
        self.capacity_factor = capacity_factor
        self._dropped: torch.Tensor | None = None

    def capacity(self, num_tokens: int, top_k: int) -> int:
        """C: buffer rows for each destination rank."""
        num_assignments = num_tokens * top_k
        if self.capacity_factor is None:
            return num_assignments  # all of them may go to one peer
        # More than all of this rank's assignments can never be needed.
        return min(math.ceil(self.capacity_factor * num_assignments / self.ep), num_assignments)

    def buffer_rows(self, num_tokens: int, top_k: int) -> int:
        """S = ep·C: rows of D values this rank sends (and receives) in each all-to-all, and the
        rows the grouped experts get. ep·N·K when dropless, against N·K for the exact
        dispatcher."""
        return self.ep * self.capacity(num_tokens, top_k)

    def dispatch(
        self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, NoSyncState]:
        """Returns the received rows sorted by local expert, padding last (S, D), the int32 end
        offset of each local expert's rows (L,), and the state for `combine`."""
        R, L = self.ep, self.num_local_experts
        num_tokens, top_k = topk_ids_NK.shape
        M, C = num_tokens * top_k, self.capacity(num_tokens, top_k)
        S, device = R * C, x_ND.device

        # 1. Each assignment's row in its destination's buffer: its rank among the assignments to
        #    that destination, in token order.
        expert_M = topk_ids_NK.flatten()
        dest_M = expert_M // L
        send_counts_R = tokens_per_expert_E.view(R, L).sum(1)
        start_R = send_counts_R.cumsum(0) - send_counts_R
        order_M = dest_M.argsort(stable=True)  # destination-major, token order within each
        rank_in_dest_M = torch.arange(M, device=device) - start_R[dest_M[order_M]]
        pos_M = torch.empty_like(rank_in_dest_M).index_copy_(0, order_M, rank_in_dest_M)
        keep_M = pos_M < C
        slot_M = torch.where(keep_M, dest_M * C + pos_M, 0)
        if self.capacity_factor is not None:
            self._dropped = (send_counts_R - C).clamp(min=0).sum()

        # The same map read from the buffer's side, as a gather (no duplicate writes): slot (r, c)
        # holds the c-th assignment to r, if there is one.
        slot_r_S = torch.arange(S, device=device) // C
        slot_c_S = torch.arange(S, device=device) % C
        filled_S = slot_c_S < send_counts_R[slot_r_S]
        src_S = order_M[(start_R[slot_r_S] + slot_c_S).clamp(max=M - 1)]
        send_expert_S = torch.where(filled_S, expert_M[src_S] % L, L)
        # Zeros, not a copy of some token: see the module docstring on garbage gradients.
        x_send_SD = wire_dtype(torch.where(filled_S.unsqueeze(-1), x_ND.index_select(0, src_S // top_k), 0))

        # 2. Equal splits: every shape is known without looking at the routing.
        splits = [C] * R
        recv_expert_S = funcol.all_to_all_single(send_expert_S, splits, splits, group=self.ep_group)
        x_recv_SD = funcol.all_to_all_single_autograd(x_send_SD, splits, splits, group=self.ep_group)
        # Stable: within an expert, source-major then token order, as the exact dispatcher has it.
        regroup_idx_S = recv_expert_S.argsort(stable=True)
        x_local_SD = x_recv_SD.index_select(0, regroup_idx_S)
        # A scatter, not bincount: bincount's output size is data (a sync).
        rows_per_expert = torch.zeros(L + 1, dtype=torch.int64, device=device)
        rows_per_expert.scatter_add_(0, recv_expert_S, torch.ones_like(recv_expert_S))
        offsets_L = rows_per_expert[:L].cumsum(0).to(torch.int32)
        return x_local_SD, offsets_L, NoSyncState(slot_M, keep_M, regroup_idx_S, num_tokens)

    def combine(self, y_local_SD: torch.Tensor, state: NoSyncState, topk_weights_NK: torch.Tensor) -> torch.Tensor:
        """(S, D) in local-expert order -> each token's weighted sum over its copies (N, D);
        dropped assignments add nothing. Padding rows of `y_local_SD` may hold anything."""
        splits = [y_local_SD.shape[0] // self.ep] * self.ep
        # regroup_idx is a permutation of S: every row is overwritten, so no zero-fill is needed.
        y_recv_SD = torch.empty_like(y_local_SD).index_copy(0, state.regroup_idx_S, y_local_SD)
        y_back_SD = funcol.all_to_all_single_autograd(y_recv_SD, splits, splits, group=self.ep_group)
        y_MD = torch.where(state.keep_M.unsqueeze(-1), y_back_SD.index_select(0, state.slot_M), 0)
        y_NKD = y_MD.view(state.num_tokens, -1, y_MD.shape[-1])
        return (y_NKD * topk_weights_NK.unsqueeze(-1).to(y_NKD.dtype)).sum(dim=1)

    def dropped_tokens(self) -> torch.Tensor | None:
        """Assignments dropped in the last dispatch (device int64 scalar); None when dropless."""
        return self._dropped
