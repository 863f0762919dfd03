"""A missing optional package is answered with one paragraph naming what needs it and the
`pip install 'moetrain[extra]'` line, never a ModuleNotFoundError traceback: one test per extra
(hf, viz, wandb), the package hidden from the import system."""

import json
import sys
import tomllib
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.errors import EXTRAS, ConfigError, MissingDependency, require


def hide(monkeypatch, *modules):
    # A None entry in sys.modules makes `import name` raise ImportError (ModuleNotFoundError).
    for name in list(sys.modules):
        if name.split(".")[0] in modules:
            monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def one_paragraph(err: str, extra: str) -> None:
    assert err.startswith("error: ") and "Traceback" not in err and "ModuleNotFoundError" not in err, err
    assert f"pip install 'moetrain[{extra}]'" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["export-hf", "import-hf"])
def test_hf_extra_missing_safetensors(monkeypatch, tmp_path, capsys, command):
    hide(monkeypatch, "safetensors")
    assert main([command, str(tmp_path / "somewhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    one_paragraph(err, "hf")
    assert command in err and "safetensors" in err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_viz_extra_missing_matplotlib(monkeypatch, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 1.0, "lm_loss": 1.0, "tokens_per_sec": 1.0}) + "\n"
    )
    hide(monkeypatch, "matplotlib")
    assert main(["plot", str(run), "--out", str(tmp_path / "x.png")]) == 2
    one_paragraph(capsys.readouterr().err, "viz")
    # At the end of training the plot is optional: a note, the run is not failed.
    from moetrain.train.plot import plot_run

    assert plot_run(run) is None
    assert "pip install 'moetrain[viz]'" in capsys.readouterr().err


def test_viz_extra_missing_tensorboard_is_a_note(monkeypatch, tmp_path, capsys):
    hide(monkeypatch, "tensorboard", "torch.utils.tensorboard")
    from moetrain.train.metrics import TensorBoardSink

    assert TensorBoardSink.open(tmp_path) is None
    err = capsys.readouterr().err
    assert "pip install 'moetrain[viz]'" in err and "logging.tensorboard=false" in err


def test_wandb_extra_missing(monkeypatch, tmp_path, capsys):
    hide(monkeypatch, "wandb")
    from moetrain.train.wandb_sink import require_wandb

    with pytest.raises(ConfigError) as e:
        require_wandb()
    assert "pip install 'moetrain[wandb]'" in str(e.value) and "logging.wandb=false" in str(e.value)


def test_require_names_the_purpose_and_every_optional_package_has_an_extra(monkeypatch):
    hide(monkeypatch, "matplotlib")
    with pytest.raises(MissingDependency, match=r"^the thing needs the optional package 'matplotlib'"):
        require("matplotlib.pyplot", "the thing")
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for package, extra in EXTRAS.items():
        assert any(dep.startswith(package) for dep in extras[extra]), (package, extra)


def test_data_extra_missing_pyarrow(monkeypatch, tmp_path, capsys):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")  # never opened: the import fails first
    hide(monkeypatch, "pyarrow")
    assert main(["prepare-data", str(tmp_path / "d.parquet"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    one_paragraph(err, "data")
    assert "d.parquet" in err
