"""`moetrain plan`: per-GPU memory, communication and step time of a run on N GPUs, without a GPU.

The run is checked and laid out by the trainer's own code (`RunConfig.build_dims`); its costs sum what
the model's components declare (src/moetrain/model/counting.py; Muon's matrices from a meta-device
build: the trillion-parameter presets plan instantly). Then three typed steps, each a function:

    memory_per_rank   → [RankMemory]      parameters, gradients, optimizer state, activations, peak
    communication     → Communication     bytes sent per step and their time, by collective
    step_time         → StepTime          compute, memory-bound work, exposed communication

Legend: P parameters, t tokens per rank per micro-batch (rows × seq_len), m micro-batches per
optimizer step, D d_model, E experts, K top-k, H expert hidden, Hs shared hidden, Hd dense
hidden, V vocabulary, hq/hkv query/key-value heads of hd dims, ep/dp/pp/v the layout
(src/moetrain/parallel/dims.py), edp = dp / ep.

Memory per GPU is the peak of torch's allocated bytes (what `moetrain bench` reports) on the
pipeline rank that needs most: weights, gradients and optimizer state as the stack and the
optimizer lay them out (memory.py `_state`), the activations autograd keeps for the
micro-batches a rank holds at once (`block_saved_bytes` per block and token, the loss's logits,
autocast's bf16 weight copies, an overlapped exchange's buffer), the pipeline's receive buffers
and work space. The peak is the larger of "weights + optimizer + everything saved at the start
of backward" and "weights + optimizer + gradients"; while a checkpoint is saved or loaded,
the state that persists plus the save's or load's temporaries (`save_temporaries`,
`load_temporaries`). The activation terms account for the saved tensors of the compiled bf16
step, checked against peaks measured on one H200 (docs/measurements.md, "The planner against
measured peaks").

Step time (time.py `step_time`): GEMM and attention FLOPs (the MFU formula's,
src/moetrain/model/counting.py) at `gemm_eff` of the dense BF16 peak, the passes over every local
parameter (optimizer, clipping norm, the gradients' copies) at their measured rates, element-wise
kernels at `hbm_eff`, the measured cost of recompute, and the communication compute does not
hide: the expert all-to-all less what parallel.overlap_chunks hides, the sharded optimizer's
all-gather, the data-parallel reductions backward finishes last (`dp_tail`), FSDP's transfers
beyond `fsdp_overlap`, the pipeline's bubble and sends. Host time is not modeled: the step is
taken to be device time. Links: NVLink within a node of `gpus_per_node`, the node's network
across nodes, at `link_eff` of their one-way bandwidth. The constants are assumptions, stated in
`GPUS` and `Assumptions` with what each was calibrated on (one and two H200s); treat step time
and MFU as ±25% (docs/measurements.md, "The planner against measured peaks" and "One-GPU
tokens/s", compares them with measured runs)."""

from moetrain.parallel.config import layout_legend
from moetrain.plan.calibration import Assumptions
from moetrain.plan.estimate import PEAK_ERROR, capacity_floor, device_capacity_floor, plan
from moetrain.plan.hardware import GIB, GPUS, plan_gpu
from moetrain.plan.layout import ParamGroups, layout_of, rows_per_token
from moetrain.plan.memory import load_temporaries, memory_per_rank, save_temporaries
from moetrain.plan.report import layouts_text, legend_lines, more_gpus_json, more_gpus_text, report, to_json
from moetrain.plan.search import MAX_GPUS, MoreGpus, fewest_gpus, larger_counts, suggest, with_layout
from moetrain.plan.time import EXPOSED_PARTS

__all__ = [
    "Assumptions",
    "EXPOSED_PARTS",
    "GIB",
    "GPUS",
    "MAX_GPUS",
    "MoreGpus",
    "PEAK_ERROR",
    "ParamGroups",
    "capacity_floor",
    "device_capacity_floor",
    "fewest_gpus",
    "larger_counts",
    "layout_legend",
    "layout_of",
    "layouts_text",
    "legend_lines",
    "load_temporaries",
    "memory_per_rank",
    "more_gpus_json",
    "more_gpus_text",
    "plan",
    "plan_gpu",
    "report",
    "rows_per_token",
    "save_temporaries",
    "suggest",
    "to_json",
    "with_layout",
]
