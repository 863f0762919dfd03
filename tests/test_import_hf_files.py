"""`import-hf` reads weights from safetensors files only: a pickled weight file (which can run
code when it is loaded) is refused unopened, so is an index naming one, and a pickle disguised
as model.safetensors fails as a safetensors file without running anything."""

import json
import pickle

import pytest

from moetrain.cli import main
from moetrain.hf.arch import hf_config
from moetrain.presets import resolve_config

pytest.importorskip("safetensors")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file when unpickled


@pytest.fixture
def hf_dir(tmp_path):
    """A Qwen3-MoE config.json (a small `tiny`) and no weights yet."""
    cfg = resolve_config("tiny", ["model.vocab_size=512", "model.d_model=64", "model.n_layers=2"])
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config(cfg.model, 0, 64, "float32")))
    return path


def refused(capsys, hf_dir, tmp_path, *words):
    assert main(["import-hf", str(hf_dir), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "pwned").exists()  # nothing ran
    assert not (tmp_path / "out").exists()


def test_a_pickled_weight_file_is_refused_unopened(capsys, hf_dir, tmp_path):
    (hf_dir / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(str(tmp_path / "pwned"))))
    refused(capsys, hf_dir, tmp_path, "pytorch_model.bin", "pickles", "only safetensors", "save_pretrained")


def test_an_index_naming_a_pickle_is_refused(capsys, hf_dir, tmp_path):
    (hf_dir / "evil.bin").write_bytes(pickle.dumps(_Payload(str(tmp_path / "pwned"))))
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "evil.bin"}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(capsys, hf_dir, tmp_path, "evil.bin", "not a safetensors file")


def test_a_pickle_named_model_safetensors_fails_as_safetensors(capsys, hf_dir, tmp_path):
    (hf_dir / "model.safetensors").write_bytes(pickle.dumps(_Payload(str(tmp_path / "pwned"))))
    refused(capsys, hf_dir, tmp_path, "model.safetensors", "not a readable safetensors file", "nothing in it was run")


def test_an_index_cannot_point_outside_the_directory(capsys, hf_dir, tmp_path):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(capsys, hf_dir, tmp_path, "../elsewhere.safetensors", "outside the directory")


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("num_experts_per_tok", 100, ["top_k=100", "num_experts=8"]),
        ("rms_norm_eps", -1, ["norm_eps=-1", "positive"]),
        ("head_dim", 7, ["head_dim=7", "even"]),
        ("hidden_size", "64", ["d_model='64'", "integer"]),
        ("mlp_only_layers", 5, ["wrong type", "not iterable"]),
    ],
)
def test_a_config_json_of_a_model_moetrain_cannot_build_is_refused(capsys, hf_dir, tmp_path, field, value, words):
    """Values of the wrong type or outside a key's domain, checked as `moetrain train` checks its
    config, before any weight is read: no traceback, and no checkpoint that fails later."""
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, field: value}))
    refused(capsys, hf_dir, tmp_path, "config.json", *words)
