"""`SymmMemDispatcher`: exact, dropless expert-parallel dispatch with the split sizes on the device.

Legend: N tokens on this rank, K top-k, M = N·K assignments, D model dim, E experts in all,
R = ep ranks, L = E / R experts on this rank, S = R·M + L rows of the receive layout (the most
this rank can be sent, plus one padding row per expert).

The exact `AllToAllDispatcher` moves only the routed rows but reads the split sizes on the host
(a sync per MoE layer); `NoSyncDispatcher` needs no sync but moves fixed-size buffers (1.25× the
bytes by default, dropping what overflows its capacity; R× in its padded, dropless mode). This one
needs neither, dropless: the transport is NVSHMEM's all-to-all-v over
symmetric memory (`torch.ops.symm_mem.all_to_all_vdev_2d` and its inverse `..._2d_offset`),
whose kernels exchange the split sizes between GPUs and write each row straight into its
expert's slot on the destination GPU. Only routed rows cross NVLink, and nothing waits on the host.

One MoE layer:
1. dispatch: sort this rank's assignments by global expert (rank-major, so rows for rank r's
   experts are contiguous, expert by expert) and cast them to the wire dtype; the per-expert
   counts are the split sizes. The transport returns them on the destination grouped by local
   expert (source-rank order within an expert) — the order the grouped GEMM wants — with the
   (split, offset) of every (expert, source) chunk. The layout is S rows; rows that belong to no
   chunk (padding between experts, the unused tail) are zeroed, and the grouped GEMM's group
   ends are read from the chunk table, so it never computes on them (the tail) or computes on
   zeros (padding inside a group, which also receives zero gradient).
2. combine: the inverse transport brings every expert output row back to the rank and position
   it came from; undo the sort.
3. backward: dispatch's gradient is a combine and combine's a dispatch, with the same tables.

Symmetric buffers (every rank allocates the same sizes; one set per dtype and width, shared by
all layers, which run one after another): the sorted rows (M × D), the receive layout (S × D),
and the split tables. They are allocated on first use (a collective). The transport's kernels
start by exchanging split sizes with every peer, so no rank writes into a buffer a peer is still
reading from the previous layer.

On CPU (gloo) the transport is emulated with `all_to_all_single` and split sizes read on the host,
in the same layout (no padding): the dispatcher's own logic — sort, chunk table, group ends,
zeroed rows, autograd — runs the same, which is what the CPU tests check against the exact
dispatcher; on CUDA a GPU test checks the NVSHMEM transport against it too.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from moetrain.model.token_dispatcher import DispatchState
from moetrain.parallel.exact_dispatchers import ExpertParallelDispatcher


class SymmState(NamedTuple):
    order: DispatchState
    """This rank's assignments in global expert order."""
    counts_E: torch.Tensor
    table_2C: torch.Tensor
    """Split and offset (rows) of each (local expert, source rank) chunk of the receive layout,
    expert-major: chunk c = e·R + r."""


# --- the transport: two custom ops (opaque to torch.compile, fixed output shapes) ---------------


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


class _Buffers:
    """Symmetric buffers per (dtype, D, group): rows M, layout S, split tables. Grown (a
    collective) when a larger micro-batch comes; never shrunk."""

    cache: dict = {}

    @classmethod
    def get(cls, group_name: str, dtype: torch.dtype, D: int, M: int, S: int, E: int, device) -> dict:
        import torch.distributed._symmetric_memory as symm_mem

        key = (group_name, dtype, D, E, device)
        b = cls.cache.get(key)
        if b is not None and b["M"] >= M and b["S"] >= S:
            return b
        if not cls.cache:  # first allocation initializes NVSHMEM: size its heap first
            need = (M + S) * D * torch.finfo(dtype).bits // 8 + (1 << 20)
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(2 * need, 1 << 30)))
            if hasattr(symm_mem, "set_backend"):
                symm_mem.set_backend("NVSHMEM")
            else:  # older torch reads the backend from the environment
                os.environ.setdefault("TORCH_SYMMMEM", "NVSHMEM")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group_name)
        b = {
            "M": M,
            "S": S,
            "rows": symm_mem.empty(M, D, dtype=dtype, device=device),
            "layout": symm_mem.empty(S, D, dtype=dtype, device=device),
            "splits": symm_mem.empty(E, dtype=torch.int64, device=device),
            "table_in": symm_mem.empty(2, E, dtype=torch.int64, device=device),
            "table_out": symm_mem.empty(2, E, dtype=torch.int64, device=device),
        }
        for name in ("rows", "layout", "splits", "table_in", "table_out"):
            symm_mem.rendezvous(b[name], group_name)
        cls.cache[key] = b
        return b


def _valid_rows(table_2C: torch.Tensor, S: int) -> torch.Tensor:
    """(S,) bool: rows of the receive layout that hold a chunk's row."""
    splits_C, starts_C = table_2C[0], table_2C[1]
    rows_S = torch.arange(S, device=table_2C.device)
    # The chunk a row falls in: the last chunk starting at or before it (empty chunks share their
    # start with the next one, which `right=True` picks).
    c_S = (torch.searchsorted(starts_C.contiguous(), rows_S, right=True) - 1).clamp(min=0)
    return (rows_S >= starts_C[c_S]) & (rows_S < starts_C[c_S] + splits_C[c_S])


def _emulated_dispatch(x_MD, counts_E, group, S):
    """gloo: the same layout, split sizes on the host."""
    R = dist.get_world_size(group)
    E = counts_E.numel()
    L = E // R
    recv_RL = torch.empty_like(counts_E.view(R, L))
    dist.all_to_all_single(recv_RL, counts_E.view(R, L).contiguous(), group=group)
    send = counts_E.view(R, L).sum(1).tolist()
    recv = recv_RL.sum(1).tolist()
    x_recv = torch.empty(sum(recv), x_MD.shape[1], dtype=x_MD.dtype)
    dist.all_to_all_single(x_recv, x_MD.contiguous(), recv, send, group=group)
    # received: source-major, expert within; chunk (e, r) goes to expert-major position
    splits_C = recv_RL.t().reshape(-1)  # c = e·R + r
    starts_C = splits_C.cumsum(0) - splits_C
    src_start_RL = (recv_RL.flatten().cumsum(0) - recv_RL.flatten()).view(R, L)
    out = torch.zeros(S, x_MD.shape[1], dtype=x_MD.dtype)
    for e in range(L):
        for r in range(R):
            n, a, b = int(recv_RL[r, e]), int(src_start_RL[r, e]), int(starts_C[e * R + r])
            out[b : b + n] = x_recv[a : a + n]
    return out, torch.stack([splits_C, starts_C])


def _emulated_combine(y_SD, table_2C, counts_E, group, M):
    R = dist.get_world_size(group)
    E = counts_E.numel()
    L = E // R
    splits_C, starts_C = table_2C[0], table_2C[1]
    recv_RL = splits_C.view(L, R).t()  # what this rank received from r for expert e
    parts = []
    for r in range(R):
        for e in range(L):
            s, n = int(starts_C[e * R + r]), int(recv_RL[r, e])
            parts.append(y_SD[s : s + n])
    send_back = torch.cat(parts) if parts else y_SD[:0]
    out = torch.empty(M, y_SD.shape[1], dtype=y_SD.dtype)
    dist.all_to_all_single(
        out, send_back.contiguous(), counts_E.view(R, L).sum(1).tolist(), recv_RL.sum(1).tolist(), group=group
    )
    return out


@torch.library.custom_op("moetrain::symm_dispatch", mutates_args=())
def symm_dispatch(
    x_MD: torch.Tensor, counts_E: torch.Tensor, group_name: str, S: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted rows (rank-major, expert within) → receive layout (S, D), expert-major, rows outside
    every chunk zeroed; and the (2, R·L) chunk table (splits, offsets)."""
    group = _group(group_name)
    if x_MD.device.type != "cuda":
        out, table = _emulated_dispatch(x_MD, counts_E, group, S)
        return out, table
    M, D = x_MD.shape
    b = _Buffers.get(group_name, x_MD.dtype, D, M, S, counts_E.numel(), x_MD.device)
    b["rows"][:M].copy_(x_MD)
    b["splits"].copy_(counts_E)
    torch.ops.symm_mem.all_to_all_vdev_2d(b["rows"], b["layout"], b["splits"], b["table_out"], group_name, 1)
    table = b["table_out"].clone()
    out = torch.where(_valid_rows(table, S).unsqueeze(-1), b["layout"][:S], 0)
    return out, table


@symm_dispatch.register_fake
def _(x_MD, counts_E, group_name, S):
    return x_MD.new_empty(S, x_MD.shape[1]), counts_E.new_empty(2, counts_E.numel())


@torch.library.custom_op("moetrain::symm_combine", mutates_args=())
def symm_combine(
    y_SD: torch.Tensor, table_2C: torch.Tensor, counts_E: torch.Tensor, group_name: str, M: int
) -> torch.Tensor:
    """Receive layout (S, D) → each row back to its source rank and sorted position (M, D)."""
    group = _group(group_name)
    if y_SD.device.type != "cuda":
        return _emulated_combine(y_SD, table_2C, counts_E, group, M)
    S, D = y_SD.shape
    b = _Buffers.get(group_name, y_SD.dtype, D, M, S, counts_E.numel(), y_SD.device)
    b["layout"][:S].copy_(y_SD)
    b["table_in"].copy_(table_2C)
    torch.ops.symm_mem.all_to_all_vdev_2d_offset(b["layout"], b["rows"], b["table_in"], b["table_out"], group_name)
    return b["rows"][:M].clone()


@symm_combine.register_fake
def _(y_SD, table_2C, counts_E, group_name, M):
    return y_SD.new_empty(M, y_SD.shape[1])


def _dispatch_setup(ctx, inputs, output):
    _, counts_E, group_name, _ = inputs
    ctx.save_for_backward(output[1], counts_E)
    ctx.group_name = group_name
    ctx.M = inputs[0].shape[0]


def _dispatch_backward(ctx, grad_SD, _grad_table):
    table, counts_E = ctx.saved_tensors
    return symm_combine(grad_SD.contiguous(), table, counts_E, ctx.group_name, ctx.M), None, None, None


def _combine_setup(ctx, inputs, output):
    y_SD, table_2C, counts_E, group_name, _ = inputs
    ctx.save_for_backward(counts_E)
    ctx.group_name = group_name
    ctx.S = y_SD.shape[0]


def _combine_backward(ctx, grad_MD):
    (counts_E,) = ctx.saved_tensors
    grad_SD, _ = symm_dispatch(grad_MD.contiguous(), counts_E, ctx.group_name, ctx.S)
    return grad_SD, None, None, None, None


symm_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
symm_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


# --- the dispatcher ---------------------------------------------------------------------------


class SymmMemDispatcher(ExpertParallelDispatcher):
    """Dropless expert-parallel dispatch over NVSHMEM symmetric memory: exact rows, device-side
    split sizes, no host sync (see the module docstring)."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup, dp_group: dist.ProcessGroup | None):
        super().__init__(num_experts, ep_group, dp_group)
        self.group_name = ep_group.group_name

    def layout_rows(self, num_tokens: int, top_k: int) -> int:
        """S: rows of the receive layout (and of the experts' activations)."""
        return self.ep * num_tokens * top_k + self.num_local_experts

    def dispatch(
        self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, SymmState]:
        R, L = self.ep, self.num_local_experts
        num_tokens, top_k = topk_ids_NK.shape
        order, x_MD = self.sort_by_expert(x_ND, topk_ids_NK)
        counts_E = tokens_per_expert_E.to(torch.int64)
        x_SD, table_2C = symm_dispatch(x_MD, counts_E, self.group_name, self.layout_rows(num_tokens, top_k))
        # Group ends: expert e ends where expert e+1's first chunk starts (padding rows, zeroed,
        # stay in e's group); the last expert ends at its last chunk's end (the tail is skipped).
        starts_C, splits_C = table_2C[1], table_2C[0]
        last = starts_C[-1:] + splits_C[-1:]
        offsets_L = torch.cat([starts_C.view(L, R)[1:, 0], last]).to(torch.int32)
        return x_SD, offsets_L, SymmState(order, counts_E, table_2C)

    def combine(self, y_SD: torch.Tensor, state: SymmState, topk_weights_NK: torch.Tensor) -> torch.Tensor:
        M = state.order.sort_idx_M.numel()
        y_MD = symm_combine(y_SD.contiguous(), state.table_2C, state.counts_E, self.group_name, M)
        return self.unsort(y_MD, state.order, topk_weights_NK)
