"""`moetrain upcycle`: a dense checkpoint as a mixture-of-experts one (sparse upcycling) whose
first step computes the dense model's function.

The target is the dense run's config with the caller's overrides of the MoE keys (`MOE_KEYS`);
every tensor the two models share is copied. Each new MoE block takes its dense MLP: every
routed expert (and the shared one, where the shape has one) is a copy of it, with the down
projections scaled so that the block's output is the MLP's: a token's routed weights sum to 1
(× k or × routed_scale, so the experts' are ÷ that), and with a shared expert each half takes ½.
The router is a fresh model's and the aux-loss-free biases are 0: with identical experts any
routing gives the same output, and training pulls them apart. The result is a weights-only
checkpoint that `train --checkpoint.init_from=OUT_DIR` starts from, in any layout; it is built
in one process on the CPU (both models' fp32 weights in memory).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from moetrain.config import apply_overrides
from moetrain.errors import ConfigError
from moetrain.inference import load_for_inference
from moetrain.model.config import Routing, TransformerConfig
from moetrain.model.counting import count_params
from moetrain.plan.hardware import refuse_unless_it_fits
from moetrain.train.checkpoint_io import save_weights
from moetrain.train.run_dir import check_weights_destination, resolve_checkpoint

MOE_KEYS = ("num_dense_layers", "dense_hidden", "moe")
"""The model keys an upcycle may change; every other one is the dense model's."""


def upcycle(dense: str | Path, out_dir: str | Path, overrides: list[str]) -> dict:
    """Write the MoE model of `dense` (a run or step-N directory) with `overrides` into `out_dir`
    (module docstring); the JSON-ready summary."""
    source = resolve_checkpoint(dense)
    model_d, cfg_d, _ = load_for_inference(source)
    cfg = apply_overrides(cfg_d, overrides)
    cfg.validate()
    moe_blocks = check_upcycle(cfg_d.model, cfg.model)
    out = Path(out_dir)
    params = count_params(cfg.model).total
    check_weights_destination(out, params, "the upcycled checkpoint")
    refuse_unless_it_fits(params, "cpu", "The upcycled checkpoint", "Run it on a machine with more memory.")
    model = cfg.model.build(device="cpu")
    model.init_weights()  # the routers, and the buffers no checkpoint holds
    with torch.no_grad():
        copied = _fill(model, dict(model_d.named_parameters()), moe_blocks, cfg.model)
    path = save_weights(out, cfg, model, source / "tokenizer.json", {"upcycled_from": str(source)})
    return {
        "checkpoint": str(path),
        "config": str(out / "config.yaml"),
        "upcycled_from": str(source),
        "moe_blocks": moe_blocks,
        "experts": cfg.model.moe.num_experts,
        "parameters": sum(p.numel() for p in model.parameters()),
        "copied_tensors": copied,
    }


def check_upcycle(dense: TransformerConfig, moe: TransformerConfig) -> list[int]:
    """The blocks that become MoE blocks; raises `ConfigError`, naming the key and the fix, where
    `moe` is not an upcycle of `dense`."""
    for field in dataclasses.fields(dense):
        if field.name not in MOE_KEYS and getattr(dense, field.name) != getattr(moe, field.name):
            raise ConfigError(
                f"upcycle: model.{field.name}={getattr(moe, field.name)!r} differs from the dense model's "
                f"{getattr(dense, field.name)!r}; an upcycle changes only the MoE blocks ({', '.join(MOE_KEYS)}): "
                f"drop the override."
            )
    hidden, m = dense.resolved_dense_hidden, moe.moe
    blocks = list(range(moe.num_dense_layers, moe.n_layers))
    if not blocks:
        raise ConfigError(
            f"upcycle: model.num_dense_layers={moe.num_dense_layers} leaves no MoE block: set it below "
            f"model.n_layers={moe.n_layers} (e.g. --model.num_dense_layers=1)."
        )
    problems = []
    if dense.num_dense_layers < moe.n_layers:
        problems.append(
            f"the source has MoE blocks (model.num_dense_layers={dense.num_dense_layers}): upcycle a dense model"
        )
    if moe.num_dense_layers and moe.resolved_dense_hidden != hidden:
        problems.append(f"the blocks that stay dense need model.dense_hidden={hidden}, the dense model's")
    if m.expert_hidden != hidden:
        problems.append(f"each expert copies the MLP: set model.moe.expert_hidden={hidden}")
    if m.shared_hidden not in (0, hidden):
        problems.append(f"a shared expert copies the MLP too: set model.moe.shared_hidden to 0 or {hidden}")
    if not m.normalize_weights:
        problems.append("the routed weights must sum to 1 for the MLP's output: set model.moe.normalize_weights=true")
    if m.routing != Routing.learned:
        problems.append(f"model.moe.routing={m.routing} is a benchmark mode: set model.moe.routing=learned")
    if problems:
        raise ConfigError("upcycle: " + "; ".join(problems) + ".")
    return blocks


def _fill(model: torch.nn.Module, dense: dict[str, torch.Tensor], moe_blocks: list[int], m: TransformerConfig) -> int:
    """Copy `dense`'s tensors into `model` (module docstring); how many target tensors were set."""
    target = dict(model.named_parameters())
    shared = m.moe.shared_hidden > 0
    routed_scale = (0.5 if shared else 1.0) / m.moe.weight_scale
    done = set()
    for i in moe_blocks:
        ffn = f"blocks.{i}.ffn."
        gate, up, down = (dense.pop(f"{ffn}{w}.weight") for w in ("w_gate", "w_up", "w_down"))
        target[f"{ffn}experts.w_gate_up_E2FD"].copy_(
            torch.cat([gate, up]).expand_as(target[f"{ffn}experts.w_gate_up_E2FD"])
        )
        target[f"{ffn}experts.w_down_EDF"].copy_((down * routed_scale).expand_as(target[f"{ffn}experts.w_down_EDF"]))
        done |= {f"{ffn}experts.w_gate_up_E2FD", f"{ffn}experts.w_down_EDF"}
        if shared:
            for w, value in (("w_gate", gate), ("w_up", up), ("w_down", down * 0.5)):
                target[f"{ffn}shared_expert.{w}.weight"].copy_(value)
                done.add(f"{ffn}shared_expert.{w}.weight")
    for name, value in dense.items():
        target[name].copy_(value)
        done.add(name)
    left = [n for n in target if n not in done and ".router." not in n]
    assert not left, left  # check_upcycle admits only targets whose every other tensor has a source
    return len(done)
