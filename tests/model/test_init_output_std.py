"""model.init_output_std: the output projections' std (attention out, MLP and expert down), by
default init_std / sqrt(2 × n_layers); Olmo-core's init gives them init_std
(benchmarks/learning/README.md)."""

import math

import pytest
import torch

from moetrain.presets import resolve_config


@pytest.mark.parametrize("output_std", [None, 0.05])
def test_output_projections_take_init_output_std_and_inputs_init_std(output_std):
    extra = [f"model.init_output_std={output_std}"] if output_std else []
    cfg = resolve_config("tiny", ["model.init_std=0.05", "model.n_layers=4", *extra])
    model = cfg.model.build(device="cpu")
    model.init_weights(seed=0)
    want_out = output_std or 0.05 / math.sqrt(2 * 4)
    out = torch.cat(
        [
            p.detach().flatten()
            for n, p in model.named_parameters()
            if n.endswith(("wo.weight", "w_down.weight", "w_down_EDF"))
        ]
    )
    inputs = torch.cat(
        [p.detach().flatten() for n, p in model.named_parameters() if n.endswith(("wq.weight", "w_gate_up_E2FD"))]
    )
    # a normal truncated at ±3σ has std 0.986σ
    assert out.std().item() == pytest.approx(0.986 * want_out, rel=0.03)
    assert inputs.std().item() == pytest.approx(0.986 * 0.05, rel=0.03)
