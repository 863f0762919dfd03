"""The optimizer interface every layout's optimizer implements, and what the ones built on a torch-style
optimizer share.

Per optimizer step the engine (src/moetrain/train/engine.py) calls, in this order:

    reduction.prepare(sync)  before each micro-batch's backward (sync=True for the last one), or
                             once with backward_passes=n before a pipeline step's n backward passes
    reduction.finish()       wait for the data-parallel gradient reduction
    clip_grad_norm(max)      the global gradient norm (device tensor), clipped to `max`
    set_lr(lr); step(skip)   the update (skip: a device bool, the step guard's decision), then the
                             step post-hooks (the aux-free router bias)
    zero_grad()

`reduction` is the optimizer's gradient reduction (`GradReduction`, src/moetrain/optim/grad_reducer.py),
which scales the losses (`loss_scale`) and reduces the gradients the optimizer then reads. Nothing
in that sequence reads a device value on the host where the fused kernels run (CUDA).
Checkpoints see every optimizer through `checkpoint_tensors` / `checkpoint_masters` (the part of
each parameter's state and fp32 master this rank holds, which DCP saves from and loads into in
place) and `checkpoint_loaded`. `memory_bytes()` and `grad_bytes()` (the bytes of the optimizer
state and of the gradients this rank holds) are measurements for tests, which the loop does not use.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

import moetrain.cpu_math  # noqa: F401  (the CPU's vector math set up before the first update: src/moetrain/cpu_math.py)
from moetrain.optim.adamw import AdamW
from moetrain.optim.clip import clip_coefficient
from moetrain.optim.grad_reducer import GradReduction
from moetrain.optim.rule import RuleOptimizer, local_tensor

if TYPE_CHECKING:
    from moetrain.optim.config import OptimConfig
    from moetrain.optim.grad_store import GradStore
    from moetrain.optim.muon import Muon

StepHook = Callable[[torch.Tensor | None], None]
"""Called after every `step(skip)` with the same `skip`."""


@dataclasses.dataclass(frozen=True)
class FlatShard:
    """Elements [start, start + n) in row-major order of a checkpoint entry of `shape`: the part
    of it this rank holds, as live 1-D tensors of n elements that a checkpoint saves from and loads
    into in place (src/moetrain/train/dcp_shards.py) — `values`, or, for an fp32 master that
    optim.bf16_weights splits (src/moetrain/optim/split_master.py), its `hi` (the bf16 weight) and `lo`
    (the int16 remainder) halves. n may be 0: the rank holds none of the entry."""

    shape: tuple[int, ...]
    start: int
    values: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    replicated: bool = False
    """Every rank that holds the parameter holds this same range (the replicated optimizer's whole
    masters), so one of them writes it to a checkpoint; False: the ranks of its group hold
    disjoint ranges (sharded state), each writing its own."""

    def __post_init__(self):
        parts = [t for t in (self.values, self.hi, self.lo) if t is not None]
        assert (self.values is None) == (self.hi is not None) == (self.lo is not None), "values, or hi and lo"
        assert all(t.ndim == 1 and t.numel() == parts[0].numel() for t in parts), [t.shape for t in parts]
        assert 0 <= self.start and self.start + parts[0].numel() <= math.prod(self.shape), (self.start, self.shape)

    @property
    def numel(self) -> int:
        return (self.values if self.values is not None else self.hi).numel()

    @property
    def dtype(self) -> torch.dtype:
        """The entry's dtype: the values', or fp32 for a split master."""
        return self.values.dtype if self.values is not None else torch.float32

    def window(self, begin: int, end: int, shape: tuple[int, ...]) -> FlatShard:
        """Elements [begin, end) of the entry, intersected with this shard, as a shard of an entry
        of `shape` (end − begin elements): one expert's matrix of a stacked expert tensor."""
        a, b = max(begin, self.start), min(end, self.start + self.numel)
        cut = slice(a - self.start, max(a, b) - self.start)
        parts = {k: getattr(self, k)[cut] for k in ("values", "hi", "lo") if getattr(self, k) is not None}
        return FlatShard(tuple(shape), a - begin if a < b else 0, **parts, replicated=self.replicated)


@runtime_checkable
class Optimizer(Protocol):
    """What the engine and checkpoints use of an optimizer (src/moetrain/optim/*.py)."""

    reduction: GradReduction
    """The data-parallel reduction of the gradients this optimizer updates with."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of the gradient before clipping (device tensor, no host sync);
        clips to `max_norm` (math.inf: no clipping)."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def step(self, skip: torch.Tensor | None = None) -> None:
        """The update; `skip` (device bool, equal on all ranks): leave parameters and state
        untouched. Then the step post-hooks, with the same `skip`."""
        ...

    def zero_grad(self) -> None: ...

    def register_step_post_hook(self, hook: StepHook) -> None:
        """Run `hook(skip)` after every step (state updated at optimizer time: the router bias)."""
        ...

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor | FlatShard]]:
        """Per parameter (canonical name): the update rule's state (AdamW's "exp_avg",
        "exp_avg_sq"; Lion's "lion_momentum") and a 0-d float32 "step" (a Muon matrix: its
        "momentum" alone), as the part of it this rank holds, with no copy and no communication:
        the live tensors where it holds a parameter's state whole, `FlatShard`s of the ranges it
        holds (the sharded optimizer). A checkpoint saves from them and loads into them in place;
        then `checkpoint_loaded`."""
        ...

    def checkpoint_masters(self) -> dict[str, FlatShard]:
        """Canonical name → this rank's part (possibly empty) of the fp32 master of every
        parameter the model holds in lower precision (optim.bf16_weights), as a split `FlatShard`
        over the live halves: what a checkpoint saves in the parameter's place and loads into in
        place. {} without such parameters."""
        ...

    def checkpoint_loaded(self) -> None:
        """A checkpoint was loaded into `checkpoint_tensors()` and `checkpoint_masters()` (or
        into the model's weights and the masters only): take the step count and refresh what is
        derived from the weights. Collective for the sharded optimizer."""
        ...

    def grad_parts(self) -> list[tuple[str, torch.Tensor, bool]]:
        """After the reduction, before clipping: (canonical name, this rank's part of that
        parameter's reduced gradient, whether this rank counts it) for every parameter with a
        gradient. Summed over the ranks that count, Σ‖part‖² gives every element once: a part held
        alike by several ranks (replicas) counts on one of them (`moetrain check-layout`)."""
        ...


class StepHooks(abc.ABC):
    """What every optimizer shares: `register_step_post_hook`, and `step(skip)` = `_update(skip)`
    followed by the hooks (each optimizer implements `_update`); no fp32 masters apart from the
    parameters unless an optimizer says otherwise."""

    fused: bool = False
    """The update runs on the device (torch's fused AdamW kernel, or our rules' kernels): the
    clipping factor and the skip decision go into it as device tensors."""
    low_grads: bool = False
    """Gradients stored in bf16 (optim.grad_dtype): the clipping factor goes into the update,
    multiplied in fp32, not into the stored gradients, which scaling in place would round a
    second time."""
    _clip_coef: torch.Tensor | None = None
    """The clipping factor `_clip` left for this step's update (fused, or bf16 gradients)."""

    def _clip(self, grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> torch.Tensor | None:
        """Bring the gradients to a norm of at most `max_norm`; return the factor (None: no
        clipping). Fused, or bf16 gradients (`low_grads`): not applied to the gradients but
        handed to the update (saving one read and write of every gradient, or a rounding);
        otherwise the gradients are scaled in place."""
        if max_norm == math.inf:
            return None
        coef = clip_coefficient(total, max_norm)
        if self.fused or self.low_grads:
            self._clip_coef = coef
        else:
            torch._foreach_mul_(grads, coef)
        return coef

    def checkpoint_masters(self) -> dict[str, FlatShard]:
        return {}

    def register_step_post_hook(self, hook: StepHook) -> None:
        self.__dict__.setdefault("_step_post_hooks", []).append(hook)

    def step(self, skip: torch.Tensor | None = None) -> None:
        self._update(skip)
        for hook in self.__dict__.get("_step_post_hooks", ()):
            hook(skip)

    @abc.abstractmethod
    def _update(self, skip: torch.Tensor | None) -> None:
        """The update itself (`skip`: as for `step`)."""


def param_groups(model: nn.Module, weight_decay: float, exclude: set[int] = frozenset()) -> list[dict]:
    """Decay matrices only: norms, biases and embeddings (1-D or nn.Embedding) get no decay.
    Parameters whose id is in `exclude` are left out (another optimizer updates them)."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in exclude:
            continue
        (no_decay if p.ndim < 2 or id(p) in embedding_params else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def use_fused(cfg: OptimConfig, device: torch.device) -> bool:
    """optim.fused, or by default: fused on CUDA."""
    return cfg.fused if cfg.fused is not None else device.type == "cuda"


def build_torch_style(
    model: nn.Module, cfg: OptimConfig, exclude: set[int] = frozenset(), grad_of: Callable | None = None
) -> torch.optim.AdamW | RuleOptimizer:
    """An optimizer of `cfg.rule()` over `model`'s parameter groups (less `exclude`, as in
    `param_groups`), on the device where `use_fused`: torch's AdamW (fused: one kernel for all
    parameters); or, for another rule, optim.moments_dtype=bf16, or gradients kept off `.grad`
    (`grad_of`: a parameter's gradient, optim.grad_dtype=bf16), our `RuleOptimizer` in its place
    (same interface)."""
    device = next(model.parameters()).device
    fused = use_fused(cfg, device)
    rule = cfg.rule()
    if not isinstance(rule, AdamW) or cfg.moments_dtype.dtype != torch.float32 or grad_of is not None:
        return RuleOptimizer(
            rule,
            param_groups(model, cfg.weight_decay, exclude),
            lr=cfg.lr,
            moments_dtype=cfg.moments_dtype.dtype,
            fused=fused and device.type == "cuda",  # AdamW's Triton kernel
            grad_of=grad_of,
        )
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay, exclude),
        lr=cfg.lr,
        betas=rule.betas,
        eps=rule.eps,
        fused=True if fused else None,
    )


class TorchAdamW(StepHooks):
    """What the optimizers built on `build_torch_style` (`self.adamw`: torch's AdamW, or a
    `RuleOptimizer`) share, with `muon` stepping the matrices `muon_named` (optim.name=muon)."""

    adamw: torch.optim.AdamW | RuleOptimizer
    muon: Muon
    muon_named: list[tuple[str, nn.Parameter]]
    grads: GradStore | None = None
    """Where the bf16 gradients are kept off `.grad` (optim.grad_dtype); None: `.grad`."""

    def checkpoint_loaded(self) -> None:
        """Nothing to do: the checkpoint was loaded into the live parameters and AdamW state,
        step counts included."""

    def set_lr(self, lr: float) -> None:
        """Every group's learning rate: a number, or the device tensor of `put_lr_on_device`
        filled (no host sync)."""
        current = self.adamw.param_groups[0]["lr"]
        if isinstance(current, torch.Tensor):
            current.fill_(lr)
            return
        for group in self.adamw.param_groups:
            group["lr"] = lr

    def put_lr_on_device(self) -> None:
        """Keep the learning rate in one 0-d fp32 tensor on the parameters' device, shared by
        every group and filled by `set_lr`: what a CUDA graph of the update reads at each replay
        (src/moetrain/train/cuda_graphs.py). torch's AdamW groups also say capturable (it refuses a
        capture otherwise). On the device path (`fused`) only: the other reads numbers."""
        assert self.fused, "a learning rate on the device needs the fused update"
        groups = self.adamw.param_groups
        device = next(p.device for g in groups for p in g["params"])
        lr = torch.full((), float(groups[0]["lr"]), dtype=torch.float32, device=device)
        for group in groups:
            group["lr"] = lr
            if isinstance(self.adamw, torch.optim.AdamW) and device.type == "cuda":
                group["capturable"] = True

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """`p`'s gradient: its bf16 one in `grads`, else `.grad`."""
        grad = self.grads.grad(p) if self.grads is not None else None
        return grad if grad is not None else p.grad

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)
        if self.grads is not None:
            self.grads.zero_grad()
        for _, p in self.muon_named:
            p.grad = None

    def memory_bytes(self) -> int:
        """Bytes of the update rule's and Muon's state this rank holds (its shards)."""
        state = [local_tensor(t) for s in self.adamw.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return self.muon.memory_bytes() + sum(t.numel() * t.element_size() for t in state)

    def _update(self, skip: torch.Tensor | None) -> None:
        """Fused: `skip` and the clipping factor go into the kernels on the device (no host
        sync); the other paths (CPU) read `skip` on the host. Then Muon's matrices, with the
        clipping factor where the gradients were not scaled in place."""
        coef, self._clip_coef = self._clip_coef, None
        if isinstance(self.adamw, RuleOptimizer):
            self.adamw.step(grad_coef=coef, skip=skip)
        elif self.fused:
            # torch.optim.AdamW.step takes the clipping factor and the skip decision only as the
            # attributes torch.amp.GradScaler sets on an optimizer before its step: `grad_scale`
            # (the kernel divides the gradients by it) and `found_inf` (nonzero: no update, step
            # counts unchanged), read on the device by the fused kernel. Set here for this step
            # alone; nowhere else are they set.
            self.adamw.grad_scale = coef.reciprocal() if coef is not None else None
            self.adamw.found_inf = skip.float() if skip is not None else None
            self.adamw.step()
            del self.adamw.grad_scale, self.adamw.found_inf
        elif skip is None or not bool(skip):
            self.adamw.step()
        grads = [self._grad_of(p) for _, p in self.muon_named]
        lr = self.adamw.param_groups[0]["lr"]
        self.muon.step([None if g is None else local_tensor(g) for g in grads], lr, coef, skip)

    def _live_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's state of `p`, created as zeros for a fresh optimizer (so a checkpoint can be
        loaded into it in place)."""
        if p not in self.adamw.state or not self.adamw.state[p]:
            self.adamw.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if self.fused else "cpu"),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
        return self.adamw.state[p]
