"""AdamW with parameter groups, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrain.train.config import OptimConfig, ScheduleConfig, ScheduleKind


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings (1-D or nn.Embedding) get no decay."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in embedding_params else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        # Fused on CUDA (one kernel for all parameters); foreach on CPU.
        fused=True if on_cuda else None,
    )


def lr_at(step: int, total_steps: int, peak_lr: float, cfg: ScheduleConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    min_lr = peak_lr * cfg.min_lr_ratio
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return peak_lr * (step + 1) / cfg.warmup_steps
    if cfg.kind == ScheduleKind.constant:
        return peak_lr
    if cfg.kind == ScheduleKind.cosine:
        span = max(1, total_steps - cfg.warmup_steps - 1)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return min_lr + 0.5 * (peak_lr - min_lr) * (1 + math.cos(math.pi * progress))
    # Warmup-stable-decay: linear decay over the last decay_fraction of the run.
    decay_steps = max(1, round(total_steps * cfg.decay_fraction))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return peak_lr
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return peak_lr + (min_lr - peak_lr) * progress


def global_grad_norm(
    params: list[torch.Tensor], expert_params: list[torch.Tensor], ep_group=None, pp_group=None
) -> torch.Tensor:
    """The L2 norm of all gradients of the model, as a device tensor (no host sync).

    With expert parallelism each rank holds only its experts' gradients: their squared norms are
    summed over the expert-parallel group; with pipeline parallelism, the stage totals over the
    pipeline group; so that every rank sees the norm of the whole model.
    """
    grads = [p.grad for p in params if p.grad is not None]
    expert_grads = [p.grad for p in expert_params if p.grad is not None]
    device = (grads or expert_grads)[0].device
    dense_sq = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else torch.zeros((), device=device)
    expert_sq = (torch.stack(torch._foreach_norm(expert_grads)).square().sum() if expert_grads
                 else torch.zeros((), device=device))
    if ep_group is not None:
        import torch.distributed as dist

        dist.all_reduce(expert_sq, group=ep_group)
    total_sq = dense_sq + expert_sq
    if pp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that brings a gradient of norm `total_norm` to at most `max_norm` (≤ 1)."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


def clip_grad_norm(
    params: list[torch.Tensor], expert_params: list[torch.Tensor], max_norm: float, ep_group=None, pp_group=None
) -> torch.Tensor:
    """Clip all gradients to a global L2 norm of `max_norm` (no clipping for inf); return the
    norm before clipping, as a device tensor (no host sync)."""
    total = global_grad_norm(params, expert_params, ep_group, pp_group)
    if max_norm != math.inf:
        grads = [p.grad for p in params + expert_params if p.grad is not None]
        torch._foreach_mul_(grads, clip_coefficient(total, max_norm))
    return total


class _TorchAdamW:
    """What the optimizers built on a torch AdamW (`self.adamw`) share."""

    adamw: torch.optim.AdamW
    fused: bool = False
    """torch's fused AdamW kernel (CUDA): the clipping factor and the skip decision go into the
    kernel as device tensors (`grad_scale`, `found_inf`)."""

    def set_lr(self, lr: float) -> None:
        for group in self.adamw.param_groups:
            group["lr"] = lr

    def _clip(self, grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
        """Bring the gradients to a norm of at most `max_norm`. Fused: not applied to the
        gradients but handed to the kernel as its gradient divisor (`grad_scale`), saving one
        read and write of every gradient; otherwise the gradients are scaled in place."""
        if max_norm == math.inf:
            return
        coef = clip_coefficient(total, max_norm)
        if self.fused:
            self.adamw.grad_scale = coef.reciprocal()
        else:
            torch._foreach_mul_(grads, coef)

    def step(self, skip: torch.Tensor | None = None) -> None:
        """`skip` (device bool): leave parameters and AdamW state untouched. With the fused
        kernel it is the kernel's `found_inf` — decided on the device, no host sync; the foreach
        path (CPU) reads it on the host."""
        if self.fused:
            self.adamw.found_inf = skip.float() if skip is not None else None
            self.adamw.step()
        elif skip is None or not bool(skip):
            self.adamw.step()
        self.adamw.grad_scale = self.adamw.found_inf = None  # consumed


class ReplicatedAdamW(_TorchAdamW):
    """torch AdamW with full optimizer state on every rank, plus the data-parallel gradient
    reduction (`GradReducer`, when dp > 1) and clipping: the same interface as the sharded
    `moetrain.parallel.dist_optim.DistributedAdamW`, so the trainer drives either one."""

    def __init__(self, model: nn.Module, state, cfg: OptimConfig):
        from moetrain.parallel.data_parallel import GradReducer, expert_param_ids

        self.model = model
        self.reducer = GradReducer(model, state) if state.dims.dp > 1 else None
        self.loss_scale = self.reducer.loss_scale if self.reducer is not None else 1.0
        """Scale every backward's loss by this (1/dp): the reduced sums are then the means."""
        self.ep_group = state.ep_group
        self.pp_group = state.pp_group
        expert_ids = expert_param_ids(model)
        self.expert_params = [p for p in model.parameters() if id(p) in expert_ids]
        self.dense_params = [p for p in model.parameters() if id(p) not in expert_ids]
        self.adamw = build_optimizer(model, cfg)
        self.fused = any(g.get("fused") for g in self.adamw.param_groups)

    def prepare(self, sync: bool, backward_passes: int = 1) -> None:
        if self.reducer is not None:
            self.reducer.prepare(sync, backward_passes)

    def finish(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping (device tensor); clips (see `_clip`)."""
        total = global_grad_norm(self.dense_params, self.expert_params, self.ep_group, self.pp_group)
        self._clip([p.grad for p in self.dense_params + self.expert_params if p.grad is not None], total, max_norm)
        return total

    def zero_grad(self) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()  # the reducer's buckets must stay the gradients' storage
        else:
            self.adamw.zero_grad(set_to_none=True)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.adamw.state.values() for t in s.values() if isinstance(t, torch.Tensor))

    def state_dict_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live AdamW state per parameter (created as zeros for a fresh optimizer, so a
        checkpoint can be loaded into it in place)."""
        from moetrain.model.transformer import canonical_name

        out = {}
        fused = any(g.get("fused") for g in self.adamw.param_groups)
        for name, p in self.model.named_parameters():
            if p not in self.adamw.state or not self.adamw.state[p]:
                self.adamw.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
            out[canonical_name(name)] = self.adamw.state[p]
        return out

    def load_state_dict_tensors(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        live = self.state_dict_tensors()
        for name, tensors in state.items():
            for key, value in tensors.items():
                if live[name][key] is not value:
                    live[name][key].copy_(value)


class FSDPAdamW(_TorchAdamW):
    """torch AdamW over the FSDP stack's sharded (DTensor) parameters: each rank updates and
    holds state for its shards only (optimizer memory ÷ dp). FSDP reduce-scatters the gradients
    and averages them over dp during backward, so there is no reducer here. The interface is
    `ReplicatedAdamW`'s, so the trainer drives either one."""

    loss_scale = 1.0
    """FSDP averages the gradients over dp itself: the losses need no extra scale."""

    def __init__(self, model: nn.Module, state, cfg: OptimConfig):
        self.model = model
        self.adamw = build_optimizer(model, cfg)
        self.fused = any(g.get("fused") for g in self.adamw.param_groups)

    def prepare(self, sync: bool, backward_passes: int = 1) -> None:
        """Gradient accumulation: FSDP keeps unsharded gradients and reduce-scatters them only in
        the last micro-batch's backward."""
        if hasattr(self.model, "set_requires_gradient_sync"):  # absent on one rank (not sharded)
            self.model.set_requires_gradient_sync(sync)

    def finish(self) -> None:
        """Nothing to wait for: FSDP finishes its reduce-scatters at the end of backward."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm over the gradient shards (get_total_norm reduces DTensor norms over the
        mesh), as a plain device tensor; clip with the same coefficient as `clip_grad_norm`."""
        from moetrain.parallel.fsdp import full_tensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        total = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params], 2.0))
        if self.fused or max_norm == math.inf:
            self._clip([p.grad for p in params], total, max_norm)
        else:  # DTensor gradients: torch's own helper scales them
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)

    def memory_bytes(self) -> int:
        """Bytes of AdamW state this rank holds (its shards)."""
        from moetrain.parallel.fsdp import is_sharded

        tensors = [t.to_local() if is_sharded(t) else t for s in self.adamw.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_dict_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-parameter FULL moments keyed by canonical name (the layout of the other
        optimizers, so checkpoints stay layout-free). Collective: the shards are all-gathered
        (briefly the unsharded moments, 8 bytes per parameter element)."""
        from moetrain.model.transformer import canonical_name
        from moetrain.parallel.fsdp import full_tensor, reshard

        reshard(self.model)  # the parameters must be the sharded ones AdamW holds state for
        out = {}
        for name, p in self.model.named_parameters():
            live = self._live_state(p)
            out[canonical_name(name)] = {
                "step": live["step"],
                "exp_avg": full_tensor(live["exp_avg"]),
                "exp_avg_sq": full_tensor(live["exp_avg_sq"]),
            }
        return out

    @torch.no_grad()
    def load_state_dict_tensors(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take full per-parameter moments (as `state_dict_tensors` gives them) and keep this
        rank's shards. No communication."""
        from moetrain.model.transformer import canonical_name
        from moetrain.parallel.fsdp import copy_shard, reshard

        reshard(self.model)
        for name, p in self.model.named_parameters():
            entry = state[canonical_name(name)]
            live = self._live_state(p)
            for key, value in entry.items():
                if live[key] is not value:
                    copy_shard(live[key], value)

    def _live_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's state of `p`, created as zeros for a fresh optimizer (so a checkpoint can be
        loaded into it in place)."""
        if p not in self.adamw.state or not self.adamw.state[p]:
            fused = any(g.get("fused") for g in self.adamw.param_groups)
            self.adamw.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
        return self.adamw.state[p]
