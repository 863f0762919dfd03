#!/usr/bin/env python3
"""
Olmo-core 3.0.0's DDP-stack MoE training step on several GPUs of one host, with expert parallelism.

The single-GPU anchor (``.anchor/bench_olmocore.py``, a copy of ``shared/anchor/bench_olmocore.py``)
builds the models, the train module and the timing loop. This runner imports it and changes only
what several ranks need, by wrapping its functions instead of copying them:

* ``build_ddp_configs``: for ``--ep N`` (N > 1) sets the train module's
  ``ep_config=TransformerExpertParallelConfig(degree=N)``, as the reference scripts do
  (``src/examples/olmo_ddp/moe_8l_ep8_sync_profile.py``, ``moe_8l_ddp.py``: ``degree`` > 1, else
  ``None``). The block's ``ExpertParallelConfig(path=sync_1d, ...)`` the anchor already builds is
  the one those scripts pair with it, so each rank keeps ``num_experts / N`` experts and tokens
  travel by two synchronised all-to-alls per MoE layer (``olmo_core/nn/moe/v2/ep_sync_1d.py``).
  ``--ep 1`` keeps ``ep_config=None``: experts replicated, plain data parallel over all ranks.
* ``BenchTrainer``: the global batch is the micro-batch times the data-parallel world size.
* the batch generator and the device RNG are seeded by rank, so ranks train on different tokens
  and random routing differs per rank (the anchor seeds every rank alike).
* its ``RESULT`` lines: gathered over ranks; rank 0 alone prints and appends them (``--out``).

Per-GPU numbers: ``tokens_per_s`` = tokens over all ranks / slowest rank's time / world size, and
``tflops_per_s`` / ``mfu_pct`` use the anchor's formula on that rate. ``peak_mem_gib`` is the max
over ranks (``peak_mem_gib_per_rank`` lists all).

Run (after the setup in shared/anchor/README.md, wheels installed on PYTHONPATH):
    torchrun --standalone --nproc-per-node=2 benchmarks/olmocore_multigpu.py --config ddp-8e --ep 2
    torchrun --standalone --nproc-per-node=2 benchmarks/olmocore_multigpu.py --config ddp-8e --ep 2 --cpu-smoke
Every other flag is the anchor's (``--routing``, ``--steps``, ``--layers``, ``--no-compile`` ...).
"""

from __future__ import annotations

import argparse
import builtins
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

ANCHOR_DIR = Path(os.environ.get("OLMO_ANCHOR_DIR", Path(__file__).resolve().parent.parent / ".anchor"))
SETUP_HINT = (
    "set it up once per machine as shared/anchor/README.md says, from the repository root:\n"
    "    mkdir -p .anchor && cp ../shared/anchor/{bench_olmocore.py,run_on_gpu.sh} .anchor/\n"
    "    ../shared/anchor/fetch_wheels.sh .anchor/whl\n"
    '    echo "/.anchor/" >> .git/info/exclude\n'
    'and carry [".anchor"] in the device call (or point OLMO_ANCHOR_DIR at the folder).'
)


def load_anchor():
    """Import ``bench_olmocore`` from the anchor folder (it sets env defaults at import time)."""
    path = ANCHOR_DIR / "bench_olmocore.py"
    if not path.is_file():
        raise SystemExit(f"[olmocore-multigpu] missing {path}; {SETUP_HINT}")
    sys.path.insert(0, str(ANCHOR_DIR))
    spec = importlib.util.spec_from_file_location("bench_olmocore", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_olmocore"] = mod
    spec.loader.exec_module(mod)
    return mod


# Filled in by the patches below; read when a RESULT line is finalised.
STATE: dict[str, Any] = {"train_module": None, "batch_seed": None, "smoke_path_calls": {}}


def _rank_world():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _ep_layout(model_parts) -> dict[str, Any]:
    """What each routed block on this rank actually holds after parallelisation."""
    blocks = []
    for m in model_parts:
        for mod in m.modules():
            re_mod = getattr(mod, "routed_experts", None)
            if re_mod is None or not hasattr(mod, "ep_enabled") or not hasattr(re_mod, "w_up_gate"):
                continue
            blocks.append(
                dict(
                    ep_enabled=bool(mod.ep_enabled),
                    ep_path=str(mod.ep.path),
                    ep_world_size=int(mod.ep_world_size),
                    num_local_routed_experts=int(mod.num_local_routed_experts),
                    w_up_gate_local_experts=int(re_mod.w_up_gate.shape[0]),
                )
            )
    first = blocks[0] if blocks else {}
    consistent = all(b == first for b in blocks)
    return dict(n_routed_blocks=len(blocks), layout_same_in_all_blocks=consistent, **first)


# ----------------------------------------------------------------------------------------------
# Patches
# ----------------------------------------------------------------------------------------------
def patch_anchor(
    anchor, ep: int, rank_seed_offset: int, smoke_style: str, original_config: str, ep_path: str = "sync_1d"
):
    import torch

    # 1) EP through Olmo-core's own train-module config.
    orig_build = anchor.build_ddp_configs

    def build_ddp_configs(shape, *a, **k):
        from olmo_core.nn.moe.v2.ep_config import ExpertParallelPath
        from olmo_core.train.train_module import TransformerExpertParallelConfig

        _patch_attach_trainer()  # olmo_core is importable by now (the anchor fixed cached_path)
        model_config, tm_config = orig_build(shape, *a, **k)
        if shape.num_experts % ep != 0:
            raise SystemExit(f"--ep {ep} does not divide num_experts={shape.num_experts}")
        block_ep = model_config.block.ep
        if block_ep is None or block_ep.path != ExpertParallelPath.sync_1d:
            raise SystemExit(f"expected the anchor's block ep path sync_1d, got {block_ep}")
        if ep > 1:
            tm_config.ep_config = TransformerExpertParallelConfig(degree=ep)
            if ep_path != "sync_1d":  # opt-in, untested here: needs CUDA + NVSHMEM symmetric memory
                block_ep.path = ExpertParallelPath(ep_path)
        return model_config, tm_config

    anchor.build_ddp_configs = build_ddp_configs

    # 2) Global batch = micro-batch x grad-accum x data-parallel world size.
    base_trainer = anchor.BenchTrainer

    class BenchTrainer(base_trainer):
        def __init__(self, global_batch_size, dp_process_group, max_steps):
            from olmo_core.distributed.utils import get_world_size

            super().__init__(global_batch_size * get_world_size(dp_process_group), dp_process_group, max_steps)

    anchor.BenchTrainer = BenchTrainer

    # 3) Per-rank data and RNG. The anchor calls set_routing_mode() once, after the model is built
    #    and immediately before `gen = torch.Generator(device="cpu").manual_seed(1234)` makes the
    #    batches; on that first call, reseed the global RNGs by rank (random routing draws from
    #    them) and offset the seed of that one generator by rank.
    orig_set_routing = anchor.set_routing_mode
    real_generator = torch.Generator

    class _OffsetSeed:
        def __init__(self, gen):
            self._gen = gen

        def manual_seed(self, seed):
            STATE["batch_seed"] = int(seed) + rank_seed_offset
            return self._gen.manual_seed(int(seed) + rank_seed_offset)

        def __getattr__(self, name):
            return getattr(self._gen, name)

    def _one_shot_generator(*a, **k):
        torch.Generator = real_generator  # restore at once: only the batch generator is touched
        caller = sys._getframe(1).f_code
        if caller.co_name != "main" or Path(caller.co_filename).name != "bench_olmocore.py":
            builtins.print(
                f"[olmocore-multigpu] WARNING: batch generator not seeded by rank "
                f"(first Generator came from {caller.co_filename}:{caller.co_name})"
            )
            return real_generator(*a, **k)
        return _OffsetSeed(real_generator(*a, **k))

    def set_routing_mode(model_parts, random_routing):
        n = orig_set_routing(model_parts, random_routing)
        if not STATE.get("seeded"):
            STATE["seeded"] = True
            torch.manual_seed(2026 + rank_seed_offset)  # CPU and every CUDA device
            torch.Generator = _one_shot_generator
        return n

    anchor.set_routing_mode = set_routing_mode

    # 4) CPU smoke: the shape of the config family asked for (ddp-8e -> default attention, no
    #    peri-norm, rowwise_fp8=None, as moe_8l_ddp.py), and shims for the EP path on CPU.
    if "--cpu-smoke" in sys.argv:
        orig_smoke = anchor._smoke

        def _smoke():
            s = orig_smoke()
            base = original_config.partition("-")[2].partition("-l")[0]
            if smoke_style == "match" and base in ("8e", "moe8l-8e", "64e", "moe8l-64e"):
                s.name, s.attention_type, s.use_peri_norm = "cpu-smoke-moe8l", "default", False
                s.source += "; moe_8l style (default attention, no peri-norm), like --config " + original_config
            return s

        anchor._smoke = _smoke
        orig_shims = anchor.install_cpu_smoke_shims

        def install_cpu_smoke_shims():
            orig_shims()
            install_cpu_ep_shims()

        anchor.install_cpu_smoke_shims = install_cpu_smoke_shims

    # 5) RESULT lines go through finalize_result (print is looked up in the anchor's globals).
    anchor.print = _anchor_print


def _patch_attach_trainer():
    """Keep a handle on the train module (for the layout report) via the call the anchor makes."""
    from olmo_core.train.train_module.transformer.ddp_train_module import OLMoDDPTrainModule

    if STATE.get("attach_patched"):
        return
    STATE["attach_patched"] = True
    orig_attach = OLMoDDPTrainModule._attach_trainer

    def _attach_trainer(self, trainer):
        STATE["train_module"] = self
        return orig_attach(self, trainer)

    OLMoDDPTrainModule._attach_trainer = _attach_trainer


def install_cpu_ep_shims():
    """
    The anchor's CPU shims cover the no-EP MoE path; ep_sync_1d.py imports its own references to
    async_copy_to_cpu (pinned-memory copy on a CUDA side stream) and
    requires_host_side_split_sizes, so point those at the same CPU stand-ins. Also count which
    block forward ran (installed with --cpu-smoke only; a GPU run is left untouched).
    """
    import olmo_core.nn.ddp.block as ddp_block
    import olmo_core.nn.moe.v2.ep_sync_1d as ep1d
    import olmo_core.nn.moe.v2.no_ep as no_ep

    ep1d.async_copy_to_cpu = no_ep.async_copy_to_cpu
    ep1d.requires_host_side_split_sizes = lambda: True
    calls = STATE["smoke_path_calls"]
    for name in ("_combined_forward_ep_1d", "_combined_forward_no_ep"):
        fn, label = getattr(ddp_block, name), name.lstrip("_")

        def counted(*a, _fn=fn, _name=label, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)

        setattr(ddp_block, name, counted)


# ----------------------------------------------------------------------------------------------
# RESULT lines: gather over ranks, rank 0 prints/appends
# ----------------------------------------------------------------------------------------------
ARGS: dict[str, Any] = {}


def _append(rec: dict[str, Any]):
    line = json.dumps(rec, sort_keys=False)
    builtins.print("RESULT " + line, flush=True)
    if ARGS.get("out"):
        with open(ARGS["out"], "a") as f:
            f.write(line + "\n")


def _anchor_print(*args, **kwargs):
    if not (args and isinstance(args[0], str) and args[0].startswith("RESULT ")):
        return builtins.print(*args, **kwargs)
    rec = json.loads(args[0][len("RESULT ") :])
    rank, world = _rank_world()
    rec.update(world_size=world, ep=ARGS["ep"], runner="benchmarks/olmocore_multigpu.py")
    if "error" in rec:
        # No collective here: the other ranks may be stuck in one. Every failing rank reports.
        rec["rank"] = rank
        return _append(rec)
    if rec.get("kind") == "shim_microbench":
        return _append(rec) if rank == 0 else None
    return finalize_result(rec, rank, world)


def finalize_result(rec: dict[str, Any], rank: int, world: int):
    import torch.distributed as dist

    tm = STATE["train_module"]
    parts = (getattr(tm, "model_parts", None) or [tm.model]) if tm is not None else []
    mine = dict(
        rank=rank,
        step_time_s_mean=rec["step_time_s_mean"],
        step_time_s_median=rec["step_time_s_median"],
        tokens_per_s=rec["tokens_per_s"],
        peak_mem_gib=rec.get("peak_mem_gib"),
        peak_reserved_gib=rec.get("peak_reserved_gib"),
        mem_after_init_gib=rec.get("mem_after_init_gib"),
        real_param_count=rec.get("real_param_count"),
        load_imbalance=rec.get("load_imbalance_max_over_layers"),
        batch_seed=STATE["batch_seed"],
        layout=_ep_layout(parts),
        smoke_path_calls=dict(STATE["smoke_path_calls"]) or None,
    )
    gathered: list[dict[str, Any] | None] = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank != 0:
        return
    g = sorted((x for x in gathered if x is not None), key=lambda x: x["rank"])

    def col(key):
        return [x[key] for x in g]

    slowest = max(col("step_time_s_mean"))
    tps_gpu = rec["tokens_per_step"] / slowest  # = tokens over all ranks / time / world
    scale = tps_gpu / rec["tokens_per_s"]
    peaks = [p for p in col("peak_mem_gib") if p is not None]
    reserved = [p for p in col("peak_reserved_gib") if p is not None]
    lay = g[0]["layout"]
    tm_ep = getattr(tm, "_ep_config", None)
    rec.update(
        stack=rec["stack"]
        + (f" + EP{ARGS['ep']} ({lay.get('ep_path')})" if ARGS["ep"] > 1 else " + DP, experts replicated"),
        ep_dp=world // ARGS["ep"],
        ep_config=(f"TransformerExpertParallelConfig(degree={tm_ep.degree})" if tm_ep is not None else None),
        block_ep_path=lay.get("ep_path"),
        ep_enabled=lay.get("ep_enabled"),
        local_routed_experts_per_rank=[x["layout"].get("num_local_routed_experts") for x in g],
        ep_layout_per_rank=col("layout"),
        global_batch_tokens=rec["tokens_per_step"] * world,
        tokens_per_s=tps_gpu,
        tokens_per_s_note="per GPU: tokens over all ranks / slowest rank's timed seconds / world_size",
        tokens_per_s_global=tps_gpu * world,
        tokens_per_s_per_rank=col("tokens_per_s"),
        step_time_s_mean=slowest,
        step_time_s_mean_per_rank=col("step_time_s_mean"),
        step_time_s_median_per_rank=col("step_time_s_median"),
        tflops_per_s=rec["tflops_per_s"] * scale,
        tflops_per_s_causal_attn=rec["tflops_per_s_causal_attn"] * scale,
        mfu_pct=rec["mfu_pct"] * scale,
        olmo_tflops_per_s=(rec["olmo_tflops_per_s"] * scale if rec.get("olmo_tflops_per_s") else None),
        peak_mem_gib=max(peaks) if peaks else None,
        peak_mem_gib_per_rank=col("peak_mem_gib"),
        peak_reserved_gib=max(reserved) if reserved else None,
        peak_reserved_gib_per_rank=col("peak_reserved_gib"),
        mem_after_init_gib_per_rank=col("mem_after_init_gib"),
        real_param_count_per_rank=col("real_param_count"),
        ce_loss_note="ce_loss_* are Olmo-core's all-reduced mean over ranks",
        load_imbalance_per_rank=col("load_imbalance"),
        batch_seed_per_rank=col("batch_seed"),
    )
    if g[0]["smoke_path_calls"] is not None:
        rec["smoke_block_forward_calls_per_rank"] = col("smoke_path_calls")
    _append(rec)


# ----------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree (1 = experts replicated, plain data parallel; -1 = all ranks)",
    )
    ap.add_argument(
        "--ep-path",
        default="sync_1d",
        help="block ExpertParallelPath when --ep > 1. sync_1d (default) = synchronised "
        "NCCL all-to-all, no symmetric memory. rowwise_nvshmem (Olmo-core's "
        "production no-sync path, moe_8l_ddp.py's 'auto' for EP > 1) is opt-in and "
        "untested here: it needs NVSHMEM-backed torch symmetric memory",
    )
    ap.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    ap.add_argument(
        "--smoke-style",
        choices=["match", "anchor"],
        default="match",
        help="with --cpu-smoke: 'match' gives the toy shape the attention/norm style of "
        "--config (ddp-8e -> moe_8l style); 'anchor' keeps the anchor's toy shape",
    )
    ap.add_argument("--config", default="ddp-tiny64e-l6")
    ap.add_argument("-h", "--help", action="store_true")
    ours, rest = ap.parse_known_args()
    if ours.help:
        print(__doc__)
        ap.print_help()
        print("\nOther flags go to the anchor (bench_olmocore.py --help lists them).")
        return 0
    if not ours.config.startswith("ddp"):
        raise SystemExit("only the DDP stack (--config ddp-...) is supported by this runner")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    ep = world if ours.ep == -1 else ours.ep
    if ep < 1 or world % ep != 0:
        raise SystemExit(f"--ep {ours.ep} must divide the world size {world}")
    ARGS.update(ep=ep, out=ours.out)

    anchor = load_anchor()
    patch_anchor(
        anchor,
        ep=ep,
        rank_seed_offset=1000 * rank,
        smoke_style=ours.smoke_style,
        original_config=ours.config,
        ep_path=ours.ep_path,
    )
    # The anchor parses sys.argv itself; --out is ours (rank 0 writes the gathered line).
    sys.argv = [str(ANCHOR_DIR / "bench_olmocore.py"), "--config", ours.config, *rest]
    if rank == 0:
        builtins.print(
            f"[olmocore-multigpu] world_size={world} ep={ep} anchor={ANCHOR_DIR} args={sys.argv[1:]}", flush=True
        )
    return anchor.main()


if __name__ == "__main__":
    sys.exit(main())
