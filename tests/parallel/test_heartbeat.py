"""Naming a dead rank: every rank's heartbeat counter in the rendezvous store, and the ranks
whose counter stands still."""

import torch.distributed as dist
from support.distributed import run_distributed

from moetrain.parallel import distributed as md


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


HUNG_PEER = """
import sys, time
import torch.distributed as dist
from moetrain.parallel import distributed as md

md.init_distributed("cpu", timeout_s=300, peer_timeout_s=3)
if dist.get_rank() == 1:
    md.stop_heartbeat()  # alive but silent: as a rank stuck in a kernel or a deadlock
    time.sleep(120)
dist.barrier()  # rank 0 waits here for a peer that never comes
print("unreachable", flush=True)
"""


def test_a_hung_peer_stops_the_run_with_its_rank_named(tmp_path):
    """No collective fails when a peer hangs (gloo would wait out its 300 s timeout here, NCCL
    may wait indefinitely): the rank watching it ends the run after parallel.peer_timeout_s."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "hung.py"
    script.write_text(HUNG_PEER)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0 and "unreachable" not in proc.stdout
    assert "error: rank 0: rank 1 has shown no sign of life for" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - started < 60
