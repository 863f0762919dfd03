"""Whether the routing's stable sort by expert (`sort_by_expert`, src/moetrain/model/token_dispatcher.py)
has a cheaper form, before it changes: the idle gaps in a profiled step sit before `aten::sort`
(docs/measurements.md), and a sort of int64 keys runs twice the radix passes of int32 ones.

For each bench preset's routing shape (N tokens of one micro-batch, top-K of E experts), the
permutation and its inverse three ways, each eager and compiled (as inside a compiled block):
- `int64`: today's: a stable argsort of the int64 expert ids, the inverse by one scatter;
- `int32`: the same sort of the ids cast to int32 (half the key bits);
- `counting`: no sort: an assignment's destination is its expert's first row plus the number of
  earlier assignments to the same expert (a cumulative sum over a one-hot (M, E) matrix); the
  order by one scatter.
All three give the same permutation (a stable sort's is unique; tests/test_routing_sort_probe.py).
Per variant: ms per call back to back (launches queue as in training) and the kernels' device time.

Run on a GPU: `python benchmarks/probes/routing_sort_probe.py`.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from moetrain.model.permute import inverse_permutation
from moetrain.model.token_dispatcher import sort_by_expert

SHAPES = {  # preset: (tokens of one micro-batch, top-k, experts)
    "bench-8e": (8192, 4, 8),
    "bench-tiny64e-l6": (16384, 4, 64),
    "bench-small32e": (16384, 4, 32),
    "bench-sweep-64": (8192, 4, 64),
}


def by_int64(topk_ids_NK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    return sort_by_expert(topk_ids_NK)


def by_int32(topk_ids_NK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    sort_idx_M = topk_ids_NK.flatten().to(torch.int32).argsort(stable=True)
    return sort_idx_M, inverse_permutation(sort_idx_M).view(topk_ids_NK.shape)


def by_counting(topk_ids_NK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids_M = topk_ids_NK.flatten()
    one_hot_ME = F.one_hot(ids_M, num_experts).to(torch.int32)
    count_E = one_hot_ME.sum(0)
    first_E = count_E.cumsum(0) - count_E
    before_M = (one_hot_ME.cumsum(0) - one_hot_ME).gather(1, ids_M.unsqueeze(1)).squeeze(1)
    inv_M = first_E[ids_M] + before_M
    arange_M = torch.arange(ids_M.numel(), device=ids_M.device, dtype=inv_M.dtype)
    sort_idx_M = torch.empty_like(inv_M).scatter_(0, inv_M, arange_M)
    return sort_idx_M.long(), inv_M.long().view(topk_ids_NK.shape)


VARIANTS = {"int64": by_int64, "int32": by_int32, "counting": by_counting}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cuda_timing import busy_ms, window_ms

    for preset, (N, K, E) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        ids_NK = torch.rand(N, E, device="cuda", generator=g).topk(K, dim=-1).indices
        want = by_int64(ids_NK, E)
        for name, fn in VARIANTS.items():
            for compiled in (False, True):
                call = functools.partial(torch.compile(fn, dynamic=False) if compiled else fn, ids_NK, E)
                same = all(torch.equal(a.long(), b) for a, b in zip(call(), want))
                row = {"preset": preset, "M": N * K, "E": E, "variant": name, "compiled": compiled, "same": same}
                row["ms"] = round(window_ms(call, calls=50), 4)
                row["busy_ms"] = round(busy_ms(call, calls=10), 4)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
