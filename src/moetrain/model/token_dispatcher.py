"""Token dispatchers: the seam between routing and the experts.

Legend: N tokens, K top-k, M = N·K assignments, D model dim, E experts (local to this rank).

The MoE layer asks its dispatcher for the expert step (dispatch → experts → combine, plus the
shared expert) and never communicates itself. This file holds the interface (`TokenDispatcher`)
and the one-device implementation; the expert-parallel ones swap in behind the same methods
(src/moetrain/parallel/exact_dispatchers.py, nosync_dispatcher.py, overlapped_dispatcher.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch

from moetrain.model.permute import inverse_permutation, permute, unpermute_combine

if TYPE_CHECKING:
    from moetrain.model.experts import GroupedExperts
    from moetrain.model.router import RouterOutput


@runtime_checkable
class TokenDispatcher(Protocol):
    """Moves token copies to their experts and the experts' outputs back (the MoE layer's only
    view of where experts live)."""

    num_local_experts: int
    """Experts whose rows `dispatch` returns (all of them on one device; E / ep with expert
    parallelism)."""

    def reduce_counts(self, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """This rank's tokens per expert -> the global micro-batch's (summed over data-parallel
        ranks), for the load-balancing loss and the aux-free bias. No gradient."""
        ...

    def dispatch(
        self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Rows for this rank's experts sorted by local expert (rows past the last offset, if
        any, are padding the experts skip), the int32 end offset of each local expert's rows, and
        the state `combine` needs."""
        ...

    def combine(self, y_MD: torch.Tensor, state: Any, topk_weights_NK: torch.Tensor) -> torch.Tensor:
        """The experts' output rows back to their tokens, weighted by `topk_weights_NK` and
        summed over the k copies: (N, D) in y's dtype (dropped assignments add nothing)."""
        ...

    def dropped_tokens(self) -> torch.Tensor | None:
        """Assignments dropped in the last dispatch (device scalar); None for dropless ones (the default)."""
        return None

    def expert_step(
        self,
        x_ND: torch.Tensor,
        route: RouterOutput,
        experts: GroupedExperts,
        shared: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        """The MoE layer's output before its auxiliary losses: dispatch → experts → combine,
        plus the shared expert's output where the layer has one. A dispatcher that overlaps its
        exchange with compute overrides this, with the same results."""
        x_MD, offsets_E, state = self.dispatch(x_ND, route.topk_ids_NK, route.tokens_per_expert_E)
        y_ND = self.combine(experts(x_MD, offsets_E), state, route.topk_weights_NK)
        return y_ND if shared is None else y_ND + shared(x_ND)


class DispatchState(NamedTuple):
    """What `combine` needs to undo `dispatch` (src/moetrain/model/permute.py)."""

    sort_idx_M: torch.Tensor
    inv_NK: torch.Tensor


class LocalTokenDispatcher(TokenDispatcher):
    """The `TokenDispatcher` of one device: permute token copies into expert order; dropless,
    sync-free."""

    def __init__(self, num_experts: int):
        self.num_local_experts = num_experts

    def reduce_counts(self, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        return tokens_per_expert_E  # this device's tokens are the whole micro-batch

    def dispatch(
        self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        sort_idx_M, inv_NK = sort_by_expert(topk_ids_NK)
        offsets_E = tokens_per_expert_E.cumsum(0).to(torch.int32)
        return permute(x_ND, sort_idx_M, inv_NK), offsets_E, DispatchState(sort_idx_M, inv_NK)

    def combine(self, y_MD: torch.Tensor, state: DispatchState, topk_weights_NK: torch.Tensor) -> torch.Tensor:
        return unpermute_combine(y_MD, topk_weights_NK, state.sort_idx_M, state.inv_NK)


def sort_by_expert(topk_ids_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The order of the assignments by expert (a stable sort keeps each expert's rows in token
    order: deterministic results) and its inverse, shaped (N, K)."""
    sort_idx_M = topk_ids_NK.flatten().argsort(stable=True)
    return sort_idx_M, inverse_permutation(sort_idx_M).view(topk_ids_NK.shape)
