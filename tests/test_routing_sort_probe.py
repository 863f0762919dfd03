"""benchmarks/probes/routing_sort_probe.py times three forms of the routing's sort by expert; they
must be one permutation: today's `sort_by_expert`, bit for bit, for every shape it times."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks/probes"))
from routing_sort_probe import SHAPES, VARIANTS  # noqa: E402

from moetrain.model.token_dispatcher import sort_by_expert  # noqa: E402


@pytest.mark.parametrize("preset", sorted(SHAPES))
def test_every_variant_is_todays_permutation(preset):
    N, K, E = SHAPES[preset]
    ids_NK = torch.rand(N, E, generator=torch.Generator().manual_seed(1)).topk(K, dim=-1).indices
    want = sort_by_expert(ids_NK)
    for name, fn in VARIANTS.items():
        got = fn(ids_NK, E)
        assert all(torch.equal(a.long(), b) for a, b in zip(got, want)), name
