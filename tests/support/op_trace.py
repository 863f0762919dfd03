"""`RankTrace`: what one rank runs, op by op — for comparing a rehearsed rank with the real one.

Under `with RankTrace() as trace:` every operator torch dispatches on this thread is recorded in
order: `trace.ops` holds (operator, shapes and dtypes of its outputs) — every allocation, kernel
and view the rank's own code makes — and `trace.collectives` holds each collective as
(collective, (shape, dtype) of its inputs), from whichever process group ran it:

- torch's functional collectives (`_c10d_functional.*`: the dispatchers' all-to-alls and
  all-gathers) and the c10d operators of a real group (gloo, NCCL: `c10d.allreduce_`, …) are
  operators, recorded as they are dispatched;
- a rehearsal's stand-in group (src/moetrain/parallel/rehearsal.py) is called without an operator
  for the c10d API (`dist.all_reduce` …): its ledger's call log is read instead, and the copies
  and scales it makes in place of the transfers are left out of `ops` (no rank makes them).

What runs inside an operator's own implementation is not seen (DTensor's redistributions under
FSDP: their collectives and kernels), with a real group and a stand-in alike.

Barriers are left out (a real group's and a stand-in's differ in how they wait, not in what the
rank does), and so are the operators a real group runs on the caller's thread while its work is
waited for (gloo finishes a reduce-scatter by copying this rank's chunk out inside `wait()`).
"""

from __future__ import annotations

import torch
from torch.distributed import Work
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moetrain.parallel import rehearsal

# c10d operator → (collective, index of its input argument)
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "allgather_": ("all_gather", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "reduce_": ("reduce", 0),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
}
_FUNCTIONAL = {
    "all_to_all_single": "all_to_all",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast",
}


def _metas(value) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype)) for t in tree_leaves(value) if isinstance(t, torch.Tensor))


class RankTrace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []
        self.collectives: list[tuple[str, tuple]] = []

    def __enter__(self):
        rehearsal.LEDGER.log = []
        self._waiting = 0
        self._wait = Work.wait

        def wait(work, *args, **kwargs):
            self._waiting += 1
            try:
                return self._wait(work, *args, **kwargs)
            finally:
                self._waiting -= 1

        Work.wait = wait
        return super().__enter__()

    def __exit__(self, *exc):
        Work.wait = self._wait
        self._take_ledger()
        rehearsal.LEDGER.log = None
        return super().__exit__(*exc)

    def _take_ledger(self) -> None:
        log = rehearsal.LEDGER.log
        if log:
            self.collectives += [(op, shapes) for op, _, shapes in log]
            log.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._take_ledger()  # stand-in calls made since the last operator came before this one
        out = func(*args, **kwargs)
        # Stand-in calls made inside the operator: a functional collective's own, or those of an
        # implementation this mode does not see into (DTensor's redistributions), as with a real group.
        rehearsal.LEDGER.log.clear()
        name = func._schema.name.split("::", 1)[1]
        if func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            self.collectives.append((_FUNCTIONAL[name], _metas(args[0])))
        elif func.namespace == "c10d":
            if name in _C10D:
                kind, at = _C10D[name]
                self.collectives.append((kind, _metas(args[at])))
        elif not rehearsal.inside_stand_in() and not self._waiting:
            self.ops.append((str(func), _metas(out)))
        return out
