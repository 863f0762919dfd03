import pytest
import torch

from moetrain.train.metrics import routing_metrics


def test_routing_metrics_by_hand():
    layers = [
        {
            "tokens_per_expert": torch.tensor([4, 4, 4, 4]),
            "lb_loss": torch.tensor(1.0),
            "z_loss": torch.tensor(2.0),
            "dropped": torch.tensor(0),
        },
        {
            "tokens_per_expert": torch.tensor([10, 6, 0, 0]),
            "lb_loss": torch.tensor(3.0),
            "z_loss": torch.tensor(4.0),
            "dropped": torch.tensor(8),
        },
    ]
    m = routing_metrics(layers, ep=2)
    assert m["lb_loss"] == 2.0 and m["z_loss"] == 3.0
    assert m["expert_load_max_over_mean"] == pytest.approx(10 / 4)  # the worst layer
    assert m["expert_load_by_layer"] == [1.0, 2.5]  # each layer's, in order
    assert m["ep_load_max_over_mean"] == pytest.approx(16 / 8)  # rank 0 holds experts 0-1
    assert m["unused_experts"] == 2
    assert m["dropped_token_frac"] == pytest.approx(8 / 32)
