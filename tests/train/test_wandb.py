"""The Weights & Biases sink (logging.wandb=true), offline: nothing leaves the machine."""

import json
import struct
import sys
from pathlib import Path

import pytest

from moetrain.errors import ConfigError
from moetrain.train.metrics import read_metrics
from moetrain.train.trainer import Trainer


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb in offline mode, quiet, its files under tmp_path/wb (WANDB_DIR)."""
    wandb = pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wb"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's capture of stdout/stderr alone
    yield wandb_dir
    wandb.teardown()  # wandb reads its environment once per process: the next test sets it anew


def wandb_records(run_file: Path) -> list:
    """The records of an offline run's run-ID.wandb: a LevelDB-style log (a 7-byte ':W&B' header,
    then 32 KiB blocks of chunks: crc32 u32, length u16, type u8) of protobuf `Record`s."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, pos, parts, records = 32768, 7, [], []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0:  # zero fill: the end of what was written
            break
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE…/LAST
            records.append(Record.FromString(b"".join(parts)))
            parts = []
    return records


def finished_records(run_file: Path, timeout_s: float = 60.0) -> list:
    """`wandb_records` once the run's exit record is on disk: `finish()` returns before wandb's
    background service has always written the whole transaction log (seen once on a busy
    2-core machine: a resumed run's file read without its run record)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def history(records) -> dict[int, dict[str, float]]:
    """step -> the values logged at that step (wandb's own `_…` keys left out)."""
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def offline_run_files(wandb_dir: Path) -> list[Path]:
    return sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))


def test_metrics_reach_wandb_offline(tiny_cfg, tmp_path, offline_wandb):
    run_dir = tmp_path / "run"
    Trainer(tiny_cfg(run_dir, "train.steps=4", "train.eval_every=2", "logging.wandb=true"), quiet=True).fit()

    (run_file,) = offline_run_files(offline_wandb)
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    assert run_file.name == f"run-{run_id}.wandb"
    records = finished_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, run.run_id) == ("moetrain", "run", run_id)
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["logging"]["wandb"] is True and config["model"]["d_model"] == 64

    logged = history(records)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert sorted(logged) == [r["step"] for r in metrics] == [1, 2, 3, 4]
    for r in metrics:
        assert logged[r["step"]]["lm_loss"] == r["lm_loss"]
        assert logged[r["step"]]["unused_experts"] == r["unused_experts"]
        assert "mfu" not in logged[r["step"]]  # None on CPU: not a scalar
    assert logged[2]["val_loss"] == metrics[1]["val_loss"]
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0


def test_resume_continues_the_wandb_run(tiny_cfg, tmp_path, offline_wandb):
    run_dir = tmp_path / "run"
    extra = ("train.eval_every=0", "checkpoint.save_every=2", "logging.wandb=true", "logging.wandb_name=mine")
    Trainer(tiny_cfg(run_dir, "train.steps=2", *extra), quiet=True).fit()
    first_id = (run_dir / "wandb_id.txt").read_text().strip()
    Trainer(tiny_cfg(run_dir, "train.steps=4", *extra), resume=True, quiet=True).fit()
    assert (run_dir / "wandb_id.txt").read_text().strip() == first_id

    first, second = offline_run_files(offline_wandb)
    assert first.name == second.name == f"run-{first_id}.wandb"
    records = finished_records(second)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "mine"
    assert sorted(history(records)) == [3, 4]


def test_wandb_files_default_to_the_run_directory(tmp_path, offline_wandb, monkeypatch):
    from moetrain.train.wandb_sink import WandbSink

    monkeypatch.delenv("WANDB_DIR")
    sink = WandbSink(tmp_path, {"train": {"steps": 1}}, project="p", name=None, resumed=False)
    sink.write({"step": 1, "loss": 2.5, "mfu": None}, (1.0, 1))
    sink.close(failed=True)
    (run_file,) = offline_run_files(tmp_path)
    records = finished_records(run_file)
    assert history(records) == {1: {"loss": 2.5}}
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 1


def test_wandb_not_installed_is_a_config_error(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(
        ConfigError, match=r"logging\.wandb=true.*pip install 'moetrain\[wandb\]'.*logging\.wandb=false"
    ):
        Trainer(tiny_cfg(tmp_path / "run", "logging.wandb=true"), quiet=True)
    assert not (tmp_path / "run").exists()  # raised before any work
