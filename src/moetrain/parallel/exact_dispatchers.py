"""The exact expert-parallel dispatchers, and what every expert-parallel dispatcher shares.

Legend: N tokens on this rank, K top-k, M = N·K assignments, D model dim, E experts in all,
L = E / ep experts on this rank, R = ep ranks of the expert-parallel group.

Every dispatcher implements `TokenDispatcher` (src/moetrain/model/token_dispatcher.py): the MoE
layer asks for its expert step (dispatch → experts → combine) and never communicates itself.
`ExpertParallelDispatcher` is the base of those that split experts over ep ranks (this module's
`AllToAllDispatcher`, nosync_dispatcher.py, overlapped_dispatcher.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from moetrain.model.permute import permute, unpermute_combine
from moetrain.model.token_dispatcher import DispatchState, LocalTokenDispatcher, TokenDispatcher, sort_by_expert


class DataParallelDispatcher(LocalTokenDispatcher):
    """Every rank holds every expert (ep = 1); only the routing counts cross ranks, so that the
    load-balancing loss and the aux-free bias see the global micro-batch."""

    def __init__(self, num_experts: int, dp_group: dist.ProcessGroup | None):
        super().__init__(num_experts)
        self.dp_group = dp_group

    def reduce_counts(self, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        return all_reduce_counts(tokens_per_expert_E, self.dp_group)


class AllToAllState(NamedTuple):
    order: DispatchState
    """This rank's assignments in global expert order (`sort_by_expert`)."""
    regroup_idx: torch.Tensor
    """Received rows (source-rank-major) -> local-expert-major order."""
    send_splits: list[int]
    recv_splits: list[int]


class ExpertParallelDispatcher(TokenDispatcher):
    """What the dispatchers that split experts over an expert-parallel group share: the group,
    the local expert count and the routing counts' reduction over dp."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup, dp_group: dist.ProcessGroup | None):
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.dp_group = dp_group
        self.ep = dist.get_world_size(ep_group)
        assert num_experts % self.ep == 0, f"{num_experts} experts over {self.ep} ranks (RunConfig.validate)"
        self.num_local_experts = num_experts // self.ep

    def reduce_counts(self, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        return all_reduce_counts(tokens_per_expert_E, self.dp_group)


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Exact all-to-all with host-synchronized split sizes (the reference dispatcher): dropless,
    and each rank receives exactly the rows routed to its experts.

    1. sort this rank's assignments by global expert: rows for rank r's experts are contiguous;
    2. exchange the per-expert counts (all-to-all), read the split sizes on the host (one sync);
    3. all-to-all the rows; regroup what arrived (source-major) into local-expert-major order;
    4. combine reverses 3 and 1.
    """

    def dispatch(
        self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, AllToAllState]:
        R, L = self.ep, self.num_local_experts
        order = DispatchState(*sort_by_expert(topk_ids_NK))
        x_MD = permute(x_ND.to(wire_dtype_of(x_ND)), order.sort_idx_M, order.inv_NK)  # 1., in the wire dtype

        send_counts_RL = tokens_per_expert_E.view(R, L).contiguous()
        recv_counts_RL = torch.empty_like(send_counts_RL)
        dist.all_to_all_single(recv_counts_RL, send_counts_RL, group=self.ep_group)
        send_splits, recv_splits = torch.stack([send_counts_RL.sum(1), recv_counts_RL.sum(1)]).tolist()  # host sync
        num_recv = sum(recv_splits)

        x_recv_MD = funcol.all_to_all_single_autograd(x_MD, recv_splits, send_splits, group=self.ep_group)

        local_expert_of_row = (
            torch.arange(L, device=x_ND.device)
            .repeat(R)
            .repeat_interleave(recv_counts_RL.flatten(), output_size=num_recv)
        )
        regroup_idx = local_expert_of_row.argsort(stable=True)
        x_local_MD = x_recv_MD.index_select(0, regroup_idx)
        offsets_L = recv_counts_RL.sum(0).cumsum(0).to(torch.int32)
        return x_local_MD, offsets_L, AllToAllState(order, regroup_idx, send_splits, recv_splits)

    def combine(self, y_local_MD: torch.Tensor, state: AllToAllState, topk_weights_NK: torch.Tensor) -> torch.Tensor:
        y_recv_MD = torch.empty_like(y_local_MD).index_copy(0, state.regroup_idx, y_local_MD)
        y_MD = funcol.all_to_all_single_autograd(y_recv_MD, state.send_splits, state.recv_splits, group=self.ep_group)
        return unpermute_combine(y_MD, topk_weights_NK, state.order.sort_idx_M, state.order.inv_NK)


def wire_dtype_of(x: torch.Tensor) -> torch.dtype:
    """The dtype rows cross the all-to-all in: the autocast dtype (bf16) when autocast is on, which
    the experts cast their input to anyway (the same values at half the bytes); the backward casts
    the gradient rows back to fp32 before the per-token sum, so no precision is lost there."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def all_reduce_counts(counts_E: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum integer counts over `group` (no gradient; async on the device's stream)."""
    if group is None:
        return counts_E
    counts_E = counts_E.clone()
    dist.all_reduce(counts_E, group=group)
    return counts_E
