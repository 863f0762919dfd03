"""torchao's float8 training against moetrain's row-wise FP8 on the same products (issue 54, item 3).

Each (preset, variant) runs in a child process (an OOM or a device-side assert ends only it; each
peak is its own): `moetrain bench`'s trainer (its overrides, random routing, blocks compiled as
the preset says, compute.cuda_graphs=off as auto resolves here), `warmup` then `steps` training
steps (`Trainer.train_step`). A JSON line each (stdout, OUT/torchao.jsonl): tokens/s of the median
timed step (CUDA events, no sync in the window) and of the window, peak GiB of the timed steps,
each step's loss and their largest relative difference to BF16's (same seed, data, init and
routing draws); then a table. Variants, in order (each on every preset; the budget skips the last):

  bf16            precision.fp8=none
  ao-all          fp8=none, then torchao on the meta model `parallelize` returns: the block
                  nn.Linears mt-all takes (attention q/k/v/o, dense MLP, shared expert; the router is
                  a Parameter) torchao Float8Linears (`convert_to_float8_training`, recipe "rowwise"),
                  the expert layers torchao's row-wise FP8 grouped GEMMs (forward, both gradients)
  mt-all-nohead   moetrain on every block product (fp8_select=all), LM head bf16: ao-all's products
  mt-auto         moetrain's defaults (fp8_select=auto; the LM head in FP8 on both presets)
  ao-auto         torchao on what fp8_select=auto takes (`fp8_choice.choose`, as apply_fp8)
  mt-auto-nohead  mt-auto with precision.fp8_lm_head=false: ao-auto's products
  ao-linears      ao-all's linears, moetrain's bf16 experts: the two halves apart
  mt-all          moetrain on every block product and the LM head
  ao-all-island   ao-all, torchao's expert layer an eager island as moetrain's FP8 (where ao-all fails)

torchao gets no LM head: moetrain's chunked loss multiplies by `lm_head.weight` itself. torchao's
MoE route, `quantize_(model, Float8TrainingOpConfig(), filter_fn)`, makes expert weights a subclass
whose __torch_function__ sends moetrain's own call `torch._grouped_mm(x, w.transpose(-2, -1),
offs=...)` to `_quantize_then_scaled_grouped_mm` (--dry-run: it fires, eager and under dynamo), but
cannot train here as is: its FP8 weight gradient reduces over each expert's rows, a multiple of 16
by its contract (it refuses to pad; moetrain's offsets are not), and moetrain's split fp32 masters
(optim.bf16_weights, on for these presets) set each matrix's `.data` to a view of their flat bf16
buffer, which the subclass takes silently: it reports bf16 and goes on computing with its old fp32
tensor, so no update reaches the products (--dry-run). `TorchaoExperts` pads each expert's rows
to a multiple of 16 (zero rows; static shapes, no host sync) and calls the function the subclass
dispatches to, with its config: torchao's kernels, plain parameters. GPU: `bash
benchmarks/probes/torchao_call1.sh`. CPU: `--dry-run` (those checks, then every variant cut down,
torchao's linears emulated and its grouped GEMM a plain one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.bench import BENCH_OVERRIDES
from moetrain.model.config import Fp8
from moetrain.model.experts import GroupedExperts, expert_mlp
from moetrain.model.fp8 import Fp8Linear
from moetrain.model.fp8_choice import Product, choose
from moetrain.presets import resolve_config

MT = ["precision.fp8=rowwise"]
NOHEAD = "precision.fp8_lm_head=false"
VARIANTS = {  # name: (overrides, (linears, experts) torchao takes: "all" | "auto" | None)
    "bf16": ([], None),
    "ao-all": ([], ("all", "all")),
    "mt-all-nohead": ([*MT, "precision.fp8_select=all", NOHEAD], None),
    "mt-auto": (MT, None),
    "ao-auto": ([], ("auto", "auto")),
    "mt-auto-nohead": ([*MT, NOHEAD], None),
    "ao-linears": ([], ("all", None)),
    "mt-all": ([*MT, "precision.fp8_select=all"], None),
    "ao-all-island": ([], ("all", "all")),
}
OURS = {"ao-all": "mt-all-nohead", "ao-auto": "mt-auto-nohead", "ao-all-island": "mt-all-nohead"}
"""Each torchao variant's moetrain counterpart on the same products."""
CUT = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=1", "model.head_dim=64", "model.n_layers=3",
       "model.dense_hidden=512", "model.vocab_size=2048", "model.moe.expert_hidden=256", "model.moe.shared_hidden=256",
       "data.seq_len=256", "train.micro_batch_size=1", "train.global_batch_size=1"]  # fmt: skip
"""--dry-run's cut-down model (the CPU's)."""
ALIGN = 16
"""Rows of an expert's group: torchao's FP8 weight gradient reduces over them (16 bytes of e4m3)."""
AO = {}
"""torchao's grouped GEMM function and its config, set by `torchao_convert` (constants to dynamo)."""


def torchao_convert(model: nn.Module, rows: int, linears, experts, island=False, emulate=False) -> list[str]:
    """torchao on the products `linears` / `experts` ("all", "auto" or None) take, chosen as
    `apply_fp8` chooses at `rows` tokens per micro-batch; the converted modules' names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    AO.update(mm=_quantize_then_scaled_grouped_mm, config=Float8TrainingOpConfig())

    def takes(select, product: Product) -> bool:
        return select is not None and choose(product, select)

    def linear_filter(m: nn.Module, fqn: str) -> bool:
        in_blocks = type(m) is nn.Linear and ".blocks." in f".{fqn}"
        return in_blocks and takes(linears, Product("linear", rows, m.in_features, m.out_features))

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    convert_to_float8_training(model, module_filter_fn=linear_filter, config=config)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            if takes(experts, Product("experts", rows * model.cfg.moe.top_k, m.d_model, m.hidden, m.num_experts)):
                m.__class__, m.island, m.emulate = TorchaoExperts, island, emulate
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear | TorchaoExperts)]


class TorchaoExperts(GroupedExperts):
    """The expert layer with torchao's row-wise FP8 grouped GEMMs, each expert's rows padded."""

    island = emulate = False

    def forward(self, x_MD, offsets_E, weights=None):
        w_gate_up, w_down = weights if weights is not None else (self.w_gate_up_E2FD, self.w_down_EDF)
        return (_experts_island if self.island else _experts)(x_MD, offsets_E, w_gate_up, w_down, self.emulate)


def pad_groups(x_MD: torch.Tensor, offsets_E: torch.Tensor):
    """Each expert's rows, then zero rows up to a multiple of ALIGN, in M + ALIGN·E rows (the GEMMs
    skip the tail past the last offset): those rows, where each row of x went, and the padded end
    offsets (int32). Rows of x past its last offset (none on one GPU) are not kept apart."""
    M, E = x_MD.shape[0], offsets_E.numel()
    ends = offsets_E.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    pad = (counts + ALIGN - 1) // ALIGN * ALIGN - counts
    m = torch.arange(M, device=x_MD.device)
    dest_M = m + (pad.cumsum(0) - pad)[torch.searchsorted(ends, m, right=True).clamp_(max=E - 1)]
    x_PD = x_MD.new_zeros(M + ALIGN * E, x_MD.shape[1]).index_copy(0, dest_M, x_MD)
    return x_PD, dest_M, (ends + pad.cumsum(0)).to(torch.int32)


def _experts(x_MD, offsets_E, w_gate_up, w_down, emulate: bool):
    dt = torch.float32 if emulate else torch.bfloat16
    x_PD, dest_M, ends_E = pad_groups(x_MD.to(dt), offsets_E)
    gate, up = _grouped_mm(x_PD, w_gate_up.to(dt).transpose(-2, -1), ends_E, emulate).chunk(2, dim=-1)
    return _grouped_mm(F.silu(gate) * up, w_down.to(dt).transpose(-2, -1), ends_E, emulate).index_select(0, dest_M)


_experts_island = torch.compiler.disable(_experts)


def _grouped_mm(a_MK, b_EKN, offsets_E, emulate: bool):
    if emulate:  # --dry-run's CPU stand-in
        return _plain_grouped_mm(a_MK, b_EKN, offsets_E)
    return AO["mm"](a_MK, b_EKN, AO["config"], offs=offsets_E)


@torch.compiler.disable  # compiled _grouped_mm takes bf16 only
def _plain_grouped_mm(a_MK, b_EKN, offsets_E):
    return torch._grouped_mm(a_MK, b_EKN, offs=offsets_E)


def dry_checks(presets: list[str]) -> None:
    """CPU, a JSON line each: torchao's conversion takes the products `apply_fp8` takes (each
    preset's full-size model on the meta device); the subclass route fires on moetrain's unchanged
    expert layer (eager, under dynamo) and what the split masters do to it; the padded layer's
    gradients against the bf16 layer's."""
    from torchao.prototype.moe_training import tensor as ao_tensor
    from torchao.quantization import quantize_

    from moetrain.optim.split_master import SplitMaster
    from moetrain.parallel.parallelize import apply_fp8

    for preset in presets:
        cfg = resolve_config(preset)
        for select in ("all", "auto"):
            ours = cfg.model.build("meta")
            apply_fp8(ours, Fp8.rowwise, select, cfg.rows_per_micro_batch)
            fp8 = lambda m: isinstance(m, Fp8Linear) or getattr(m, "mlp", expert_mlp) is not expert_mlp  # noqa: E731
            mine = {n for n, m in ours.named_modules() if fp8(m)}
            theirs = set(torchao_convert(cfg.model.build("meta"), cfg.rows_per_micro_batch, select, select))
            _say(check="products", preset=preset, select=select, same=mine == theirs, kinds=_kinds(theirs))
    calls = []

    def spy(a, b_t, config, offs=None, bias=None):  # where the subclass sends torch._grouped_mm
        calls.append(b_t.stride(-2) == 1 and config == AO["config"])  # column-major, as torchao takes it
        return a @ b_t[0] if torch.compiler.is_compiling() else torch._grouped_mm(a, b_t, offs=offs)

    ao_tensor._quantize_then_scaled_grouped_mm = spy
    torch.manual_seed(0)
    x, offsets = torch.randn(45, 64, requires_grad=True), torch.tensor([7, 20, 20, 33, 45], dtype=torch.int32)
    ex = _experts_module()
    ref = ex(x, offsets)
    quantize_(ex, AO["config"], filter_fn=lambda m, fqn: isinstance(m, GroupedExperts))
    out = ex(x, offsets)
    out.sum().backward()
    eager = dict(fired=len(calls), as_taken=all(calls), same=torch.equal(out, ref), grad=ex.w_down_EDF.grad is not None)
    calls.clear()
    torch.compile(lambda x, w, o: torch._grouped_mm(x, w.transpose(-2, -1), offs=o), backend="aot_eager")(
        x, ex.w_gate_up_E2FD, offsets)  # fmt: skip
    w = ex.w_down_EDF
    split = SplitMaster(ex, {id(p) for p in ex.parameters()}, weight_decay=0.0, fused=False)
    master = split.view(split.hi, split.params.index(w))  # what the optimizer updates
    _say(check="subclass route", type=type(w).__name__, eager=eager, compiled_fired=len(calls),
         split_master=dict(param_dtype=str(w.dtype), computes_with=str(w._data.dtype),
                           computes_with_master=w._data.data_ptr() == master.data_ptr()))  # fmt: skip
    grads = []
    for padded in (False, True):
        ex, x.grad = _experts_module(), None
        ex.__class__, ex.emulate = (TorchaoExperts, True) if padded else (GroupedExperts, False)
        ex(x, offsets).square().sum().backward()
        grads.append([x.grad, ex.w_gate_up_E2FD.grad, ex.w_down_EDF.grad])
    diff = max((a - b).abs().max().item() for a, b in zip(*grads))
    _say(check="padded experts", max_grad_diff=diff, padded_ends=pad_groups(x, offsets)[2].tolist())


def _experts_module() -> GroupedExperts:
    torch.manual_seed(1)
    ex = GroupedExperts(5, 64, 32)
    for p in ex.parameters():
        nn.init.normal_(p, std=0.1)
    return ex


def _kinds(names) -> list[str]:
    return sorted({".".join(p for p in n.split(".") if not p.isdigit()).removeprefix("blocks.") for n in names})


def _say(**record) -> None:
    print(json.dumps(record), flush=True)


def run_variant(preset: str, variant: str, args) -> dict:
    """The child's work: one variant's steps in this process."""
    from moetrain.plan import device_capacity_floor
    from moetrain.train import engine
    from moetrain.train.metrics import peak_mem_gib
    from moetrain.train.trainer import Trainer

    overrides, ao = VARIANTS[variant]
    converted: list[str] = []
    if ao is not None:  # torchao on the meta model moetrain's `parallelize` returns (compile is lazy)
        parallelize = engine.parallelize

        def parallelize_then_torchao(model, *a, **kw):
            model = parallelize(model, *a, **kw)
            converted.extend(torchao_convert(model, kw["rows"], *ao, variant.endswith("island"), args.device == "cpu"))
            return model

        engine.parallelize = parallelize_then_torchao
    run_dir = f"train.run_dir={tempfile.mkdtemp(prefix='torchao-probe-')}"
    common = ["model.moe.routing=random", "compute.cuda_graphs=off", f"train.device={args.device}", run_dir]
    cfg = resolve_config(preset, [*BENCH_OVERRIDES, *common, *overrides, *args.override])
    trainer = Trainer(cfg, quiet=True, capacity_floor=device_capacity_floor)
    cuda = trainer.device.type == "cuda"

    def mark():  # a point of the device's timeline (the host's on CPU)
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    losses, marks = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            marks.append(mark())
        losses.append(trainer.train_step().lm_loss.detach().float().clone())
        if i >= args.warmup:
            marks.append(mark())
    if cuda:
        torch.cuda.synchronize()
    ms = [a.elapsed_time(b) if cuda else 1e3 * (b - a) for a, b in zip(marks, marks[1:])]
    tokens = trainer.engine.tokens_per_step
    return dict(
        tokens_per_sec=round(tokens / statistics.median(ms) * 1e3, 1),
        tokens_per_sec_window=round(tokens * len(ms) / sum(ms) * 1e3, 1),
        step_ms_median=round(statistics.median(ms), 2),
        peak_mem_gib=round(peak_mem_gib(trainer.device), 3),
        losses=[round(x.item(), 6) for x in losses],
        converted=len(converted),
        converted_kinds=_kinds(converted),
        fp8_lm_head=cfg.fp8_lm_head,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__,
        torchao=sys.modules["torchao"].__version__ if "torchao" in sys.modules else None,
    )


def run_child(preset: str, variant: str, args) -> dict:
    """One variant in a child process, within the budget: its JSON line, or one with the error."""
    cmd = [sys.executable, __file__, preset, "--child", variant, f"--device={args.device}", f"--warmup={args.warmup}",
           f"--steps={args.steps}", *[f"--override={o}" for o in args.override]]  # fmt: skip
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=min(args.variant_timeout, args.deadline - start))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and its compile workers
        out, err = proc.communicate()
        err += f"\ntimed out after {time.time() - start:.0f} s"
    with open(os.path.join(args.out, "torchao-logs", f"{preset}-{variant}.err"), "w") as f:
        f.write(err)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    record = json.loads(lines[-1][7:]) if lines else dict(error=err.strip().splitlines()[-12:])
    return dict(preset=preset, variant=variant, **record, wall_s=round(time.time() - start, 1))


def compare(records: list[dict]) -> None:
    """Each record's speed and losses against BF16's and its moetrain counterpart's (same preset)."""
    by = {(r["preset"], r["variant"]): r for r in records}
    for r in records:
        base, ours = by.get((r["preset"], "bf16"), {}), by.get((r["preset"], OURS.get(r["variant"])), {})
        if "losses" in r and "losses" in base:
            r["loss_max_rel_diff_vs_bf16"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"]))
        for key, other in (("vs_bf16", base), (f"vs_{OURS.get(r['variant'])}", ours)):
            if "tokens_per_sec" in r and "tokens_per_sec" in other:
                r[key] = round(r["tokens_per_sec"] / other["tokens_per_sec"], 4)


def table(records: list[dict]) -> str:
    rows = ["| preset | variant | tok/s (median) | window | × bf16 | × moetrain's | peak GiB | loss diff | s |"]
    for r in records:
        cells = [r["preset"], r["variant"], "skipped" if "skipped" in r else "FAILED", *[""] * 5, r.get("wall_s", "")]
        if "tokens_per_sec" in r:
            diff = r.get("loss_max_rel_diff_vs_bf16")
            cells[2:8] = [f"{r['tokens_per_sec']:,.0f}", f"{r['tokens_per_sec_window']:,.0f}", r.get("vs_bf16", ""),
                          r.get(f"vs_{OURS.get(r['variant'])}", ""), f"{r['peak_mem_gib']:.2f}",
                          "" if diff is None else f"{diff:.1e}"]  # fmt: skip
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(rows[:1] + ["|---" * 9 + "|"] + rows[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("presets", nargs="*", default=["bench-8e", "bench-tiny64e-l6"])
    p.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "ao-all-island"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--override", action="append", default=[], help="a dotted override for every variant")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all children; later ones are skipped")
    p.add_argument("--variant-timeout", type=float, default=240.0)
    p.add_argument("--min-left", type=float, default=50.0, help="no child starts with fewer seconds left")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--dry-run", action="store_true", help="on the CPU: the checks, then every variant cut down")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        try:
            print("RESULT " + json.dumps(run_variant(args.presets[0], args.child, args)), flush=True)
            return 0
        except BaseException:
            traceback.print_exc()
            return 1
    if args.dry_run:
        dry_checks(args.presets)
        args.device, args.override = "cpu", [*CUT, *args.override]
    args.deadline = time.time() + args.budget
    os.makedirs(os.path.join(args.out, "torchao-logs"), exist_ok=True)
    records, variants = [], args.variants.split(",")
    for variant in variants:  # by priority, each on every preset
        for preset in args.presets:
            todo = [variant]
            while todo:
                name = todo.pop()
                if args.deadline - time.time() < args.min_left:
                    records.append(dict(preset=preset, variant=name, skipped="no time left"))
                    continue
                r = run_child(preset, name, args)
                records.append(r)
                print(f"{preset} {name}: {r.get('tokens_per_sec', 'FAILED')}, {r['wall_s']} s", file=sys.stderr)
                if "error" in r:
                    print("\n".join(r["error"]), file=sys.stderr)
                    todo += ["ao-all-island"] if name == "ao-all" and "ao-all-island" not in variants else []
    compare(records)
    with open(os.path.join(args.out, "torchao.jsonl"), "a") as f:
        for r in records:
            print(json.dumps(r))
            f.write(json.dumps(r) + "\n")
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
