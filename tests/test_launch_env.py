"""The launch scripts run as the README writes them, from a shell whose PATH has no virtualenv
on it (issue 17, "the first hour"): they find the checkout's .venv themselves, and say what to
do when no interpreter with moetrain and torch is there."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "scripts" / "launch" / "ref-tiny-64e.sh"


def start(env_extra):
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), **env_extra}
    return subprocess.Popen(
        ["bash", str(SCRIPT), "plan", "--no-suggest"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc):
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(env_extra):
    return finish(start(env_extra))


@pytest.fixture(scope="module")
def plans():
    """The two runs that start an interpreter, side by side (one core each): {name: result}."""
    procs = {"venv": start({}), "override": start({"PYTHON": sys.executable})}
    return {name: finish(proc) for name, proc in procs.items()}


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="no .venv in this checkout")
def test_launch_script_uses_the_checkouts_venv_without_activation(plans):
    out = plans["venv"]
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["preset"] == "ref-tiny-64e"


def test_launch_script_without_a_usable_python_says_what_to_do():
    out = run({"PYTHON": "/bin/false"})
    assert out.returncode == 2 and "make install" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_launch_script_honours_python_override(plans):
    out = plans["override"]
    assert out.returncode == 0, out.stderr[-2000:]


def test_launch_script_rehearse_mode_runs_bench_rehearse_with_the_scripts_layout(tmp_path):
    """`bash ref-*.sh rehearse …` becomes `moetrain bench PRESET --rehearse GPUS LAYOUT… …`: the
    world is the script's NODES × 8, the layout flags are the ones `plan` and torchrun get, and
    the caller's flags come last (so they win). A stand-in interpreter records its arguments."""
    fake = tmp_path / "python"
    record = tmp_path / "argv.json"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = -c ] && exit 0\n'
        f"{sys.executable} -c \"import json, sys; json.dump(sys.argv[1:], open('{record}', 'w'))\" \"$@\"\n"
    )
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "PYTHON": str(fake), "NODES": "4"}
    out = subprocess.run(
        ["bash", str(SCRIPT), "rehearse", "--device", "cuda", "--model.n_layers=4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    argv = json.loads(record.read_text())
    assert argv[:5] == ["-m", "moetrain", "bench", "ref-tiny-64e", "--rehearse"] and argv[5] == "32"
    layout = argv[6:-3]
    assert "--parallel.pp=2" in layout and "--parallel.ep=8" in layout
    assert "--parallel.shard_optimizer=true" in layout and "--train.micro_batch_size=32" in layout
    assert argv[-3:] == ["--device", "cuda", "--model.n_layers=4"]
