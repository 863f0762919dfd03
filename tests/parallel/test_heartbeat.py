"""Naming a dead rank: every rank's heartbeat counter in the rendezvous store, and the ranks
whose counter stands still."""

import torch.distributed as dist

from moetrain.parallel import distributed as md
from moetrain.testing.distributed import run_distributed


def _watch():
    md._start_heartbeat()
    dist.barrier()
    all_alive = md.unresponsive_ranks(watch_s=2.5)
    dist.barrier()
    if dist.get_rank() == 2:
        md.stop_heartbeat()  # as if rank 2 had died (or hung)
    dist.barrier()
    one_gone = md.unresponsive_ranks(watch_s=2.5) if dist.get_rank() != 2 else None
    dist.barrier()
    return all_alive, one_gone


def test_the_ranks_whose_heartbeat_stopped_are_named():
    results = run_distributed(_watch, 3)
    assert [r[0] for r in results] == [[], [], []]
    assert [r[1] for r in results] == [[2], [2], None]


def test_without_a_process_group_no_rank_is_named():
    assert md.unresponsive_ranks(watch_s=0.0) is None
