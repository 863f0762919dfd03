"""CUDA checks (skipped without a GPU): bf16 grouped GEMM numerics, and a training run."""

import copy
import gc
from types import SimpleNamespace

import pytest
import torch

from moetrain.model.config import MoEConfig
from moetrain.model.moe import MoE

pytestmark = pytest.mark.gpu


def test_bf16_grouped_moe_on_cuda_matches_fp32_cpu():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=256, shared_hidden=128)
    cpu = MoE(512, cfg)
    with torch.no_grad():
        for p in cpu.parameters():
            p.normal_(0, 0.05)
    gpu = MoE(512, cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    cpu.eval(), gpu.eval()
    x = torch.randn(4, 256, 512)
    grad = torch.randn(4, 256, 512)
    x_cpu, x_gpu = x.clone().requires_grad_(), x.cuda().requires_grad_()
    y_cpu = cpu(x_cpu)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_gpu = gpu(x_gpu)
    y_cpu.backward(grad)
    y_gpu.float().backward(grad.cuda())
    scale = y_cpu.abs().mean()
    assert (y_gpu.float().cpu() - y_cpu).abs().mean() < 0.02 * scale
    # bf16 rounds every product: compare gradient directions (the router's gradient is a small
    # difference of bf16 expert outputs, so elementwise relative error is not meaningful).
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        cos = torch.nn.functional.cosine_similarity(q.grad.float().cpu().flatten(), p.grad.flatten(), dim=0)
        assert cos > 0.99, (name, cos.item())


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_tiny_trains_on_cuda(real_text_dir, tmp_path, optimizer):
    from moetrain.presets import resolve_config
    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    cfg = resolve_config(
        "tiny",
        [
            f"data.sources=[{real_text_dir}]",
            f"train.run_dir={tmp_path}",
            "model.vocab_size=512",
            "train.steps=40",
            "train.device=cuda",
            "train.eval_every=20",
            "train.log_every=10",
            "logging.tensorboard=false",
            "logging.plot=false",
            f"optim.name={optimizer}",
        ],
    )
    Trainer(cfg, quiet=True).fit()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[-1]["lm_loss"] < 0.85 * records[0]["lm_loss"]
    assert records[-1]["mfu"] is not None and records[-1]["peak_mem_gib"] > 0


def _tiny_on_cuda(tmp_path, *overrides):
    """tiny on random tokens on the GPU, two micro-batches of 12 sequences a step, then `overrides`."""
    from moetrain.presets import resolve_config

    base = ["data.synthetic=true", f"train.run_dir={tmp_path}", "train.device=cuda", "train.micro_batch_size=12"]
    return resolve_config("tiny", [*base, *overrides])


@pytest.mark.parametrize(
    "compile, recompute, optimizer",
    [
        (False, "none", "parallel.shard_optimizer=false"),
        (True, "none", "parallel.shard_optimizer=false"),
        (True, "selective", "parallel.shard_optimizer=false"),
        (False, "none", "parallel.shard_optimizer=true"),
        (False, "none", "parallel.stack=fsdp"),
        (False, "none", "optim.bf16_weights=false"),  # CUDA's default is true
        (True, "selective", "optim.bf16_weights=false"),
        (False, "none", "optim.name=muon"),
        (True, "none", "optim.name=muon"),
        (False, "none", "optim.name=muon parallel.shard_optimizer=true"),
        (False, "none", "optim.name=muon parallel.stack=fsdp"),
        (False, "none", "optim.name=lion optim.bf16_weights=true"),
        (False, "none", "optim.name=lion parallel.shard_optimizer=true"),
        (False, "none", "optim.name=lion parallel.stack=fsdp"),
        (True, "none", "compute.defer_expert_weight_grad=true"),
        (False, "none", "compute.defer_expert_weight_grad=true optim.bf16_weights=false"),
        (True, "selective", "optim.grad_dtype=bf16"),
        (False, "none", "optim.bf16_weights=false optim.moments_dtype=bf16"),
    ],
)
def test_training_step_is_sync_free(tmp_path, compile, recompute, optimizer):
    """A whole training step (forward and backward of two micro-batches, clipping, the step
    guard, AdamW, Muon or Lion, the aux-free bias update) makes no device-to-host synchronization:
    CUDA's sync debug mode in "error" raises on any (logging reads values only every
    train.log_every steps, outside). For the replicated, the sharded and the FSDP optimizers."""
    from moetrain.train.trainer import Trainer

    cfg = _tiny_on_cuda(
        tmp_path,
        "model.moe.bias_update_rate=0.001",
        f"compute.compile={str(compile).lower()}",
        f"compute.recompute={recompute}",
        "logging.tensorboard=false",
        "logging.plot=false",
        *optimizer.split(),
    )
    trainer = Trainer(cfg, quiet=True)
    for _ in range(2):  # compile and allocate outside the checked step
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_bench_reports_a_sync_free_step(capsys):
    from moetrain.cli import main

    assert main(["bench", "tiny", "--device", "cuda", "--warmup", "1", "--steps", "2", "--model.vocab_size=512"]) == 0
    import json

    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["routing"] for r in records] == ["learned", "random"]
    for r in records:
        assert r["sync_free"] is True and r["host_syncs_per_step"] == 0, r
        assert r["tokens_per_sec_per_device"] > 0 and r["mfu"] > 0 and r["peak_mem_gib"] > 0


def test_bench_profile_writes_a_trace_and_a_memory_snapshot(tmp_path, capsys):
    import json
    import pickle

    from moetrain.cli import main

    assert (
        main(
            [
                "bench",
                "tiny",
                "--device",
                "cuda",
                "--warmup",
                "1",
                "--steps",
                "1",
                "--routing",
                "learned",
                "--run-dir",
                str(tmp_path),
                "--logging.profile=true",
                "--logging.profile_steps=2",
            ]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    out = tmp_path / "profile-learned"
    assert record["profile_dir"] == str(out)
    assert "grouped_mm" in (out / "ops.txt").read_text()
    kinds = json.loads((out / "kinds.json").read_text())["ms_per_step"]
    assert kinds["grouped GEMM"] > 0 and kinds["dense GEMM"] > 0 and kinds["attention"] > 0, kinds
    snapshot = pickle.loads((out / "memory_snapshot.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]


@pytest.mark.parametrize("fast_backward", [False, True])
def test_fp8_kernels_match_the_cpu_emulation(fast_backward):
    """torch._scaled_mm / _scaled_grouped_mm on the GPU compute what the CPU path (native
    _scaled_mm, emulated grouped product) computes from the same quantized operands, forward and
    backward, up to accumulation order and the bf16 output; with fast accumulation in backward
    (precision.fp8_fast_accum_backward) too."""
    from moetrain.model.fp8 import fp8_grouped_mm, fp8_linear

    torch.manual_seed(0)

    def run(fn, *inputs, dy, device):
        leaves = [t.to(device).requires_grad_() if t.is_floating_point() else t.to(device) for t in inputs]
        y = fn(*leaves, fast_backward=fast_backward)
        y.backward(dy.to(device, y.dtype))
        return [y.float().cpu()] + [t.grad.float().cpu() for t in leaves if t.is_floating_point()]

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    x, w = torch.randn(256, 512), torch.randn(384, 512) * 0.05
    dy = torch.randn(256, 384)
    for got, want in zip(run(fp8_linear, x, w, dy=dy, device="cuda"), run(fp8_linear, x, w, dy=dy, device="cpu")):
        assert rel(got, want) < 5e-3
    offsets = torch.tensor([100, 300, 300, 480], dtype=torch.int32)
    x, w = torch.randn(512, 256), torch.randn(4, 128, 256) * 0.05
    dy = torch.randn(512, 128)
    dy[480:] = 0
    got = run(fp8_grouped_mm, x, w, offsets, dy=dy, device="cuda")
    want = run(fp8_grouped_mm, x, w, offsets, dy=dy, device="cpu")
    for i, (g, v) in enumerate(zip(got, want)):
        g, v = (g[:480], v[:480]) if i < 2 else (g, v)
        assert rel(g, v) < (2e-2 if i == 2 else 5e-3), i  # the weight gradient: bf16 on CUDA, fp32 on CPU


def test_fp8_swiglu_down_on_cuda_matches_the_cpu_emulation():
    """The fused SwiGLU + down projection on the GPU (the SwiGLU-and-quantize kernel, the backward
    kernel that recomputes silu(gate) · up) against the CPU path from the same bf16 inputs."""
    from moetrain.model.fp8 import fp8_grouped_mm, fp8_swiglu_grouped_mm

    torch.manual_seed(0)
    offsets = torch.tensor([100, 300, 300, 480], dtype=torch.int32)
    h = torch.randn(512, 2 * 192).bfloat16()
    w = (torch.randn(4, 128, 192) * 0.05).bfloat16()
    dy = torch.randn(512, 128).bfloat16()
    dy[480:] = 0

    def run(device, dtype):  # the CPU path in fp32 (silu(gate) · up not rounded twice in bf16)
        hg, wg = (t.to(device, dtype).detach().requires_grad_() for t in (h, w))
        y = fp8_swiglu_grouped_mm(hg, wg, offsets.to(device))
        y.backward(dy.to(device))
        return y.float().cpu()[:480], hg.grad.float().cpu()[:480], wg.grad.float().cpu()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    got, want = run("cuda", torch.bfloat16), run("cpu", torch.float32)
    # The kernel quantizes silu(gate) · up rounded to bf16 once; e4m3 rounding turns that rounding
    # into ~1.6% of y against the unrounded fp32 product, so y is compared with the CPU product of
    # the same rounded operand. The gradients against the fp32 CPU path.
    gate, up = h.float().chunk(2, dim=-1)
    a = (torch.nn.functional.silu(gate) * up).bfloat16().float()
    assert rel(got[0], fp8_grouped_mm(a, w.float(), offsets)[:480].float()) < 5e-3
    assert rel(got[1], want[1]) < 1e-2 and rel(got[2], want[2]) < 1e-2


def test_deferred_expert_weight_gradients_on_cuda_match_the_per_micro_batch_ones():
    """compute.defer_expert_weight_grad on the GPU (bf16 grouped GEMMs, the SwiGLU kernels, the
    expert-major row copy): three micro-batches' weight gradients from the last backward against
    the plain layer's per-micro-batch gradients summed in fp32, with an empty expert and NaN rows
    past the last offset; the SwiGLU forward kernel's product is the backward kernel's, bit for bit."""
    from moetrain.model.expert_grads import DeferredExpertGrads
    from moetrain.model.experts import GroupedExperts
    from moetrain.model.fp8_kernels import swiglu_backward, swiglu_forward

    torch.manual_seed(0)
    plain = GroupedExperts(4, 256, 128).cuda()
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.05)
    plain.to(torch.bfloat16)
    held = copy.deepcopy(plain)
    held.runtime.expert_grads = DeferredExpertGrads()
    held.runtime.expert_grads.begin(3)
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in plain.parameters()]
    for i in range(3):
        offsets = torch.tensor([300 + i, 300 + i, 1000, 1900], dtype=torch.int32, device="cuda")
        x = torch.randn(2048, 256, device="cuda").bfloat16()
        x[1900:] = float("nan")
        dy = torch.randn(2048, 256, device="cuda").bfloat16()
        plain(x, offsets).backward(dy)
        for s, p in zip(sums, plain.parameters()):
            s += p.grad.float()
            p.grad = None
        held(x, offsets).backward(dy)
    held.runtime.expert_grads.finish()
    for s, p in zip(sums, held.parameters()):
        assert torch.isfinite(p.grad).all()
        assert ((p.grad.float() - s).norm() / s.norm()).item() < 1e-2
    h = torch.randn(1000, 2 * 768, device="cuda").bfloat16()
    assert torch.equal(swiglu_forward(h), swiglu_backward(torch.ones(1000, 768, device="cuda").bfloat16(), h)[1])


def _graph_engine(tmp_path, *overrides):
    """A tiny engine on the GPU, no graph yet (compute.cuda_graphs=off): bf16 weights with split
    masters (the Triton update), two micro-batches, clipping that bites, the router bias."""
    from moetrain.parallel.dims import ParallelDims, ParallelState
    from moetrain.train.engine import TrainEngine

    cfg = _tiny_on_cuda(
        tmp_path,
        "compute.cuda_graphs=off",
        "optim.grad_clip=0.05",
        "schedule.warmup_steps=4",
        "model.moe.bias_update_rate=0.01",
        *overrides,
    )
    torch.manual_seed(0)
    return cfg, TrainEngine(cfg, ParallelState(ParallelDims(world_size=1, dp=1, ep=1)), torch.device("cuda"))


def test_the_expert_major_row_copy_on_cuda_gives_the_cpu_layout():
    """`expert_major` on the GPU (the Triton row copy) lays 8 micro-batches' rows out as the CPU's
    index_copy_ does, at bench-sweep-64's widths and expert count (every position written)."""
    from moetrain.model.expert_grads import expert_major

    g = torch.Generator().manual_seed(0)
    parts = []
    for p in range(8):
        counts = torch.multinomial(torch.ones(64), 4000, replacement=True, generator=g).bincount(minlength=64)
        counts[p] = 0
        M = 4096  # at least 96 padding rows past the last offset
        parts.append((torch.randn(M, 2048, generator=g).bfloat16(), torch.randn(M, 1024, generator=g).bfloat16(),
                      counts.cumsum(0).to(torch.int32)))  # fmt: skip
    want = expert_major(list(parts))
    got = expert_major([tuple(t.cuda() for t in part) for part in parts])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))


@pytest.mark.parametrize(
    "overrides",
    [
        "",
        "compute.compile=true",
        "compute.compile=true model.moe.routing=random",
        "compute.defer_expert_weight_grad=true optim.grad_dtype=bf16",
        "optim.bf16_weights=false",
        "compute.compile=true precision.fp8=rowwise",
    ],
)
def test_training_with_the_step_graph_follows_the_eager_run_on_cuda(tmp_path, overrides):
    """compute.cuda_graphs=step against off, 12 steps of two micro-batches each: the step graph is
    captured once after the eager warm-up (compiled blocks, dropless grouped GEMMs, the routing's
    sort, the Triton update with the address tables of gradients the captured backward allocates,
    FP8's quantizers) and replayed on new batches; losses and gradient norms bit for bit the
    eager run's at every step, the eager run's learning rate on the device as the graph's is
    (torch's capturable AdamW rounds its bias corrections differently from the host's)."""
    from support.steps import synthetic_batches

    from moetrain.train.cuda_graphs import WARMUP_STEPS

    if "fp8" in overrides and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    runs = {}
    for mode in ("off", "step"):
        cfg, engine = _graph_engine(tmp_path / mode, *overrides.split())
        if mode == "step":
            _attach_step_graph(engine)
        else:
            engine.optimizer.put_lr_on_device()
        outs = []
        for n in range(12):
            torch.manual_seed(n)
            out = engine.train_step(synthetic_batches(cfg, n), n)
            outs.append((float(out.lm_loss), float(out.grad_norm)))
        runs[mode] = outs
    assert runs["step"] == runs["off"]
    assert engine.cuda_graph_counts() == {"captures": 1, "replays": 12 - WARMUP_STEPS, "eager": WARMUP_STEPS}


def test_forward_and_backward_alone_from_the_step_graph_follow_the_eager_passes_on_cuda(tmp_path):
    """`moetrain bench --also-forward-backward` with compute.cuda_graphs=step: two training steps'
    worth of warm-up, then forward and backward passes alone (`StepGraph.run(..., update=False)`)
    captured after their own eager passes and replayed; compiled blocks; the losses within 0.1% of
    eager passes' and the parameters unchanged by them."""
    from support.steps import synthetic_batches

    from moetrain.train.cuda_graphs import WARMUP_STEPS

    runs = {}
    for mode in ("off", "step"):
        cfg, engine = _graph_engine(tmp_path / mode, "compute.compile=true")
        if mode == "step":
            _attach_step_graph(engine)
        before = [p.detach().clone() for p in engine.model.parameters()]
        losses = []
        for n in range(10):
            torch.manual_seed(n)
            if mode == "step":
                out = engine.step_graph.run(synthetic_batches(cfg, n), n, update=False)
            else:
                out = engine.drop_step(engine.forward_backward(synthetic_batches(cfg, n)))
            losses.append(float(out.lm_loss))
        assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))
        runs[mode] = losses
    for a, b in zip(runs["off"], runs["step"]):
        assert abs(a - b) <= 1e-3 * abs(a), runs
    assert engine.cuda_graph_counts() == {"captures": 1, "replays": 10 - WARMUP_STEPS, "eager": WARMUP_STEPS}


def _attach_step_graph(engine) -> None:
    """compute.cuda_graphs=step's graph on an engine built with cuda_graphs=off, so that the eager
    and the graphed engine of a test are built alike."""
    from moetrain.train.cuda_graphs import CudaGraph, StepGraph

    engine.step_graph = StepGraph(engine, CudaGraph(engine.device, "the training step"))


def test_auto_keeps_the_step_graph_of_tiny_whose_launches_bound_it(tmp_path):
    """compute.cuda_graphs=auto on tiny, whose step the GPU runs in less time than the host takes
    to launch it (22.5 ms eager, 3.5 ms replayed on an H100; docs/benchmarks.md, "CUDA graphs"):
    its timed replays are far faster than its timed eager steps, so the graph stays."""
    from support.steps import synthetic_batches

    from moetrain.train.config import CudaGraphs
    from moetrain.train.cuda_graphs import JUDGED_REPLAYS, WARMUP_STEPS

    cfg, engine = _graph_engine(tmp_path, "compute.cuda_graphs=auto")
    steps = WARMUP_STEPS + JUDGED_REPLAYS + 2
    for n in range(steps):
        engine.train_step(synthetic_batches(cfg, n), n)
    torch.cuda.synchronize()
    assert engine.cuda_graphs == CudaGraphs.step, engine.cuda_graphs_why
    assert engine.cuda_graph_counts() == {"captures": 1, "replays": steps - WARMUP_STEPS, "eager": WARMUP_STEPS}


def test_a_dropped_step_graph_leaves_the_eager_steps_memory_as_without_it(tmp_path, monkeypatch):
    """compute.cuda_graphs=auto where the graph does not pay (here: a gain no replay can reach):
    once it is dropped, the eager steps hold what compute.cuda_graphs=off's hold, within 1 MiB.
    The capture stream's cuBLAS workspace (32 MiB and more on Hopper) would stay otherwise."""
    from support.steps import synthetic_batches

    from moetrain.train import cuda_graphs
    from moetrain.train.config import CudaGraphs

    monkeypatch.setattr(cuda_graphs, "AUTO_MIN_GAIN", 1.0)
    held = {}
    for mode in ("off", "auto"):
        cfg, engine = _graph_engine(tmp_path / mode, f"compute.cuda_graphs={mode}")
        steps = cuda_graphs.WARMUP_STEPS + cuda_graphs.JUDGED_REPLAYS + 3
        for n in range(steps):
            engine.train_step(synthetic_batches(cfg, n), n)
        torch.cuda.synchronize()
        assert engine.cuda_graphs == CudaGraphs.off, engine.cuda_graphs_why
        held[mode] = torch.cuda.memory_allocated()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    assert held["auto"] <= held["off"] + 2**20, held


def test_a_batch_goes_to_the_gpu_without_waiting_for_the_work_queued_before_it():
    """A step's batch is copied from page-locked memory (`pinned_for`), so the host returns from
    the copy while a third of a second of GEMMs queued before it still runs, and the copy
    arrives whole once they are done; from pageable memory CUDA would first wait for them."""
    from moetrain.transfer import pinned_for

    device = torch.device("cuda")
    a = torch.randn(8192, 8192, device=device) / 100
    torch.cuda.synchronize()
    for _ in range(20):
        a = torch.tanh(a @ a)
    batch = torch.randint(0, 100_000, (8, 4096))
    copied = pinned_for(batch, device).to(device, non_blocking=True)
    assert not torch.cuda.current_stream().query()  # the GEMMs still run: the host did not wait
    torch.cuda.synchronize()
    assert torch.equal(copied.cpu(), batch)


def test_a_graph_captured_again_replays_the_new_capture():
    """`CudaGraph.capture` a second time (as `StepGraph` does after a reset): the first graph
    and its memory pool go, the second capture takes a new pool
    (torch refuses a pool whose graphs were all reset) and its replays compute the new function
    on the current input."""
    from moetrain.train.cuda_graphs import CudaGraph

    device = torch.device("cuda")
    x = torch.arange(4, dtype=torch.float32, device=device)
    backend = CudaGraph(device, "a small graph")
    first = backend.capture(lambda: x * 2)
    backend.replay()
    assert first.tolist() == [0.0, 2.0, 4.0, 6.0]
    second = backend.capture(lambda: x + 10)
    x.fill_(1.0)
    backend.replay()
    torch.cuda.synchronize()
    assert second.tolist() == [11.0, 11.0, 11.0, 11.0]


def test_replayed_training_steps_are_sync_free_and_keep_the_peak_memory(tmp_path):
    """compute.cuda_graphs=step through the trainer: once captured, a step makes no device-to-host
    synchronization, and the peak memory it reports (the allocator's peak since the capture plus
    the graph's memory the allocator does not count) is the eager step's, within the pool's
    rounding: neither above by more than 10% nor below by more than 10% (an accounting that
    forgot the graph's memory would report far less)."""
    from moetrain.train.cuda_graphs import WARMUP_STEPS
    from moetrain.train.metrics import peak_mem_gib
    from moetrain.train.trainer import Trainer

    peaks = {}
    for mode in ("off", "step"):
        cfg = _tiny_on_cuda(
            tmp_path / mode, "logging.tensorboard=false", "logging.plot=false", "compute.cuda_graphs=off"
        )
        trainer = Trainer(cfg, quiet=True)
        if mode == "step":
            _attach_step_graph(trainer.engine)
        torch.cuda.reset_peak_memory_stats()
        for _ in range(WARMUP_STEPS + 1):
            trainer.train_step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        peaks[mode] = peak_mem_gib(trainer.device, trainer.engine.graph_memory_bytes())
        assert (trainer.engine.graph_memory_bytes() > 0) == (mode == "step")
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
    assert 0.9 * peaks["off"] <= peaks["step"] <= 1.1 * peaks["off"] + 1 / 16, peaks


def test_fp8_quantizer_kernels_give_the_cpu_bits():
    """The Triton quantizers (src/moetrain/model/fp8_kernels.py) on the GPU give quantize_rowwise's
    bytes and scales on the CPU, in every (dim, layout) the FP8 products ask for."""
    from moetrain.model.fp8 import _quantize

    torch.manual_seed(0)
    x = (torch.randn(300, 1536) * torch.logspace(-8, 3, 300).unsqueeze(1)).bfloat16()
    x[7] = 0
    w = torch.randn(4, 384, 256) * torch.logspace(-4, 1, 256)
    cases = [(x, -1, None), (x.t(), -1, "row"), (x, 0, "col"), (w, -1, None), (w, -2, "col"), (w.bfloat16(), -2, "col")]
    for t, dim, layout in cases:
        q_gpu, s_gpu = _quantize(t.cuda(), dim, layout)
        q_cpu, s_cpu = _quantize(t, dim, layout)
        assert q_gpu.shape == q_cpu.shape and q_gpu.stride() == q_cpu.stride(), (dim, layout)
        assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8)), (dim, layout)
        assert torch.equal(s_gpu.cpu(), s_cpu), (dim, layout)


def test_fp8_training_step_is_sync_free_and_learns(real_text_dir, tmp_path):
    """Row-wise FP8 (compiled blocks, FP8 products as eager islands) learns real text about as
    BF16 does, and its step makes no host sync."""
    from moetrain.presets import resolve_config
    from moetrain.train.trainer import Trainer

    def losses(fp8):
        cfg = resolve_config(
            "tiny",
            [
                f"data.sources=[{real_text_dir}]",
                f"train.run_dir={tmp_path / fp8}",
                "model.vocab_size=512",
                "train.device=cuda",
                f"precision.fp8={fp8}",
                "precision.fp8_select=all",
                "logging.tensorboard=false",
                "logging.plot=false",
                "compute.compile=true",
                "train.seed=0",
            ],
        )
        trainer = Trainer(cfg, quiet=True)
        out = [trainer.train_step().lm_loss.item() for _ in range(40)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            last = trainer.train_step().lm_loss
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return out + [last.item()]

    fp8, bf16 = losses("rowwise"), losses("none")
    assert fp8[-1] < 0.85 * fp8[0]
    # the same data order and initialization: FP8 tracks BF16 within a few percent
    assert abs(fp8[-1] - bf16[-1]) < 0.05 * bf16[-1], (fp8[-1], bf16[-1])


def test_chunked_loss_matches_the_plain_one_on_cuda():
    """The compiled element-wise part of the chunked loss (src/moetrain/model/loss.py) on the GPU,
    under bf16 autocast: the plain head + cross-entropy's loss and gradients to bf16 rounding."""
    import torch.nn.functional as F

    from moetrain.model.loss import linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(3000, 256, device="cuda", generator=g)
    w = torch.randn(5000, 256, device="cuda", generator=g) * 0.05
    t = torch.randint(0, 5000, (3000,), device="cuda", generator=g)
    out = []
    for fn in (
        lambda a, b: F.cross_entropy(F.linear(a, b).float(), t),
        lambda a, b: linear_cross_entropy(a, b, t, 1024),
    ):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(a, b)
        loss.backward()
        out.append((loss.detach(), a.grad, b.grad))
    (l0, gh0, gw0), (l1, gh1, gw1) = out
    torch.testing.assert_close(l1, l0, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(gh1, gh0, rtol=2e-2, atol=1e-5)
    torch.testing.assert_close(gw1, gw0, rtol=2e-2, atol=1e-5)


def test_split_adamw_kernel_matches_the_reference_on_cuda():
    """The Triton AdamW of optim.bf16_weights against the torch reference on the GPU, including
    the far end of a buffer longer than 2³¹ elements (64-bit offsets)."""
    from moetrain.optim.adamw import adamw_reference
    from moetrain.optim.split_master import join, split_fp32
    from moetrain.optim.triton_kernels import adamw_triton, bias_corrections

    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for n, tail in ((5000, 5000), (2**31 + 3000, 8192)):
        g = torch.Generator(device="cuda").manual_seed(0)
        p = torch.randn(n, device="cuda", generator=g)
        hi, lo = split_fp32(p)
        del p
        grad = torch.randn(n, device="cuda", generator=g)
        m = torch.randn(n, device="cuda", generator=g) * 0.1
        v = torch.rand(n, device="cuda", generator=g) * 0.01
        end = slice(n - tail, n)
        ref = [hi[end].clone(), lo[end].clone(), grad[end].clone(), m[end].clone(), v[end].clone()]
        coef = torch.tensor(0.5, device="cuda")
        adamw_reference([ref[0]], [ref[2]], [ref[3]], [ref[4]], [ref[1]], step=3.0, grad_coef=coef, **hyper)
        adamw_triton(
            hi,
            lo,
            grad,
            m,
            v,
            bias_corrections(torch.tensor(3.0, device="cuda"), 1e-3, 0.9, 0.95),
            grad_coef=coef,
            skip=torch.tensor(False, device="cuda"),
            **{k: v for k, v in hyper.items() if k != "lr"},  # the kernel reads lr from the corrections
        )
        torch.testing.assert_close(join(hi[end], lo[end]), join(ref[0], ref[1]), rtol=1e-6, atol=1e-8)
        # m ← m + (1 − β₁)(g − m) cancels: a few ulps of the inputs (|g| ~ 1) with the GPU's FMAs.
        torch.testing.assert_close(m[end], ref[3], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v[end], ref[4], rtol=1e-6, atol=1e-8)
        del hi, lo, grad, m, v, ref
        torch.cuda.empty_cache()


def test_one_adamw_launch_over_many_tensors_gives_the_bits_of_one_launch_each_on_cuda():
    """`adamw_triton_flat` (the split masters' update in one launch per gradient dtype) against
    `adamw_triton` tensor by tensor, on the GPU, with the gradients at their own addresses."""
    from moetrain.optim.split_master import split_fp32
    from moetrain.optim.triton_kernels import BLOCK, adamw_triton, adamw_triton_flat, bias_corrections

    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)  # lr=1e-3 comes with the corrections
    g = torch.Generator(device="cuda").manual_seed(0)
    for sizes in ([BLOCK * 300 + 5, 1, BLOCK, 3000, 2**20], [BLOCK * 300, 16, BLOCK, 3008, 2**20]):  # tails; 16-aligned
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        hi, lo = split_fp32(torch.randn(sum(sizes), device="cuda", generator=g))
        m = torch.randn(sum(sizes), device="cuda", generator=g) * 1e-3
        v = torch.rand(sum(sizes), device="cuda", generator=g) * 1e-6
        dtypes = [torch.bfloat16, torch.float32] * 3
        grads = [(torch.randn(n, device="cuda", generator=g) * 1e-2).to(dt) for n, dt in zip(sizes, dtypes)]
        corr = bias_corrections(torch.tensor(3.0, device="cuda"), 1e-3, 0.9, 0.95)
        coef = torch.tensor(0.5, device="cuda")
        flat = [t.clone() for t in (hi, lo, m, v)]
        adamw_triton_flat(flat[0], flat[1], grads, offsets, flat[2], flat[3], corr, grad_coef=coef, skip=None, **hyper)
        each = [t.clone() for t in (hi, lo, m, v)]
        for off, n, grad in zip(offsets, sizes, grads):
            part = [t[off : off + n] for t in each]
            adamw_triton(part[0], part[1], grad, part[2], part[3], corr, grad_coef=coef, skip=None, **hyper)
        assert all(torch.equal(a, b) for a, b in zip(flat, each)), sizes


def test_clipping_norm_kernel_matches_float64_on_cuda():
    """`sum_squares` (the clipping norm's pass on CUDA) against float64, over bf16 and fp32
    gradients including one past 2³¹ elements (64-bit offsets), the same bits on a second call,
    and `global_grad_norm` through it against torch's `_foreach_norm`."""
    from moetrain.optim.clip import global_grad_norm
    from moetrain.optim.triton_kernels import sum_squares

    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [
        torch.randn(n, device="cuda", generator=g).to(dt) for n, dt in ((4097, torch.bfloat16), (10**6, torch.float32))
    ]
    big = torch.ones(2**31 + 5, device="cuda", dtype=torch.bfloat16)
    big[-5:] = 3.0
    got = sum_squares([*ts, big])
    want = sum(float(t.double().pow(2).sum()) for t in ts) + (2**31) + 5 * 9.0
    assert abs(float(got) - want) <= 1e-5 * want, (float(got), want)
    assert torch.equal(sum_squares([*ts, big]), got)
    del big
    norm = global_grad_norm(ts[:1], ts[1:])
    ref = torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32)).square().sum().sqrt()
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)


def test_bf16_weights_train_like_fp32_weights_on_cuda(real_text_dir, tmp_path):
    """tiny on real text, 60 steps, bf16 weights with split masters beside fp32 weights under
    autocast, both eager: the final losses agree within 1%. Eager, because the step graph reads
    the learning rate from the device, which the split masters' update rounds apart from a host
    number (the step-graph tests compare against an eager run with the rate on the device): over
    60 steps at tiny's rate that rounding grew into 1.5% between the two precisions at seed 0,
    against 0.44% eager (one H100, 2026-12-06; docs/measurements.md, "GPU tests")."""
    from moetrain.presets import resolve_config
    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    losses = {}
    for flag in ("false", "true"):
        run_dir = tmp_path / flag
        cfg = resolve_config(
            "tiny",
            [
                f"data.sources=[{real_text_dir}]",
                f"train.run_dir={run_dir}",
                "train.device=cuda",
                "train.steps=60",
                "train.log_every=10",
                "train.eval_every=0",
                "checkpoint.save_every=0",
                "logging.tensorboard=false",
                "logging.plot=false",
                f"optim.bf16_weights={flag}",
                "compute.cuda_graphs=off",
            ],
        )
        Trainer(cfg, quiet=True).fit()
        losses[flag] = read_metrics(run_dir / "metrics.jsonl")[-1]["lm_loss"]
    assert abs(losses["true"] - losses["false"]) <= 0.01 * losses["false"], losses


def test_fused_permutation_compiled_on_cuda_is_within_bf16_rounding_of_float64():
    """src/moetrain/model/permute.py compiled on the GPU with bf16 expert rows (as in a block), the
    experts an identity GEMM in bf16: the output, the token gradient and the router-weight gradient
    against float64 sums of the same bf16 values, within the rounding the dtypes allow; and
    deterministic (gathers, no atomics): two runs give the same bits. (Compared with the plain
    formulation instead, the products differ by a bf16 rounding: Inductor keeps them in fp32.)
    Measured on the H200 (2026-12-01): determinism, output and token gradient passed; the
    weight gradient first failed with a bare cast as the experts (see `experts`)."""
    from support.steps import fused_permute_combine, routed_case

    ids, x, w, grad = (t.cuda() for t in routed_case(4, skew=True))
    K, D = ids.shape[1], x.shape[1]
    compiled = torch.compile(fused_permute_combine)
    eye = torch.eye(D, dtype=torch.bfloat16, device="cuda")

    def experts(x_MD):
        # bf16(x) through a GEMM: materialized in bf16 as the grouped GEMM's output is (a bare
        # cast would fuse into its consumers, where Inductor does not round it to bf16)
        return x_MD.to(torch.bfloat16) @ eye

    def run():
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = compiled(x_, ids, w_, experts)
        return (y, *torch.autograd.grad(y, [x_, w_], grad.to(torch.bfloat16)))

    (y, gx, gw), again = run(), run()
    assert all(torch.equal(a, b) for a, b in zip((y, gx, gw), again))
    xb, gb = x.to(torch.bfloat16).double(), grad.to(torch.bfloat16).double()
    wb = w.to(torch.bfloat16).double()  # the combine multiplies by the weights in y's dtype
    ulp = 2.0**-8  # bf16's relative rounding bound
    want_y = xb * wb.sum(1, keepdim=True)
    # the products and the sum round at most once each to bf16
    assert ((y.double() - want_y).abs() <= 2 * ulp * want_y.abs()).all()
    want_gx = gb * wb.sum(1, keepdim=True)  # K bf16 products, summed in fp32
    assert ((gx.double() - want_gx).abs() <= K * ulp * (gb.abs() * wb.sum(1, keepdim=True))).all()
    want_gw = (xb * gb).sum(1, keepdim=True).expand(-1, K)  # summed in fp32, not rounded to bf16
    assert ((gw.double() - want_gw).abs() <= 1e-5 * (xb * gb).abs().sum(1, keepdim=True)).all()


def test_an_over_large_micro_batch_stops_with_one_paragraph_naming_the_plans_layout(tmp_path, capsys):
    """bench-8e with a micro-batch `moetrain plan` predicts at over 1.5× the device's memory,
    one step: exit 2 with one paragraph (the step, the peak, the capacity, the plan's layout that
    fits), no traceback, no partial checkpoint. The paragraph goes into docs/reliability.md."""
    from moetrain.cli import main
    from moetrain.plan import plan
    from moetrain.presets import resolve_config

    overrides = [
        "data.synthetic=true",
        f"train.run_dir={tmp_path / 'run'}",
        "train.device=cuda",
        "compute.compile=false",
        "train.steps=1",
        "train.eval_every=0",
        "checkpoint.save_every=1",
        "logging.tensorboard=false",
        "logging.plot=false",
    ]
    capacity_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    rows = 2
    while True:
        batch = [f"train.micro_batch_size={rows}", f"train.global_batch_size={rows}"]
        if plan(resolve_config("bench-8e", overrides + batch), 1, "h200").peak_mem_gib_per_device > 1.5 * capacity_gib:
            break
        rows *= 2
    assert main(["train", "bench-8e", *[f"--{o}" for o in overrides + batch], "--quiet"]) == 2
    err = capsys.readouterr().err
    print(err)  # the message recorded in docs/reliability.md
    assert err.startswith("error: Out of memory on ") and "Traceback" not in err and err.count("\n") == 1, err
    for words in ("in step 1 (the first step", "GiB of the device's", "moetrain plan", "--train.micro_batch_size="):
        assert words in err, (words, err)
    assert "no checkpoint was written yet" in err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_nosync_exchanges_run_through_nccl():
    """The sync-free dispatcher on this GPU's torch and NCCL (a 1-rank group: the exchanges are
    copies, but every collective, stream wait and kernel is the real one): with capacity 0.5 and
    spill 0.25 the spill rows' counts all-gather runs; the overlapped exchange (1 chunk, 2 by
    experts, 3 by tokens) gives the plain path's outputs and gradients, within the kernels'
    rounding."""
    import gc
    import os

    import torch.distributed as dist
    from support.distributed import free_port

    from moetrain.model.experts import GroupedExperts
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher
    from moetrain.parallel.overlapped_dispatcher import OverlappedDispatcher

    # NCCL allocates with cudaMallocAsync, outside torch's cache: after the tests before this one
    # (the out-of-memory one fills the device) the cache must give its memory back, or NCCL's
    # first allocation fails ("Failed to CUDA calloc async", seen in a full tests/gpu run).
    gc.collect()
    torch.cuda.empty_cache()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        E, N, D, K = 8, 512, 128, 2
        torch.manual_seed(0)
        experts = GroupedExperts(E, D, 64).cuda()
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.1)
        x0 = torch.randn(N, D, device="cuda")
        ids = torch.rand(N, E, device="cuda").topk(K, dim=1).indices
        w0 = torch.rand(N, K, device="cuda")

        def run(factor, spill, chunks):
            group = dist.group.WORLD
            if chunks:
                disp = OverlappedDispatcher(E, group, None, factor, spill, 0, chunks=chunks)
            else:
                disp = NoSyncDispatcher(E, group, None, factor, spill, 0)
            for p in experts.parameters():
                p.grad = None
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            counts = torch.bincount(ids.flatten(), minlength=E)
            route = SimpleNamespace(topk_ids_NK=ids, topk_weights_NK=w, tokens_per_expert_E=counts)
            with torch.autocast("cuda", torch.bfloat16):
                y = disp.expert_step(x, route, experts, None)
            y.float().square().sum().backward()
            torch.cuda.synchronize()
            return [y.detach(), x.grad, w.grad, *[p.grad for p in experts.parameters()]], disp.dropped_tokens()

        capped, dropped = run(0.5, 0.25, 0)  # C = M/2, W = 3M/4: drops, counted
        assert 0 < int(dropped) < N * K
        assert all(torch.isfinite(t).all() for t in capped)
        plain, _ = run(1.25, 0.125, 0)
        for chunks in (1, 2, 3):  # 2 chunks by experts (2 divide 8), 3 by tokens
            got, _ = run(1.25, 0.125, chunks)
            for a, b in zip(got, plain):
                assert (a - b).abs().max() <= 1e-2 * b.abs().max(), (chunks, (a - b).abs().max())
    finally:
        dist.destroy_process_group()


def _rehearse_on_cuda(run_dir, overrides, rank):
    from moetrain.bench import run_bench

    records = run_bench(
        "tiny",
        ["train.device=cuda", "model.vocab_size=512", *overrides],
        warmup=2,
        steps=3,
        routings=["random"],
        run_dir=str(run_dir),
        rehearse=4,
        rank=rank,
        progress=False,
    )
    return records[0]


@pytest.mark.parametrize(
    "overrides,rank",
    [
        (["parallel.ep=2", "compute.compile=true"], 3),
        (["parallel.ep=2", "parallel.overlap_chunks=2"], 1),
        (["parallel.pp=2", "parallel.ep=2", "parallel.shard_optimizer=true", "train.micro_batch_size=12"], 2),
        (["parallel.stack=fsdp"], 1),
        (["parallel.cp=2", "parallel.ep=2", "compute.compile=true"], 1),
        (["parallel.cp=4", "parallel.ep=2"], 2),
        pytest.param(["parallel.ep=2", "parallel.shard_optimizer=true", "optim.name=muon"], 1, id="sharded-muon"),
        pytest.param(["parallel.stack=fsdp", "optim.name=muon"], 2, id="fsdp-muon"),
    ],
)
def test_a_rehearsed_rank_runs_on_one_gpu_with_its_stand_ins_measured_apart(tmp_path, overrides, rank):
    """A rehearsal on CUDA (compiled blocks, the overlapped exchange, a pipeline with the sharded
    optimizer, FSDP, context parallelism compiled and eager): its step has no host
    sync, its stand-ins' own kernels are timed and taken
    out of the kinds, and its checkpoint shard is saved and loaded back with their peaks."""
    from support.distributed import run_alone

    record = run_alone(_rehearse_on_cuda, tmp_path, overrides, rank)
    r = record["rehearsal"]
    assert (r["world"], r["rank"]) == (4, rank) and "NOT measured" in r["communication"]
    assert record["sync_free"] is True, record["host_syncs_per_step"]
    assert 0 < r["stand_in_s"] < r["step_s_with_stand_ins"] and r["compute_s"] > 0
    kinds = r["kinds_ms_per_step"]
    assert kinds["stand-in transfers (excluded)"] > 0 and kinds["total"] > 0, kinds
    assert r["peak_gib"]["saving"] > 0 and r["peak_gib"]["loading"] > 0
    assert r["planner"]["rank"] in range(4) and r["projected"]["tokens_per_sec_per_device"] > 0


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_context_parallel_attention_on_cuda_matches_whole_sequence_sdpa(docs):
    """Each rank of cp = 4, given the whole sequence's keys and values (what its all-gather
    returns), attends through CUDA's kernels (flash for the lower-right causal blocks; the masked
    kernel with documents) in bf16 with grouped-query heads: its rows of the output and of the
    queries' gradient are the whole-sequence SDPA's, to bf16 rounding."""
    import torch.nn.functional as F

    from moetrain.model.rope import RotaryEmbedding
    from moetrain.parallel.context_parallel import ContextShard

    cp, B, H, G, T, Dh = 4, 2, 8, 2, 1024, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, Dh, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, G, T, Dh, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    w = torch.randn(B, H, T, Dh, device="cuda", dtype=torch.bfloat16, generator=g)
    doc_ids_BT = (torch.rand(B, T, device="cuda", generator=g) < 0.01).long().cumsum(1) if docs else None
    q_whole = q.clone().requires_grad_()
    if docs:
        keep = (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :]) & torch.ones(
            T, T, dtype=torch.bool, device="cuda"
        ).tril()
        out = F.scaled_dot_product_attention(q_whole, k, v, attn_mask=keep.unsqueeze(1), enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q_whole, k, v, is_causal=True, enable_gqa=True)
    (out.float() * w.float()).sum().backward()
    rope = RotaryEmbedding(Dh, 10_000.0).cuda()
    rope.init_weights()
    for rank in range(cp):
        shard = ContextShard(cp, rank, None)
        shard.gather_kv = lambda k_local, v_local: (k, v)  # the whole sequence's, as the gather returns

        def mine(x_BHTD, shard=shard):
            return shard.shard(x_BHTD.transpose(1, 2)).transpose(1, 2)

        q_local = mine(q).clone().requires_grad_()
        _, _, masks = shard.attention_inputs(rope, T // cp, doc_ids_BT, torch.device("cuda"))
        out_local = shard.attend(q_local, mine(k), mine(v), masks)
        (out_local.float() * mine(w).float()).sum().backward()
        scale = out.float().abs().mean()
        assert (out_local.float() - mine(out).float()).abs().max() < 0.05 * scale * 10, rank
        assert (out_local.float() - mine(out).float()).abs().mean() < 0.01 * scale, rank
        grad_scale = q_whole.grad.float().abs().mean()
        assert (q_local.grad.float() - mine(q_whole.grad).float()).abs().mean() < 0.02 * grad_scale, rank


def test_muon_compiled_element_wise_steps_match_the_eager_ops_on_cuda():
    """Muon's momentum and update on CUDA (one compiled kernel each, the direction written in
    bf16, the bf16 orthogonalized update read as is) give the eager fp32 ops' values: the
    momentum and weights within an fp32 rounding, the direction its bf16 rounding; a skipped
    step leaves both untouched."""
    from moetrain.optim.muon import _apply_update, _momentum_direction, apply_update, momentum_direction

    g = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(64, 96, 80, device="cuda", generator=g) * 1e-3
    m0 = torch.randn(64, 96, 80, device="cuda", generator=g) * 1e-3
    w0 = torch.randn(64, 96, 80, device="cuda", generator=g) * 0.02
    coef = torch.tensor(0.7, device="cuda")
    for skip in (torch.tensor(False, device="cuda"), torch.tensor(True, device="cuda"), None):
        m_fused, m_eager = m0.clone(), m0.clone()
        u_fused = momentum_direction(m_fused, grad, 0.95, coef, skip, torch.bfloat16)
        u_eager = _momentum_direction(m_eager, grad, 0.95, coef, skip, torch.float32)
        assert u_fused.dtype == torch.bfloat16 and u_fused.shape == grad.shape
        torch.testing.assert_close(m_fused, m_eager, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(u_fused.float(), u_eager, rtol=8e-3, atol=1e-9)
        w_fused, w_eager = w0.clone(), w0.clone()
        apply_update(w_fused, u_fused, 3.0, 1e-3, 0.1, skip)
        _apply_update(w_eager, u_fused.float(), 3.0, 1e-3, 0.1, skip)
        torch.testing.assert_close(w_fused, w_eager, rtol=1e-6, atol=1e-9)
        if skip is not None and bool(skip):
            assert torch.equal(m_fused, m0) and torch.equal(w_fused, w0)


def test_newton_schulz_one_triangle_at_a_time_is_the_full_products_iteration_on_cuda():
    """From 1,024 rows (not longer than the columns), Newton–Schulz's symmetric products run one
    triangle at a time (`symmetric_product`): each product is torch's to bf16's rounding, and
    Newton–Schulz through them orthogonalizes as the iteration with torch's products does (the
    same singular values), on square and wide batches. At multiples of the tile the results are
    torch's bit for bit on an H100; where a tile is cut (1,100 × 1,300) the products sum in
    another order and five bf16 iterations carry the last bits apart (1.6% of the result's norm)."""
    from moetrain.optim.muon import NS_COEFFICIENTS, TRIANGLE_MIN_ROWS, newton_schulz
    from moetrain.optim.triton_kernels import symmetric_product

    def rel(got, want):
        return ((got.float() - want.float()).norm() / want.float().norm()).item()

    a, b, c = NS_COEFFICIENTS
    g = torch.Generator(device="cuda").manual_seed(0)
    for k, S, L in [(3, 1024, 1024), (2, 1024, 2048), (1, 1100, 1300)]:
        assert S >= TRIANGLE_MIN_ROWS
        u = torch.randn(k, S, L, device="cuda", generator=g)
        x = u.bfloat16()
        x = x / (torch.linalg.matrix_norm(x.float(), keepdim=True) + 1e-7).bfloat16()
        a_kSS = x @ x.mT
        assert rel(symmetric_product(x.contiguous(), 1.0, None, 0.0), a_kSS) < 4e-3, (k, S, L)
        b_kSS = torch.baddbmm(a_kSS, a_kSS, a_kSS, beta=b, alpha=c)
        assert rel(symmetric_product(a_kSS, c, a_kSS, b), b_kSS) < 4e-3, (k, S, L)
        for _ in range(5):
            a_kSS = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(a_kSS, a_kSS, a_kSS, beta=b, alpha=c), x, beta=a)
        got = newton_schulz(u, 5, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == u.shape
        assert rel(got, x) < 2.5e-2, (k, S, L)
        sv_got, sv_want = (torch.linalg.svdvals(t.float()) for t in (got, x))
        assert (sv_got - sv_want).abs().max().item() < 1e-2, (k, S, L)


def test_the_fused_row_gathers_on_cuda_compute_the_eager_ones():
    """Every `fused` body of the dispatchers (src/moetrain/model/permute.py, nosync_dispatcher.py)
    compiled on the GPU gives what the same body gives run eagerly there, on random bf16 rows
    with dropped copies and empty rows: the gathers, masks and sums fused, nothing else changed."""
    from moetrain.model import permute
    from moetrain.parallel import nosync_dispatcher as nd

    torch.manual_seed(0)
    N, K, D, S, dev = 1000, 4, 256, 5000, "cuda"
    bf = torch.bfloat16
    x_ND, y_SD = torch.randn(N, D, device=dev, dtype=bf), torch.randn(S, D, device=dev, dtype=bf)
    y_MD, grad_ND = torch.randn(N * K, D, device=dev, dtype=bf), torch.randn(N, D, device=dev, dtype=bf)
    w_NK = torch.rand(N, K, device=dev)
    sort_M = torch.randperm(N * K, device=dev)
    inv_NK = permute.inverse_permutation(sort_M).view(N, K)
    slot_NK, keep_NK = torch.randint(0, S, (N, K), device=dev), torch.rand(N, K, device=dev) > 0.1
    src_S, filled_S = torch.randint(0, N * K, (S,), device=dev), torch.rand(S, device=dev) > 0.2
    inv_S = torch.randperm(S, device=dev)
    cases = [
        (permute._sum_copies, (y_MD, inv_NK)),
        (permute._weighted_sum, (y_MD, w_NK, inv_NK)),
        (permute._weighted_sum_backward, (grad_ND, y_MD, w_NK, sort_M, inv_NK)),
        (nd._gather_filled, (x_ND, src_S // K, filled_S, bf)),
        (nd._sum_kept, (y_SD, slot_NK, keep_NK, torch.float32)),
        (nd._gather_prefix_grad, (y_SD[:4000], inv_S)),
        (nd._combine_kept, (y_SD, w_NK, slot_NK, keep_NK, None)),
        (nd._combine_kept, (y_SD, w_NK, slot_NK, keep_NK, x_ND)),  # the shared expert's output added
        (nd._spread_grad, (grad_ND, w_NK, src_S, filled_S, bf)),
        (nd._weight_grad, (grad_ND, y_MD.view(N, K, D), torch.float32)),
    ]
    for fused, args in cases:
        got, want = fused(*args), fused.__wrapped__(*args)
        for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
            assert g.dtype == w.dtype and g.shape == w.shape, fused.__name__
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2, msg=fused.__name__)


@pytest.mark.parametrize("window", [1, 100, 600])
def test_local_flash_attention_is_the_windowed_softmax_and_compiles(window):
    """FlashAttention-2's window in bf16 (src/moetrain/model/local_attention.py) against the fp32
    masked path, outputs and q/k/v gradients; and inside a compiled function, the same numbers
    as eager."""
    from moetrain.model.local_attention import local_attention

    g = torch.Generator(device="cuda").manual_seed(window)
    B, H, G, T, Dh = 2, 8, 2, 512, 64
    q = torch.randn(B, H, T, Dh, device="cuda", generator=g)
    k, v = (torch.randn(B, G, T, Dh, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(B, H, T, Dh, device="cuda", generator=g)

    def run(dtype, fn=local_attention):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*xs, window, None)
        (out.float() * w).sum().backward()
        return [out.float()] + [x.grad.float() for x in xs]

    got, want = run(torch.bfloat16), run(torch.float32)
    for i, (a, b) in enumerate(zip(got, want)):  # window 1: out = v, so q's gradient is 0
        assert (a - b).abs().max() <= 2e-2 * b.abs().max() + 1e-4, (window, i, (a - b).abs().max(), b.abs().max())
    compiled = run(torch.bfloat16, torch.compile(local_attention, fullgraph=True))
    for i, (a, b) in enumerate(zip(compiled, got)):
        assert (a - b).abs().max() <= 1e-2 * b.abs().max() + 1e-4, (window, i, (a - b).abs().max())
