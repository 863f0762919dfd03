"""`moetrain check-layout` on gloo ranks: a sound layout passes; the faults users reported in MoE
stacks, planted into the layout's ranks (the one-process reference runs in a child process, out
of their reach), fail it, naming the quantity that shows them. That every layout of the suite
passes the check's per-group comparison is tested with the layouts themselves
(tests/parallel/test_layouts.py, `check`)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from support.distributed import run_distributed

SMALL = [
    "--device=cpu",
    "--steps=3",
    "--model.vocab_size=512",
    "--model.d_model=64",
    "--model.n_layers=3",
    "--model.moe.expert_hidden=32",
    "--data.seq_len=32",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=4",
]


def _check(data_dir, argv: list[str], fault: str | None):
    """`moetrain check-layout tiny` with `argv` on this rank, after planting `fault`: (exit code,
    stdout)."""
    if fault is not None:
        FAULTS[fault]()
    from moetrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["check-layout", "tiny", f"--data.sources=[{data_dir}]", *SMALL, *argv])
    return code, out.getvalue()


def _experts_summed_not_averaged():
    """Expert gradients reduced over their replicas without the division by their count (2)."""
    from moetrain.optim import grad_reducer

    finish = grad_reducer.GradReducer.finish

    def summed(self):
        finish(self)
        for b in self.buckets:
            if b.group is not None and b.params[0].ndim == 3:  # an expert bucket: (E, ·, ·) weights
                b.flat.mul_(2)

    grad_reducer.GradReducer.finish = summed


def _router_not_reduced():
    """The routers' gradients left out of the data-parallel reduction (each rank keeps its own)."""
    from moetrain.model.router import Router
    from moetrain.optim import grad_reducer

    reduced = grad_reducer.reduced_param_ids

    def without_router(model, state):
        return reduced(model, state) - {id(m.weight) for m in model.modules() if isinstance(m, Router)}

    grad_reducer.reduced_param_ids = without_router


def _norm_counts_expert_shards_once():
    """The global gradient norm takes this rank's experts for all of them (no sum over ep)."""
    from moetrain.optim import clip, replicated

    def one_rank(grads, expert_grads, ep_group=None, pp_group=None):
        return clip.global_grad_norm(grads, expert_grads, None, pp_group)

    replicated.global_grad_norm = one_rank


def _stage_not_reduced():
    """The second pipeline stage's gradients not reduced over its data-parallel replicas."""
    import torch.distributed as dist

    from moetrain.optim import grad_reducer

    launch = grad_reducer.GradReducer._launch

    def skip_stage_1(self, bucket):
        if dist.get_rank() >= 2:  # pp2·dp2: ranks 2 and 3 are stage 1
            bucket.launched = True
            return
        launch(self, bucket)

    grad_reducer.GradReducer._launch = skip_stage_1


FAULTS = {
    "experts summed": _experts_summed_not_averaged,
    "router not reduced": _router_not_reduced,
    "norm counts expert shards once": _norm_counts_expert_shards_once,
    "stage not reduced": _stage_not_reduced,
}


def test_a_sound_layout_passes_and_says_so(real_text_dir):
    (code, out), (code1, out1) = run_distributed(_check, 2, real_text_dir, ["--parallel.ep=2", "--json"], None)
    assert (code, code1, out1) == (0, 0, "")  # rank 0 reports
    result = json.loads(out)
    assert result["ok"] and result["failed"] == [] and result["precision"] == "fp32", result
    assert result["world_size"] == 2 and len(result["steps"]) == 3
    q = result["quantities"]
    assert {"lm_loss", "grad_norm", "embeddings", "attention", "router", "routed_experts", "head"} <= set(q)
    for v in q.values():  # step 1 from the same parameters: rounding alone; later steps within theirs
        assert v["first_step_rel_diff"] <= v["rtol"][0] and v["later_max_rel_diff"] <= v["rtol"][1], q
    assert all(s["layout"]["groups"]["routed_experts"] > 0 for s in result["steps"])


def test_bf16_gradients_are_held_to_the_bf16_tolerances(real_text_dir):
    """optim.grad_dtype=bf16 rounds the gradients a layout sums in another order than one process:
    fp32 compute, but a sound dp2 layout differs by bf16's rounding, which fp32's tolerances fail."""
    code, out = run_distributed(_check, 2, real_text_dir, ["--optim.grad_dtype=bf16", "--json"], None)[0]
    result = json.loads(out)
    assert code == 0 and result["ok"] and result["precision"] == "bf16", result


def test_random_routing_on_several_ranks_is_refused(real_text_dir):
    """Each rank draws its tokens' experts from its own generator: the layout and the reference
    route differently, so the check would fail a sound layout; it is refused, naming the key."""
    code, err = run_distributed(_check_err, 2, real_text_dir, ["--model.moe.routing=random"])[0]
    assert code == 2 and "model.moe.routing=random" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "fault, world, layout, named",
    [
        ("experts summed", 2, [], "routed_experts"),
        ("router not reduced", 2, ["--parallel.ep=2"], "router"),
        # experts most of the norm, as in a real MoE (at SMALL's size the embeddings dominate it)
        ("norm counts expert shards once", 2, ["--parallel.ep=2", "--model.moe.expert_hidden=256"], "grad_norm"),
        ("stage not reduced", 4, ["--parallel.pp=2", "--parallel.dp=2"], "head"),
    ],
)
def test_a_planted_fault_fails_naming_its_group(real_text_dir, fault, world, layout, named):
    results = run_distributed(_check, world, real_text_dir, layout, fault)
    code, out = results[0]
    assert code == 1, out
    assert "FAILED: " in out and named in out.splitlines()[-1], out
    row = next(line for line in out.splitlines() if line.startswith(named + " "))
    assert row.split()[-1] != "-", row  # the first step past the tolerance is named


def test_an_fsdp_reference_checks_the_layout_on_every_rank(real_text_dir):
    """--reference=fsdp (what auto takes for a model one device cannot hold): the FSDP stack over
    the launch's ranks is the reference; a sound ep2 layout passes against it, and a router left
    out of the ddp stack's reduction (which FSDP does not use) fails naming the router."""
    sound = run_distributed(_check, 2, real_text_dir, ["--parallel.ep=2", "--json", "--reference=fsdp"], None)
    result = json.loads(sound[0][1])
    assert sound[0][0] == 0 and result["ok"] and result["reference"] == "fsdp over 2 ranks", result
    assert result["reference_why"] == "as --reference asked" and sound[1] == (0, "")
    argv = ["--parallel.ep=2", "--reference=fsdp"]
    code, out = run_distributed(_check, 2, real_text_dir, argv, "router not reduced")[0]
    assert code == 1 and out.startswith("reference: fsdp over 2 ranks") and "router" in out.splitlines()[-1], out


@pytest.mark.parametrize(
    "layout",
    [["--parallel.ep=2"], ["--parallel.cp=2", "--parallel.ep=2"], ["--parallel.pp=2"]],
    ids=["dp2ep2", "cp2ep2", "pp2"],
)
def test_local_blocks_check_out_under_every_layout(real_text_dir, layout):
    """A model with local blocks (a window of 6 positions, every other block) against one process:
    data and expert parallelism, context parallelism's chunks of 8 positions, and pipeline
    stages, each block keeping its own window."""
    argv = [*layout, "--model.sliding_window=6", "--model.attention_pattern=LG", "--json"]
    code, out = run_distributed(_check, 2, real_text_dir, argv, None)[0]
    result = json.loads(out)
    assert code == 0 and result["ok"], result


def test_auto_takes_one_process_where_it_fits_and_fsdp_where_it_does_not(monkeypatch):
    """The planner's one-process peak of tiny against the machine's memory, and against 1 MiB."""
    import torch

    from moetrain.layout_check import reference_kind
    from moetrain.plan import hardware
    from moetrain.presets import resolve_config

    cfg, cpu = resolve_config("tiny", ["train.device=cpu"]), torch.device("cpu")
    kind, why = reference_kind(cfg, cpu, 4)
    assert kind == "one" and "fits" in why, why
    monkeypatch.setattr(hardware, "device_memory", lambda device: (2**20, None))
    kind, why = reference_kind(cfg, cpu, 4)
    assert kind == "fsdp" and "of the 0.0 GiB of one device" in why and "4 ranks" in why, why
    assert reference_kind(cfg, cpu, 1)[0] == "one"  # one rank: nothing else to hold it


def test_an_fsdp_reference_the_batch_cannot_split_is_refused(real_text_dir):
    """pp3 with micro-batches of 2 sequences: 3 FSDP ranks cannot split them, so the FSDP
    reference is refused before any step, naming it."""
    argv = ["--parallel.pp=3", "--train.micro_batch_size=2", "--reference=fsdp"]
    code, out = run_distributed(_check_err, 3, real_text_dir, argv)[0]
    assert code == 2 and "the FSDP reference" in out and "micro_batch_size" in out and "Traceback" not in out, out


def _check_err(data_dir, argv):
    """`moetrain check-layout tiny` with `argv`: (exit code, stderr)."""
    from moetrain.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["check-layout", "tiny", f"--data.sources=[{data_dir}]", *SMALL, *argv])
    return code, err.getvalue()


@pytest.mark.parametrize(
    "argv, named", [(["--steps", "0"], "--steps=0"), (["--rtol", "0", "1e-3"], "--rtol 0.0 0.001")]
)
def test_bad_flags_are_refused_in_one_paragraph(capsys, argv, named):
    from moetrain.cli import main

    assert main(["check-layout", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err
