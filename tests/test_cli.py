"""The command line: subcommands, JSON output lines, errors without tracebacks."""

import json
import subprocess
import sys
import warnings

import pytest
import yaml

from moetrain.cli import SUBCOMMANDS, main


def run(*args, check=True):
    out = subprocess.run([sys.executable, "-m", "moetrain", *args], capture_output=True, text=True)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in text


def test_config_prints_the_resolved_yaml(capsys):
    assert main(["config", "tiny", "--steps", "7", "--optim.lr=1e-3"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["steps"] == 7 and cfg["optim"]["lr"] == 1e-3


USER_ERRORS = [
    (["config", "tiny", "--model.moe.top_k=99"], ["model.moe.top_k=99"]),
    (["config", "tiny", "--optim.lrr=1"], ["optim.lrr"]),
    (["config", "nope"], ["nope"]),
    (["config", "tiny", "--bogus"], ["--bogus"]),
    (["train", "tiny", "--stpes", "3"], ["--stpes", "Did you mean --steps?"]),
    (
        ["train", "tiny", "--data.sources=[/does/not/exist]", "--run-dir", "/tmp/moetrain-cli-test"],
        ["/does/not/exist", "prepare-data"],
    ),
    (["eval", "/does/not/exist", "--text", "x.txt"], ["/does/not/exist"]),
]


DEBUG = ["config", "tiny", "--model.moe.top_k=99", "--debug"]


@pytest.fixture(scope="module")
def user_error_runs():
    """{argv: CompletedProcess} of every USER_ERRORS command line and of DEBUG, as subprocesses
    started side by side (each is an interpreter start on one core)."""
    argvs = [args for args, _ in USER_ERRORS] + [DEBUG]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen([sys.executable, "-m", "moetrain", *args], **pipes) for args in argvs]
    done = {}
    for args, proc in zip(argvs, procs):
        stdout, stderr = proc.communicate(timeout=300)
        done[tuple(args)] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return done


@pytest.mark.parametrize("args, words", USER_ERRORS)
def test_user_errors_exit_2_with_one_paragraph_and_no_traceback(user_error_runs, args, words):
    out = user_error_runs[tuple(args)]
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("error: ")
    for word in words:
        assert word in out.stderr


def test_config_keys_take_a_value_after_a_space_too(capsys):
    """--optim.lr 3e-4 as torchtitan and most command lines accept, beside --optim.lr=3e-4; a
    list too."""
    assert (
        main(["config", "tiny", "--optim.lr", "3e-4", "--optim.weight_decay", "0.5", "--data.sources", "[a, b]"]) == 0
    )
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["optim"]["lr"] == 3e-4 and cfg["optim"]["weight_decay"] == 0.5 and cfg["data"]["sources"] == ["a", "b"]


def test_version(capsys):
    import moetrain

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"moetrain {moetrain.__version__} (torch ")


def test_debug_shows_the_traceback(user_error_runs):
    out = user_error_runs[tuple(DEBUG)]
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_train_eval_generate_end_to_end(real_text_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    common = [
        "--model.vocab_size=512",
        "--model.d_model=64",
        "--data.seq_len=64",
        "--train.global_batch_size=4",
        "--train.micro_batch_size=4",
        "--train.eval_tokens=256",
        "--logging.tensorboard=false",
        f"--data.sources=[{real_text_dir}]",
    ]
    out = run(
        "train", "tiny", "--steps", "4", "--run-dir", str(run_dir), "--eval-every", "2", "--save-every", "2", *common
    )
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and (run_dir / "loss.png").is_file()
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n")

    ev = json.loads(run("eval", str(run_dir), "--text", str(text)).stdout.strip().splitlines()[-1])
    assert set(ev) == {"loss", "perplexity", "tokens"} and ev["tokens"] > 5 and ev["loss"] > 0
    # In process (the same code path as the subprocess above, without another interpreter start)
    assert main(["eval", str(run_dir / "checkpoints" / "step-2"), "--text", str(text)]) == 0
    ev2 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev2["loss"] != ev["loss"]  # a step-N directory is a different checkpoint

    g1 = json.loads(
        run(
            "generate", str(run_dir), "--prompt", "To be", "--temperature", "0", "--max-new-tokens", "8", "--json"
        ).stdout
    )
    greedy = ["--prompt", "To be", "--temperature", "0", "--max-new-tokens", "8", "--json"]
    assert main(["generate", str(run_dir), *greedy]) == 0
    g2 = json.loads(capsys.readouterr().out)  # in process: greedy output equal across processes too
    assert g1 == g2 and len(g1["token_ids"]) <= 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CLI's note alone, not the API's warning besides
        assert main(["generate", str(run_dir), *greedy, "--top-p", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out) == g1

    resumed = run("train", "tiny", "--steps", "6", "--run-dir", str(run_dir), "--resume", "--eval-every", "2", *common)
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == 6
    assert "resumed from" in resumed.stderr


def bench(tmp_path, *args: str) -> int:
    """`moetrain bench` of a narrow `tiny` on CPU; its exit code."""
    small = ["--model.d_model=64", "--model.vocab_size=512", "--data.seq_len=32"]
    return main(["bench", "tiny", "--device", "cpu", "--run-dir", str(tmp_path), *small, *args])


def test_bench_prints_one_json_line_per_routing_mode(capsys, tmp_path):
    """On CPU (no sync check there): the contract keys, the shape and batch it ran."""
    assert bench(tmp_path, "--warmup", "1", "--steps", "1") == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["routing"] for r in records] == ["learned", "random"]
    for r in records:
        for key in (
            "tokens_per_sec_per_device",
            "tflops_per_device",
            "mfu",
            "peak_mem_gib",
            "sync_free",
            "shape",
            "batch",
            "precision",
        ):
            assert key in r, key
        assert r["tokens_per_sec_per_device"] > 0 and r["tflops_per_device"] > 0
        assert r["mfu"] is None and r["sync_free"] is None  # CPU: no peak FLOPs, no CUDA syncs
        assert r["shape"]["d_model"] == 64 and r["shape"]["num_experts"] == 8
        assert r["batch"] == {"seq_len": 32, "micro_batch_size": 24, "grad_accum_steps": 1, "tokens_per_step": 768}
        assert r["precision"] == "fp32" and r["timed"] == "training step"
        assert r["peak_mem_gib_per_rank"] == [r["peak_mem_gib"]]  # one process
        assert r["commit"] and r["commit"] != "unknown"  # this checkout's HEAD
        assert r["cuda_graphs"] == "off" and "on cpu" in r["cuda_graphs_why"]  # auto, the default: no graph here


def test_bench_says_what_train_cuda_graphs_auto_chose_and_why(capsys, tmp_path):
    assert bench(tmp_path, "--warmup", "1", "--steps", "1", "--routing", "learned", "--compute.cuda_graphs=auto") == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["cuda_graphs"] == "off" and "on cpu" in record["cuda_graphs_why"]


def test_bench_can_time_forward_and_backward_alone(capsys, tmp_path):
    assert (
        bench(
            tmp_path,
            *"--warmup 0 --steps 1 --routing random --forward-backward-only --train.micro_batch_size=12".split(),
        )
        == 0
    )
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["timed"] == "forward+backward" and record["routing"] == "random"
    assert record["batch"]["grad_accum_steps"] == 2 and record["loss"] > 0


def test_bench_times_both_windows_and_reports_routing_balance(capsys, tmp_path):
    assert (
        bench(
            tmp_path,
            *"--warmup 1 --steps 1 --routing learned --also-forward-backward --train.micro_batch_size=12".split(),
        )
        == 0
    )
    step, fwd_bwd = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (step["timed"], fwd_bwd["timed"]) == ("training step", "forward+backward")
    for r in (step, fwd_bwd):
        # Single process, dropless: nothing dropped, one expert-parallel rank, some imbalance.
        assert r["dropped_token_frac"] == 0.0 and r["ep_load_max_over_mean"] == 1.0
        assert r["expert_load_max_over_mean"] >= 1.0 and r["loss"] > 0


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "lion"])
def test_bench_times_the_optimizer_step_alone(capsys, tmp_path, optimizer):
    """--also-optimizer-step: a third line timing the optimizer's part alone, a fraction of the
    training step, no token rates; every line names the optimizer and its state per parameter:
    fp32 AdamW on CPU holds two fp32 moments (8 bytes, plus the step counters), Lion one (4),
    Muon one momentum for the blocks' matrices and AdamW's two for the rest (between 4 and 8)."""
    args = "--warmup 1 --steps 2 --routing learned --also-forward-backward --also-optimizer-step"
    args += f" --optim.name={optimizer}"
    assert bench(tmp_path, *args.split()) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["timed"] for r in lines] == ["training step", "forward+backward", "optimizer step"]
    step, opt = lines[0], lines[2]
    assert 0 < opt["step_time_s"] and opt["share_of_training_step"] == opt["step_time_s"] / step["step_time_s"]
    assert opt["share_of_training_step"] < 1
    assert opt["tokens_per_sec"] is None and opt["mfu"] is None and opt["loss"] > 0
    per_param = {r["optimizer"]["state_bytes_per_param"] for r in lines}
    assert len(per_param) == 1 and {r["optimizer"]["name"] for r in lines} == {optimizer}
    low, high = {"adamw": (8, 8.01), "lion": (4, 4.01)}.get(optimizer, (4.001, 8))
    assert low <= per_param.pop() < high


def test_bench_optimizer_step_with_forward_backward_only_is_refused(capsys, tmp_path):
    assert bench(tmp_path, "--forward-backward-only", "--also-optimizer-step") == 2
    err = capsys.readouterr().err
    assert "--also-optimizer-step" in err and "--forward-backward-only" in err and "Traceback" not in err


def test_bench_profiles_after_the_timed_window(capsys, tmp_path):
    """--logging.profile=true: a profiler window per routing mode in RUN_DIR/profile-ROUTING,
    named in the JSON line (on CUDA also a memory snapshot: tests/gpu/test_cuda.py)."""
    assert (
        bench(
            tmp_path, *"--warmup 1 --steps 1 --routing learned --logging.profile=true --logging.profile_steps=1".split()
        )
        == 0
    )
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["profile_dir"] == str(tmp_path / "profile-learned")
    assert "aten::" in (tmp_path / "profile-learned" / "ops.txt").read_text()


def test_bench_rejects_an_unknown_routing_mode(capsys):
    assert main(["bench", "tiny", "--routing", "learned,roundrobin"]) == 2
    err = capsys.readouterr().err
    assert "roundrobin" in err and "learned, random" in err and "Traceback" not in err


def _bench_on_rank(run_dir: str):
    from moetrain.bench import run_bench

    return run_bench(
        "tiny",
        ["train.device=cpu", "model.d_model=64", "model.vocab_size=512", "data.seq_len=32", "parallel.ep=2"],
        warmup=0,
        steps=1,
        routings=["random"],
        sync_check=False,
        run_dir=run_dir,
    )


def test_bench_under_two_ranks_reports_every_ranks_peak(tmp_path):
    """dp2·ep2 on two gloo ranks: both ranks' records list both peaks, and peak_mem_gib is the
    largest (the one that must fit)."""
    from support.distributed import run_distributed

    results = run_distributed(_bench_on_rank, 2, str(tmp_path))
    (a,), (b,) = results
    assert a["peak_mem_gib_per_rank"] == b["peak_mem_gib_per_rank"] and len(a["peak_mem_gib_per_rank"]) == 2
    assert a["peak_mem_gib"] == max(a["peak_mem_gib_per_rank"]) > 0
    assert a["layout"]["ep"] == 2 == b["layout"]["ep"]


def test_code_version_names_the_commit_or_says_unknown(monkeypatch, tmp_path):
    import subprocess

    from moetrain import bench as bench_module

    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert bench_module.code_version().removesuffix("-dirty") == head
    monkeypatch.setenv("MOETRAIN_COMMIT", "abc1234")
    assert bench_module.code_version() == "abc1234"
    monkeypatch.delenv("MOETRAIN_COMMIT")
    monkeypatch.setenv("PATH", str(tmp_path))  # no git to be found
    assert bench_module.code_version() == "unknown"


def test_config_help_marks_the_experimental_switches(capsys):
    """Emulated or once-measured switches say so where a user reads the keys."""
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for key, words in (
        ("precision.fp8", "mxfp8, experimental"),
        ("parallel.compile_overlap", "Experimental."),
    ):
        entry = text.split(f"{key} ", 1)[1].split(" = ", 1)[1][:400]
        assert words in entry, (key, entry)


def test_moetrain_eval_reads_jsonl_and_the_prepared_tokens_a_run_trained_on(real_text_dir, tmp_path, capsys):
    """`moetrain eval RUN --text docs.jsonl` equals the same documents as text files, exactly;
    `moetrain eval RUN --data DIR` evaluates the directory's val split (every token but the first
    is a target), near the run's own validation loss on it; a directory tokenized differently,
    and neither flag, are refused in one paragraph."""
    from moetrain.data.tokens import open_source

    run_dir = tmp_path / "run"
    flags = ["--model.vocab_size=512", "--model.d_model=64", "--data.seq_len=64", "--train.eval_tokens=4096"]
    flags += ["--train.global_batch_size=4", "--train.micro_batch_size=4", "--logging.tensorboard=false"]
    assert main(["train", "tiny", "--steps", "4", "--run-dir", str(run_dir), f"--data.sources=[{real_text_dir}]",
                 *flags, "--quiet", "--logging.plot=false"]) == 0  # fmt: skip
    capsys.readouterr()
    docs = ["To be, or not to be, that is the question.", "Now is the winter of our discontent."]
    files = []
    for i, doc in enumerate(docs):
        files.append(tmp_path / f"d{i}.txt")
        files[-1].write_text(doc)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    assert main(["eval", str(run_dir), "--text", *map(str, files)]) == 0
    as_text = json.loads(capsys.readouterr().out)
    assert main(["eval", str(run_dir), "--text", str(tmp_path / "docs.jsonl"), "--text-key", "body"]) == 0
    assert json.loads(capsys.readouterr().out) == as_text

    # by default the windows the run's val_loss read (train.eval_tokens): its loss, to fp32 rounding
    assert main(["eval", str(run_dir), "--data", str(real_text_dir)]) == 0
    out = capsys.readouterr()
    ev, available = json.loads(out.out), open_source(real_text_dir, "val").num_tokens - 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert ev["tokens"] == summary["val_loss_tokens"] == 4096 and available > 4096
    assert ev["loss"] == pytest.approx(summary["final_val_loss"], rel=1e-5)
    assert f"eval: 4,096 of the {available:,} tokens of val (train.eval_tokens" in out.err
    assert out.err.splitlines()[0].startswith("evaluating: 64/64 windows, ")  # a line every 30 s, and at the end
    assert main(["eval", str(run_dir), "--data", str(real_text_dir), "--tokens", "all"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == available
    assert main(["eval", str(run_dir), "--data", str(real_text_dir / "train.bin")]) == 0  # names its split
    train = open_source(real_text_dir, "train").num_tokens - 1
    assert f"eval: 4,096 of the {train:,} tokens of train (" in capsys.readouterr().err
    assert main(["eval", str(run_dir), "--data", str(real_text_dir), "--tokens", "100"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 64  # whole windows, at least one
    for bad in (["--data", str(real_text_dir), "--tokens", "0"], ["--text", str(files[0]), "--tokens", "64"]):
        assert main(["eval", str(run_dir), *bad]) == 2
        assert "--tokens" in capsys.readouterr().err

    other = tmp_path / "other"
    assert (
        main(["prepare-data", *map(str, files), "--out", str(other), "--vocab-size", "300", "--val-frac", "0.5"]) == 0
    )
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert "another tokenizer" in err and "Traceback" not in err
    assert main(["eval", str(run_dir)]) == 2
    assert "--text FILE" in capsys.readouterr().err
