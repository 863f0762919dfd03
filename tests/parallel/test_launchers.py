"""Ranks started by srun or mpirun without torchrun join one world (src/moetrain/parallel/distributed.py,
`adopt_launcher_env`) instead of running as N independent single-process runs, or are refused with
the torchrun line."""

import json
import os
import subprocess
import sys

import pytest
from support.distributed import free_port

from moetrain.errors import ConfigError
from moetrain.parallel.distributed import adopt_launcher_env, first_slurm_host


@pytest.mark.parametrize(
    "nodelist, host",
    [("gpu-[003-007,010],cpu1", "gpu-003"), ("node7", "node7"), ("a,b", "a"), ("x[07]", "x07"), ("p-[1,3]", "p-1")],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_srun_variables_become_torch_ones():
    env = {"SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu-[03-04]"}
    env["SLURM_JOB_ID"] = "123456"
    adopt_launcher_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("9", "16", "1")
    assert env["MASTER_ADDR"] == "gpu-03" and env["MASTER_PORT"] == str(29500 + 456)


def test_open_mpi_without_an_address_is_refused_with_the_torchrun_line():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    with pytest.raises(ConfigError, match="mpirun") as err:
        adopt_launcher_env(env)
    assert "MASTER_ADDR" in str(err.value) and "torchrun --nnodes" in str(err.value)
    env["MASTER_ADDR"] = "10.0.0.1"
    adopt_launcher_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("2", "4", "29500")


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "0", "WORLD_SIZE": "2", "SLURM_NTASKS": "8", "SLURM_PROCID": "5"},  # torchrun under srun
        {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"},  # one task: a world of one
        {},
    ],
)
def test_torchrun_and_single_tasks_are_left_alone(env):
    before = dict(env)
    adopt_launcher_env(env)
    assert env == before


def test_two_srun_tasks_form_one_world(tmp_path):
    """Two processes with srun's variables only (no RANK or WORLD_SIZE) run one dp2·ep2 bench:
    both ranks' peaks are in the record."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    cmd = [sys.executable, "-m", "moetrain", "bench", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "1"]
    cmd += ["--routing", "learned", "--parallel.ep=2", "--train.micro_batch_size=4", "--train.global_batch_size=4"]
    procs = []
    for rank in range(2):
        env = base | {
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    records = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    assert records and all(len(r["peak_mem_gib_per_rank"]) == 2 and r["layout"]["ep"] == 2 for r in records)


def _alone(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """`moetrain train tiny` as one process with `env` over a clean launcher environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_"))}
    torch_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in base.items() if k not in torch_vars}
    cmd = [sys.executable, "-m", "moetrain", "train", "tiny", "--device", "cpu", "--parallel.timeout_s=3", *extra]
    return subprocess.run(cmd, env=base | env, capture_output=True, text=True, timeout=120)


def test_srun_variables_without_srun_stop_in_bounded_time_saying_what_is_missing(tmp_path):
    """A plain python in a SLURM allocation (SLURM_NTASKS=2, no second task) waits no longer than
    parallel.timeout_s for the rank that never comes, then says how many came and that srun starts them."""
    env = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = _alone(env, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "1 of WORLD_SIZE=2 ranks met" in done.stderr and "srun starts one process per task" in done.stderr


def test_a_port_in_use_is_named_not_blamed_on_a_dead_rank(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        done = _alone(env, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2 and f"MASTER_PORT={port} on 127.0.0.1 is in use" in done.stderr, done.stderr[-2000:]
    assert "gone" not in done.stderr and "Traceback" not in done.stderr


def _setup_with_steps(steps_by_rank):
    import torch.distributed as dist

    from moetrain.presets import resolve_config
    from moetrain.train.runtime import setup_runtime

    cfg = resolve_config("tiny", [f"train.steps={steps_by_rank[dist.get_rank()]}", "train.device=cpu"])
    try:
        setup_runtime(cfg)
    except ConfigError as e:
        return str(e)
    return None


def test_ranks_started_with_other_configs_all_stop_naming_the_key():
    """A rank given other overrides (or another config file) than rank 0 would meet its peers in
    mismatched collectives, failing as a dead peer or hanging: every rank refuses at start-up."""
    from support.distributed import run_distributed

    messages = run_distributed(_setup_with_steps, 3, [2, 2, 3], timeout_s=60)
    assert messages[0] == messages[1] == messages[2], messages
    assert "rank 2 was started with other settings than rank 0" in messages[0]
    assert "train.steps=3 there, 2 on rank 0" in messages[0]
    assert run_distributed(_setup_with_steps, 2, [2, 2], timeout_s=60) == [None, None]


@pytest.mark.parametrize(
    "env, words",
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer ≥ 1"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE='0' is not an integer ≥ 1"),
        ({"RANK": "2"}, "RANK='2' is not an integer from 0 to 1"),
        ({"RANK": "-1"}, "RANK='-1' is not an integer from 0 to 1"),
        ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not an integer from 1 to 65535"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999' is not an integer from 1 to 65535"),
    ],
)
def test_launch_variables_set_wrong_by_hand_are_named(monkeypatch, env, words):
    """A rank outside the world waited for a rank 0 without a word; a word where a number belongs
    (or a port past 65535) ended in a traceback."""
    from moetrain.parallel.distributed import init_distributed

    for k, v in ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"} | env).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=words):
        init_distributed("cpu", timeout_s=3)


def _bench_with_steps(steps_by_rank):
    import torch.distributed as dist

    from moetrain.bench import run_bench

    try:
        run_bench("tiny", ["train.device=cpu"], warmup=0, steps=steps_by_rank[dist.get_rank()], progress=False)
    except ConfigError as e:
        return str(e)
    return None


def _check_with_reference(reference_by_rank):
    import torch.distributed as dist

    from moetrain.layout_check import check_layout
    from moetrain.presets import resolve_config

    try:
        check_layout(resolve_config("tiny", ["train.device=cpu"]), 1, reference=reference_by_rank[dist.get_rank()])
    except ConfigError as e:
        return str(e)
    return None


def test_check_layout_ranks_given_other_references_stop_instead_of_waiting():
    """check-layout's --reference, --steps and --rtol are not config keys: rank 0 comparing against
    one process while rank 1 joins an FSDP reference waited out the collective timeout."""
    from support.distributed import run_distributed

    messages = run_distributed(_check_with_reference, 2, ["one", "fsdp"], timeout_s=60)
    assert messages[0] == messages[1] and "--reference='fsdp' there, 'one' on rank 0" in messages[0], messages


def test_bench_ranks_given_other_steps_stop_instead_of_hanging():
    """bench's --warmup/--steps/--routing are not config keys: ranks timing another number of steps
    hung in their collectives. Each rank's own temporary run directory is no difference."""
    from support.distributed import run_distributed

    messages = run_distributed(_bench_with_steps, 2, [1, 2], timeout_s=60)
    assert messages[0] == messages[1] and "--steps=2 there, 1 on rank 0" in messages[0], messages
    assert "run_dir" not in messages[0]
