"""
Same weights, same batch: Olmo-core 3.0.0's model and moetrain's, one forward and backward each.

Olmo-core's model comes from the anchor's builder (.anchor/bench_olmocore.py `build_ddp_configs`,
as in olmocore_learn.py), moetrain's from the matching preset (bench-8e / bench-small32e), both
shrunk to a CPU size, in fp32. Olmo-core's initialized tensors are copied into moetrain's model by
name (every moetrain parameter must get one, of its shape). Both run one micro-batch of real tokens
(data/default/train.bin) and backpropagate what each trains on: the LM loss with the lb and router
z-losses attached, each side's own. Same weights, same tokens: what differs is the models' arithmetic.

    PYTHONPATH=/tmp/olmo-site:src .venv/bin/python benchmarks/learning/same_weights.py --shape 8e
    ... --shape 8e --mt model.pre_norm=true --mt model.peri_norm=false   # moetrain's old pre-norm block

Prints side by side, with the relative difference: the LM loss, the lb and z losses (unweighted, mean
over MoE layers), the global and per-group gradient norms; the tensor whose gradient differs most; one
JSON line. Exits 1 if the loss or the gradient norm differ by more than --rtol. No data? `moetrain
prepare-data --default-corpus --out data/default`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRESETS = {"small32e": "bench-small32e", "8e": "bench-8e"}

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--shape", choices=sorted(PRESETS), default="8e")
ap.add_argument("--layers", type=int, default=2, help="layers, the first dense (both shapes)")
ap.add_argument("--d-model", type=int, default=512)
ap.add_argument("--hidden", type=int, default=512, help="routed and shared expert width (dense MLP: 5x)")
ap.add_argument("--heads", type=int, default=None, help="query heads (default d_model / 128); kv heads: a quarter")
ap.add_argument("--batch", type=int, default=4, help="sequences in the batch")
ap.add_argument("--seq-len", type=int, default=256)
ap.add_argument("--seed", type=int, default=0, help="Olmo-core's init seed and the windows' offsets")
ap.add_argument("--data", default=str(REPO / "data" / "default"))
ap.add_argument("--mt", action="append", default=[], help="moetrain override, e.g. model.pre_norm=true (repeatable)")
ap.add_argument("--rtol", type=float, default=1e-4)
args = ap.parse_args()
heads = args.heads or args.d_model // 128
kv_heads = max(1, heads // 4)

data = Path(args.data)
if not (data / "train.bin").is_file():
    raise SystemExit(f"{data}/train.bin not found: moetrain prepare-data --default-corpus --out {data}")
meta = json.loads((data / "meta.json").read_text())
from moetrain.presets import resolve_config  # noqa: E402

shrink = dict(n_layers=args.layers, d_model=args.d_model, n_heads=heads, n_kv_heads=kv_heads)
shrink |= {"head_dim": args.d_model // heads, "moe.expert_hidden": args.hidden, "moe.shared_hidden": args.hidden}
overrides = [f"--model.vocab_size={meta['vocab_size']}", *(f"--model.{k}={v}" for k, v in shrink.items())]
mcfg = resolve_config(PRESETS[args.shape], overrides + ["--" + o.lstrip("-") for o in args.mt]).model

# The anchor sets Olmo-core's environment before torch is imported; its shims run the no-EP MoE
# block on the CPU (no CUDA streams, host-side split sizes, a pure-PyTorch permute).
spec = importlib.util.spec_from_file_location("bench_olmocore", REPO / ".anchor" / "bench_olmocore.py")
anchor = importlib.util.module_from_spec(spec)
sys.modules["bench_olmocore"] = anchor
spec.loader.exec_module(anchor)
import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)
anchor.ensure_cached_path_importable()
anchor.install_cpu_smoke_shims()
from olmo_core.nn.moe.v2.routed_experts import use_torch_grouped_mm  # noqa: E402

use_torch_grouped_mm()
anchor.install_te_permute_shim()

# Olmo-core's model: the anchor's shape at this size, its dense MLP as wide as moetrain's.
shape = anchor._small32e(args.layers) if args.shape == "small32e" else anchor._moe8l(8, args.layers)
shape.d_model, shape.n_heads, shape.n_kv_heads, shape.head_dim = args.d_model, heads, kv_heads, args.d_model // heads
shape.moe_hidden, shape.shared_hidden, shape.dense_mlp = args.hidden, args.hidden, mcfg.resolved_dense_hidden
olmo_vocab = 128 * -(-meta["vocab_size"] // 128)  # Olmo-core pads the vocabulary to a multiple of 128
ocfg, _ = anchor.build_ddp_configs(
    shape, olmo_vocab, args.seq_len, args.batch, compile_model=False, compile_optim=False,
    random_routing=False, attn_backend_name="torch", warmup_sched=1,
)  # fmt: skip
ocfg.init_seed = args.seed
olmo = ocfg.build(init_device="cpu")
olmo.init_weights(device=torch.device("cpu"))  # drawn in bf16, Olmo-core's training dtype ...
olmo = olmo.float().train()  # ... and compared in fp32
mt = mcfg.build("cpu").train()
mt.init_weights(seed=args.seed)  # its buffers; every parameter is then overwritten with Olmo-core's


def mapping(cfg, osd) -> dict[str, tuple[str, object]]:
    """moetrain parameter -> (Olmo-core tensor, function giving it moetrain's layout). The functions
    are slices, transposes and concatenations: they map gradients as they map weights."""
    E, D, same = cfg.moe.num_experts, cfg.d_model, lambda t: t
    swap_halves = lambda t: torch.cat(t.chunk(2, 1)[::-1], 1)  # noqa: E731  (E, [up | gate], D) -> (E, [gate | up], D)
    nq, nk = cfg.n_heads * cfg.resolved_head_dim, cfg.n_kv_heads * cfg.resolved_head_dim
    m = {"embed.weight": ("embeddings.weight", same), "embed.norm.weight": ("embedding_norm.weight", same)}
    m |= {"norm.weight": ("lm_head.norm.weight", same), "lm_head.weight": ("lm_head.w_out.weight", same)}
    for i in range(cfg.n_layers):
        o, a, b = f"blocks.{i}.", f"blocks.{i}.attention.", f"blocks.{i}.attn."
        if a + "w_qkv.weight" in osd:  # fused_v2 attention (small32e): one [q | k | v] matrix
            for p, rows in zip("qkv", (slice(0, nq), slice(nq, nq + nk), slice(nq + nk, None))):
                m[b + f"w{p}.weight"] = (a + "w_qkv.weight", lambda t, rows=rows: t[rows])
        else:
            m |= {b + f"w{p}.weight": (a + f"w_{p}.weight", same) for p in "qkv"}
        m |= {b + "wo.weight": (a + "w_out.weight", same)}
        m |= {b + f"{p}_norm.weight": (a + f"{p}_norm.weight", same) for p in "qk"}
        # Olmo-core's attention_norm / feed_forward_norm normalize the sublayer's output (in both
        # its block layouts), *_input_norm its input (peri-norm only). A moetrain input norm takes
        # the output norm where Olmo-core has no input norm: all ones at init, the same values.
        for mo, ol in (("attn", "attention"), ("ffn", "feed_forward")):
            m[o + f"{mo}_out_norm.weight"] = (o + f"{ol}_norm.weight", same)
            inp = o + f"{ol}_input_norm.weight"
            m[o + f"{mo}_norm.weight"] = (inp if inp in osd else o + f"{ol}_norm.weight", same)
        # Olmo-core's shared expert (block 0's dense MLP too): w_up_gate (D, 2H) = [up | gate], w_down (1, H, D)
        ffn, se = o + ("ffn." if i < cfg.num_dense_layers else "ffn.shared_expert."), o + "shared_experts."
        H = osd[se + "w_up_gate"].shape[1] // 2
        m[ffn + "w_up.weight"] = (se + "w_up_gate", lambda t, H=H: t[:, :H].t())
        m[ffn + "w_gate.weight"] = (se + "w_up_gate", lambda t, H=H: t[:, H:].t())
        m[ffn + "w_down.weight"] = (se + "w_down", lambda t: t[0].t())
        if i >= cfg.num_dense_layers:  # router flat (E·D,); routed w_up_gate (E, 2H, D) = [up | gate], w_down (E, H, D)
            m[o + "ffn.router.weight"] = (o + "routed_experts_router.weight", lambda t: t.view(E, D))
            m[o + "ffn.experts.w_gate_up_E2FD"] = (o + "routed_experts.w_up_gate", swap_halves)
            m[o + "ffn.experts.w_down_EDF"] = (o + "routed_experts.w_down", lambda t: t.transpose(1, 2))
    return m


def group(name: str) -> str:
    """Gradient group of a moetrain parameter; an Olmo-core tensor is in its moetrain tensors' group."""
    keys = {"norm.weight": "norms", "embed.": "embedding", "lm_head.": "head", ".attn.": "attention"}
    keys |= {".router.": "router", ".experts.": "routed experts", ".shared_expert.": "shared expert"}
    return next((g for k, g in keys.items() if k in name), "dense mlp")


# Copy Olmo-core's tensors into moetrain's parameters; stop on any parameter left out or misshaped.
osd, og, mparams = olmo.state_dict(), dict(olmo.named_parameters()), dict(mt.named_parameters())
links = {n: v for n, v in mapping(mcfg, osd).items() if n in mparams}
if unmapped := sorted(set(mparams) - set(links)):
    raise SystemExit(f"moetrain parameters with no Olmo-core tensor: {unmapped}")
with torch.no_grad():
    for n, (on, f) in links.items():
        if f(osd[on]).shape != mparams[n].shape:
            raise SystemExit(f"shapes differ: {n} {tuple(mparams[n].shape)} <- {on} {tuple(f(osd[on]).shape)}")
        mparams[n].copy_(f(osd[on]))
if unused := sorted(set(og) - {on for on, _ in links.values()}):
    print(f"note: Olmo-core tensors with no moetrain counterpart: {unused}")
olmo_group = {on: group(n) for n, (on, _) in links.items()}

# One batch: windows of seq_len + 1 tokens at seeded offsets of train.bin; the targets are the inputs shifted by one.
tok = np.memmap(data / "train.bin", dtype=np.dtype(meta["dtype"]), mode="r")
starts = np.random.default_rng(args.seed).integers(0, len(tok) - args.seq_len - 1, size=args.batch)
xy = torch.tensor(np.stack([tok[s : s + args.seq_len + 1] for s in starts]).astype(np.int64))
x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def grad_norms(named, group_of) -> dict[str, float]:
    """The global gradient norm and each group's, accumulated in float64."""
    sq: dict[str, float] = {}
    for n, p in named:
        for k in ("grad norm", f"grad {group_of(n)}"):
            sq[k] = sq.get(k, 0.0) + (p.grad.double().square().sum().item() if p.grad is not None else 0.0)
    return {k: v**0.5 for k, v in sq.items()}


# Olmo-core: what train_batch backpropagates for one micro-batch (no LM-head z-loss, olmocore_learn.py's default).
out = olmo(x, labels=y, loss_reduction="sum", loss_div_factor=float(y.numel()))
out.loss.backward()
routers = [r for blk in olmo.blocks.values() if (r := getattr(blk, "routed_experts_router", None)) is not None]
metrics = [{k: v[0].item() for k, v in r.compute_metrics().items()} for r in routers]
res_o = {"lm loss": out.ce_loss.item(), "lb loss": np.mean([m["load balancing loss unscaled"] for m in metrics])}
res_o |= {"z loss": np.mean([m["router Z loss unscaled"] for m in metrics])}
res_o |= grad_norms(olmo.named_parameters(), lambda n: olmo_group.get(n, "not mapped"))

# moetrain: the trainer's one-micro-batch step (backward_scale 1: the aux losses get gradient 1 × their weight).
loss = mt(x, targets_BT=y)
loss.backward()
stats = [moe.end_step() for moe in mt.moe_layers()]
res_m = {"lm loss": loss.item(), "lb loss": np.mean([s["lb_loss"].item() for s in stats])}
res_m |= {"z loss": np.mean([s["z_loss"].item() for s in stats])} | grad_norms(mt.named_parameters(), group)

# Every moetrain gradient against Olmo-core's, mapped as the weights were.
diff = {n: ((f(og[on].grad) - mparams[n].grad).norm() / f(og[on].grad).norm()).item() for n, (on, f) in links.items()}
rows = {k: (float(res_o.get(k, 0.0)), float(res_m.get(k, 0.0))) for k in res_o | res_m}
rdiff = {k: abs(a - b) / max(abs(a), abs(b), 1e-30) for k, (a, b) in rows.items()}
print(
    f"{args.shape}: {args.layers} layers, d_model {args.d_model}, {args.batch} x {args.seq_len} tokens; moetrain "
    f"pre_norm={mcfg.pre_norm} peri_norm={mcfg.peri_norm} embedding_norm={mcfg.embedding_norm}; lb/z weight: Olmo-core "
    f"{shape.lb_loss_weight}/{shape.z_loss_weight}, moetrain {mcfg.moe.lb_loss_weight}/{mcfg.moe.z_loss_weight}"
)
print(f"{'':18s} {'Olmo-core':>12s} {'moetrain':>12s} {'rel. diff':>10s}")
for k, (a, b) in rows.items():
    print(f"{k if k == 'grad norm' else k.replace('grad ', '  '):18s} {a:12.6f} {b:12.6f} {rdiff[k]:10.2e}")
print(f"largest gradient difference |g_mt - g_olmo| / |g_olmo|: {(w := max(diff, key=diff.get))} {diff[w]:.2e}")
ok = rdiff["lm loss"] <= args.rtol and rdiff["grad norm"] <= args.rtol
print(f"{'PASS' if ok else 'FAIL'}: loss and gradient norm {'within' if ok else 'not within'} rtol {args.rtol:g}")
sides = {"olmo_core": {k: a for k, (a, _) in rows.items()}, "moetrain": {k: b for k, (_, b) in rows.items()}}
record = {"shape": args.shape, "mt_overrides": args.mt, **sides, "rel_diff": rdiff, "max_rel_diff": max(rdiff.values())}
print(json.dumps(record | {"worst_tensor": [w, diff[w]], "rtol": args.rtol, "pass": ok}))
sys.exit(0 if ok else 1)
