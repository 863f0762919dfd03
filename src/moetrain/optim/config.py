"""Configuration of the optimizer (`optim.*`) and of the learning-rate schedule (`schedule.*`).

`OptimConfig.build` picks the optimizer the parallel layout needs (src/moetrain/optim/__init__.py
lists them) and builds it over a materialized, initialized model.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from moetrain.config import Config, in_range, non_negative, positive
from moetrain.errors import ConfigError
from moetrain.parallel.config import ParallelConfig, Stack

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moetrain.optim.base import Optimizer
    from moetrain.optim.rule import UpdateRule
    from moetrain.parallel.dims import ParallelState


class ScheduleKind(enum.StrEnum):
    cosine = "cosine"
    wsd = "wsd"
    constant = "constant"


class OptimizerName(enum.StrEnum):
    adamw = "adamw"
    muon = "muon"
    lion = "lion"

    @property
    def state(self) -> tuple[str, ...]:
        """A matrix's optimizer state entries under this rule (checkpoint keys optim.NAME.STATE)."""
        return {
            "adamw": ("step", "exp_avg", "exp_avg_sq"),
            "muon": ("momentum",),
            "lion": ("step", "lion_momentum"),
        }[self.value]


class StateDtype(enum.StrEnum):
    """The dtype of AdamW's moments (optim.moments_dtype) or of the kept gradients (optim.grad_dtype)."""

    fp32 = "fp32"
    bf16 = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16 if self == StateDtype.bf16 else torch.float32


@dataclasses.dataclass(kw_only=True)
class OptimConfig(Config):
    name: OptimizerName = OptimizerName.adamw
    """adamw; muon: the blocks' matrices orthogonalized (Newton–Schulz on the Nesterov momentum,
    scaled to AdamW's update RMS so that lr and weight_decay serve both; src/moetrain/optim/muon.py),
    the rest AdamW, not with optim.bf16_weights; or lion: every parameter by Lion (the sign of an
    interpolation of momentum and gradient, one moment; usually a 3–10× smaller lr and 3–10× larger
    weight_decay than AdamW's; src/moetrain/optim/lion.py). Each works with every optimizer layout
    (replicated, parallel.shard_optimizer, the fsdp stack) and with expert parallelism."""
    lr: float = positive(3e-3)
    """Peak learning rate (Muon's matrices and AdamW's or Lion's parameters alike)."""
    betas: list[float] = in_range(lo=0, hi=1, hi_open=True, default_factory=lambda: [0.9, 0.95])
    """AdamW's decay rates of the first and second moments."""
    eps: float = positive(1e-8)
    """AdamW's epsilon, added to the square root of the second moment."""
    weight_decay: float = non_negative(0.1)
    """Decoupled weight decay on matrices; never on norms, embeddings or biases."""
    grad_clip: float = non_negative(1.0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    fused: bool | None = None
    """torch's fused AdamW kernel: the clipping factor and the skip decision go into the kernel as
    device tensors (no extra pass, no host sync). None = on CUDA (the foreach kernels on CPU)."""
    moments_dtype: StateDtype = StateDtype.fp32
    """AdamW's two moments in this dtype. bf16: half the optimizer state, updated in fp32 and
    rounded to nearest each step, for every optimizer (our AdamW kernel, src/moetrain/optim/adamw.py,
    instead of torch's)."""
    grad_dtype: StateDtype = StateDtype.fp32
    """The gradients kept between micro-batches and reduced over the data-parallel ranks in this
    dtype, for every optimizer. bf16: 2 bytes per element instead of 4 (on the fsdp stack its
    unsharded gradients and its reduce-scatter; the reduced shards stay fp32). Each micro-batch's
    gradient is added in fp32 and rounded to nearest once, the reduction sums in bf16, and the
    clipping norm and the update compute in fp32 from the bf16 values."""
    lion_betas: list[float] = in_range(lo=0, hi=1, hi_open=True, default_factory=lambda: [0.9, 0.99])
    """optim.name=lion: β1, the momentum's weight in the update's sign, and β2, its decay rate."""
    muon_momentum: float = in_range(0.95, lo=0, hi=1, hi_open=True)
    """optim.name=muon: the momentum β of the matrices' Nesterov momentum."""
    muon_ns_steps: int = positive(5, at_most=100)
    """optim.name=muon: Newton–Schulz iterations per matrix and step."""
    bf16_weights: bool | None = None
    """Store the matrices (attention, MLPs, experts, LM head) in bf16, their exact fp32 masters
    split into that bf16 value and a 16-bit remainder held by the optimizer
    (src/moetrain/optim/split_master.py): no weight casts in forward, backward or recompute, and no
    cast copies kept for backward, at the same 16 bytes per parameter. Needs bf16 precision and
    the ddp stack; with parallel.shard_optimizer the remainders are sharded with the moments (the
    bf16 weights stay whole). None = on for bf16 compute on CUDA with the replicated optimizer and AdamW
    (`resolved_bf16_weights`); with the sharded optimizer, measured by rehearsal only
    (docs/benchmarks.md), it stays opt-in."""

    def validate(self) -> None:
        for key in ("betas", "lion_betas"):
            if len(getattr(self, key)) != 2:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be two numbers (β1, β2), each in [0, 1).")
        if self.name == OptimizerName.muon and self.bf16_weights:
            raise ConfigError(
                "optim.name=muon updates fp32 matrices; optim.bf16_weights=true splits them into bf16 halves that "
                "only the AdamW update steps: set optim.bf16_weights=false (or leave it unset), or optim.name=adamw."
            )

    def resolved_bf16_weights(self, parallel: ParallelConfig, amp_dtype: torch.dtype | None, device) -> bool:
        """optim.bf16_weights, or by default: on for bf16 compute (`amp_dtype`) on CUDA with the
        replicated optimizer (RunConfig.validate refuses an explicit true on the fsdp stack)."""
        import torch

        if self.bf16_weights is not None:
            return self.bf16_weights
        if self.name != OptimizerName.adamw:
            return False
        replicated = parallel.stack == Stack.ddp and not parallel.shard_optimizer
        return replicated and amp_dtype == torch.bfloat16 and torch.device(device).type == "cuda"

    def rule(self) -> UpdateRule:
        """The element-wise update (src/moetrain/optim/rule.py): Lion's with optim.name=lion, else
        AdamW's (with Muon: of the parameters Muon does not take)."""
        from moetrain.optim.adamw import AdamW
        from moetrain.optim.lion import Lion

        if self.name == OptimizerName.lion:
            return Lion(tuple(self.lion_betas))
        if self.name in (OptimizerName.adamw, OptimizerName.muon):
            return AdamW(tuple(self.betas), self.eps)
        raise ConfigError(f"optim.name={self.name!r} is not one of {', '.join(OptimizerName)}.")

    def build(
        self, model: nn.Module, state: ParallelState, parallel: ParallelConfig, *, bf16_weights: bool = False
    ) -> Optimizer:
        """The optimizer of this layout over `model` (materialized and initialized; with
        `bf16_weights`, over bf16 matrices whose fp32 masters it keeps); each owns the
        data-parallel gradient reduction."""
        from moetrain.optim.fsdp import FSDPAdamW
        from moetrain.optim.replicated import ReplicatedAdamW
        from moetrain.optim.sharded import ShardedAdamW

        if parallel.stack == Stack.fsdp:
            return FSDPAdamW(model, state, self)
        if parallel.shard_optimizer:
            return ShardedAdamW(model, state, self, bf16_weights=bf16_weights)
        return ReplicatedAdamW(model, state, self, bf16_weights=bf16_weights)


@dataclasses.dataclass(kw_only=True)
class ScheduleConfig(Config):
    kind: ScheduleKind = ScheduleKind.cosine
    """Shape of the learning rate after the linear warm-up: cosine decay to min_lr_ratio × lr at the
    last step, wsd (warmup-stable-decay: constant, then a linear decay to min_lr_ratio × lr over the
    last decay_fraction of the steps), or constant."""
    warmup_steps: int = non_negative(30, at_most=10**9)
    """Steps of linear warm-up from 0 to the peak learning rate."""
    min_lr_ratio: float = in_range(0.1, lo=0, hi=1)
    """Final learning rate as a fraction of the peak."""
    decay_fraction: float = in_range(0.2, lo=0, hi=1, lo_open=True)
    """wsd only: the share of steps spent decaying."""
