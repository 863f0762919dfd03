"""Expert-parallel dispatchers on two GPUs over NCCL (skipped with fewer than two GPUs): nosync
against the exact `AllToAllDispatcher` (its default with capacity and spill rows on learned
routing, its padded mode on skewed routing too: everything to rank 0 overflows the default's
capacity by design). Two MoE layers run back to back."""

import pytest
import torch
from support.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

D, E, K, F, B, T = 256, 8, 2, 128, 2, 128


def _two_layers(dispatcher_cls, rank, device, skew):
    from moetrain.model.config import MoEConfig
    from moetrain.model.experts import GroupedExperts
    from moetrain.model.moe import MoE

    layers = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        moe = MoE(D, MoEConfig(num_experts=E, top_k=K, expert_hidden=F))
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.05)
            if skew:
                moe.router.expert_bias_E[:2] = 10.0  # every token to rank 0's experts
        disp = dispatcher_cls()
        L = disp.num_local_experts
        local = GroupedExperts(L, D, F, expert_offset=rank * L)
        with torch.no_grad():
            local.w_gate_up_E2FD.copy_(moe.experts.w_gate_up_E2FD[rank * L : (rank + 1) * L])
            local.w_down_EDF.copy_(moe.experts.w_down_EDF[rank * L : (rank + 1) * L])
        moe.experts, moe.dispatcher = local, disp
        layers.append(moe.to(device))
    return layers


def compare_on_gpus():
    import torch.distributed as dist

    from moetrain.parallel.exact_dispatchers import AllToAllDispatcher
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher

    rank, group = dist.get_rank(), dist.group.WORLD
    device = torch.device("cuda", rank)
    kinds = {
        "alltoall": lambda: AllToAllDispatcher(E, group, group),
        "nosync": lambda: NoSyncDispatcher(E, group, group),
        "nosync-padded": lambda: NoSyncDispatcher(E, group, group, capacity_factor=None),
    }
    out = {}
    for skew in (False, True):
        g = torch.Generator().manual_seed(10 + rank)
        x0, grad = torch.randn(B, T, D, generator=g).to(device), torch.randn(B, T, D, generator=g).to(device)
        res = {}
        for name, make in kinds.items():
            layers = _two_layers(make, rank, device, skew)
            x = x0.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layers[1](layers[0](x))
            (y.float() * grad).sum().backward()
            res[name] = [y.detach().float(), x.grad] + [
                p.grad.float() for m in layers for p in m.parameters() if p.grad is not None
            ]
        for name in ("nosync-padded",) if skew else ("nosync", "nosync-padded"):
            diffs = [
                ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
                for a, b in zip(res[name], res["alltoall"])
            ]
            out[f"{name}{'-skew' if skew else ''}"] = {
                "max_rel": max(diffs),
                "finite": all(bool(torch.isfinite(t).all()) for t in res[name]),
            }
    return out


def test_nosync_matches_the_exact_dispatcher_on_two_gpus():
    for r in run_distributed(compare_on_gpus, 2, backend="nccl", timeout_s=300):
        for name, v in r.items():
            assert v["finite"] and v["max_rel"] < 1e-2, (name, v)


def _check_layout_on_gpus(data_dir):
    """`moetrain check-layout tiny --parallel.ep=2` on this rank's GPU, its one-process reference
    on the first: (exit code, stdout)."""
    import contextlib
    import io

    from moetrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["check-layout", "tiny", f"--data.sources=[{data_dir}]", "--device=cuda", "--steps=3"]
        code = main([*argv, "--parallel.ep=2", "--json"])
    return code, out.getvalue()


def test_check_layout_passes_an_expert_parallel_layout_over_nccl(real_text_dir):
    """The command users run before a large job, on two GPUs: dp2·ep2 against one process, each
    quantity within the bf16 tolerance."""
    import json

    (code, out), (code1, out1) = run_distributed(_check_layout_on_gpus, 2, real_text_dir, backend="nccl", timeout_s=600)
    assert (code, code1, out1) == (0, 0, ""), out
    result = json.loads(out)
    assert result["ok"] and result["failed"] == [] and result["world_size"] == 2, result
