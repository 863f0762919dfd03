"""The run configuration, and `RunConfig.validate`: the one place for every rule that relates two
sections (or a section and the world size or the device), after each section's own `validate()`.
The trainer, `bench` and the planner call it, then the sections' builders: nothing else checks a run.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from moetrain.config import Config, non_negative, positive, validate_tree
from moetrain.data.config import DataConfig
from moetrain.errors import ConfigError
from moetrain.model.config import MAX_LAYERS, Fp8, TransformerConfig
from moetrain.model.counting import block_matrices
from moetrain.model.fp8_choice import Fp8Select, choose_head
from moetrain.optim.config import OptimConfig, OptimizerName, ScheduleConfig
from moetrain.parallel.config import (
    AUTO_OVERLAP_CHUNKS,
    DispatcherKind,
    ParallelConfig,
    PipelineSchedule,
    Recompute,
    Stack,
)

if TYPE_CHECKING:
    import torch

    from moetrain.parallel.dims import ParallelDims


class Extend(enum.StrEnum):
    """What the learning-rate schedule does when a run resumes with another `train.steps`."""

    keep = "keep"
    """The schedule stays the one planned over the first train.steps; steps past its end run at
    the rate of its last step (decayed, or the warm-up's last if it ended inside it; no jump)."""
    replan = "replan"
    """The schedule is planned again over the new train.steps, as if the run had asked for them
    from the start: the rate at the resumed step can jump (re-warming a decayed run)."""


class Precision(enum.StrEnum):
    auto = "auto"
    """bf16 compute with fp32 master weights on CUDA; fp32 on CPU."""
    fp32 = "fp32"
    bf16 = "bf16"
    """bf16 autocast for matmuls; parameters, gradients and AdamW state stay fp32."""


class CudaGraphs(enum.StrEnum):
    """What of a training step is replayed from a CUDA graph (src/moetrain/train/cuda_graphs.py)."""

    off = "off"
    """Every kernel launched from Python, one by one."""
    step = "step"
    """The whole training step captured once after a few eager steps and replayed: one launch a
    step. One GPU, the ddp stack's replicated AdamW."""
    auto = "auto"
    """`step` where the device and layout allow it and its first replays measure faster, else `off`."""


MAX_STEPS = 10**9
"""The most steps (and step intervals) a run may ask for: 10^4 × a trillion-parameter run's."""
MAX_BATCH = 10**8
"""The most sequences a (micro-)batch may hold: 10^4 × the largest preset's."""

DEFAULT_LOSS_CHUNK_TOKENS = 4096
"""`compute.loss_chunk_tokens` on CUDA when not set."""


@dataclasses.dataclass(kw_only=True)
class TrainerConfig(Config):
    """The loop: how many steps of how large a batch, where the run writes, how often it logs and evaluates."""

    steps: int = positive(300, at_most=MAX_STEPS)
    """Optimizer steps."""
    extend: Extend = Extend.keep
    """A run resumed with another train.steps: keep the schedule it planned (steps past its end
    at the final rate) or replan it over the new count (the rate may jump). The resume says
    which, with the rates."""
    global_batch_size: int = positive(32, at_most=MAX_BATCH)
    """Sequences per optimizer step, summed over data-parallel ranks."""
    micro_batch_size: int = positive(32, at_most=MAX_BATCH)
    """Sequences per forward/backward, summed over data-parallel ranks; gradient accumulation
    steps = global_batch_size / micro_batch_size."""
    seed: int = non_negative(0, at_most=2**62)
    """Seed of the initialization, the data order and random routing."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (cuda when available)."""
    run_dir: str | None = None
    """Where config.yaml, metrics.jsonl, checkpoints/ and the plots go (--run-dir). None: runs/NAME
    after the preset or YAML file, or one past the newest runs/NAME-N that holds a run (with
    --resume, that newest; src/moetrain/train/run_dir.py). The start-up header prints the one chosen."""
    log_every: int = positive(10, at_most=MAX_STEPS)
    """Write metrics.jsonl (and sync the device) every N steps; the first and last steps always."""
    eval_every: int = non_negative(100, at_most=MAX_STEPS)
    """Validation loss every N steps (and at the end); 0 = never."""
    eval_tokens: int = positive(65_536, at_most=10**12)
    """Validation tokens per evaluation: the first eval_tokens // data.seq_len sequences of the
    validation data (at least one; all of it when it holds fewer), the loss averaged per token:
    the same set whatever the micro-batch and the layout, so validation curves compare."""

    def eval_sequences(self, seq_len: int) -> int:
        """Validation sequences per evaluation (train.eval_tokens in whole sequences, ≥ 1)."""
        return max(1, self.eval_tokens // seq_len)

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def validate(self) -> None:
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}: gradient accumulation needs a "
                "whole number of micro-batches per step."
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device={self.device!r} must be cpu, cuda, cuda:N or auto.")
        if self.run_dir is not None and not self.run_dir.strip():
            raise ConfigError(
                f"train.run_dir (--run-dir) is {self.run_dir!r}, which names no directory: name one (e.g. "
                "--run-dir runs/my-run), or leave it out for runs/NAME."
            )


@dataclasses.dataclass(kw_only=True)
class PrecisionConfig(Config):
    """The number formats of the compute: bf16 or fp32, and FP8 matrix products."""

    dtype: Precision = Precision.auto
    """fp32, bf16 (autocast, or bf16 weights with optim.bf16_weights) or auto (bf16 on CUDA,
    fp32 on CPU)."""
    fp8: Fp8 = Fp8.none
    """FP8 matrix products: rowwise (Hopper's scaled FP8 kernels), or mxfp8, experimental: MXFP8's
    numerics with emulated products, for loss-curve studies, not speed (see Fp8)."""
    fp8_select: Fp8Select = Fp8Select.auto
    """Which products precision.fp8=rowwise turns to FP8: auto, those whose shape is measured to repay
    it (src/moetrain/model/fp8_choice.py; the start-up line names them), or all of them."""
    fp8_lm_head: bool | None = None
    """With precision.fp8=rowwise, the LM head's logits and their input gradient as row-wise FP8
    products too (its weight gradient stays bf16, summed in fp32; src/moetrain/model/loss.py).
    None: where precision.fp8_select takes it, as it would a block's product of that shape (auto: at
    least 0.8 TFLOP a call, as every bench preset's head is; all: always) and the vocabulary is a
    multiple of 16 (`RunConfig.fp8_lm_head`); docs/benchmarks.md, "FP8"."""
    fp8_fast_accum_backward: bool | None = None
    """With precision.fp8=rowwise, the backward FP8 products (input and weight gradients) with
    Hopper's fast accumulation too, as the forward ones always are (src/moetrain/model/fp8.py).
    None: on (docs/benchmarks.md, "FP8")."""

    def validate(self) -> None:
        for key in ("fp8_lm_head", "fp8_fast_accum_backward"):
            if getattr(self, key) is True and self.fp8 != Fp8.rowwise:
                raise ConfigError(
                    f"precision.{key}=true is a setting of row-wise FP8, but precision.fp8={self.fp8}: set "
                    f"precision.fp8=rowwise, or precision.{key}=false."
                )


@dataclasses.dataclass(kw_only=True)
class ComputeConfig(Config):
    """How a step is computed, not what: compiled blocks, CUDA graphs, activation recompute, the
    chunked loss, deferred expert weight gradients."""

    compile: bool = False
    """torch.compile each block."""
    cuda_graphs: CudaGraphs = CudaGraphs.auto
    """auto (the default), off or step. step: the whole training step replayed from one CUDA graph,
    captured after 3 eager steps (src/moetrain/train/cuda_graphs.py); it needs one CUDA device, the
    ddp stack without parallel.shard_optimizer, optim.name=adamw, optim.fused not false and
    compute.recompute=none. A routing switch or a loaded checkpoint makes the next steps eager and
    the graph is captured again; a step that cannot be captured runs eagerly, said once.
    peak_mem_gib counts the graph's memory. auto: step where all of that holds and logging.profile
    is off (a profile names the eager step's kernels), else off, never refused; the graph then
    stays only where its first 2 replays take the device at least 3% less time than the eager
    steps (docs/benchmarks.md, "CUDA graphs"). The start-up header says which, and why."""
    recompute: Recompute = Recompute.none
    """Activation recompute: none, full (keep only each block's input) or selective (also keep
    the matrix products' and collectives' outputs)."""
    recompute_every: int = positive(1, at_most=MAX_LAYERS)
    """With recompute: only every Nth block (blocks 0, N, 2N, …) recomputes; the others keep
    their activations (less recompute, more memory)."""
    loss_chunk_tokens: int | None = non_negative(None, at_most=2**31)
    """The LM loss over chunks of this many tokens, so that only one chunk's logits exist at a
    time (src/moetrain/model/loss.py); 0 = the plain path (logits of the whole micro-batch). None =
    4096 on CUDA, 0 on CPU. Pipeline stages use the plain path."""
    defer_expert_weight_grad: bool = False
    """With gradient accumulation, each expert layer's weight gradients computed once per step, in
    its last backward, over every micro-batch's rows (one grouped GEMM whose fp32 accumulator sums
    the micro-batches) instead of once per micro-batch. Costs memory: each MoE layer keeps its
    experts' inputs and output gradients (bf16) of every micro-batch but the last, which `moetrain
    plan` counts (src/moetrain/model/expert_grads.py). Pays with many small experts, not few large
    ones (docs/benchmarks.md, "The expert sweep"). Row-wise FP8 and bf16 experts; not mxfp8. On the
    fsdp stack over several ranks, with optim.grad_dtype the compute's dtype. Does nothing with one
    micro-batch per step."""

    def resolved_loss_chunk_tokens(self, device_type: str) -> int:
        """compute.loss_chunk_tokens on this device (its default when None)."""
        if self.loss_chunk_tokens is not None:
            return self.loss_chunk_tokens
        return DEFAULT_LOSS_CHUNK_TOKENS if device_type == "cuda" else 0


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig(Config):
    """When checkpoints are written and kept, and the weights a run starts from."""

    save_every: int = non_negative(100, at_most=MAX_STEPS)
    """Checkpoint every N steps (and at the end); 0 = only at the end."""
    save_final: bool = True
    """Checkpoint after the last step (turn off for benchmark runs)."""
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint async_save): the
    tensors are copied to host memory at the save step and training goes on; the checkpoint
    appears, complete, when the write has finished (checked at the next save and at the end)."""
    keep_last: int = non_negative(3, at_most=MAX_STEPS)
    """Checkpoints to keep; older ones are deleted. 0 keeps all."""
    init_from: str | None = None
    """Start from the model weights of this checkpoint (a run directory, a step-N directory, or
    what `moetrain import-hf` wrote), with a fresh optimizer at step 0; its tensors this model
    lacks are left unread, and the start-up says how many. Not used when --resume finds a
    checkpoint of this run (that continues the run itself)."""

    def validate(self) -> None:
        if self.init_from is not None and not self.init_from.strip():
            raise ConfigError(
                f"checkpoint.init_from is {self.init_from!r}, which names no checkpoint: name a run directory or a "
                "step-N directory, or leave it out to start from fresh weights."
            )


@dataclasses.dataclass(kw_only=True)
class LoggingConfig(Config):
    """Where the metrics go besides metrics.jsonl (TensorBoard, W&B, a plot), and the profiler."""

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
    profile: bool = False
    """Record a window of steps with torch.profiler (and, on CUDA, a memory snapshot) into
    RUN_DIR/profile (src/moetrain/train/profiling.py)."""
    profile_wait: int = non_negative(5, at_most=MAX_STEPS)
    """Steps before the profiled window (compilation and warm-up stay outside it)."""
    profile_steps: int = positive(3, at_most=10**4)
    """Steps in the profiled window."""


@dataclasses.dataclass(kw_only=True)
class GuardConfig(Config):
    """The step guard: updates whose loss or gradient norm spikes are skipped (src/moetrain/train/guard.py)."""

    skip_spike_sigma: float = non_negative(6.0)
    """Skip an update whose loss or gradient norm exceeds the mean of the last `skip_window`
    accepted steps by this many standard deviations (0: only non-finite values are skipped)."""
    skip_window: int = positive(128, at_most=10**6)
    """Accepted steps the spike statistics cover (detection starts after half of them)."""
    max_consecutive_skips: int = non_negative(10, at_most=MAX_STEPS)
    """Stop with an error after this many skipped updates in a row (0: never)."""


@dataclasses.dataclass(kw_only=True)
class RunConfig(Config):
    """Everything one training run needs; `moetrain config` prints it, RUN_DIR/config.yaml keeps it."""

    model: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    train: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    compute: ComputeConfig = dataclasses.field(default_factory=ComputeConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    guard: GuardConfig = dataclasses.field(default_factory=GuardConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    renamed = {"train.precision": "precision.dtype", "train.async_checkpoint": "checkpoint.async_save"} | {
        f"train.{key}": f"{section}.{key}"  # earlier names of keys, still read (`Config.renamed`)
        for section, keys in (
            ("precision", "fp8 fp8_select fp8_lm_head fp8_fast_accum_backward"),
            ("compute", "compile cuda_graphs recompute recompute_every loss_chunk_tokens defer_expert_weight_grad"),
            ("checkpoint", "save_every save_final keep_last init_from"),
            ("logging", "tensorboard wandb wandb_project wandb_name plot profile profile_wait profile_steps"),
            ("guard", "skip_spike_sigma skip_window max_consecutive_skips"),
        )
        for key in keys.split()
    }
    retired = {  # keys no longer read (`Config.retired`)
        "train.eval_batches": (
            ...,
            "validation reads train.eval_tokens tokens (an earlier version's count of micro-batches), "
            "whatever the micro-batch size.",
        )
    } | {
        f"{section}.fp8_expert_weight_grad": (
            False,
            "FP8 expert weight gradients were removed, having no measured win (+0.3% on bench-8e's "
            "step, within noise; docs/measurements.md): the expert weight gradients are bf16 grouped "
            "GEMMs, as with false. Remove the key.",
        )
        for section in ("train", "precision")
    }

    def validate(self, world_size: int | None = None, device: torch.device | None = None) -> None:
        """Every section's rules, then those across sections, of the layout on `world_size` ranks
        and of `device`. Raises `ConfigError` naming the fields."""
        self.check_domains()
        for f in dataclasses.fields(self):
            validate_tree(getattr(self, f.name), f"{f.name}.")
        m, tc, p = self.model, self.train, self.parallel
        has_moe = m.num_moe_layers > 0
        if p.ep > 1 and not has_moe:
            raise ConfigError(
                f"parallel.ep={p.ep} splits the experts over ranks, but model.num_dense_layers={m.num_dense_layers} = "
                "model.n_layers makes every block dense: set parallel.ep=1 (the ranks train data-parallel), or lower "
                "model.num_dense_layers."
            )
        if has_moe and m.moe.num_experts % p.ep:
            raise ConfigError(
                f"parallel.ep={p.ep} does not divide model.moe.num_experts={m.moe.num_experts}: every "
                "rank of an expert-parallel group must hold the same number of experts."
            )
        if has_moe and (problem := p.overlap_problem(m.moe.num_experts, self.compute.defer_expert_weight_grad)):
            raise ConfigError(problem)
        if p.pp > 1 or p.stages_per_rank > 1:
            stages = p.pp * p.stages_per_rank
            if m.n_layers < stages:
                raise ConfigError(
                    f"model.n_layers={m.n_layers} cannot fill parallel.pp={p.pp} × "
                    f"parallel.pp_stages_per_rank={p.stages_per_rank} = {stages} pipeline stages (each needs a "
                    f"block): choose pp × stages-per-rank ≤ {m.n_layers}."
                )
            micro_batches = tc.grad_accum_steps
            if micro_batches < p.pp:
                raise ConfigError(
                    f"Pipeline parallelism needs at least parallel.pp={p.pp} micro-batches per step, "
                    f"got train.global_batch_size / train.micro_batch_size = {micro_batches}: "
                    f"lower train.micro_batch_size."
                )
            if p.pp_schedule == PipelineSchedule.interleaved_1f1b and micro_batches % p.pp:
                raise ConfigError(
                    f"parallel.pp_schedule=interleaved-1f1b needs a multiple of parallel.pp={p.pp} "
                    f"micro-batches per step, got train.global_batch_size / "
                    f"train.micro_batch_size = {micro_batches}."
                )
        _check_context_split(self.data.seq_len, p.cp)
        _check_multi_token(m.mtp_depth, self.data.seq_len, p.cp)
        if p.compile_overlap and not self.compute.compile:
            raise ConfigError(
                "parallel.compile_overlap=true reorders collectives inside compiled blocks: "
                "it needs compute.compile=true."
            )
        _check_fp8(self.precision, self.compute, m)
        if p.stack == Stack.fsdp and self.defers_expert_weight_grads and (world_size or 1) > 1:
            _check_fsdp_deferral(self, device)
        if self.optim.bf16_weights:
            if p.stack != Stack.ddp:
                raise ConfigError(
                    f"optim.bf16_weights=true works on the ddp stack only; got parallel.stack={p.stack}. Set "
                    "optim.bf16_weights=false, or parallel.stack=ddp (with parallel.shard_optimizer=true to shard "
                    "the optimizer state)."
                )
            if self.precision.dtype == Precision.fp32:
                raise ConfigError(
                    "optim.bf16_weights=true computes in bf16, but precision.dtype=fp32: set precision.dtype=bf16 "
                    "(or auto on CUDA), or optim.bf16_weights=false."
                )
        if self.compute.cuda_graphs == CudaGraphs.step and (problem := _step_graph_problem(self, world_size)):
            raise ConfigError(": ".join(problem))
        if world_size is not None:
            dims = p.build(world_size)
            if tc.micro_batch_size % dims.dp:
                raise ConfigError(
                    f"train.micro_batch_size={tc.micro_batch_size} (sequences per micro-batch, summed over "
                    f"ranks) is not divisible by the {dims.dp} data-parallel ranks."
                )
        if device is not None:
            self._validate_device(device)

    def _validate_device(self, device: torch.device) -> None:
        """What the device (resolved from train.device: src/moetrain/train/runtime.py) must support."""
        if self.optim.bf16_weights and self.precision.dtype == Precision.auto and device.type != "cuda":
            raise ConfigError(
                f"optim.bf16_weights=true computes in bf16, but precision.dtype=auto means fp32 on {device.type}: "
                "set precision.dtype=bf16, or optim.bf16_weights=false."
            )
        if self.compute.cuda_graphs == CudaGraphs.step and (problem := _step_graph_problem(self, None, device)):
            raise ConfigError(": ".join(problem))
        import torch

        fp8 = self.precision.fp8
        if fp8 != Fp8.none and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ConfigError(
                f"precision.fp8={fp8} needs FP8 tensor cores (compute capability ≥ 8.9: Ada, Hopper or newer); "
                f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}. "
                "Use precision.fp8=none."
            )

    @property
    def rows_per_micro_batch(self) -> int:
        """Tokens of one micro-batch on a rank: its sequences' positions this cp rank holds."""
        return self.train.micro_batch_size * self.data.seq_len // self.parallel.cp

    @property
    def fp8_lm_head(self) -> bool:
        """Whether the LM head runs its products in row-wise FP8 (precision.fp8_lm_head, resolved)."""
        p = self.precision
        return p.fp8 == Fp8.rowwise and choose_head(self.model, self.rows_per_micro_batch, p.fp8_select, p.fp8_lm_head)

    @property
    def defers_expert_weight_grads(self) -> bool:
        """compute.defer_expert_weight_grad takes effect: it is set, the model has experts and a step
        has several micro-batches."""
        return (
            self.compute.defer_expert_weight_grad and self.train.grad_accum_steps > 1 and self.model.num_moe_layers > 0
        )

    @property
    def fp8_fast_backward(self) -> bool:
        """Whether row-wise FP8's backward products use fast accumulation (precision.fp8_fast_accum_backward)."""
        return self.precision.fp8 == Fp8.rowwise and self.precision.fp8_fast_accum_backward is not False

    def cuda_graphs_choice(self, world_size: int, device: torch.device) -> tuple[CudaGraphs, str | None]:
        """compute.cuda_graphs for this run: (the mode, and for auto why it is that one)."""
        mode = self.compute.cuda_graphs
        if mode != CudaGraphs.auto:
            return mode, None
        if problem := _step_graph_problem(self, world_size, device):  # said as why auto did not take it
            return CudaGraphs.off, problem[0].replace("compute.cuda_graphs=step", "the step graph", 1)
        if self.logging.profile:
            return CudaGraphs.off, (
                "logging.profile: the profiled steps run eagerly, so that the profile names each kernel and the "
                "operation that launched it (a replayed graph shows as one launch)"
            )
        return CudaGraphs.step, (
            "one GPU and a layout the step graph captures; kept if its first replays take the device "
            "at least 3% less time than the eager steps"
        )

    def build_dims(self, world_size: int, device: torch.device | None = None) -> ParallelDims:
        """`validate(world_size, device)`, then the layout, parallel.overlap_chunks resolved."""
        self.validate(world_size, device)
        dims = self.parallel.build(world_size)
        return dataclasses.replace(dims, overlap_chunks=self.overlap_chunks(device))

    def overlap_chunks(self, device: torch.device | None = None) -> int:
        """parallel.overlap_chunks on `device` (None: a GPU, as the planner plans), auto resolved:
        `AUTO_OVERLAP_CHUNKS` where the sync-free exchange runs on GPUs under a capacity factor
        (and, with deferred expert weight gradients, the chunks divide a rank's experts); 0 on
        CPUs, where the chunks would take the 1024-row capacity floor instead of every row."""
        p = self.parallel
        if p.overlap_chunks is not None:
            return p.overlap_chunks
        if p.ep == 1 or p.dispatcher != DispatcherKind.nosync or p.capacity_factor is None:
            return 0
        if device is not None and device.type != "cuda":
            return 0
        divides = (self.model.moe.num_experts // p.ep) % AUTO_OVERLAP_CHUNKS == 0
        return AUTO_OVERLAP_CHUNKS if divides or not self.compute.defer_expert_weight_grad else 0


def _step_graph_problem(
    cfg: RunConfig, world_size: int | None, device: torch.device | None = None
) -> tuple[str, str] | None:
    """(why compute.cuda_graphs=step cannot capture this run's step, the fix), or None: it can."""
    p, o = cfg.parallel, cfg.optim
    problem = None
    if p.stack != Stack.ddp or p.shard_optimizer:
        problem = f"parallel.stack={p.stack} with parallel.shard_optimizer={str(p.shard_optimizer).lower()}"
    elif o.name != OptimizerName.adamw:
        problem = f"optim.name={o.name}"
    elif o.fused is False:
        problem = "optim.fused=false (its update reads the skip decision on the host)"
    elif world_size is not None and world_size > 1:
        problem = f"{world_size} ranks (the all-reduces are not captured)"
    if problem:
        return (
            "compute.cuda_graphs=step captures the training step of the ddp stack's replicated AdamW "
            f"on one GPU, not with {problem}",
            "set compute.cuda_graphs=off.",
        )
    if cfg.compute.recompute != Recompute.none:
        return (
            f"compute.cuda_graphs=step cannot capture a step with compute.recompute={cfg.compute.recompute}: torch's "
            "checkpoint reads the CUDA generator's state in every recomputed block, which a graph capture "
            "forbids",
            "set compute.recompute=none, or compute.cuda_graphs=off.",
        )
    if device is not None and device.type != "cuda":
        return (
            f"compute.cuda_graphs=step replays CUDA kernels, but the run is on {device.type}",
            "set compute.cuda_graphs=off, or train.device=cuda.",
        )
    return None


def _check_context_split(seq_len: int, cp: int) -> None:
    """parallel.cp cuts each sequence into 2·cp equal chunks (src/moetrain/parallel/context_parallel.py)."""
    if cp == 1 or seq_len % (2 * cp) == 0:
        return
    fits = [str(c) for c in range(2, seq_len // 2 + 1) if seq_len % (2 * c) == 0][:4]
    hint = f", or use parallel.cp={', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else ""
    hint = f", or use parallel.cp={fits[0]}" if len(fits) == 1 else hint
    raise ConfigError(
        f"parallel.cp={cp} cuts each sequence into 2 × cp = {2 * cp} equal chunks, so data.seq_len must be "
        f"a multiple of {2 * cp}; data.seq_len={seq_len} is not: change data.seq_len{hint}."
    )


def _check_multi_token(depth: int, seq_len: int, cp: int) -> None:
    """model.mtp_depth: each depth predicts one token further within the sequence this rank holds."""
    if depth and cp > 1:
        raise ConfigError(
            f"model.mtp_depth={depth} shifts each sequence by up to {depth} positions, which under "
            f"parallel.cp={cp} belong to another rank's chunk: use parallel.cp=1 with multi-token prediction, "
            "or model.mtp_depth=0."
        )
    if depth >= seq_len:
        raise ConfigError(
            f"model.mtp_depth={depth} predicts {depth + 1} tokens ahead, but data.seq_len={seq_len} leaves no "
            f"position to predict from: lower model.mtp_depth below {seq_len}."
        )


def _check_fsdp_deferral(cfg: RunConfig, device: torch.device | None) -> None:
    """FSDP keeps the gradients of a step's earlier micro-batches in optim.grad_dtype; a deferred
    expert gradient (first of its step in the last backward) comes in the compute dtype, and
    FSDP's reduce-scatter refuses the two mixed. precision.dtype=auto is checked once the device is
    known."""
    from moetrain.train.engine import autocast_dtype

    dtype = cfg.precision.dtype
    if dtype == Precision.auto and device is None:
        return
    compute, grads = ("bf16" if autocast_dtype(dtype, device) else "fp32"), cfg.optim.grad_dtype
    here = f": {compute} here" if dtype == Precision.auto else ""
    if compute != grads:
        raise ConfigError(
            f"compute.defer_expert_weight_grad=true on parallel.stack=fsdp needs optim.grad_dtype={compute}, the "
            f"compute's dtype (precision.dtype={dtype}{here}): FSDP keeps the other gradients between micro-batches "
            f"in optim.grad_dtype={grads} and the deferred expert gradients come in {compute}, which its "
            f"reduce-scatter cannot mix. Set optim.grad_dtype={compute}, or compute.defer_expert_weight_grad=false, "
            "or parallel.stack=ddp."
        )


def _check_fp8(pc: PrecisionConfig, compute: ComputeConfig, m: TransformerConfig) -> None:
    """FP8 agrees with the deferred expert weight gradients and the model's product dims."""
    if compute.defer_expert_weight_grad and pc.fp8 == Fp8.mxfp8:
        raise ConfigError(
            "compute.defer_expert_weight_grad=true works with bf16 and row-wise FP8 experts, but "
            "precision.fp8=mxfp8: set precision.fp8=rowwise or none, or compute.defer_expert_weight_grad=false."
        )
    if pc.fp8 == Fp8.none:
        return
    dims = {}  # the config fields that set a dimension of a block's matrix product (FP8 takes all but the router's)
    for moe_block, layers in ((True, m.num_moe_layers), (False, m.num_dense_layers)):
        for x in block_matrices(m, moe_block) if layers else ():
            dims |= dict(zip(x.fields, (x.d_in, x.d_out)))
    for key, dim in (dims | ({"model.vocab_size": m.vocab_size} if pc.fp8_lm_head is True else {})).items():
        if dim % pc.fp8.align:
            raise ConfigError(
                f"precision.fp8={pc.fp8} needs every matrix-product dimension divisible by "
                f"{pc.fp8.align}; {key}={dim} is not: change it, or use precision.fp8=none."
            )
