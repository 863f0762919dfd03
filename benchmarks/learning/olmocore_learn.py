#!/usr/bin/env python3
"""
Olmo-core 3.0.0 trains its own MoE model on moetrain's tokens: the learning side of the
side-by-side (issue 55, item 1). benchmarks/learning/README.md explains the comparison.

Olmo-core's side is all Olmo-core: the model and train module come from the anchor's config
builders (.anchor/bench_olmocore.py: OLMoDDPModel + OLMoDDPTrainModule, OLMoDDPOptimizer's
AdamW with fp32 master weights over bf16 parameters, MultiGroupDDP on a 1-rank group), its own
init, its own load-balancing and router z-losses, its own CosWithWarmup schedule, driven by
`train_batch` / `optim_step` / `zero_grads` as olmo_core.train.Trainer drives them.

The data is moetrain's: the moetrain run config of the same settings is resolved with
moetrain's own `resolve_config` (the same preset and the same override strings `moetrain train`
is given: print them with --print-moetrain-args), its loader is built with `DataConfig.build`
exactly as `Trainer._build` builds it, and each step's micro-batches come from moetrain's own
`Trainer.next_batches`. The validation windows are chosen by moetrain's `Evaluator` (same
object, same `val_batches` call); only the loss over them is computed by Olmo-core's model.

Output (--out, JSON lines): one {"kind": "config"} line, one {"kind": "train"} line per step
(step, lm_loss, lr, lr_moetrain, grad_norm, tokens, lb_loss, z_loss,
expert_load_max_over_mean, skipped), one {"kind": "eval"} line at step 0 and every
--eval-every steps (and at the last), and one {"kind": "expert_load"} line at the end.

    torchrun --standalone --nproc-per-node=1 benchmarks/learning/olmocore_learn.py --shape small32e \
        --steps 1000 --global-batch 8 --micro-batch 8 --seq-len 2048 --compile --out olmocore.jsonl
    python benchmarks/learning/olmocore_learn.py --cpu-smoke --out /tmp/olmo-smoke.jsonl
    python benchmarks/learning/olmocore_learn.py --shape small32e ... --print-moetrain-args
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PRESETS = {"small32e": "bench-small32e", "8e": "bench-8e"}
"""moetrain's presets of the anchor's shapes (src/moetrain/presets.py)."""
SMOKE_DEFAULTS = dict(steps=4, global_batch=4, micro_batch=2, seq_len=64, eval_every=2, eval_tokens=4 * 64, warmup=2)
GPU_DEFAULTS = dict(
    steps=1000, global_batch=8, micro_batch=8, seq_len=2048, eval_every=100, eval_tokens=81_920, warmup=100
)
TOY_MOETRAIN_MODEL = [  # what the in-process moetrain Trainer check builds (the loader ignores the model)
    "--model.n_layers=2",
    "--model.d_model=128",
    "--model.n_heads=1",
    "--model.n_kv_heads=1",
    "--model.moe.num_experts=4",
    "--model.moe.expert_hidden=128",
    "--model.moe.shared_hidden=128",
    "--model.dense_hidden=256",
]


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shape",
        choices=sorted(PRESETS),
        default="small32e",
        help="the anchor's ddp-small32e or ddp-8e (moetrain: bench-small32e / bench-8e)",
    )
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (both sides)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (GPU default 1000)")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default 8)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (default 8)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default 100)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr of the cosine")
    ap.add_argument(
        "--schedule",
        choices=["olmo", "exact"],
        default="olmo",
        help="olmo: Olmo-core's CosWithWarmup(warmup, alpha_f=min-lr-ratio, t_max=steps), whose "
        "cosine runs one step ahead of moetrain's lr_at (<= 0.2%% of the peak apart at 1000 "
        "steps; both logged); exact: an Olmo-core Scheduler whose get_lr is moetrain's lr_at",
    )
    ap.add_argument("--betas", default="0.9,0.95", help="AdamW beta1,beta2")
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    ap.add_argument("--lb-weight", type=float, default=None, help="load-balancing loss weight (default: the shape's)")
    ap.add_argument("--z-weight", type=float, default=None, help="router z-loss weight (default: the shape's)")
    ap.add_argument(
        "--lm-z-loss",
        type=float,
        default=0.0,
        help="Olmo-core's LM-head z-loss multiplier (its reference recipes: 1e-4); 0 = off, as moetrain has none",
    )
    ap.add_argument(
        "--skip-sigma",
        type=float,
        default=6.0,
        help="skip-step spike threshold: OLMoDDPOptimizer sigma_factor (int) and moetrain "
        "train.skip_spike_sigma (both default 6; the anchor's reference scripts use 12)",
    )
    ap.add_argument(
        "--init-std",
        type=float,
        default=0.01,
        help="Olmo-core's init_std (the anchor's 0.01); moetrain is given the same model.init_std",
    )
    ap.add_argument(
        "--embedding",
        choices=["reference", "plain"],
        default="reference",
        help="reference: Olmo-core's embed_scale=sqrt(d_model) + embedding RMSNorm (the anchor's "
        "model); plain: neither, the embedding as moetrain's model has it",
    )
    ap.add_argument(
        "--wd-groups",
        choices=["moetrain", "reference"],
        default="moetrain",
        help="moetrain: no weight decay on embeddings and every norm weight (moetrain's rule: "
        "none on tensors of <2 dims or embeddings); reference: the anchor's per-shape list "
        "(8e decays the norms)",
    )
    ap.add_argument("--eval-every", type=int, default=None, help="validation every N steps and at step 0 (default 100)")
    ap.add_argument("--eval-tokens", type=int, default=None, help="validation tokens (default 81,920)")
    ap.add_argument("--data", default=None, help="moetrain prepared data directory (default <repo>/data/default)")
    ap.add_argument("--seed", type=int, default=0, help="moetrain's train.seed: the data order (and Olmo's init seed)")
    ap.add_argument("--out", default=None, help="JSON lines output (truncated at start)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model and the optimizer step")
    ap.add_argument("--attn-backend", default="torch", help="Olmo-core attention backend (torch = SDPA)")
    ap.add_argument(
        "--anchor", default=None, help="path of bench_olmocore.py (default <repo>/.anchor/bench_olmocore.py)"
    )
    ap.add_argument("--load-window", type=int, default=100, help="the last N steps the expert-load statistics cover")
    ap.add_argument(
        "--no-trainer-check",
        action="store_true",
        help="skip building a (toy-model, CPU) moetrain Trainer to assert its first batch and "
        "validation windows equal the ones trained and evaluated here",
    )
    ap.add_argument(
        "--print-moetrain-args",
        action="store_true",
        help="print the matching `moetrain train` arguments, one per line, and exit",
    )
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="toy shape (anchor's cpu-smoke: 2 layers, d_model 128, 8 experts) on CPU, real tokens, a few steps",
    )
    args = ap.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.cpu_smoke else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.data = str(Path(args.data).resolve()) if args.data else str(REPO / "data" / "default")
    args.betas = tuple(float(b) for b in args.betas.split(","))
    assert len(args.betas) == 2, "--betas takes two numbers: 0.9,0.95"
    if args.global_batch % args.micro_batch:
        ap.error(f"--global-batch {args.global_batch} must be a multiple of --micro-batch {args.micro_batch}")
    if args.skip_sigma != int(args.skip_sigma):
        ap.error("--skip-sigma must be a whole number (OLMoDDPOptimizer's sigma_factor is an int)")
    return args


def shape_defaults(args: argparse.Namespace) -> tuple[float, float]:
    """(lb weight, z weight): given, else the shape's (the anchor's reference values)."""
    lb, z = {"small32e": (0.01, 2e-4), "8e": (0.015, 1e-4)}[args.shape]
    return (args.lb_weight if args.lb_weight is not None else lb, args.z_weight if args.z_weight is not None else z)


def moetrain_args(args: argparse.Namespace, vocab_size: int) -> list[str]:
    """The `moetrain train PRESET` override strings of the same run (everything that decides the
    data, the batches, the schedule, the optimizer and the losses). The driver adds --run-dir,
    --device and bookkeeping (log_every, save, plot) that change nothing trained."""
    lb, z = shape_defaults(args)
    out = [
        f"--data.sources=[{args.data}]",
        f"--model.vocab_size={vocab_size}",
        f"--data.seq_len={args.seq_len}",
        f"--train.global_batch_size={args.global_batch}",
        f"--train.micro_batch_size={args.micro_batch}",
        f"--train.steps={args.steps}",
        f"--train.seed={args.seed}",
        f"--optim.lr={args.lr}",
        f"--optim.betas=[{args.betas[0]},{args.betas[1]}]",
        f"--optim.eps={args.eps}",
        f"--optim.weight_decay={args.weight_decay}",
        f"--optim.grad_clip={args.clip}",
        "--schedule.kind=cosine",
        f"--schedule.warmup_steps={args.warmup}",
        f"--schedule.min_lr_ratio={args.min_lr_ratio}",
        f"--model.moe.lb_loss_weight={lb}",
        f"--model.moe.z_loss_weight={z}",
        f"--model.init_std={args.init_std}",
        f"--train.eval_every={args.eval_every}",
        f"--train.eval_tokens={args.eval_tokens}",
        f"--train.skip_spike_sigma={args.skip_sigma}",
        "--train.skip_window=128",
    ]
    if args.layers is not None:
        out.append(f"--model.n_layers={args.layers}")
    return out


def data_vocab(data_dir: str) -> int:
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    return int(meta["vocab_size"])


# ------------------------------------------------------------------------------------------------
# moetrain's side of the data: its config, loader, step batches and validation windows
# ------------------------------------------------------------------------------------------------
def ensure_moetrain_importable() -> None:
    try:
        import moetrain  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))


def moetrain_config(args: argparse.Namespace, vocab_size: int, extra: list[str] | None = None):
    """The moetrain RunConfig `moetrain train PRESET <moetrain_args>` resolves (its own code)."""
    from moetrain.presets import resolve_config

    return resolve_config(PRESETS[args.shape], moetrain_args(args, vocab_size) + list(extra or []))


class MoetrainData:
    """moetrain's loader and evaluator, built and called as `Trainer` builds and calls them."""

    def __init__(self, cfg):
        from moetrain.train.callbacks import Evaluator

        self.cfg = cfg
        tc = cfg.train
        # src/moetrain/train/trainer.py, Trainer._build (one rank: dp_rank 0 of 1)
        self.loader = cfg.data.build(
            micro_batch_size=tc.micro_batch_size, seed=tc.seed, vocab_size=cfg.model.vocab_size, dp_rank=0, dp_size=1
        )
        self.evaluator = Evaluator(cfg, 0, 1)
        self._trainer_view = SimpleNamespace(loader=self.loader, cfg=cfg)

    def next_batches(self):
        """The next step's micro-batches: moetrain's own `Trainer.next_batches` on this loader."""
        from moetrain.train.trainer import Trainer

        return Trainer.next_batches(self._trainer_view)

    def is_eval_step(self, step: int) -> bool:
        from moetrain.train.callbacks import is_eval_step

        return is_eval_step(self.cfg, step)


class _CaptureEngine:
    """Stands in for moetrain's TrainEngine in `Evaluator.__call__`: keeps the batches."""

    def __init__(self):
        self.batches: list[tuple[Any, Any, int]] = []

    def eval_loss(self, batches) -> float:
        self.batches = list(batches)
        return float("nan")


def moetrain_trainer_reference(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """Build moetrain's real `Trainer` (the object `moetrain train` builds) with the same overrides
    but a toy model on the CPU, and take its first step's batches and its evaluator's validation
    batches: what `moetrain train` with these arguments trains and evaluates on."""
    from moetrain.train.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="olmo-learn-mtcheck-")
    extra = TOY_MOETRAIN_MODEL + [
        "--train.device=cpu",
        "--train.precision=fp32",
        "--train.compile=false",
        f"--train.run_dir={run_dir}",
        "--train.save_final=false",
        "--train.save_every=0",
        "--train.tensorboard=false",
        "--train.plot=false",
    ]
    cfg = moetrain_config(args, vocab_size, extra)
    trainer = Trainer(cfg, quiet=True, name="olmo-learn-check")
    try:
        first = [(x.clone(), y.clone()) for x, y in trainer.next_batches()]
        capture = _CaptureEngine()
        trainer.evaluator(capture)
        return {"first": first, "eval": capture.batches, "run_dir": run_dir}
    finally:
        trainer.run.release()
        shutil.rmtree(run_dir, ignore_errors=True)


def batches_equal(a, b) -> bool:
    if len(a) != len(b):
        return False
    for xa, xb in zip(a, b):
        if len(xa) != len(xb):
            return False
        for ta, tb in zip(xa, xb):
            if hasattr(ta, "shape"):
                if ta.shape != tb.shape or not bool((ta == tb).all()):
                    return False
            elif ta != tb:
                return False
    return True


def token_digest(batches) -> str:
    h = hashlib.blake2b(digest_size=8)
    for x, y, *_ in batches:
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------
# Olmo-core's side
# ------------------------------------------------------------------------------------------------
def load_anchor(path: str | None):
    """Import bench_olmocore.py (the anchor's shapes, config builders and shims) from a path."""
    path = Path(path) if path else REPO / ".anchor" / "bench_olmocore.py"
    if not path.is_file():
        raise SystemExit(f"{path} not found: copy the anchor into .anchor/ (shared/anchor/README.md) or pass --anchor")
    spec = importlib.util.spec_from_file_location("bench_olmocore", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_olmocore"] = module
    spec.loader.exec_module(module)  # sets the anchor's environment variables before torch is imported
    return module


def single_process_env() -> None:
    """Olmo-core's train module needs a (1-rank) process group: torchrun's variables, or these."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def build_olmo(anchor, args: argparse.Namespace, vocab_model: int):
    """Model config + OLMoDDPTrainModule config from the anchor's builders, then the settings of
    this run. Returns (shape, model_config, tm_config, notes)."""
    from olmo_core.optim import OptimGroupOverride
    from olmo_core.optim.scheduler import CosWithWarmup

    if args.cpu_smoke:
        shape = anchor._smoke()
    elif args.shape == "small32e":
        shape = anchor._small32e(args.layers or 16)
    else:
        shape = anchor._moe8l(8, args.layers or 8)
    if args.cpu_smoke and args.layers:
        shape.n_layers = args.layers
    shape.lb_loss_weight, shape.z_loss_weight = shape_defaults(args)
    shape.lr = args.lr
    model_config, tm_config = anchor.build_ddp_configs(
        shape,
        vocab_model,
        args.seq_len,
        args.micro_batch,
        compile_model=args.compile,
        compile_optim=args.compile,
        random_routing=False,
        attn_backend_name=args.attn_backend,
        warmup_sched=args.warmup,
    )
    notes = []
    model_config.init_seed = args.seed
    model_config.init_std = args.init_std
    if args.embedding == "plain":
        model_config.embed_scale = None
        model_config.embedding_norm = None
        notes.append("embedding: plain (no embed_scale, no embedding RMSNorm), as moetrain's model")
    optim = tm_config.optim
    optim.lr = args.lr
    optim.betas = tuple(args.betas)
    optim.eps = args.eps
    optim.weight_decay = args.weight_decay
    optim.sigma_factor = int(args.skip_sigma)
    optim.max_grad_norm = args.clip
    tm_config.max_grad_norm = args.clip
    if args.wd_groups == "moetrain":
        # every 1-dim parameter of OLMoDDPModel is a norm weight (no biases anywhere): the t001
        # list names them all, whichever the block layout
        no_wd = [
            "*embeddings.weight",
            "*embedding_norm.weight",
            "*q_norm.weight",
            "*k_norm.weight",
            "*input_norm.weight",
            "*lm_head.norm.weight",
            "*attention_norm.weight",
            "*feed_forward_norm.weight",
        ]
        optim.group_overrides = [OptimGroupOverride(params=no_wd, opts=dict(weight_decay=0.0, use_muon=False))]
    tm_config.z_loss_multiplier = args.lm_z_loss if args.lm_z_loss > 0 else None
    if args.schedule == "olmo":
        tm_config.scheduler = CosWithWarmup(warmup=args.warmup, alpha_f=args.min_lr_ratio)
    else:
        tm_config.scheduler = moetrain_lr_scheduler(args)
    return shape, model_config, tm_config, notes


def moetrain_lr_scheduler(args: argparse.Namespace):
    """An Olmo-core Scheduler (same set_lr path) whose rate is moetrain's lr_at: for --schedule exact."""
    from olmo_core.optim.scheduler import CosWithWarmup

    from moetrain.optim.config import ScheduleConfig
    from moetrain.optim.schedule import lr_at

    sched = ScheduleConfig(kind="cosine", warmup_steps=args.warmup, min_lr_ratio=args.min_lr_ratio)

    @dataclasses.dataclass
    class MoetrainCosine(CosWithWarmup):
        def get_lr(self, initial_lr, current, t_max):  # current: Olmo's 1-based global_step
            return lr_at(current - 1, t_max, initial_lr, sched)

    return MoetrainCosine(warmup=args.warmup, alpha_f=args.min_lr_ratio)


def moetrain_lr(args: argparse.Namespace, step: int) -> float:
    """moetrain's rate for (1-based) step `step` of this run."""
    from moetrain.optim.config import ScheduleConfig
    from moetrain.optim.schedule import lr_at

    sched = ScheduleConfig(kind="cosine", warmup_steps=args.warmup, min_lr_ratio=args.min_lr_ratio)
    return lr_at(step - 1, args.steps, args.lr, sched)


def metric_tensor(metrics: dict, key: str, device):
    """A recorded metric (device tensor or number; NaN when absent) as a 0-dim float tensor on `device`."""
    import torch

    v = metrics.get(key)
    if isinstance(v, torch.Tensor):
        return v.detach().float().reshape(()).to(device)
    return torch.tensor(float(v if v is not None else float("nan")), device=device)


class ExpertCounts:
    """Per routed layer, the tokens each expert received in the last step: Olmo-core's routers
    accumulate `batch_size_per_expert` over a step's micro-batches and zero it in `reset_metrics`
    (called by `train_batch` when it records the step's metrics); we copy it just before that."""

    def __init__(self, model_parts):
        import torch

        self.layers: list[int] = []
        self.last: list[torch.Tensor] = []
        for part in model_parts:
            for name, mod in part.named_modules():
                if not (
                    hasattr(mod, "batch_size_per_expert")
                    and hasattr(mod, "reset_metrics")
                    and hasattr(mod, "top_k")
                    and 1 < getattr(mod, "num_experts", 0)
                    and mod.top_k < mod.num_experts
                    and "routed_experts_router" in name
                ):
                    continue
                idx = int(name.split("blocks.")[1].split(".")[0])
                snap = torch.zeros(mod.num_experts, dtype=torch.float32, device=mod.batch_size_per_expert.device)
                orig = mod.reset_metrics

                def reset(mod=mod, snap=snap, orig=orig):
                    snap.copy_(mod.batch_size_per_expert.float())
                    orig()

                mod.reset_metrics = reset
                self.layers.append(idx)
                self.last.append(snap)
        order = sorted(range(len(self.layers)), key=lambda i: self.layers[i])
        self.layers = [self.layers[i] for i in order]
        self.last = [self.last[i] for i in order]
        self.window_sum = None
        self.window_steps = 0

    def step_LE(self):
        import torch

        return torch.stack(self.last) if self.last else None

    def add_to_window(self, counts_LE) -> None:
        if counts_LE is None:
            return
        self.window_sum = counts_LE.clone() if self.window_sum is None else self.window_sum + counts_LE
        self.window_steps += 1


class OlmoEvalEngine:
    """What moetrain's `Evaluator` calls `engine.eval_loss(batches)` on, computed by Olmo-core:
    `OLMoDDPTrainModule.eval_batch` (eval mode, no grad) per validation batch; each batch's mean
    per-token CE weighted by its rows in float64, as moetrain's `TrainEngine.eval_loss` does."""

    def __init__(self, train_module, device):
        self.tm, self.device = train_module, device
        self.last_digest: str | None = None
        self.last_tokens = 0

    def eval_loss(self, batches) -> float:
        import torch

        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        seen = []
        tokens = 0
        for inputs_BT, targets_BT, rows in batches:
            seen.append((inputs_BT, targets_BT))
            out = self.tm.eval_batch({"input_ids": inputs_BT.to(self.device)}, labels=targets_BT.to(self.device))
            loss = out.ce_loss.float().mean()
            if rows:
                total[0] += loss.double() * rows
                total[1] += rows
                tokens += rows * inputs_BT.shape[1]
        for m in self.tm.model_parts:
            m.train()
        self.last_digest, self.last_tokens = token_digest(seen), tokens
        loss_sum, num_rows = total.tolist()
        return loss_sum / max(num_rows, 1)


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab_real = data_vocab(args.data)
    ensure_moetrain_importable()

    if args.print_moetrain_args:
        print("\n".join(moetrain_args(args, vocab_real)))
        return 0

    t_start = time.time()
    out_f = open(args.out, "w") if args.out else None

    def emit(rec: dict[str, Any]) -> None:
        line = json.dumps(rec)
        if rec.get("kind") != "train" or rec["step"] <= 3 or rec["step"] % 25 == 0 or rec["step"] == args.steps:
            print("LEARN " + line[:600], flush=True)
        if out_f:
            out_f.write(line + "\n")
            out_f.flush()

    # moetrain's data first (before any Olmo-core shim touches torch)
    mt_cfg = moetrain_config(args, vocab_real)
    data = MoetrainData(mt_cfg)
    reference = None
    if not args.no_trainer_check:
        reference = moetrain_trainer_reference(args, vocab_real)

    anchor = load_anchor(args.anchor)
    import torch

    torch.set_float32_matmul_precision("high")
    if args.cpu_smoke:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    cached_path_status = anchor.ensure_cached_path_importable()
    if args.cpu_smoke:
        anchor.install_cpu_smoke_shims()
    from olmo_core.nn.moe.v2.routed_experts import use_torch_grouped_mm
    from olmo_core.train import prepare_training_environment, teardown_training_environment
    from olmo_core.utils import seed_all
    from olmo_core.version import VERSION as olmo_version

    use_torch_grouped_mm()
    permute_impl = anchor.install_te_permute_shim()
    single_process_env()
    prepare_training_environment(backend="gloo" if args.cpu_smoke else "cpu:gloo,cuda:nccl")

    # Olmo-core pads the vocabulary (TokenizerConfig.padded_vocab_size) to a multiple of 128.
    vocab_model = 128 * ((vocab_real + 127) // 128)
    rc = 0
    try:
        shape, model_config, tm_config, notes = build_olmo(anchor, args, vocab_model)
        if vocab_model != vocab_real:
            notes.append(
                f"vocab padded {vocab_real} -> {vocab_model}: the {vocab_model - vocab_real} pad rows take "
                "part in the softmax (never a target), as in Olmo-core's own runs"
            )
        seed_all(args.seed)
        model = model_config.build(init_device="meta")
        tm = tm_config.build(model)
        device = tm.device
        if args.cpu_smoke and args.compile:
            _avail = torch.cuda.is_available
            torch.cuda.is_available = lambda: True  # the train module compiles the model only on CUDA
            try:
                tm.compile_model()
            finally:
                torch.cuda.is_available = _avail
        parts = tm.model_parts
        emb = [p for part in parts for n, p in part.named_parameters() if n.endswith("embeddings.weight")]
        assert len(emb) == 1 and emb[0].shape[0] == vocab_model, ([e.shape for e in emb], vocab_model)
        counts = ExpertCounts(parts)
        n_moe = len(counts.layers)

        tokens_per_step = args.global_batch * args.seq_len
        trainer = anchor.BenchTrainer(
            global_batch_size=tokens_per_step, dp_process_group=tm.dp_process_group, max_steps=args.steps
        )
        tm._attach_trainer(trainer)
        eval_engine = OlmoEvalEngine(tm, device)

        groups = []
        for g in tm.optim.param_groups:
            names = list(g["named_params"].keys())
            groups.append(
                {
                    "n_params": len(names),
                    "numel": sum(p.numel() for p in g["named_params"].values()),
                    "weight_decay": float(g["weight_decay"]),
                    "first_names": names[:3],
                }
            )
        # (Olmo-core's v2 router keeps its weight flat, 1-dim: tell norms and embeddings by name)
        norm_or_emb_decayed = [
            n
            for g in tm.optim.param_groups
            if float(g["weight_decay"]) > 0
            for n in g["named_params"]
            if "norm" in n or "embeddings" in n
        ]
        emit(
            {
                "kind": "config",
                "framework": "olmo-core",
                "olmo_core_version": olmo_version,
                "torch_version": torch.__version__,
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                "shape": shape.name,
                "shape_source": shape.source,
                "n_layers": shape.n_layers,
                "n_moe_layers": n_moe,
                "d_model": shape.d_model,
                "num_experts": shape.num_experts,
                "top_k": shape.top_k,
                "total_params": model_config.num_params,
                "active_params": model_config.num_active_params,
                "vocab_real": vocab_real,
                "vocab_model": vocab_model,
                "seq_len": args.seq_len,
                "global_batch": args.global_batch,
                "micro_batch": args.micro_batch,
                "grad_accum": args.global_batch // args.micro_batch,
                "tokens_per_step": tokens_per_step,
                "steps": args.steps,
                "lr": args.lr,
                "warmup": args.warmup,
                "min_lr_ratio": args.min_lr_ratio,
                "schedule": args.schedule,
                "betas": list(args.betas),
                "eps": args.eps,
                "weight_decay": args.weight_decay,
                "clip": args.clip,
                "lb_weight": shape.lb_loss_weight,
                "z_weight": shape.z_loss_weight,
                "lm_z_loss": tm_config.z_loss_multiplier,
                "skip_sigma": int(args.skip_sigma),
                "init_std": args.init_std,
                "embedding": args.embedding,
                "wd_groups": args.wd_groups,
                "optim_groups": groups,
                "norm_or_embedding_params_decayed": norm_or_emb_decayed,
                "eval_every": args.eval_every,
                "eval_tokens": args.eval_tokens,
                "eval_tokens_used": data.evaluator.tokens(),
                "data": args.data,
                "seed": args.seed,
                "compile": args.compile,
                "attention_backend": args.attn_backend,
                "permute_impl": permute_impl,
                "cached_path": cached_path_status,
                "notes": notes,
                "moetrain_preset": PRESETS[args.shape],
                "moetrain_args": moetrain_args(args, vocab_real),
                "precision": "OLMoDDP: bf16 parameters and activations, fp32 master weights, fp32 grad "
                "accumulation/reduction, fp32 AdamW moments (OLMoDDPOptimizer)",
            }
        )

        def evaluate(step: int) -> None:
            t0 = time.time()
            loss = data.evaluator(eval_engine)
            emit(
                {
                    "kind": "eval",
                    "step": step,
                    "val_loss": loss,
                    "val_tokens": eval_engine.last_tokens,
                    "val_digest": eval_engine.last_digest,
                    "eval_s": round(time.time() - t0, 2),
                }
            )

        if reference is not None:  # moetrain Trainer's evaluator windows vs the ones evaluated here
            capture = _CaptureEngine()
            data.evaluator(capture)
            equal = batches_equal(reference["eval"], capture.batches)
            print(
                f"[learn] validation windows == moetrain Trainer's evaluator: {equal} ({len(capture.batches)} "
                f"batches, digest {token_digest(capture.batches)}, moetrain's "
                f"{token_digest(reference['eval'])})",
                flush=True,
            )
            assert equal, "validation windows differ from moetrain's"

        gc.collect()
        gc.disable()  # as olmo_core.train.Trainer's GarbageCollectorCallback
        if data.evaluator.path is not None and args.eval_every > 0:
            evaluate(0)
        tokens = 0
        t_train = time.time()
        window_start = args.steps - args.load_window
        for step in range(1, args.steps + 1):
            micro = data.next_batches()
            if step == 1:
                first_digest = token_digest(micro)
                x0 = micro[0][0]
                print(
                    f"[learn] first batch: {len(micro)} micro-batch(es) of {tuple(x0.shape)}, first ids "
                    f"{x0[0, :8].tolist()}, digest {first_digest}",
                    flush=True,
                )
                if reference is not None:
                    equal = batches_equal(reference["first"], micro)
                    print(
                        f"[learn] first batch == moetrain Trainer.next_batches(): {equal} "
                        f"(moetrain digest {token_digest(reference['first'])})",
                        flush=True,
                    )
                    assert equal, "first batch differs from moetrain's"
            inputs = torch.cat([x for x, _ in micro]).to(device, non_blocking=True)
            labels = torch.cat([y for _, y in micro]).to(device, non_blocking=True)
            trainer.global_step = step
            trainer.global_train_tokens_seen += tokens_per_step
            tm.train_batch({"input_ids": inputs, "labels": labels})
            tm.optim_step()
            tm.zero_grads()
            tokens += tokens_per_step
            m = trainer.metrics
            counts_LE = counts.step_LE()
            if step > window_start:
                counts.add_to_window(counts_LE)
            zero = torch.zeros((), device=device)

            def val(key, m=m):
                return metric_tensor(m, key, device)

            packed = torch.stack(
                [
                    val("train/CE loss"),
                    val("optim/LR (group 0)"),
                    val("optim/total grad norm"),
                    val("optim/step skipped"),
                    val("train/load balancing loss unscaled") / max(n_moe, 1) if n_moe else zero,
                    val("train/router Z loss unscaled") / max(n_moe, 1) if n_moe else zero,
                    (counts_LE.max(1).values / counts_LE.mean(1).clamp(min=1e-9)).max()
                    if counts_LE is not None
                    else zero,
                    val("train/load imbalance") if n_moe else zero,
                ]
            ).tolist()
            ce, lr, gn, skipped, lb, z, load, olmo_imb = packed
            rec = {
                "kind": "train",
                "step": step,
                "lm_loss": ce,
                "lr": lr,
                "lr_moetrain": moetrain_lr(args, step),
                "grad_norm": gn,
                "tokens": tokens,
                "lb_loss": lb,
                "z_loss": z,
                "expert_load_max_over_mean": load,
                "skipped": int(skipped),
                "elapsed_s": round(time.time() - t_train, 3),
            }
            if tm_config.z_loss_multiplier is not None:
                rec["lm_z_loss"] = float(val("train/Z loss"))
            if abs(olmo_imb - load) > 1e-3 * max(1.0, load):
                rec["olmo_load_imbalance"] = olmo_imb
            emit(rec)
            if data.is_eval_step(step) and data.evaluator.path is not None:
                gc.collect(1)
                evaluate(step)
        train_s = time.time() - t_train
        load_rec: dict[str, Any] = {
            "kind": "expert_load",
            "available": bool(n_moe),
            "steps": counts.window_steps,
            "note": "tokens per expert summed over the last steps, per routed layer "
            "(router.batch_size_per_expert, copied before Olmo-core resets it)",
        }
        if counts.window_sum is not None:
            w = counts.window_sum.cpu()
            load_rec["layers"] = {
                str(layer): {
                    "max_over_mean": float(w[i].max() / w[i].mean()),
                    "min_over_mean": float(w[i].min() / w[i].mean()),
                    "tokens_per_expert": [int(v) for v in w[i].tolist()],
                }
                for i, layer in enumerate(counts.layers)
            }
            load_rec["max_over_mean_max"] = max(v["max_over_mean"] for v in load_rec["layers"].values())
        emit(load_rec)
        emit(
            {
                "kind": "done",
                "train_s": round(train_s, 1),
                "tokens_per_s": tokens / max(train_s, 1e-9),
                "wall_s": round(time.time() - t_start, 1),
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
            }
        )
    except Exception as e:  # noqa: BLE001 - recorded, then re-raised as the exit status
        import traceback

        traceback.print_exc()
        emit(
            {
                "kind": "error",
                "error": type(e).__name__,
                "detail": str(e)[:800],
                "oom": "OutOfMemoryError" in type(e).__name__,
                "wall_s": round(time.time() - t_start, 1),
            }
        )
        rc = 3 if "OutOfMemoryError" in type(e).__name__ else 2
    finally:
        with contextlib.suppress(Exception):
            teardown_training_environment()
        if out_f:
            out_f.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
