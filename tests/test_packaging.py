"""The package lives under src/: a clone's root folder is named like the package, and a script run
from the folder holding the clone must import the package, not the clone."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "moetrain"


def test_a_script_run_beside_the_clone_imports_the_package(tmp_path):
    """The current directory comes first on sys.path and offers the clone (no __init__.py) as a
    namespace package `moetrain`, its data/ (`make data` writes it) as `moetrain.data`. An
    editable install's finder of a package at the clone's top level comes after that and lost
    (`No module named 'moetrain.data.config'`); the regular package under src/ wins."""
    clone = tmp_path / "moetrain"
    clone.mkdir()
    for entry in ROOT.iterdir():
        (clone / entry.name).symlink_to(entry)
    if not (clone / "data").exists():
        (clone / "data" / "default").mkdir(parents=True)
    env = dict(os.environ)
    if env.get("PYTHONPATH"):  # a relative entry would be read against the other directory
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
    code = "import moetrain.data.config, moetrain; print(moetrain.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()).resolve() == (PACKAGE / "__init__.py").resolve(), out.stdout
