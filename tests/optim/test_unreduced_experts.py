"""Experts alone in their data-parallel group (edp = 1, dp = ep) keep their gradients where backward
puts them: `GradReducer` buckets only what it sums (src/moetrain/optim/grad_reducer.py). No copy of an
expert's gradient into a bucket, no accumulation pass at the step's first backward, as at dp = 1;
with edp > 1 they are bucketed and summed as before. Four gloo ranks: dp4·ep4 against dp4·ep2."""

import torch
from conftest import tiny_overrides
from support.distributed import call_each, run_distributed
from support.steps import synthetic_batches
from torch.profiler import ProfilerActivity, profile

from moetrain.model.experts import GroupedExperts
from moetrain.train.engine import TrainEngine

WRITES = {"aten::copy_", "aten::add_", "aten::zero_", "aten::fill_", "aten::mul_"}


def expert_grad_writes(prof, shapes) -> int:
    """In-place writes (copy_, add_, ...) into tensors shaped like an expert weight, from a CPU
    profile with shapes (passive: a dispatch mode would wait on funcol's collectives itself)."""
    return sum(1 for e in prof.events() if e.name in WRITES and e.input_shapes and tuple(e.input_shapes[0]) in shapes)


# 2 rows on each of 4 ranks; an expert width no activation has (the counts go by shape)
ONE_MICRO_BATCH = ["train.global_batch_size=8", "train.micro_batch_size=8", "model.moe.expert_hidden=40"]


def _first_backward(data_dir, run_dir, ep, weights):
    import torch.distributed as dist

    from moetrain.presets import resolve_config
    from moetrain.train.runtime import setup_runtime

    extra = ["train.precision=bf16", "optim.bf16_weights=true"] if weights == "bf16" else []
    cfg = resolve_config(
        "tiny",
        tiny_overrides(
            data_dir, run_dir, "train.device=cpu", f"parallel.ep={ep}", "optim.grad_clip=0", *extra, *ONE_MICRO_BATCH
        ),
    )
    runtime = setup_runtime(cfg)
    torch.manual_seed(0)
    engine = TrainEngine(cfg, runtime.par, runtime.device)
    rank = dist.get_rank()
    experts = [p for m in engine.model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]
    reducer = engine.optimizer.reducer
    bucketed = {id(p) for b in reducer.buckets for p in b.params}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.forward_backward(synthetic_batches(cfg, 0, rank))
    split = engine.optimizer.split
    grads = [split.grad_of(p) if split is not None else p.grad for p in experts]
    loss = [engine.train_step(synthetic_batches(cfg, s, rank), s).lm_loss.item() for s in (1, 2)]
    return {
        "bucketed": sum(id(p) in bucketed for p in experts),
        "unreduced": sum(any(p is q for q in reducer.unreduced) for p in experts),
        "experts": len(experts),
        "writes": expert_grad_writes(prof, {tuple(p.shape) for p in experts}),
        "all_have_grads": all(g is not None for g in grads),
        "losses": loss,
    }


def test_experts_alone_in_their_group_are_not_bucketed_or_copied(real_text_dir, tmp_path):
    runs = [(4, "fp32"), (4, "bf16"), (2, "fp32"), (2, "bf16")]
    args = [(real_text_dir, tmp_path / f"ep{ep}-{w}", ep, w) for ep, w in runs]
    per_rank = run_distributed(call_each, 4, _first_backward, args, timeout_s=400)
    for rank in range(4):
        for (ep, weights), out in zip(runs, per_rank[rank]):
            n = out["experts"]
            assert n > 0 and out["all_have_grads"], out
            if ep == 4:  # edp = 1: nothing to sum
                assert out["bucketed"] == 0 and out["unreduced"] == n, out
                assert out["writes"] == 0, f"ep{ep} {weights}: expert gradients copied or added {out['writes']}×"
            else:  # edp = 2: summed over the expert-replica group, through the buckets
                assert out["bucketed"] == n and out["unreduced"] == 0, out
                assert out["writes"] >= n, out  # each one copied or accumulated into its bucket
            assert all(torch.isfinite(torch.tensor(out["losses"]))), out
