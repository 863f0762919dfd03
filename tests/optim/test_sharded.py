"""`ShardedAdamW` (sharded AdamW state) reproduces GradReducer + torch AdamW + torch's clipping
in the same layout (within 1e-6 absolute) and the single-process run (within 1e-5, relative or
absolute, as in test_layouts.py); it holds 1/dp of the optimizer state; its full-moment state
dict matches torch AdamW's, and a checkpoint of it resumes exactly. (fp32, gloo, CPU ranks.)

One spawn per world size; each rank runs its layouts' checks and returns plain numbers/arrays.
"""

import contextlib
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.steps import carry_checkpoint, saved_state

from moetrain.model.config import MoEConfig, TransformerConfig
from moetrain.optim.config import OptimConfig

STEPS, MICRO = 3, 2
ROWS, SEQ = 4, 16
"""Sequences per global micro-batch (divisible by every dp here) and their length."""
MODEL = TransformerConfig(
    vocab_size=64,
    d_model=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
)
# grad_clip is below the gradient norms of these steps: clipping is active.
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5)


def make_state(ep: int, world: int):
    import torch.distributed as dist

    from moetrain.parallel.config import ParallelConfig
    from moetrain.parallel.dims import ParallelState

    rank = dist.get_rank() if world > 1 else 0
    dims = ParallelConfig(ep=ep).build(world)
    return ParallelState.create(dims, "cpu", rank)


def build_model(state):
    from moetrain.parallel.config import ParallelConfig
    from moetrain.parallel.expert_parallel import apply_expert_parallel

    model = MODEL.build(device="meta")
    # nosync padded: the default's capacity would drop some of these 16-token micro-batches'
    # assignments, and the layouts are compared with the single process.
    apply_expert_parallel(model, state, ParallelConfig(ep=state.dims.ep, capacity_factor=None))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    model.runtime.backward_scale = 1.0 / MICRO / state.dims.dp  # as the trainer sets it
    return model


class ReferenceOptimizer:
    """The replicated stack behind ShardedAdamW's interface: GradReducer + torch AdamW + clip."""

    def __init__(self, model, state, cfg):
        from moetrain.optim.base import build_torch_style
        from moetrain.optim.grad_reducer import GradReducer, NoReduction, expert_param_ids

        self.reducer = GradReducer(model, state) if state.dims.dp > 1 else None
        self.reduction = self.reducer if self.reducer is not None else NoReduction()
        expert_ids = expert_param_ids(model)
        self.expert = [p for p in model.parameters() if id(p) in expert_ids]
        self.dense = [p for p in model.parameters() if id(p) not in expert_ids]
        self.optimizer = build_torch_style(model, cfg)
        self.ep_group = state.group("ep")

    def clip_grad_norm(self, max_norm):
        """torch's clipping to the norm of the whole model: the experts' squared norm summed
        over the expert-parallel group (each rank holds its own experts)."""
        import torch.distributed as dist

        dense = torch.nn.utils.get_total_norm([p.grad for p in self.dense if p.grad is not None])
        expert_sq = torch.nn.utils.get_total_norm([p.grad for p in self.expert if p.grad is not None]).square()
        if self.ep_group is not None:
            dist.all_reduce(expert_sq, group=self.ep_group)
        total = (dense.square() + expert_sq).sqrt()
        torch.nn.utils.clip_grads_with_norm_(self.dense + self.expert, max_norm, total)
        return total

    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        if self.reducer is not None:
            self.reducer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)


def micro_batch(step, micro, state):
    """This rank's rows of a random global micro-batch (the same tokens in every layout)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, MODEL.vocab_size, (ROWS, SEQ + 1), generator=g)
    rows = ROWS // state.dims.dp
    mine = tokens[state.index("dp") * rows : (state.index("dp") + 1) * rows]
    return mine[:, :-1], mine[:, 1:]


def train(model, opt, state, steps, first_step=0):
    """Train like Trainer.train_step; return the gradient norms before clipping."""
    norms = []
    for step in range(first_step, first_step + steps):
        for micro in range(MICRO):
            opt.reduction.prepare(sync=micro == MICRO - 1)
            inputs_BT, targets_BT = micro_batch(step, micro, state)
            logits_BTV = model(inputs_BT)
            loss = F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())
            (loss / MICRO * opt.reduction.loss_scale).backward()
        if hasattr(opt, "buckets"):  # the reduce-scatters started during backward, not in finish()
            assert all(b.launched for b in opt.buckets)
        opt.reduction.finish()
        norms.append(opt.clip_grad_norm(OPTIM.grad_clip).item())
        opt.set_lr(OPTIM.lr * (step + 1) / (first_step + steps))
        opt.step()
        opt.zero_grad()
        for moe in model.moe_layers():
            moe.end_step()
    return norms


def named_params(model):
    """Canonical name → (numpy array, first global expert index or None)."""
    from moetrain.model.experts import GroupedExperts
    from moetrain.model.transformer import canonical_name

    firsts = {
        f"{canonical_name(n)}.{pn}": m.expert_offset
        for n, m in model.named_modules()
        if isinstance(m, GroupedExperts)
        for pn, _ in m.named_parameters(recurse=False)
    }
    return {
        canonical_name(n): (p.detach().numpy().copy(), firsts.get(canonical_name(n)))
        for n, p in model.named_parameters()
    }


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def held(model, opt) -> SimpleNamespace:
    """`model` and `opt` as a checkpoint sees them (`TrainEngine.checkpoint_state` and
    `checkpoint_loaded`)."""
    from moetrain.train.checkpoint_io import checkpoint_entries

    return SimpleNamespace(
        checkpoint_state=lambda: checkpoint_entries(model, opt.checkpoint_masters(), opt.checkpoint_tensors()),
        checkpoint_loaded=opt.checkpoint_loaded,
    )


def check_layout(ep: int, world: int, run_dir) -> dict:
    """Everything one layout checks on one rank; plain Python and numpy results."""
    from moetrain.model.transformer import canonical_name
    from moetrain.optim.sharded import ShardedAdamW
    from moetrain.train.checkpoint_io import optimizer_state_dict

    state = make_state(ep, world)
    ref_model = build_model(state)
    ref_opt = ReferenceOptimizer(ref_model, state, OPTIM)
    ref_norms = train(ref_model, ref_opt, state, STEPS)

    model = build_model(state)
    opt = ShardedAdamW(model, state, OPTIM)
    norms = train(model, opt, state, STEPS)
    param_err = max_abs_diff(
        {n: p.detach() for n, p in model.named_parameters()}, {n: p.detach() for n, p in ref_model.named_parameters()}
    )
    after = named_params(model)

    # The moments saved from the shards, read back whole, are torch AdamW's moments.
    moments = saved_state(held(model, opt), run_dir / "moments")["optim"]
    ref_moments = optimizer_state_dict(
        ref_model,
        {
            canonical_name(n): {k: ref_opt.optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq", "step")}
            for n, p in ref_model.named_parameters()
        },
    )
    moment_err = max(  # relative to each tensor's largest entry
        float((moments[k] - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
        for k, ref in ref_moments.items()
        if not k.endswith(".step")
    )
    assert all(int(moments[k]) == int(ref) for k, ref in ref_moments.items() if k.endswith(".step"))

    # Round trip: a fresh model + optimizer loading a checkpoint of them continues bit-for-bit
    # like the original.
    model2 = build_model(state)
    opt2 = ShardedAdamW(model2, state, OPTIM)
    carry_checkpoint(held(model, opt), run_dir, held(model2, opt2))
    moments2 = saved_state(held(model2, opt2), run_dir / "moments2")["optim"]
    assert moments2.keys() == moments.keys()
    roundtrip_moment_err = max(float((moments2[k] - moments[k]).abs().max()) for k in moments)
    train(model, opt, state, 1, first_step=STEPS)
    train(model2, opt2, state, 1, first_step=STEPS)
    roundtrip_param_err = max_abs_diff(
        {n: p.detach() for n, p in model.named_parameters()}, {n: p.detach() for n, p in model2.named_parameters()}
    )

    local_numel = sum(p.numel() for p in model.parameters())
    return {
        "param_err": param_err,
        "norms": norms,
        "ref_norms": ref_norms,
        "moment_err": moment_err,
        "roundtrip_moment_err": roundtrip_moment_err,
        "roundtrip_param_err": roundtrip_param_err,
        "memory_bytes": opt.memory_bytes(),
        "unsharded_layout_bytes": 12 * local_numel,
        "params": after,
    }


def rank_fn(world: int, eps: list[int], run_dir) -> dict:
    import torch.distributed as dist

    out = {}
    for ep in eps:
        out[ep] = check_layout(ep, world, run_dir / f"ep{ep}")
        dist.barrier()
    return out


@contextlib.contextmanager
def one_thread():
    """One torch thread, like the spawned ranks: for a model this small, intra-op threads only
    add overhead (≈100× slower steps on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single_process():
    """Single-process run with torch AdamW: the parameters every layout must reproduce."""
    with one_thread():
        state = make_state(1, 1)
        model = build_model(state)
        norms = train(model, ReferenceOptimizer(model, state, OPTIM), state, STEPS)
    return {n: a for n, (a, _) in named_params(model).items()}, norms


def total_numel() -> int:
    return sum(p.numel() for p in MODEL.build(device="meta").parameters())


def test_single_process_matches_torch_adamw(single_process, tmp_path):
    """dp = 1: no collectives, every shard is a whole bucket; a checkpoint that lacks a
    parameter's moments is refused by name."""
    from moetrain.errors import CheckpointError
    from moetrain.optim.sharded import ShardedAdamW
    from moetrain.train.checkpoint_io import load_checkpoint, save_checkpoint

    ref_params, ref_norms = single_process
    with one_thread():
        state = make_state(1, 1)
        model = build_model(state)
        opt = ShardedAdamW(model, state, OPTIM)
        norms = train(model, opt, state, STEPS)
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    assert max(ref_norms) > OPTIM.grad_clip, "clipping should be active in this test"
    for name, (got, _) in named_params(model).items():
        np.testing.assert_allclose(got, ref_params[name], rtol=0, atol=1e-6, err_msg=name)
    assert opt.memory_bytes() == 12 * total_numel()
    entries = held(model, opt).checkpoint_state()
    entries["optim"] = {k: v for k, v in entries["optim"].items() if not k.startswith("lm_head.weight.")}
    path = save_checkpoint(tmp_path, 0, entries, {"step": 0})
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_checkpoint(path, held(model, opt).checkpoint_state())


@pytest.mark.parametrize("world, eps", [(2, [1, 2]), (4, [2])], ids=["dp2+dp2ep2", "dp4ep2"])
def test_sharded_adamw_matches_reference_layouts(single_process, world, eps, tmp_path):
    from support.distributed import run_distributed

    ref_params, ref_norms = single_process
    results = run_distributed(rank_fn, world, world, eps, tmp_path)
    full_state_bytes = 12 * total_numel()
    for ep in eps:
        for rank, per_rank in enumerate(results):
            r = per_rank[ep]
            where = f"dp{world} ep{ep} rank {rank}"
            # Same layout, same math: only reduction order differs (reduce-scatter vs all-reduce).
            assert r["param_err"] <= 1e-6, (where, r["param_err"])
            assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-6), where
            assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), where
            assert r["moment_err"] <= 1e-5, (where, r["moment_err"])
            assert r["roundtrip_moment_err"] == 0.0 and r["roundtrip_param_err"] == 0.0, where
            # 1/dp of the single-device state (master + 2 moments), up to padding.
            ratio = r["memory_bytes"] / (full_state_bytes / world)
            assert 1.0 <= ratio <= 1.03, (where, r["memory_bytes"], ratio)
            assert r["memory_bytes"] < r["unsharded_layout_bytes"], where
            for name, (got, first) in r["params"].items():
                want = ref_params[name]
                if first is not None:
                    want = want[first : first + got.shape[0]]
                err = np.max(np.abs(got - want) / (1e-5 * (1 + np.abs(want))))
                assert err <= 1.0, (where, name, float(np.max(np.abs(got - want))))
    for ep in eps:  # the measured figures, for the record (pytest -s shows them)
        print(
            f"dp{world} ep{ep}: memory_bytes per rank {[r[ep]['memory_bytes'] for r in results]}, "
            f"unsharded in this layout {results[0][ep]['unsharded_layout_bytes']}, "
            f"single-device {full_state_bytes}; param_err {[r[ep]['param_err'] for r in results]}"
        )


def _fused_vs_foreach(world: int, ep: int, name: str) -> dict:
    """Train the foreach path (the CPU default) and the fused kernel path side by side, then one
    non-finite step that both must skip — the fused one without reading `skip` on the host."""
    from unittest import mock

    from moetrain.optim.sharded import ShardedAdamW

    state = make_state(ep, world)
    runs = {}
    for fused in (False, True):
        model = build_model(state)
        opt = ShardedAdamW(model, state, dataclasses.replace(OPTIM, fused=fused, name=name))
        norms = train(model, opt, state, STEPS)
        # A step whose gradient is NaN on one rank: the global norm is NaN everywhere.
        for micro in range(MICRO):
            opt.reduction.prepare(sync=micro == MICRO - 1)
            inputs_BT, targets_BT = micro_batch(STEPS, micro, state)
            loss = F.cross_entropy(model(inputs_BT).flatten(0, 1), targets_BT.flatten())
            (loss / MICRO * opt.reduction.loss_scale).backward()
        opt.reduction.finish()
        if state.index("dp") == 0:
            opt.buckets[0].grad_S[0] = float("nan")
        norm = opt.clip_grad_norm(OPTIM.grad_clip)
        skip = ~torch.isfinite(norm)
        live = opt.master_S + [t for s in opt.state_S for t in s.values()]
        before = [t.clone() for t in live]
        params_before = [p.detach().clone() for p in model.parameters()]
        no_host_read = (
            mock.patch.object(torch.Tensor, "__bool__", side_effect=AssertionError("host read"))
            if fused
            else contextlib.nullcontext()
        )
        with no_host_read:
            opt.step(skip)
        opt.zero_grad()
        for moe in model.moe_layers():
            moe.end_step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, live))
        unchanged &= all(torch.equal(a, p.detach()) for a, p in zip(params_before, model.parameters()))
        step_after_skip = float(opt.checkpoint_tensors()["lm_head.weight"]["step"])
        train(model, opt, state, 1, first_step=STEPS + 1)  # training goes on
        runs[fused] = {
            "norms": norms,
            "skip": bool(skip),
            "unchanged": unchanged,
            "step": step_after_skip,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    return {
        "norm_rel": max(abs(a - b) / b for a, b in zip(runs[True]["norms"], runs[False]["norms"])),
        "param_err": max_abs_diff(runs[True]["params"], runs[False]["params"]),
        **{f"{k}_{fused}": runs[fused][k] for fused in (False, True) for k in ("skip", "unchanged", "step")},
    }


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_fused_sharded_adamw_matches_the_foreach_path_and_skips_on_the_device(name):
    """The fused kernel path (CUDA's default; torch's CPU kernel here) gives the foreach path's
    update to rounding, folds clipping into the kernel, and skips a non-finite step with the
    decision left on the device: parameters, master shards, moments and step count unchanged.
    Lion's one path reads nothing on the host either way."""
    from support.distributed import run_distributed

    for r in run_distributed(_fused_vs_foreach, 2, 2, 2, name):
        assert r["norm_rel"] <= 1e-6 and r["param_err"] <= 2e-6, r
        for fused in (False, True):
            assert r[f"skip_{fused}"] and r[f"unchanged_{fused}"], r
            assert r[f"step_{fused}"] == STEPS, r
