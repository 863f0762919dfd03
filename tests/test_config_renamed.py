"""Earlier key names (`RunConfig.renamed`: the keys `precision`, `compute`, `checkpoint`,
`logging` and `guard` hold, once all under `train`) are read as the new ones everywhere a key is
read: a YAML file, an override, an older run's config.yaml. Each is noted once a process, and an
old key beside its new one with another value is refused naming both. A retired key
(`RunConfig.retired`) at the value that behaves as the code does now is dropped with a note once
a process; at another it is refused, saying why it is gone and what to do."""

from __future__ import annotations

import pytest
import yaml

import moetrain.config as config_module
from moetrain.cli import main
from moetrain.config import load_yaml
from moetrain.errors import ConfigError
from moetrain.presets import resolve_config
from moetrain.train.config import RunConfig


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    """Every test starts as a fresh process would: no old key noted yet."""
    monkeypatch.setattr(config_module, "_NOTED", set())


def old_layout(tree: dict) -> dict:
    """`tree` (a RunConfig's dict) written the earlier way: every renamed key back under `train`."""
    old = {section: dict(keys) for section, keys in tree.items()}
    for old_key, new_key in RunConfig.renamed.items():
        section, leaf = new_key.split(".")
        old["train"][old_key.split(".")[1]] = old[section].pop(leaf)
    for section in {new.split(".")[0] for new in RunConfig.renamed.values()}:
        assert not old.pop(section), section
    return old


def test_an_older_runs_config_yaml_loads_as_the_new_tree_noting_each_old_key_once(tmp_path, capsys):
    cfg = resolve_config("tiny", ["precision.fp8_select=all", "checkpoint.save_every=50", "compute.recompute=full"])
    cfg.checkpoint.async_save, cfg.logging.wandb_name, cfg.guard.skip_window = True, "0123", 64
    old = old_layout(cfg.to_dict())
    assert old["train"]["save_every"] == 50 and old["train"]["async_checkpoint"] is True
    path = tmp_path / "run" / "config.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(old, sort_keys=False).replace("wandb_name: '0123'", "wandb_name: 0123"))

    resumed = RunConfig.from_dict(load_yaml(path, RunConfig))  # how --resume and init_from read it
    assert resumed == cfg and resumed.to_dict() == cfg.to_dict()
    assert resolve_config(str(path)) == cfg  # `moetrain train RUN_DIR/config.yaml`
    err = capsys.readouterr().err
    for old_key, new_key in RunConfig.renamed.items():
        assert err.count(f"note: {old_key} is now {new_key}; read as that.") == 1, (old_key, err)
    assert "note: train.precision is now precision.dtype; read as that." in err


def test_an_old_key_in_an_override_sets_its_new_key_and_is_noted_once(capsys):
    cfg = resolve_config("tiny", ["train.compile=true", "train.async_checkpoint=true", "train.steps=7"])
    again = resolve_config("tiny", ["--train.compile=true"])
    assert cfg.compute.compile and again.compute.compile and cfg.checkpoint.async_save and cfg.train.steps == 7
    err = capsys.readouterr().err
    assert err.count("note: train.compile is now compute.compile; read as that.") == 1
    assert err.count("note: train.async_checkpoint is now checkpoint.async_save; read as that.") == 1
    assert "train.steps" not in err


@pytest.mark.parametrize(
    "overrides", [["train.compile=true", "compute.compile=false"], ["compute.compile=false", "train.compile=true"]]
)
def test_an_old_and_a_new_key_with_different_values_are_refused_naming_both(overrides):
    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", overrides)
    message = str(e.value)
    assert "train.compile=true" in message and "compute.compile=false" in message, message
    assert "Keep compute.compile alone" in message


def test_an_old_and_a_new_key_with_one_value_are_one_setting():
    assert resolve_config("tiny", ["train.fp8_select=all", "precision.fp8_select=all"]).precision.fp8_select == "all"


def test_a_yaml_file_with_an_old_and_a_new_key_that_differ_is_refused_naming_both(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\ntrain:\n  save_every: 5\ncheckpoint:\n  save_every: 7\n")
    with pytest.raises(ConfigError, match=r"train\.save_every=5 and checkpoint\.save_every=7"):
        resolve_config(str(path))
    path.write_text("preset: tiny\ntrain:\n  save_every: 7\ncheckpoint:\n  save_every: 7\n")
    assert resolve_config(str(path)).checkpoint.save_every == 7


def test_the_shortcut_flags_set_the_new_keys(capsys):
    assert main(["config", "tiny", "--save-every", "5", "--steps", "9"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["checkpoint"]["save_every"] == 5 and out["train"]["steps"] == 9 and "save_every" not in out["train"]


def test_config_help_and_output_show_the_sections(capsys):
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    text = capsys.readouterr().out
    for key in ("precision.dtype", "precision.fp8", "compute.compile", "checkpoint.async_save", "logging.wandb"):
        assert f"  {key}  (" in text, key
    assert "  guard.skip_spike_sigma  (" in text and "  train.fp8  (" not in text
    assert main(["config", "tiny"]) == 0
    sections = list(yaml.safe_load(capsys.readouterr().out))
    assert sections[4:10] == ["train", "precision", "compute", "checkpoint", "logging", "guard"], sections


# --- retired keys (`RunConfig.retired`) --------------------------------------------------------


@pytest.mark.parametrize("section", ["precision", "train"])
def test_an_older_runs_config_yaml_with_a_retired_key_at_its_old_value_loads_noting_it_once(tmp_path, capsys, section):
    cfg = resolve_config("tiny", ["train.steps=7"])
    old = cfg.to_dict()
    old[section]["fp8_expert_weight_grad"] = False
    path = tmp_path / "run" / "config.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(old, sort_keys=False))

    assert RunConfig.from_dict(load_yaml(path, RunConfig)) == cfg  # how --resume and init_from read it
    assert resolve_config(str(path)) == cfg  # `moetrain train RUN_DIR/config.yaml`
    err = capsys.readouterr().err
    assert err.count(f"note: {section}.fp8_expert_weight_grad is no longer a key; false ignored:") == 1, err


@pytest.mark.parametrize("section", ["precision", "train"])
def test_a_retired_key_set_otherwise_is_refused_saying_why_and_what_to_do(tmp_path, capsys, section):
    path = tmp_path / "run.yaml"
    path.write_text(f"preset: tiny\n{section}:\n  fp8_expert_weight_grad: true\n")
    for args in (["config", str(path)], ["config", "tiny", f"--{section}.fp8_expert_weight_grad=true"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err, err
        for words in (f"{section}.fp8_expert_weight_grad=true is no longer a key", "no measured win", "Remove the key"):
            assert words in err, (words, err)
    assert main(["config", "tiny", f"--{section}.fp8_expert_weight_grad=false"]) == 0
