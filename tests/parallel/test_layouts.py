"""Every parallel layout reproduces the single-process run: per-step losses and gradient norms
within 1e-5 relative, parameters after the steps within 1e-5 (relative or absolute)
(fp32, gloo, CPU ranks)."""

import pytest
import torch
from support.distributed import run_distributed

from moetrain.errors import ConfigError
from moetrain.layout_check import GROUPS, group_norm_probe
from moetrain.presets import resolve_config

STEPS = 5


# The layouts are compared with the single process under the default config. The default nosync
# dispatcher (capacity 1.25, spill rows) gives these 64-token micro-batches every row through its
# floor (parallel.capacity_min_rows: a rank's experts get at least 1024 rows), i.e. the padded
# layout: they put up to 1.3 × the mean load on one rank, past the 1.25 capacity, and would drop
# without it. CAPPED turns the floor off and binds a capacity, which drops and says so; DEFAULT
# names the default's settings and must never drop here (the bounded mode against the exact
# dispatcher at ep 2, 4 and 8: tests/parallel/test_nosync_capacity.py).
def layout_cfg(data_dir, run_dir, *extra):
    return resolve_config(
        "tiny",
        [
            f"data.sources=[{data_dir}]",
            f"train.run_dir={run_dir}",
            "model.vocab_size=512",
            "model.d_model=64",
            "model.n_layers=4",
            "model.moe.expert_hidden=32",
            "data.seq_len=32",
            "train.global_batch_size=8",
            "train.micro_batch_size=4",
            f"train.steps={STEPS}",
            "train.log_every=1",
            "train.eval_every=0",
            "checkpoint.save_every=0",
            "checkpoint.save_final=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "schedule.warmup_steps=2",
            "model.moe.bias_update_rate=0.001",
            "train.device=cpu",  # gloo ranks, also on a GPU machine
            # Adam divides by sqrt(v) + eps: with eps = 1e-8, embedding rows whose gradient is near eps
            # turn fp32 reassociation noise (sums split over ranks) into ~1e-5 parameter differences
            # after a few steps. eps = 1e-6 keeps the comparison about the parallel machinery.
            "optim.eps=1e-6",
            *extra,
        ],
    )


def train_and_report(data_dir, run_dir, extra, params_file=None):
    """Train; return rank-0's per-step records, how far this rank's parameters are from the
    single-process ones (expert slices compared by global expert index; sharded FSDP parameters
    gathered whole), and what this rank holds (parameter elements, optimizer bytes)."""
    from moetrain.model.experts import GroupedExperts
    from moetrain.model.transformer import canonical_name
    from moetrain.parallel.fsdp import full_tensor, local_numel
    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    trainer = Trainer(layout_cfg(data_dir, run_dir, *extra), quiet=True)
    deferred = _count_deferred(trainer.engine.model.runtime.expert_grads)
    launched = _launched_before_finish(trainer.engine.optimizer.reduction)
    norms = group_norm_probe(trainer)
    trainer.fit()
    records = _with_groups(read_metrics(run_dir / "metrics.jsonl"), norms) if trainer.par.is_main else None
    max_err = None
    if params_file is not None:
        ref = torch.load(params_file, weights_only=True)
        offsets = {
            f"{canonical_name(n)}.{pn}": (m.expert_offset, m.num_experts)
            for n, m in trainer.engine.model.named_modules()
            if isinstance(m, GroupedExperts)
            for pn, _ in m.named_parameters(recurse=False)
        }
        max_err, worst = 0.0, None
        for name, p in trainer.engine.model.named_parameters():
            name = canonical_name(name)
            p = full_tensor(p.detach())  # collective for DTensors: every rank walks the same names
            expected = ref[name]
            if name in offsets:
                first, count = offsets[name]
                expected = expected[first : first + count]
            # In units of 1e-5·(1 + |expected|): ≤ 1 means within 1e-5, relative or absolute. (Adam
            # divides by sqrt(v) + eps: for elements whose gradient is near eps, fp32 reassociation
            # across layouts moves the update by up to ~1e-5 absolute over a few steps.)
            err = ((p.detach() - expected).abs() / (1e-5 * (1 + expected.abs()))).max().item()
            if err > max_err:
                max_err, worst = err, (name, (p.detach() - expected).abs().max().item())
    held = {
        "param_numel": local_numel(trainer.engine.model),
        "param_tensors": len(list(trainer.engine.model.parameters())),
        "optim_bytes": trainer.engine.optimizer.memory_bytes(),
        "deferred": deferred,
        "launched": launched,
    }
    return records, (max_err, worst) if params_file is not None else None, held


def _count_deferred(expert_grads) -> list[int]:
    """A list that counts the weight gradients `expert_grads` deferred (returned None for)."""
    count = [0]
    if expert_grads is not None:
        weight_grad = expert_grads.weight_grad

        def counting(*args):
            out = weight_grad(*args)
            count[0] += out is None
            return out

        expert_grads.weight_grad = counting
    return count


def _launched_before_finish(reduction) -> list[bool]:
    """Per step, whether every bucket of a `GradReducer` had started its reduction during
    backward, before `finish()` (empty for reductions without buckets)."""
    seen = []
    if hasattr(reduction, "buckets"):
        finish = reduction.finish

        def recording():
            seen.append(all(b.launched for b in reduction.buckets))
            finish()

        reduction.finish = recording
    return seen


def rank_layouts(data_dir, tmp, layouts, params_file):
    import torch.distributed as dist

    out = {}
    for name, extra in layouts:
        run_dir = tmp / name
        out[name] = train_and_report(data_dir, run_dir, extra, params_file)
        dist.barrier()
    return out


def single_run(data_dir, tmp, *extra):
    """Train `layout_cfg` with `extra` on this process in tmp/run: (its records, the file of its
    final parameters by canonical name), the reference the layouts are checked against."""
    from moetrain.model.transformer import canonical_name
    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    trainer = Trainer(layout_cfg(data_dir, tmp / "run", *extra), quiet=True)
    norms = group_norm_probe(trainer)
    trainer.fit()
    params_file = tmp / "params.pt"
    torch.save({canonical_name(n): p.detach().clone() for n, p in trainer.engine.model.named_parameters()}, params_file)
    return _with_groups(read_metrics(tmp / "run" / "metrics.jsonl"), norms), params_file


def _with_groups(records, norms):
    """metrics.jsonl's records, each with its step's parameter-group gradient norms
    (`moetrain check-layout`'s probe: src/moetrain/layout_check.py)."""
    return [{**r, "groups": dict(zip(GROUPS, n))} for r, n in zip(records, norms, strict=True)]


@pytest.fixture(scope="module")
def reference(real_text_dir, tmp_path_factory):
    return single_run(real_text_dir, tmp_path_factory.mktemp("single"))


def check(records, reference_records):
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, want in zip(records, reference_records):
        for key in ("lm_loss", "loss", "grad_norm", "lb_loss", "z_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key, got[key], want[key])
        # each parameter group's reduced gradient, every element counted once over the ranks
        for group, norm in want["groups"].items():
            assert got["groups"][group] == pytest.approx(norm, rel=1e-5), (got["step"], group, got["groups"], norm)
        assert got["expert_load_max_over_mean"] == pytest.approx(want["expert_load_max_over_mean"], rel=1e-6)


A2A = "parallel.dispatcher=alltoall"
FSDP = "parallel.stack=fsdp"
SHARD = "parallel.shard_optimizer=true"
CAPPED = ["parallel.ep=2", "parallel.capacity_factor=0.6", "parallel.capacity_min_rows=0"]
DEFAULT = ["parallel.ep=2", "parallel.capacity_factor=1.25", "parallel.capacity_min_rows=1024"]  # named
CHUNKED_LOSS = "compute.loss_chunk_tokens=48"  # 64 tokens per rank per micro-batch: 48 + 16
INTERLEAVED = "parallel.pp_schedule=interleaved-1f1b"  # 2 stages per rank: 4 stages of 1 block
DEFER = "compute.defer_expert_weight_grad=true"  # the step's 2 micro-batches: one expert GEMM


LAYOUT_GROUPS = [
    (
        2,
        [
            ("dp2", ["parallel.ep=1"]),
            ("dp2ep2", ["parallel.ep=2"]),
            ("dp2ep2-alltoall", ["parallel.ep=2", A2A]),
            ("dp2ep2-capped", CAPPED),
            ("dp2ep2-default", DEFAULT),
            ("dp2-sharded", [SHARD]),
            ("dp2ep2-chunked-loss", ["parallel.ep=2", CHUNKED_LOSS]),
            ("dp2ep2-overlap2", ["parallel.ep=2", "parallel.overlap_chunks=2"]),
            ("dp2ep2-overlap2-deferred", ["parallel.ep=2", "parallel.overlap_chunks=2", DEFER]),
            ("dp2ep2-overlap3-tokens", ["parallel.ep=2", "parallel.overlap_chunks=3"]),  # 3 ∤ 4 experts
            ("cp2", ["parallel.cp=2"]),
            ("cp2ep2-sharded", ["parallel.cp=2", "parallel.ep=2", SHARD]),
        ],
    ),
    (
        4,
        [
            ("dp4ep4", ["parallel.ep=4"]),
            ("dp4ep2", ["parallel.ep=2"]),
            ("dp4ep4-alltoall", ["parallel.ep=4", A2A]),
            ("dp4ep2-sharded", ["parallel.ep=2", SHARD]),
            ("dp4ep4-overlap2-recompute", ["parallel.ep=4", "parallel.overlap_chunks=2", "compute.recompute=full"]),
            ("dp4ep2-sharded-deferred-recompute", ["parallel.ep=2", SHARD, DEFER, "compute.recompute=full"]),
            ("cp2dp2ep4-alltoall", ["parallel.cp=2", "parallel.ep=4", A2A]),
            ("cp2dp2ep2-recompute", ["parallel.cp=2", "parallel.ep=2", "compute.recompute=full"]),
        ],
    ),
    (
        2,
        [
            ("fsdp2", [FSDP]),
            ("fsdp2-recompute", [FSDP, "compute.recompute=full"]),
            ("fsdp2-chunked-loss", [FSDP, CHUNKED_LOSS]),
            ("fsdp2-deferred", [FSDP, DEFER]),
            ("fsdp-cp2", [FSDP, "parallel.cp=2"]),
        ],
    ),
    (4, [("fsdp4", [FSDP]), ("fsdp2-cp2", [FSDP, "parallel.cp=2"])]),
    (
        2,
        [
            ("pp2", ["parallel.pp=2"]),
            ("pp2-interleaved", ["parallel.pp=2", INTERLEAVED]),
            ("pp2-interleaved-deferred", ["parallel.pp=2", INTERLEAVED, DEFER]),
            ("pp2-gpipe-recompute", ["parallel.pp=2", "parallel.pp_schedule=gpipe", "compute.recompute=full"]),
        ],
    ),
    (
        4,
        [
            ("pp2dp2ep2", ["parallel.pp=2", "parallel.ep=2"]),
            ("pp2dp2ep2-interleaved-alltoall-sharded", ["parallel.pp=2", "parallel.ep=2", INTERLEAVED, A2A, SHARD]),
            ("pp2dp2", ["parallel.pp=2", "parallel.dp=2"]),
            ("pp2dp2-deferred", ["parallel.pp=2", "parallel.dp=2", DEFER]),
            ("pp2cp2-interleaved", ["parallel.pp=2", "parallel.cp=2", INTERLEAVED]),
            (
                "pp2dp2ep2-overlap2-selective",
                ["parallel.pp=2", "parallel.ep=2", "parallel.overlap_chunks=2", "compute.recompute=selective"],
            ),
        ],
    ),
]


@pytest.fixture(scope="module")
def layout_results(real_text_dir, reference, tmp_path_factory):
    """Factory: per rank, {layout name: `train_and_report`} for every layout of LAYOUT_GROUPS at
    `world` ranks, trained in one spawned group per world size (a group's start-up once)."""
    _, params_file = reference
    done = {}

    def get(world):
        if world not in done:
            layouts = [layout for w, group in LAYOUT_GROUPS if w == world for layout in group]
            tmp = tmp_path_factory.mktemp(f"layouts-world{world}")
            done[world] = run_distributed(rank_layouts, world, real_text_dir, tmp, layouts, params_file)
        return done[world]

    return get


@pytest.mark.parametrize("world, layouts", LAYOUT_GROUPS)
def test_layouts_match_single_process(reference, layout_results, world, layouts):
    """The dispatchers (sync-free `nosync` padded, and exact `alltoall`), the sharded
    optimizer, the FSDP2 stack (which holds 1/dp of the parameters and AdamW state per rank) and
    pipeline parallelism (1F1B, interleaved 1F1B with two stages per rank, GPipe with recompute;
    alone and composed with dp and ep; the step's 2 micro-batches are the pipeline's), and the
    experts' weight gradients deferred to the step's last backward under ep with an overlapped
    exchange, the sharded optimizer with recompute, FSDP and pipelines (interleaved; with dp,
    whose expert buckets must still be reduced during backward), reproduce
    the single-process run, nosync under its default settings too (their floor gives these small
    micro-batches every row, so nothing is dropped); a capacity that binds drops and says so."""
    ref_records, params_file = reference
    results = layout_results(world)
    for name, extra in layouts:
        records = results[0][name][0]
        if extra is CAPPED:
            assert all(r["dropped_token_frac"] > 0 for r in records), [r["dropped_token_frac"] for r in records]
            assert all(r["lm_loss"] == r["lm_loss"] for r in records)  # finite, not NaN
            continue
        check(records, ref_records)
        assert all(r["dropped_token_frac"] == 0 for r in records)
        # deferred: each step's first backward gave no expert weight gradient, on every rank, and
        # the buckets of the gradients that came in the last backward alone were still reduced
        # during it (a pipeline step's reducer counts one pass for them)
        assert all((per_rank[name][2]["deferred"][0] > 0) == (DEFER in extra) for per_rank in results), name
        if DEFER in extra:
            assert all(all(per_rank[name][2]["launched"]) for per_rank in results), name
        for rank, per_rank in enumerate(results):
            assert per_rank[name][1][0] <= 1.0, (name, rank, per_rank[name][1])
        if any(e.startswith("parallel.pp=") for e in extra):
            # Each pipeline rank holds about half of the parameters, none twice across stages.
            total = sum(p.numel() for p in torch.load(params_file, weights_only=True).values())
            held = [per_rank[name][2]["param_numel"] for per_rank in results]
            assert all(h < 0.75 * total for h in held), (held, total)
        if FSDP in extra:
            # Each rank holds ~1/dp of the parameters and of the AdamW moments (8 bytes/element,
            # plus a 4-byte step count per tensor).
            total = sum(p.numel() for p in torch.load(params_file, weights_only=True).values())
            held = [per_rank[name][2] for per_rank in results]
            assert sum(h["param_numel"] for h in held) == total, held
            for h in held:
                assert h["param_numel"] <= 1.1 * total / world, (h, total)
                assert h["optim_bytes"] == 8 * h["param_numel"] + 4 * h["param_tensors"], (h, total)


@pytest.mark.parametrize(
    "parallel, world, words",
    [
        (["parallel.dp=3"], 4, ["pp=1 × dp=3", "world size 4"]),
        (["parallel.ep=3"], 6, ["parallel.ep=3", "num_experts=8"]),
        (["parallel.ep=4"], 2, ["parallel.ep=4", "parallel.dp=2", "--nproc-per-node=4"]),
        (["parallel.pp=3", "train.micro_batch_size=2"], 4, ["parallel.pp=3", "world size 4"]),
        (["parallel.pp=2", "parallel.dp=1"], 4, ["pp=2 × dp=1", "parallel.dp=2"]),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_stages_per_rank=4"],
            2,
            ["model.n_layers=4", "pp_stages_per_rank=4", "8 pipeline stages"],
        ),
        (["parallel.pp=4"], 4, ["at least parallel.pp=4 micro-batches", "= 2", "train.micro_batch_size"]),
        (
            ["train.micro_batch_size=6", "train.global_batch_size=12"],
            4,
            ["train.micro_batch_size=6", "4 data-parallel"],
        ),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b"], 2, []),
    ],
)
def test_impossible_layouts_fail_before_any_work(parallel, world, words):
    """`RunConfig.validate(world_size)` (what the trainer and the planner call) refuses layouts
    that cannot run, naming the fields; the rules that need no world size fire already when the
    config is resolved."""
    overrides = ["model.n_layers=4", "train.global_batch_size=8", "train.micro_batch_size=4", *parallel]
    if not words:  # a possible layout, for contrast
        cfg = resolve_config("tiny", overrides)
        dims = cfg.build_dims(world)
        assert (dims.world_size, dims.pp, dims.stages_per_rank) == (world, 2, 2)
        return
    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", overrides).validate(world_size=world)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["parallel.stack=fsdp", "parallel.ep=2"], ["parallel.stack=fsdp", "parallel.ep=1", "parallel.ep=2"]),
        (["parallel.stack=fsdp", "parallel.shard_optimizer=true"], ["parallel.shard_optimizer", "parallel.stack=fsdp"]),
        (["parallel.stack=fsdp", "parallel.pp=2"], ["parallel.stack=fsdp", "parallel.pp=1", "parallel.stack=ddp"]),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_stages_per_rank=1"],
            ["interleaved-1f1b", "pp_stages_per_rank ≥ 2", "got 1"],
        ),
        (["parallel.pp=2", "parallel.pp_stages_per_rank=2"], ["pp_stages_per_rank=2", "interleaved-1f1b"]),
        (["parallel.pp_schedule=interleaved-1f1b"], ["parallel.pp=1", "parallel.pp ≥ 2"]),
        (["parallel.pp_schedule=zigzag"], ["parallel.pp_schedule", "zigzag", "1f1b"]),
    ],
)
def test_fsdp_stack_rejects_expert_parallelism_and_the_sharded_optimizer(overrides, words):
    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", overrides)
    for word in words:
        assert word in str(e.value)
