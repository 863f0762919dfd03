"""Typed configs: YAML, dotted overrides, presets, and errors that name the key."""

import pytest

from moetrain.config import apply_overrides, load_yaml
from moetrain.errors import ConfigError
from moetrain.model.config import Routing
from moetrain.presets import PRESETS, preset, resolve_config
from moetrain.train.config import RunConfig


def test_overrides_set_nested_typed_values():
    cfg = resolve_config("tiny", ["optim.lr=1e-3", "model.moe.routing=random", "data.sources=[a, b]", "train.steps=7"])
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.model.moe.routing == Routing.random
    assert cfg.data.sources == ["a", "b"]
    assert cfg.train.steps == 7


def test_round_trip_through_yaml(tmp_path):
    cfg = resolve_config("ref-small-64e", ["optim.lr=2e-4"])
    path = tmp_path / "run.yaml"
    path.write_text(cfg.to_yaml())
    assert resolve_config(str(path)) == cfg


def test_yaml_can_start_from_a_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\nmodel:\n  moe:\n    top_k: 2\ntrain:\n  steps: 5\n")
    cfg = resolve_config(str(path))
    assert cfg.model.moe.top_k == 2 and cfg.train.steps == 5
    assert cfg.model.d_model == PRESETS["tiny"]().model.d_model


@pytest.mark.parametrize(
    "override, words",
    [
        ("optim.lrr=1", ["optim.lrr", "Did you mean 'lr'"]),
        ("model.moe.nope=1", ["model.moe.nope"]),
        ("optim.lr=fast", ["optim.lr", "number", "fast"]),
        ("train.steps=1.5", ["train.steps", "integer"]),
        ("model.moe.routing=smart", ["model.moe.routing", "learned", "random"]),
        ("compute.compile=maybe", ["compute.compile", "true or false"]),
        ("optim.lr", ["has no value"]),
        ("optim.lr.x=1", ["optim.lr", "not a section"]),
    ],
)
def test_bad_overrides_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", [override])
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.moe.top_k=9", ["model.moe.top_k=9", "num_experts=8"]),
        ("model.n_heads=3", ["model.n_heads=3", "d_model=128"]),
        ("model.n_kv_heads=3", ["model.n_kv_heads=3", "n_heads=4"]),
        ("train.micro_batch_size=5", ["global_batch_size=24", "micro_batch_size=5"]),
        ("train.steps=0", ["train.steps=0"]),
        ("data.seq_len=-4", ["data.seq_len=-4"]),
        ("model.d_model=-8", ["model.d_model=-8"]),
        ("model.moe.expert_hidden=12", ["expert_hidden=12", "multiple of 8"]),
        ("data.weights=[1.0, 2.0]", ["data.weights", "one weight per source"]),
    ],
)
def test_invalid_values_fail_validation_with_the_field(override, words):
    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", [override])
    for word in words:
        assert word in str(e.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_model: 64\n   n_layers: [2\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert "bad.yaml" in str(e.value) and "line" in str(e.value)


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError) as e:
        resolve_config(str(path))
    assert "run.yaml" in str(e.value) and "model.d_modle" in str(e.value) and "d_model" in str(e.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_call_of_a_preset_gets_a_config_of_its_own(name):
    first = preset(name)
    pristine = first.to_yaml()
    first.model.n_layers += 1
    first.model.moe.num_experts += 1
    assert preset(name).to_yaml() == pristine


def test_unknown_preset():
    with pytest.raises(ConfigError, match="Unknown preset|neither a preset"):
        resolve_config("huge")


def test_grad_accum_follows_from_global_batches():
    cfg = resolve_config("tiny", ["train.global_batch_size=64", "train.micro_batch_size=16"])
    assert cfg.train.grad_accum_steps == 4


def test_apply_overrides_returns_new_tree():
    cfg = RunConfig()
    new = apply_overrides(cfg, ["optim.lr=0.5"])
    assert cfg.optim.lr != 0.5 and new.optim.lr == 0.5


def test_config_help_lists_every_key_with_type_default_and_docstring(capsys):
    """`moetrain config --help` is the reference of every key, generated from the dataclasses,
    so a new field shows up by itself; a field without a docstring fails here."""
    import dataclasses

    from moetrain.cli import main
    from moetrain.config import type_name, walk_fields
    from moetrain.train.config import RunConfig

    with pytest.raises(SystemExit) as e:
        main(["config", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    fields = list(walk_fields(RunConfig))
    assert len(fields) > 60 and len({f.dotted for f in fields}) == len(fields)
    for f in fields:
        assert f"  {f.dotted}  ({type_name(f.type)})" in text, f.dotted
        assert f.doc, f"{f.dotted} has no docstring (the string literal after the field)"
        assert f.default is not dataclasses.MISSING, f.dotted
    assert "  optim.lr  (float) = " in text and "  model.moe.routing  (one of learned|random) = learned" in text
    assert "  model.head_dim  (int or null) = null" in text


NAMES = ["run #1", "0123", "2026-12-06", "a: b", "[x]", "yes", "1e3", "~x", "null-run", "12:30"]


@pytest.mark.parametrize("name", NAMES)
def test_a_name_or_path_is_the_text_given_whatever_yaml_would_read(name, tmp_path):
    cfg = resolve_config("tiny", [f"train.run_dir={name}", f"logging.wandb_name={name}", f"data.sources={name}"])
    assert cfg.train.run_dir == cfg.logging.wandb_name == name
    assert cfg.data.sources == ([name] if name[0] != "[" else ["x"])  # [x]: a list key's own syntax
    plain = name if name[0] not in "[~" and ": " not in name and "#" not in name else None
    if plain is not None:  # the same words unquoted in a config file
        path = tmp_path / "run.yaml"
        path.write_text(f"preset: tiny\ntrain:\n  run_dir: {plain}\ndata:\n  sources: [{plain}]\n")
        cfg = resolve_config(str(path))
        assert cfg.train.run_dir == plain and cfg.data.sources == [plain]


def test_null_unsets_an_optional_name_and_a_list_of_names_keeps_its_items_as_text():
    assert resolve_config("tiny", ["train.run_dir=x", "train.run_dir=null"]).train.run_dir is None
    assert resolve_config("tiny", ["data.sources=[0123, 2026-12-06, 'a b']"]).data.sources == [
        "0123",
        "2026-12-06",
        "a b",
    ]


def test_a_number_on_the_command_line_is_read_as_written():
    cfg = resolve_config("tiny", ["train.seed=0123", "train.steps=1e3", "optim.lr=1e-3"])
    assert (cfg.train.seed, cfg.train.steps, cfg.optim.lr) == (123, 1000, 1e-3)


@pytest.mark.parametrize("key", ["train.run_dir", "checkpoint.init_from", "data.val"])
def test_an_empty_name_is_refused_naming_the_key(key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_config("tiny", [f"{key}="])


def test_python_values_of_the_wrong_shape_are_refused_naming_the_key(tmp_path):
    cfg = resolve_config("tiny")
    for key, value, words in [
        ("train.run_dir", tmp_path / "run", r"train\.run_dir=PosixPath\(.*\) must be a string \(a path as str"),
        ("data.val", tmp_path, r"data\.val=PosixPath"),
        ("data.sources", "data/default", r"data\.sources='data/default' must be a list of strings"),
        ("data.sources", [tmp_path], r"data\.sources=\[PosixPath"),
        ("data.synthetic", "false", r"data\.synthetic='false' must be true or false"),  # "false" is truthy
        ("optim", None, r"optim=None is no OptimConfig: set its fields"),
    ]:
        *section, name = key.split(".")
        wrong = resolve_config("tiny")
        setattr(getattr(wrong, section[0]) if section else wrong, name, value)
        with pytest.raises(ConfigError, match=words):
            wrong.validate()
    with pytest.raises(ConfigError, match=r"pass \['train.steps=3'\], not the string alone"):
        resolve_config("tiny", "train.steps=3")  # not read as overrides 't', 'r', …
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(cfg.to_yaml())
    assert resolve_config(yaml_file).to_yaml() == cfg.to_yaml()  # a Path to a YAML file
