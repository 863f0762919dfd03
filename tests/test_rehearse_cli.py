"""`--rehearse N [--rank R]` on the command line (src/moetrain/rehearse.py): `moetrain bench` and
`moetrain train` run one rank of an N-rank layout alone on CPU, say so on the console, and report
the rank's record in their JSON line; a plain resume refuses the rehearsal's checkpoint; bad
flags exit 2 with one paragraph; `moetrain plan` prints the `moetrain bench --rehearse` line of
its layout. A rehearsal registers a process-group backend, so each runs in its own process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from moetrain.cli import main
from moetrain.plan import plan
from moetrain.presets import resolve_config
from moetrain.rehearse import NOT_MEASURED

SMALL = ["--model.d_model=64", "--model.vocab_size=512", "--data.seq_len=32"]
BENCH = [
    "--device",
    "cpu",
    "--routing",
    "learned",
    "--warmup",
    "1",
    "--steps",
    "1",
    "--logging.profile_steps=1",
    *SMALL,
]
MUON_STEP = ["--parallel.shard_optimizer=true", "--optim.name=muon", "--also-optimizer-step"]
PP2 = ["--parallel.pp=2", "--train.micro_batch_size=12"]  # two micro-batches per step: pp=2 needs ≥ 2


def start(*args: str) -> subprocess.Popen:
    """`python -m moetrain ARGS` started in the background, one thread (they run side by side)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "moetrain", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def last_json(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines, f"no JSON line on stdout; stderr:\n{out.stderr}"
    return json.loads(lines[-1])


def the_checkpoint(run_dir: Path) -> Path:
    """The one checkpoint of a run."""
    (path,) = (run_dir / "checkpoints").iterdir()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, real_text_dir):
    """{name: (run_dir, CompletedProcess)}: three bench rehearsals and a train rehearsal on CPU,
    run side by side, then a plain `train --resume` of the train rehearsal's run directory."""
    root = tmp_path_factory.mktemp("rehearse-cli")
    train_flags = [
        "--model.d_model=64",
        "--model.vocab_size=512",
        "--data.seq_len=64",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=8",
        "--train.eval_tokens=256",
        "--logging.tensorboard=false",
        "--logging.plot=false",
        f"--data.sources=[{real_text_dir}]",
    ]
    ep2 = ["--rehearse", "4", "--parallel.ep=2"]
    argv = {
        "bench rank 1": ["bench", "tiny", *ep2, "--rank", "1", *BENCH],
        "bench, no checkpoint": ["bench", "tiny", *ep2, "--rank", "0", "--no-checkpoint", *BENCH],
        "bench, default rank": ["bench", "tiny", "--rehearse", "4", *PP2, *BENCH],
        "bench, sharded Muon's step": ["bench", "tiny", *ep2, "--rank", "2", "--no-checkpoint", *MUON_STEP, *BENCH],
        "train rank 1": ["train", "tiny", *ep2, "--rank", "1", "--steps", "2", *train_flags],
    }
    dirs = {name: root / name.replace(" ", "-").replace(",", "") for name in argv}
    procs = {name: start(*args, "--run-dir", str(dirs[name])) for name, args in argv.items()}
    done = {name: (dirs[name], finish(proc)) for name, proc in procs.items()}
    # On one process: ep=2 needs dp ≥ 2, so the plain resume runs the layout's dp1 version.
    resume = ["train", "tiny", "--steps", "4", "--resume", *train_flags, "--run-dir", str(dirs["train rank 1"])]
    done["plain resume"] = (dirs["train rank 1"], finish(start(*resume)))
    return done


def test_bench_rehearsal_says_on_the_console_which_rank_runs_and_that_communication_is_not_measured(runs):
    """The console (stderr) names the rehearsed rank and says what is not measured."""
    _, out = runs["bench rank 1"]
    assert out.returncode == 0, out.stderr
    assert "REHEARSAL" in out.stderr and "rank 1 of 4 runs alone" in out.stderr
    assert "communication is NOT measured" in out.stderr and "Traceback" not in out.stderr


def test_bench_rehearsal_writes_the_rehearsed_ranks_checkpoint(runs):
    """The checkpoint saved and loaded back is rank 1's of 4: its RNG file, a data file for
    every rank (what each stand-in peer would write) and the rehearsal in trainer_state.json."""
    run_dir, out = runs["bench rank 1"]
    assert out.returncode == 0, out.stderr
    path = the_checkpoint(run_dir)
    assert (path / "COMPLETE").is_file() and [p.name for p in path.glob("rng-rank*.json")] == ["rng-rank1.json"]
    assert sorted(p.name for p in path.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert json.loads((path / "trainer_state.json").read_text())["rehearsal"] == {"world": 4, "rank": 1}


def test_bench_rehearsal_of_rank_1_prints_its_record(runs):
    """The last stdout line is the bench record with the rehearsal's entry: rank 1 of 4, its
    layout, communication labelled not measured, compute time, the three peaks (None while
    saving/loading on CPU), the checkpoint's sizes, the stood-in ep=2 exchange; no planner or
    projection on CPU (no GPU to compare with)."""
    run_dir, out = runs["bench rank 1"]
    r = last_json(out)["rehearsal"]
    assert (r["world"], r["rank"]) == (4, 1)
    assert isinstance(r["layout"], str) and "ep2" in r["layout"]
    assert r["communication"] == NOT_MEASURED and r["compute_s"] > 0
    assert set(r["peak_gib"]) == {"training", "saving", "loading"} and r["peak_gib"]["training"] > 0
    ckpt = r["checkpoint"]
    assert 0 < ckpt["shard_bytes"] <= ckpt["checkpoint_bytes"]
    assert ckpt["checkpoint"] == str(the_checkpoint(run_dir))
    assert any(k.startswith("all_to_all over 2 ranks") for k in r["collectives_per_step"]), r["collectives_per_step"]
    assert r["planner"] is None and r["projected"] is None


def test_bench_rehearsal_with_no_checkpoint_saves_none(runs):
    run_dir, out = runs["bench, no checkpoint"]
    r = last_json(out)["rehearsal"]
    assert (r["world"], r["rank"]) == (4, 0) and r["communication"] == NOT_MEASURED
    assert r["checkpoint"] is None and r["peak_gib"]["saving"] is None and r["peak_gib"]["loading"] is None
    assert not (run_dir / "checkpoints").exists()
    assert "saving this rank's checkpoint" not in out.stderr


def test_bench_rehearsal_times_a_sharded_optimizer_step_without_projecting_it(runs):
    """--also-optimizer-step in a rehearsal (the sharded Muon of rank 2 of 4, its peers' shards
    stood in): a second line timing the optimizer alone, with its share of the training step and
    no rehearsal projection (no tokens pass); the rank holds a quarter of the dense matrices'
    momentum and of the rest's AdamW moments, so well under the 4 + 8 bytes per parameter of a
    whole Muon and AdamW state."""
    _, out = runs["bench, sharded Muon's step"]
    assert out.returncode == 0, out.stderr
    step, opt = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert (step["timed"], opt["timed"]) == ("training step", "optimizer step")
    assert step["rehearsal"]["rank"] == 2 and "rehearsal" not in opt
    assert 0 < opt["share_of_training_step"] < 1 and opt["tokens_per_sec"] is None
    assert opt["optimizer"]["name"] == "muon" and 0 < opt["optimizer"]["state_bytes_per_param"] < 4


def test_bench_rehearsal_without_rank_runs_the_planners_busiest_rank(runs):
    """pp2 on 4: the planner's busiest rank is on the second pipeline stage (not rank 0, so the
    default shows); that rank is the one the console names and whose checkpoint is written."""
    run_dir, out = runs["bench, default rank"]
    assert out.returncode == 0, out.stderr
    overrides = [a[2:] for a in [*PP2, *SMALL]] + ["data.synthetic=true", "train.device=cpu"]
    expected = plan(resolve_config("tiny", overrides), 4, "h200").busiest_rank
    assert expected != 0
    assert f"REHEARSAL: rank {expected} of 4 runs alone" in out.stderr
    path = the_checkpoint(run_dir)
    assert [p.name for p in path.glob("rng-rank*.json")] == [f"rng-rank{expected}.json"]
    assert json.loads((path / "trainer_state.json").read_text())["rehearsal"] == {"world": 4, "rank": expected}
    assert last_json(out)["rehearsal"]["rank"] == expected  # the rehearsed process reports, whatever its rank


def test_train_rehearsal_ends_with_the_ranks_record_and_checkpoint(runs):
    """Two steps of rank 1 of dp4·ep2 on real text, then its checkpoint saved and loaded back:
    the final JSON line has the rehearsal's entry and names that checkpoint (no final save of
    its own: one checkpoint in the run)."""
    run_dir, out = runs["train rank 1"]
    summary = last_json(out)
    assert "REHEARSAL : rank 1 of 4" in out.stderr and "communication is NOT measured" in out.stderr
    r = summary["rehearsal"]
    assert (r["world"], r["rank"], r["communication"]) == (4, 1, NOT_MEASURED) and summary["steps"] == 2
    assert set(r["peak_gib"]) == {"training", "saving", "loading"} and r["peak_gib"]["training"] > 0
    assert 0 < r["checkpoint"]["shard_bytes"] <= r["checkpoint"]["checkpoint_bytes"]
    assert summary["checkpoint"] == r["checkpoint"]["checkpoint"] == str(the_checkpoint(run_dir))
    assert (run_dir / "checkpoints" / "step-2" / "COMPLETE").is_file()


def test_a_plain_resume_refuses_the_rehearsals_checkpoint(runs):
    """The checkpoint holds only rank 1's entries: a plain `train --resume` stops with exit 2,
    names the rehearsal that can load it, and leaves it in place."""
    run_dir, out = runs["plain resume"]
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "rehearsal of rank 1 of 4" in out.stderr and "--rehearse 4 --rank 1" in out.stderr
    assert (run_dir / "checkpoints" / "step-2" / "COMPLETE").is_file()


BAD_FLAGS = [
    (["--rank", "1"], ["--rank=1", "--rehearse N"]),
    (["--rehearse", "1"], ["--rehearse=1", "2 or more"]),
    (["--rehearse", "4", "--rank", "4"], ["--rank=4", "0 to 3"]),
    (["--rehearse", "4", "--rank", "-1"], ["--rank=-1", "0 to 3"]),
]


@pytest.mark.parametrize("command", ["bench", "train"])
@pytest.mark.parametrize("flags, words", BAD_FLAGS)
def test_bad_rehearsal_flags_exit_2_naming_the_flag(capsys, tmp_path, command, flags, words):
    """Refused before any process group is made (so in this process)."""
    assert main([command, "tiny", *flags, "--device", "cpu", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and all(w in err for w in words), err
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_bench_no_checkpoint_without_rehearse_is_refused(capsys):
    """--no-checkpoint only means something to a rehearsal (a plain bench saves nothing)."""
    assert main(["bench", "tiny", "--no-checkpoint", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--no-checkpoint" in err and "--rehearse N" in err and "Traceback" not in err, err


@pytest.mark.parametrize("layout", [["--parallel.ep=8"], ["--parallel.pp=2"]])
def test_plan_names_the_rehearse_command_of_its_busiest_rank(capsys, layout):
    """dp8·ep8 (busiest rank 0) and pp2·dp4 (busiest rank on the second stage): the JSON line's
    `rehearse_command` rehearses the planner's busiest rank on CUDA with the given flags."""
    assert main(["plan", "sweep-8l-8", "--gpus", "8", "--gpu", "h200", *layout]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    busiest = plan(resolve_config("sweep-8l-8", [f[2:] for f in layout]), 8, "h200").busiest_rank
    assert (busiest != 0) == ("--parallel.pp=2" in layout) and out["busiest_rank"] == busiest
    command = out["rehearse_command"]
    assert command.startswith(f"moetrain bench sweep-8l-8 --rehearse 8 --rank {busiest} "), command
    assert "--device cuda" in command and command.split()[-len(layout) :] == layout


def test_a_rehearsal_under_torchrun_is_refused(capsys, monkeypatch, tmp_path):
    """A rehearsal is one process: started as one of torchrun's WORLD_SIZE ranks it stops with
    one paragraph saying to start it plainly, before any process group exists."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["bench", "tiny", "--rehearse", "4", *BENCH, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--rehearse" in err and "WORLD_SIZE=2" in err and "plain process" in err and "Traceback" not in err, err
    assert not dist.is_initialized()
