"""The fsdp stack under bf16 compute all-gathers the blocks' parameters in bf16 and reduce-scatters
fp32 gradients (MixedPrecisionPolicy), with the residual stream, embedding and head in fp32; it
trains as the ddp stack does (two gloo ranks, CPU)."""

import torch
from conftest import tiny_overrides
from support.distributed import call_each, run_distributed
from support.steps import synthetic_batches


def _run(args):
    import torch.distributed as dist

    from moetrain.presets import resolve_config
    from moetrain.train.engine import TrainEngine
    from moetrain.train.runtime import setup_runtime

    data_dir, run_dir, stack = args
    cfg = resolve_config(
        "tiny",
        tiny_overrides(data_dir, run_dir, "train.device=cpu", "train.precision=bf16", f"parallel.stack={stack}"),
    )
    runtime = setup_runtime(cfg)
    torch.manual_seed(0)
    engine = TrainEngine(cfg, runtime.par, runtime.device)
    seen = {}

    def record(name):
        def hook(module, _inputs):
            weight = module.weight
            seen[name] = (weight.to_local() if hasattr(weight, "to_local") else weight).dtype

        return hook

    block = engine.model.blocks[str(len(engine.model.blocks) - 1)]
    block.attn.wq.register_forward_pre_hook(record("wq"))
    engine.model.embed.register_forward_pre_hook(record("embed"))
    rank = dist.get_rank()
    losses = []
    for step in range(4):
        losses.append(engine.train_step(synthetic_batches(cfg, step, rank), step).lm_loss.item())
    shard_dtypes = {str(p.dtype) for p in engine.model.parameters()}
    return losses, {k: str(v) for k, v in seen.items()}, shard_dtypes


def test_fsdp_gathers_bf16_and_trains_like_ddp(real_text_dir, tmp_path):
    runs = [((real_text_dir, tmp_path / stack, stack),) for stack in ("fsdp", "ddp")]
    fsdp, ddp = run_distributed(call_each, 2, _run, runs)[0]  # one group, both runs
    (losses, seen, shard_dtypes), (ddp_losses, ddp_seen, _) = fsdp, ddp
    assert seen == {"wq": "torch.bfloat16", "embed": "torch.float32"}, seen  # gathered bf16; root fp32
    assert ddp_seen == {"wq": "torch.float32", "embed": "torch.float32"}
    assert shard_dtypes == {"torch.float32"}  # the shards (masters) and their optimizer stay fp32
    for a, b in zip(losses, ddp_losses):
        assert abs(a - b) <= 1e-4 * b, (losses, ddp_losses)  # bf16 rounding: measured ~2e-5
