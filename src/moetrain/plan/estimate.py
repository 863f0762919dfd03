"""`plan`: memory, communication and step time of a config on N GPUs of a kind (`Plan`)."""

from __future__ import annotations

import dataclasses

import torch

from moetrain.errors import ConfigError
from moetrain.parallel.config import DEFAULT_CAPACITY_MIN_ROWS, EVERY_ROW, DispatcherKind
from moetrain.plan.calibration import Assumptions
from moetrain.plan.hardware import GIB, GPU, GPUS, device_memory
from moetrain.plan.layout import Layout, ParamGroups, layout_of
from moetrain.plan.memory import checkpoint_state_bytes, load_temporaries, memory_per_rank, save_temporaries
from moetrain.plan.time import COMPUTE_PARTS, EXPOSED_PARTS, PEER_PARTS, communication, step_time
from moetrain.train.config import RunConfig

PEAK_ERROR = 0.10
"""How far a modelled peak may be from the measured one: tests/test_plan.py pins the planner's
peaks within 10% of the measured and rehearsed peaks. A layout whose peak comes closer than that
to the GPU's capacity is `tight`."""


@dataclasses.dataclass
class Plan:
    layout: Layout
    gpu: GPU
    params_per_device: int
    memory_gib: dict[str, float]
    peak_mem_gib_per_device: float
    fits: bool
    comm_gb_per_step: dict[str, float]
    time_s: dict[str, float]
    step_time_s: float
    mfu: float
    tokens_per_sec_per_device: float
    activations_without_recompute_gib: float
    activations_full_recompute_gib: float
    peak_gib_per_pipeline_rank: list[float]
    save_peak_gib_per_pipeline_rank: list[float]
    load_peak_gib_per_pipeline_rank: list[float]
    params_per_pipeline_rank: list[int]
    save_peak_gib_per_device: float
    """Allocated during a checkpoint save: the training state, the gradient buckets that persist,
    and the temporaries the save makes on the device (`save_temporaries`)."""
    fits_while_saving: bool
    load_peak_gib_per_device: float
    """Allocated while a checkpoint is loaded (a resume): the training state, the gradient
    buckets the optimizer allocates up front, and the load's temporaries (`load_temporaries`)."""
    fits_while_loading: bool
    busiest_rank: int
    """A global rank of the pipeline rank that needs most memory (its stage's first dp rank: the
    ranks of a stage hold alike): the one `moetrain bench --rehearse` runs by default."""
    comm_s: dict[str, float]
    """Seconds per step each collective takes at the links' achieved rates, before any overlap
    (`Communication.seconds`): what the exposed parts of `time_s` are parts of."""

    @property
    def largest_peak_gib(self) -> float:
        """The highest of the three peaks: training, saving a checkpoint, loading one."""
        return max(self.peak_mem_gib_per_device, self.save_peak_gib_per_device, self.load_peak_gib_per_device)

    @property
    def tight(self) -> bool:
        """It fits while training, but its largest peak is within the memory model's error
        (`PEAK_ERROR`) of the GPU's capacity, or over it while saving or loading: a real run
        may run out of memory."""
        return self.fits and self.largest_peak_gib > (1 - PEAK_ERROR) * self.gpu.memory_gib

    @property
    def compute_s(self) -> float:
        """The step's parts one rank's own kernels make (`COMPUTE_PARTS`): what a rehearsal
        measures."""
        return sum(self.time_s[k] for k in COMPUTE_PARTS)

    def transfer_s(self, part: str) -> float:
        """The transfer time of which the step-time part `part` (one of `EXPOSED_PARTS`) is the exposed part."""
        return sum(self.comm_s.get(k, 0.0) for k in EXPOSED_PARTS[part])

    @property
    def exposed_comm_s(self) -> float:
        """Communication's share of the step: what compute does not hide (`EXPOSED_PARTS`)."""
        return sum(self.time_s[k] for k in EXPOSED_PARTS)

    @property
    def peers_s(self) -> dict[str, float]:
        """The parts that need the other ranks (`PEER_PARTS`): what a rehearsal cannot measure."""
        return {k: self.time_s[k] for k in PEER_PARTS}


def capacity_floor(
    cfg: RunConfig, gpus: int, memory_bytes: float, gpu: str | None, assume: Assumptions = Assumptions()
) -> tuple[int | None, str | None]:
    """parallel.capacity_min_rows resolved on `gpus` devices of `memory_bytes` each, of the
    planner's kind `gpu` (None: CPUs), and why (None where nothing was chosen): as set; unset where
    no sync-free exchange uses it; else, where it exchanges once per layer under a capacity factor,
    on CPUs every row (`EVERY_ROW`: dropless) if the busiest rank's modelled peak with those
    buffers fits, and 1024 (`DEFAULT_CAPACITY_MIN_ROWS`) otherwise and on GPUs, where every row
    puts ep × the exact exchange's rows on the wire (docs/architecture.md, "Dispatcher memory")."""
    p = cfg.parallel
    if p.capacity_min_rows is not None or p.ep == 1 or p.dispatcher != DispatcherKind.nosync:
        return p.capacity_min_rows, None
    if p.capacity_factor is None:
        return DEFAULT_CAPACITY_MIN_ROWS, None
    if gpu is not None:
        return DEFAULT_CAPACITY_MIN_ROWS, "on a GPU every row would put ep x the exact exchange's rows on the wire"
    if cfg.overlap_chunks(torch.device("cpu")) > 1:
        return DEFAULT_CAPACITY_MIN_ROWS, None
    every = dataclasses.replace(cfg, parallel=dataclasses.replace(p, capacity_min_rows=EVERY_ROW))
    ranks = memory_per_rank(every, layout_of(every, gpus), ParamGroups.of(cfg.model), assume)
    peak = max(r.peak for r in ranks)
    if peak > memory_bytes:
        return (
            DEFAULT_CAPACITY_MIN_ROWS,
            f"every row would need a modelled {peak / GIB:.1f} GiB of {memory_bytes / GIB:.1f}",
        )
    return EVERY_ROW, f"the buffers' modelled peak {peak / GIB:.1f} GiB fits {memory_bytes / GIB:.1f}"


def device_capacity_floor(cfg: RunConfig, gpus: int, device: torch.device) -> tuple[int | None, str | None]:
    """`capacity_floor` on `gpus` devices like `device` (what `Trainer` takes as capacity_floor)."""
    return capacity_floor(cfg, gpus, *device_memory(device))


def plan(cfg: RunConfig, gpus: int, gpu: str, assume: Assumptions = Assumptions()) -> Plan:
    """Memory, communication and step time of `cfg` on `gpus` GPUs of kind `gpu`."""
    if gpu not in GPUS:
        raise ConfigError(f"--gpu={gpu!r} is not one the planner knows: choose one of {', '.join(GPUS)}.")
    if gpus <= 0:
        raise ConfigError(f"--gpus={gpus} must be a positive number of GPUs.")
    if cfg.precision.fp8.value != "none" and not GPUS[gpu].fp8:
        raise ConfigError(f"precision.fp8={cfg.precision.fp8} needs FP8 tensor cores, which {GPUS[gpu].name} "
                          "lacks: plan it with precision.fp8=none.")  # fmt: skip
    spec, L = GPUS[gpu], layout_of(cfg, gpus)  # auto capacity_min_rows is 1024 on a GPU: `capacity_floor`
    ranks = memory_per_rank(cfg, L, ParamGroups.of(cfg.model), assume)
    busiest = max(ranks, key=lambda r: r.peak)  # the first of equal peaks
    comm = communication(cfg, L, busiest, spec, assume)
    time = step_time(cfg, L, busiest, comm, spec, assume)
    peak_gib = busiest.peak / GIB
    memory = {k: round(getattr(busiest, k) / GIB, 2) for k in ("weights", "grads", "optimizer", "activations")}
    memory["workspace"] = ws = assume.workspace_gib
    saves = [(checkpoint_state_bytes(L, r) + save_temporaries(cfg, L, r)) / GIB + ws for r in ranks]
    loads = [(checkpoint_state_bytes(L, r) + load_temporaries(cfg, L, r)) / GIB + ws for r in ranks]
    save_gib, load_gib = max(saves), max(loads)
    return Plan(
        layout=L,
        gpu=spec,
        params_per_device=int(busiest.local / (L.replicas if L.fsdp else 1)),
        memory_gib=memory,
        peak_mem_gib_per_device=round(peak_gib, 2),
        fits=peak_gib <= spec.memory_gib,
        comm_gb_per_step={k: round(v / 1e9, 3) for k, v in comm.bytes.items()},
        time_s=time.parts,
        step_time_s=time.step,
        mfu=time.mfu,
        tokens_per_sec_per_device=time.tokens_per_device / time.step,
        activations_without_recompute_gib=busiest.act_none / GIB,
        activations_full_recompute_gib=busiest.act_full / GIB,
        peak_gib_per_pipeline_rank=[round(r.peak / GIB, 2) for r in ranks],
        save_peak_gib_per_pipeline_rank=[round(x, 2) for x in saves],
        load_peak_gib_per_pipeline_rank=[round(x, 2) for x in loads],
        params_per_pipeline_rank=[int(r.local / (L.replicas if L.fsdp else 1)) for r in ranks],
        save_peak_gib_per_device=round(save_gib, 2),
        fits_while_saving=save_gib <= spec.memory_gib,
        load_peak_gib_per_device=round(load_gib, 2),
        fits_while_loading=load_gib <= spec.memory_gib,
        busiest_rank=busiest.rank * L.replicas,
        comm_s=comm.seconds,
    )
