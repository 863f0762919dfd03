"""Named configurations shipped with the package, and resolution of PRESET_OR_YAML + overrides.

What each preset is for: `PURPOSES` (`moetrain presets`); the figures they reproduce:
docs/benchmarks.md and shared/REFERENCE.md. A YAML run file may start from a preset with a
top-level `preset: NAME` key and override any section below it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetrain.config import apply_overrides, load_yaml
from moetrain.errors import ConfigError
from moetrain.model.config import AttentionKind, Gating, MoEConfig, TransformerConfig
from moetrain.train.config import RunConfig, TrainerConfig

OLMO_CORE_VOCAB = 100_352  # Olmo-core's tokenizer: 100,278 tokens padded to a multiple of 128


def tiny() -> RunConfig:
    """≈3.7M parameters, 8k vocabulary: softmax top-4 of 8 experts with normalized weights, no
    shared expert, per-head QK-norm, pre-norm (maps onto HF Qwen3-MoE). Sized so that 300 steps
    of 24 × 128 tokens take about 6 minutes on 2 CPU cores (docs/benchmarks.md). Its model is the
    config classes' default one, with a stronger z-loss."""
    cfg = RunConfig()
    cfg.model.moe.z_loss_weight = 1e-3
    cfg.data.seq_len = 128
    cfg.train.global_batch_size = cfg.train.micro_batch_size = 24
    cfg.train.eval_tokens = 96 * 128  # 96 sequences: 4 micro-batches of 24, the set it evaluated before
    return cfg


def _deepseek_v3_model(
    *, experts: int, top_k: int, hidden: int, groups: int, kept_groups: int, init_std: float, **shape: int
) -> TransformerConfig:
    """DeepSeek-V3's architecture: multi-head latent attention, the first `dense` blocks dense (as
    wide as the k routed experts and the shared one together), then fine-grained routed experts
    with one shared expert of the same width, sigmoid top-k whose selected scores are normalized,
    auxiliary-loss-free balancing (bias speed 0.001) beside a small load-balancing loss (1e-4, where
    DeepSeek's is per sequence and moetrain's over the micro-batch), no z-loss,
    untied embeddings, RoPE θ = 10,000, every matrix at one init std; each token's experts come from
    its best `kept_groups` of `groups` expert groups (node-limited routing) and their weights are
    × 2.5 (the routed scaling factor). `shape`: the model's sizes (TransformerConfig's names)."""
    return TransformerConfig(
        **shape,
        n_kv_heads=shape["n_heads"],  # MLA's unabsorbed form: every head its own keys and values
        dense_hidden=(top_k + 1) * hidden,
        qk_norm=False,
        attention=AttentionKind.mla,
        rope_theta=10_000.0,
        init_std=init_std,
        init_output_std=init_std,
        moe=MoEConfig(
            num_experts=experts,
            top_k=top_k,
            expert_hidden=hidden,
            shared_hidden=hidden,
            gating=Gating.sigmoid,
            normalize_weights=True,
            routed_scale=2.5,
            n_groups=groups,
            topk_groups=kept_groups,
            lb_loss_weight=1e-4,
            z_loss_weight=0.0,
            bias_update_rate=1e-3,
        ),
    )


def dsv3_tiny() -> RunConfig:
    """DeepSeek-V3's architecture at `tiny`'s size (≈3.7M parameters, 8k vocabulary, the same data
    and batches): MLA with both latents, one dense block, 16 routed experts top-4 plus a shared
    one, sigmoid routing with the aux-loss-free bias, from the best 2 of 4 groups of 4 experts."""
    cfg = tiny()
    cfg.model = _deepseek_v3_model(
        vocab_size=8192, d_model=128, n_layers=4, num_dense_layers=1, n_heads=4, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        experts=16, top_k=4, hidden=64, groups=4, kept_groups=2, init_std=0.02,
    )  # fmt: skip
    return cfg


def dsv3_671b() -> RunConfig:
    """DeepSeek-V3's main model (the multi-token prediction module aside: `--model.mtp_depth=1`
    adds a dense one): 61 blocks of width 7168, the first 3 dense (18,432 wide), 128 heads with
    latents of 1536 (queries) and 512 (keys/values), heads of 128 + 64 rotary dims and values of
    128, 256 routed experts of 2048 top-8 from the best 4 of 8 groups, and one shared; its pre-training batch (15,360
    sequences of 4,096 tokens, micro-batches of 1,024) and peak learning rate 2.2e-4."""
    model = _deepseek_v3_model(
        vocab_size=129_280, d_model=7168, n_layers=61, num_dense_layers=3, n_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        experts=256, top_k=8, hidden=2048, groups=8, kept_groups=4, init_std=0.006,
    )  # fmt: skip
    return _big_run(model, seq_len=4096, gpus=1024, global_batch=15_360, lr=2.2e-4)


def _olmo_core_model(
    *,
    layers: int,
    dense: int,
    d_model: int,
    heads: int,
    kv_heads: int,
    hidden: int,
    experts: int,
    lb: float,
    z: float = 2e-4,
    peri_norm: bool = False,
    pre_norm: bool = True,
) -> TransformerConfig:
    """Olmo-core 3's production architecture: head_dim 128, QK-norm, one shared expert as wide as a
    routed one, top-4 softmax with normalized weights × k, first `dense` blocks dense; its embedding
    (× √d_model, RMSNorm) and init (every matrix at std 0.01, as Olmo-core's benchmark runner), with
    which both train to the same curve (docs/measurements.md, "Learning side by side")."""
    return TransformerConfig(
        vocab_size=OLMO_CORE_VOCAB,
        d_model=d_model,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=128,
        num_dense_layers=dense,
        peri_norm=peri_norm,
        pre_norm=pre_norm,
        embedding_norm=True,
        init_std=0.01,
        init_output_std=0.01,
        moe=MoEConfig(
            num_experts=experts,
            top_k=4,
            expert_hidden=hidden,
            shared_hidden=hidden,
            normalize_weights=True,
            restore_weight_scale=True,
            lb_loss_weight=lb,
            z_loss_weight=z,
        ),
    )


def _big_run(model: TransformerConfig, *, seq_len: int, gpus: int, global_batch: int, lr: float) -> RunConfig:
    """Batch sizes are global: one sequence per GPU per micro-batch at the reference GPU count.
    `model` is copied: a preset's maker hands each call a config of its own."""
    cfg = RunConfig(model=copy.deepcopy(model))
    cfg.data.seq_len = seq_len
    cfg.optim.lr = lr
    cfg.schedule.warmup_steps = 2000
    cfg.train = TrainerConfig(steps=100_000, global_batch_size=global_batch, micro_batch_size=gpus, eval_every=1000)
    cfg.train.eval_tokens = 8 * gpus * seq_len  # 8 sequences per GPU at the reference GPU count
    cfg.checkpoint.save_every = 1000
    return cfg


def _ref(layers, dense, d_model, heads, kv, hidden, experts, gpus, lb=0.01):
    return lambda: _big_run(
        _olmo_core_model(
            layers=layers, dense=dense, d_model=d_model, heads=heads, kv_heads=kv, hidden=hidden, experts=experts, lb=lb
        ),
        seq_len=8192,
        gpus=gpus,
        global_batch=max(256, gpus * 4),
        lr=4e-4,
    )


def _sweep(experts: int) -> Callable[[], RunConfig]:
    return lambda: _big_run(
        _moe_8l(experts, 4096, 4096, lb=0.01, z=2e-4), seq_len=4096, gpus=8, global_batch=64, lr=4e-4
    )


def _bench(model: TransformerConfig, *, micro_batch: int, accum: int = 1, lr: float) -> Callable[[], RunConfig]:
    """One GPU, sequences of 8192 tokens, `micro_batch` sequences per micro-batch (Olmo-core's
    benchmark runner's), `accum` micro-batches per optimizer step; bf16 with fp32 master weights; blocks
    compiled (measured +18% tokens/s on bench-8e, +24% on bench-tiny64e-l6: docs/benchmarks.md);
    evaluation (of 8 micro-batches) and checkpoints off."""

    def make() -> RunConfig:
        cfg = _big_run(model, seq_len=8192, gpus=micro_batch, global_batch=micro_batch * accum, lr=lr)
        cfg.schedule.warmup_steps = 10
        cfg.train.steps = 1000
        cfg.train.eval_every = 0
        cfg.checkpoint.save_every = 0
        cfg.compute.compile = True
        return cfg

    return make


def _moe_8l(experts: int, d_model: int, hidden: int, lb: float = 0.015, z: float = 1e-4) -> TransformerConfig:
    """Olmo-core's moe_8l shape: 8 layers (the first dense), each sublayer's output normalized and
    not its input (x + norm(f(x))); bench-8e's lb and z by default."""
    return _olmo_core_model(
        layers=8,
        dense=1,
        d_model=d_model,
        heads=d_model // 128,
        kv_heads=d_model // 512,
        hidden=hidden,
        experts=experts,
        lb=lb,
        z=z,
        peri_norm=True,
        pre_norm=False,
    )


def _small32e(**local) -> TransformerConfig:
    """bench-small32e's model (`local`: its sliding_window and attention_pattern)."""
    model = _olmo_core_model(
        layers=16, dense=1, d_model=1024, heads=8, kv_heads=2, hidden=1024, experts=32, lb=0.01, peri_norm=True
    )
    return dataclasses.replace(model, **local)


def _long(model: TransformerConfig, *, seq_len: int, gpus: int, cp: int, global_batch: int, lr: float):
    """A long-context stage: sequences of `seq_len` tokens, each split over `cp` GPUs of one node
    (context parallelism), one sequence per data-parallel rank and micro-batch."""

    def make() -> RunConfig:
        cfg = _big_run(model, seq_len=seq_len, gpus=gpus // cp, global_batch=global_batch, lr=lr)
        cfg.parallel.cp = cp
        cfg.schedule.warmup_steps = 200
        cfg.train.steps = 5000
        cfg.train.eval_tokens = 4 * seq_len
        cfg.compute.compile = True
        return cfg

    return make


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny,
    "ref-tiny-64e": _ref(16, 1, 2048, 16, 4, 2048, 64, gpus=16),
    "ref-small-64e": _ref(32, 1, 2560, 24, 6, 2560, 64, gpus=128),
    "ref-medium-128e": _ref(39, 2, 3072, 32, 8, 3072, 128, gpus=128, lb=0.005),
    "ref-large-128e": _ref(47, 2, 4096, 40, 10, 4096, 128, gpus=512, lb=0.005),
    "ref-ultra-128e": _ref(63, 2, 6144, 64, 32, 8192, 128, gpus=512, lb=0.005),
    "ref-ultra-256e": _ref(63, 2, 6144, 64, 32, 8192, 256, gpus=512, lb=0.005),
    **{f"sweep-8l-{e}": _sweep(e) for e in (8, 16, 32, 64, 128)},
    "bench-8e": _bench(_moe_8l(8, 4096, 4096), micro_batch=1, lr=3e-4),
    "bench-tiny64e-l6": _bench(
        _olmo_core_model(
            layers=6, dense=1, d_model=2048, heads=16, kv_heads=4, hidden=2048, experts=64, lb=0.01, peri_norm=True
        ),
        micro_batch=2,
        lr=1.8e-4,
    ),
    "bench-small32e": _bench(_small32e(), micro_batch=2, lr=1.8e-4),
    **{f"bench-sweep-{e}": _bench(_moe_8l(e, 2048, 1024), micro_batch=1, accum=8, lr=3e-4) for e in (8, 16, 32, 64)},
    "long-small32e-64k": _long(_small32e(), seq_len=65_536, gpus=8, cp=4, global_batch=8, lr=1e-4),
    "long-small32e-64k-local": _long(
        _small32e(sliding_window=4096, attention_pattern="LLLG"), seq_len=65_536, gpus=8, cp=4, global_batch=8, lr=1e-4
    ),
    "dsv3-tiny": dsv3_tiny,
    "dsv3-671b": dsv3_671b,
}

PURPOSES: dict[str, str] = {
    "tiny": "CPU-sized: trains on a laptop CPU in minutes (make train); exports as Qwen3-MoE",
    **{  # one sequence per GPU and micro-batch (`_big_run`)
        name: f"Olmo-core 3's reference shape, batch sized for {make().train.micro_batch_size} GPUs"
        for name, make in PRESETS.items()
        if name.startswith("ref-")
    },
    **{
        f"sweep-8l-{e}": f"Olmo-core 3's capacity sweep on 8 GPUs: {e} experts, 3.17B active"
        for e in (8, 16, 32, 64, 128)
    },
    "bench-8e": "one-GPU benchmark: the Olmo-core 3 runner's 8-expert moe_8l shape",
    "bench-tiny64e-l6": "one-GPU benchmark: the Olmo-core 3 runner's 64-expert, 6-layer shape",
    "bench-small32e": "one-GPU benchmark: the Olmo-core 3 runner's 32-expert, 16-layer shape",
    **{
        f"bench-sweep-{e}": f"one-GPU expert-count sweep at constant active parameters: {e} experts"
        for e in (8, 16, 32, 64)
    },
    "long-small32e-64k": "long context: bench-small32e's model on 65,536-token sequences, dp2 · cp4 on 8 GPUs",
    "long-small32e-64k-local": "long-small32e-64k with three of every four blocks attending over 4,096 tokens",
    "dsv3-tiny": "CPU-sized DeepSeek-V3 architecture: latent attention, sigmoid top-4 of 16 with a shared expert",
    "dsv3-671b": "DeepSeek-V3's shape (671B, MTP aside): latent attention, 256 experts top-8 + shared",
}
"""What each preset is for, in one line (`moetrain presets`)."""


def preset(name: str) -> RunConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"Unknown preset '{name}'.{hint} Presets: {', '.join(PRESETS)}; or pass a YAML file path.")
    return PRESETS[name]()


def resolve_config(spec: str | Path, overrides: list[str] | None = None, *, validate: bool = True) -> RunConfig:
    """PRESET_OR_YAML plus `key.sub=value` overrides -> a RunConfig, validated (`RunConfig.validate`)
    unless `validate` is false (for a caller that changes it further first)."""
    spec = str(spec)
    if spec in PRESETS:
        cfg = preset(spec)
    elif spec.endswith((".yaml", ".yml")) or Path(spec).exists():
        cfg = _from_yaml(load_yaml(spec, RunConfig), spec)
    else:
        close = difflib.get_close_matches(spec, list(PRESETS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        relative = "/" in spec and not Path(spec).is_absolute()
        where = f" (a relative path is read from the current directory, {Path.cwd()})" if relative else ""
        raise ConfigError(
            f"'{spec}' is neither a preset nor an existing YAML file{where}.{hint} Presets: {', '.join(PRESETS)}."
        )
    cfg = apply_overrides(cfg, overrides or [])
    if validate:
        try:
            cfg.validate()
        except ConfigError as e:
            if spec in PRESETS:
                raise
            given = " with the command line's overrides" if overrides else ""
            raise ConfigError(f"In '{spec}'{given}: {e}") from None
    return cfg


def run_name(spec: str) -> str:
    """What a run of PRESET_OR_YAML is called (its default run directory is runs/NAME): the
    preset's name, or the YAML file's without the suffix — for a config.yaml (a run's, or what
    import-hf wrote), its directory's name."""
    if spec in PRESETS:
        return spec
    path = Path(spec).resolve()
    return path.parent.name if path.stem == "config" and path.parent.name else path.stem


def _from_yaml(data: dict[str, Any], path: str) -> RunConfig:
    base_name = data.pop("preset", None)
    if base_name is not None and (not isinstance(base_name, str) or base_name not in PRESETS):
        got = f"'{base_name}'" if isinstance(base_name, str) else f"{type(base_name).__name__} {base_name!r}"
        raise ConfigError(
            f"In '{path}': 'preset' names the preset the file starts from, got {got}. "
            f"Presets: {', '.join(PRESETS)} (e.g. 'preset: tiny'); or leave it out to start from the defaults."
        )
    base = preset(base_name) if base_name is not None else RunConfig()
    merged = _deep_merge(base.to_dict(), data)
    try:
        return RunConfig.from_dict(merged)
    except ConfigError as e:
        raise ConfigError(f"In '{path}': {e}") from None


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
