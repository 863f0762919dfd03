import pytest
import torch

from moetrain.errors import DataError
from moetrain.train.metrics import read_metrics, routing_metrics


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


def test_read_metrics_skips_a_torn_last_line_and_names_any_other_bad_one(tmp_path):
    """A process killed while appending leaves a torn last line: skipped. A line damaged inside
    the file (a crash's zeros, bytes that are not UTF-8) is a `DataError` naming its line, which
    `train --resume` and `plot` print as one paragraph instead of a JSON traceback."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\n{"step": 2, "val_loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    for damaged in (b'{"step": 1, "lo\x00\x00', b"\xff\xfe", b"[1, 2]"):
        path.write_bytes(damaged + b'\n{"step": 2}\n')
        with pytest.raises(DataError, match="metrics.jsonl, line 1: not a step's record"):
            read_metrics(path)
