"""The run configuration: model + data + optimizer + schedule + trainer settings."""

from __future__ import annotations

import dataclasses
import enum

from moetrain.config import Config
from moetrain.data.config import DataConfig
from moetrain.errors import ConfigError
from moetrain.model.config import TransformerConfig
from moetrain.parallel.dims import ParallelConfig


class ScheduleKind(enum.StrEnum):
    cosine = "cosine"
    """Linear warmup, then cosine decay to min_lr_ratio × lr at the last step."""
    wsd = "wsd"
    """Warmup-stable-decay: linear warmup, constant, then linear decay over the last
    decay_fraction of the steps to min_lr_ratio × lr."""
    constant = "constant"
    """Linear warmup, then constant."""


class Precision(enum.StrEnum):
    auto = "auto"
    """bf16 compute with fp32 master weights on CUDA; fp32 on CPU."""
    fp32 = "fp32"
    bf16 = "bf16"
    """bf16 autocast for matmuls; parameters, gradients and AdamW state stay fp32."""


class Fp8(enum.StrEnum):
    none = "none"
    rowwise = "rowwise"
    """Expert grouped GEMMs and the attention / shared-expert / dense-MLP linears in float8_e4m3
    with one power-of-two scale per row (moetrain/model/fp8.py); the router, embedding and LM
    head stay in bf16. Needs a GPU of compute capability ≥ 8.9 (Hopper: H100, H200), or CPU."""
    mxfp8 = "mxfp8"
    """The same GEMMs with MXFP8 operands (blocks of 32 with a shared power-of-two scale, the
    format of Blackwell's tensor cores) for forward and input gradients. Products are computed
    from the dequantized operands on any device: MXFP8's numerics, not yet its speed
    (moetrain/model/fp8.py). Dims must be multiples of 32."""


class Recompute(enum.StrEnum):
    none = "none"
    full = "full"
    """Per-layer activation recompute: keep only each block's input, recompute the block
    during backward."""
    selective = "selective"
    """Keep what is expensive to recompute — the outputs of matrix products (linear layers,
    grouped expert GEMMs, attention) and of communication — and recompute the cheap element-wise
    work (norms, RoPE, the SwiGLU activation, routing scores, permutations) during backward."""


@dataclasses.dataclass(kw_only=True)
class OptimConfig(Config):
    lr: float = 3e-3
    """Peak learning rate."""
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices; never on norms, embeddings or biases."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr} must be positive.")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas} must be two numbers in [0, 1).")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.eps <= 0:
            raise ConfigError("optim.weight_decay and optim.grad_clip must be ≥ 0 and optim.eps > 0.")


@dataclasses.dataclass(kw_only=True)
class ScheduleConfig(Config):
    kind: ScheduleKind = ScheduleKind.cosine
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    decay_fraction: float = 0.2
    """wsd only: the share of steps spent decaying."""

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps={self.warmup_steps} must be ≥ 0.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"schedule.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1].")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"schedule.decay_fraction={self.decay_fraction} must lie in (0, 1].")


@dataclasses.dataclass(kw_only=True)
class TrainerConfig(Config):
    steps: int = 300
    """Optimizer steps."""
    global_batch_size: int = 32
    """Sequences per optimizer step, summed over data-parallel ranks."""
    micro_batch_size: int = 32
    """Sequences per forward/backward, summed over data-parallel ranks; gradient accumulation
    steps = global_batch_size / micro_batch_size."""
    seed: int = 0
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (cuda when available)."""
    precision: Precision = Precision.auto
    run_dir: str = "runs/default"
    log_every: int = 10
    """Write metrics.jsonl (and sync the device) every N steps; the first and last steps always."""
    eval_every: int = 100
    """Validation loss every N steps (and at the end); 0 = never."""
    eval_batches: int = 8
    """Validation micro-batches per evaluation."""
    save_every: int = 100
    """Checkpoint every N steps (and at the end); 0 = only at the end."""
    save_final: bool = True
    """Checkpoint after the last step (turn off for benchmark runs)."""
    async_checkpoint: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint async_save): the
    tensors are copied to host memory at the save step and training goes on; the checkpoint
    appears, complete, when the write has finished (checked at the next save and at the end)."""
    keep_last: int = 3
    """Checkpoints to keep; older ones are deleted. 0 keeps all."""
    init_from: str | None = None
    """Start from the model weights of this checkpoint (a run directory, a step-N directory, or
    what `moetrain import-hf` wrote), with a fresh optimizer at step 0. Not used when --resume
    finds a checkpoint of this run (that continues the run itself)."""
    fp8: Fp8 = Fp8.none
    """FP8 matrix products (see Fp8)."""
    recompute: Recompute = Recompute.none
    recompute_every: int = 1
    """With recompute: only every Nth block (blocks 0, N, 2N, …) recomputes; the others keep
    their activations (less recompute, more memory)."""
    compile: bool = False
    """torch.compile each block."""
    tensorboard: bool = True
    """Also write TensorBoard events to RUN_DIR/tb (when the tensorboard package is installed)."""
    wandb: bool = False
    """Also log the metrics to Weights & Biases (needs pip install 'moetrain[wandb]'); wandb's own
    environment applies: WANDB_MODE=offline or disabled, WANDB_API_KEY, WANDB_ENTITY, WANDB_DIR
    (default: RUN_DIR). Rank 0 logs; --resume continues the same W&B run."""
    wandb_project: str = "moetrain"
    """The W&B project of the run."""
    wandb_name: str | None = None
    """The W&B run name; default: the run directory's name."""
    plot: bool = True
    """Write RUN_DIR/loss.png at the end (when matplotlib is installed)."""
    skip_spike_sigma: float = 6.0
    """Skip an update whose loss or gradient norm exceeds the mean of the last `skip_window`
    accepted steps by this many standard deviations (0: only non-finite values are skipped)."""
    skip_window: int = 128
    """Accepted steps the spike statistics cover (detection starts after half of them)."""
    max_consecutive_skips: int = 10
    """Stop with an error after this many skipped updates in a row (0: never)."""
    profile: bool = False
    """Record a window of steps with torch.profiler (and, on CUDA, a memory snapshot) into
    RUN_DIR/profile (moetrain/train/profiling.py)."""
    profile_wait: int = 5
    """Steps before the profiled window (compilation and warm-up stay outside it)."""
    profile_steps: int = 3
    """Steps in the profiled window."""

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def validate(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size", "log_every", "eval_batches", "recompute_every", "skip_window"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be a positive integer.")
        for name in ("eval_every", "save_every", "keep_last", "profile_wait", "skip_spike_sigma", "max_consecutive_skips"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be ≥ 0.")
        if self.profile_steps <= 0:
            raise ConfigError(f"train.profile_steps={self.profile_steps} must be a positive integer.")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}: gradient accumulation needs a "
                "whole number of micro-batches per step."
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device={self.device!r} must be cpu, cuda, cuda:N or auto.")


@dataclasses.dataclass(kw_only=True)
class RunConfig(Config):
    """Everything one training run needs; `moetrain config` prints it, RUN_DIR/config.yaml keeps it."""

    model: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    train: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
