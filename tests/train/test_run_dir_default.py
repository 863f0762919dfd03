"""Without --run-dir a run goes to runs/NAME, and never into an earlier run's directory."""

import json

import pytest
from conftest import tiny_overrides
from support.distributed import run_distributed

from moetrain.cli import main
from moetrain.presets import resolve_config, run_name
from moetrain.train.metrics import read_metrics
from moetrain.train.run_dir import default_run_dir
from moetrain.train.trainer import Trainer


def _a_run(path):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("{}\n")


def test_fresh_runs_take_the_next_number_and_resume_takes_the_newest(tmp_path):
    root = tmp_path / "runs"
    assert default_run_dir("tiny", resume=False, root=root)[0] == root / "tiny"
    assert default_run_dir("tiny", resume=True, root=root)[0] == root / "tiny"  # nothing to resume: fresh
    (root / "tiny").mkdir(parents=True)  # an empty directory holds no run
    assert default_run_dir("tiny", resume=False, root=root)[0] == root / "tiny"
    (root / "tiny" / "metrics.jsonl").write_text("")
    path, note = default_run_dir("tiny", resume=False, root=root)
    assert path == root / "tiny-2" and str(root / "tiny") in note
    assert default_run_dir("tiny", resume=True, root=root)[0] == root / "tiny"
    _a_run(root / "tiny-2")
    _a_run(root / "tiny-4")  # numbers only grow: a gap is not refilled
    (root / "tiny-7").mkdir()  # empty
    _a_run(root / "tiny-x")
    _a_run(root / "tinyX-9")
    assert default_run_dir("tiny", resume=False, root=root)[0] == root / "tiny-5"
    assert default_run_dir("tiny", resume=True, root=root)[0] == root / "tiny-4"


def test_names_with_pattern_characters_match_only_themselves(tmp_path):
    _a_run(tmp_path / "axb-3")
    assert default_run_dir("a.b", resume=False, root=tmp_path)[0] == tmp_path / "a.b"


@pytest.mark.parametrize(
    "spec, name",
    [("tiny", "tiny"), ("configs/my-run.yaml", "my-run"), ("runs/tiny-imported/config.yaml", "tiny-imported")],
)
def test_a_run_is_named_after_its_preset_or_yaml_file(spec, name):
    assert run_name(spec) == name


def test_trainer_without_run_dir_never_writes_into_an_earlier_run(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tiny_cfg("null", "train.steps=2", "train.eval_every=0")  # train.run_dir unset
    first = Trainer(cfg, quiet=True, name="tiny")
    assert str(first.run.path) == "runs/tiny" and cfg.train.run_dir is None  # the caller's config unchanged
    first.fit()
    before = (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text()

    second = Trainer(cfg, quiet=True, name="tiny")
    assert str(second.run.path) == "runs/tiny-2" and second.cfg.train.run_dir == "runs/tiny-2"
    second.fit()
    assert (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text() == before
    assert "run_dir: runs/tiny-2" in (tmp_path / "runs" / "tiny-2" / "config.yaml").read_text()
    assert str(Trainer(cfg, quiet=True).run.path) == "runs/run"  # no name given


def test_resume_without_run_dir_continues_the_newest_run(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tiny_cfg("null", "train.steps=2", "train.eval_every=0")
    for _ in range(2):
        Trainer(cfg, quiet=True, name="tiny").fit()
    longer = tiny_cfg("null", "train.steps=3", "train.eval_every=0")
    resumed = Trainer(longer, resume=True, quiet=True, name="tiny")
    assert str(resumed.run.path) == "runs/tiny-2" and resumed.step == 2
    resumed.fit()
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "tiny-2" / "metrics.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "tiny" / "metrics.jsonl")] == [1, 2]


def _rank_run_dir(data_dir, tmp_path):
    import os

    os.chdir(tmp_path / f"rank{os.environ['RANK']}")
    cfg = resolve_config("tiny", tiny_overrides(data_dir, "null", "train.steps=1", "train.eval_every=0"))
    return str(Trainer(cfg, quiet=True, name="tiny").run.path)


def test_every_rank_takes_rank_0s_choice(real_text_dir, tmp_path):
    """Rank 0 picks the directory, before any rank creates it, and the others take its answer:
    here rank 1 sees another directory tree (its own working directory, without runs/tiny), and
    still lands where rank 0 does. (Deciding by itself, a rank could see the directory rank 0
    has just made and go on to the next number.)"""
    _a_run(tmp_path / "rank0" / "runs" / "tiny")
    (tmp_path / "rank1").mkdir()
    assert run_distributed(_rank_run_dir, 2, real_text_dir, tmp_path) == ["runs/tiny-2", "runs/tiny-2"]


def test_train_help_documents_the_default_run_dir(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default runs/NAME" in text and "runs/NAME-2" in text


def test_plot_writes_into_the_first_run_directory(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        records = [{"step": s, "loss": 5.0 / s, "lm_loss": 5.0 / s, "tokens_per_sec": 1.0} for s in (1, 2)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", "a", "b"]) == 0
    assert json.loads(capsys.readouterr().out) == {"plot": "a/loss-compare.png"}
    assert (tmp_path / "a" / "loss-compare.png").is_file() and not (tmp_path / "loss-compare.png").exists()
