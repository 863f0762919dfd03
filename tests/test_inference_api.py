"""The Python API (`moetrain.load` → `LoadedModel`) and generation: a run or step directory
loads, a bad path is named with the fix, `logits` are the model's, greedy decoding with the KV
cache gives the tokens of the full recompute (inside the context and past it, where the window
slides), top-k 1 and a tiny top-p are greedy, a seed reproduces its draws, and `moetrain
generate` refuses a bad --top-k/--top-p in one line.

The checkpoint is a randomly initialized two-layer model (one dense block, one MoE block) with
a 300-token BPE, written by the checkpoint code itself: no training, a second to make. Its
init_std is large so that the logits are far from ties and greedy decoding is a sharp test."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import moetrain
from moetrain.cli import main
from moetrain.data.prepare import train_bpe
from moetrain.errors import CheckpointError, ConfigError, DataError
from moetrain.generation import Sampling, generate_ids
from moetrain.model.token_dispatcher import LocalTokenDispatcher
from moetrain.presets import preset
from moetrain.train.checkpoint_io import model_state_dict, save_checkpoint
from moetrain.train.config import RunConfig

SEQ = 48
TEXT = """To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer
the slings and arrows of outrageous fortune, or to take arms against a sea of troubles and by
opposing end them. To die, to sleep; no more; and by a sleep to say we end the heart-ache."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("api") / "run"
    run.mkdir()
    tokenizer = train_bpe([TEXT], vocab_size=300, progress=False)
    tokenizer.save(str(run / "tokenizer.json"))
    tiny = preset("tiny").model
    model_cfg = dataclasses.replace(
        tiny,
        vocab_size=320,
        d_model=64,
        n_layers=2,
        init_std=0.3,
        moe=dataclasses.replace(tiny.moe, expert_hidden=32),
    )
    cfg = RunConfig(model=model_cfg)
    cfg.data.seq_len = SEQ
    model = model_cfg.build(device="cpu")
    model.init_weights(seed=1)
    (run / "config.yaml").write_text(cfg.to_yaml())
    extra = {"config.yaml": run / "config.yaml", "tokenizer.json": run / "tokenizer.json"}
    save_checkpoint(run, 0, {"model": model_state_dict(model)}, {"step": 0}, extra_files=extra)
    return run


@pytest.fixture(scope="module")
def lm(run):
    return moetrain.load(run)


def test_load_takes_a_run_directory_or_a_step_directory(run, lm):
    step = run / "checkpoints" / "step-0"
    assert lm.checkpoint == step and moetrain.load(step).checkpoint == step
    assert not lm.model.training and lm.config.data.seq_len == SEQ == lm.max_context
    assert lm.tokenizer.decode(lm.encode("To be")) == "To be"
    # A literal "<|endoftext|>" in a prompt is text, as prepare-data encoded the training text.
    assert lm.tokenizer.decode(lm.encode("To<|endoftext|>be")) == "To<|endoftext|>be"
    # Generation routes token by token through the plain one-device dispatcher.
    assert all(type(m.dispatcher) is LocalTokenDispatcher for m in lm.model.moe_layers())


def test_a_bad_path_is_named_with_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="'.*nowhere' does not exist: pass a run directory"):
        moetrain.load(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=f"'{tmp_path}' holds no complete checkpoint.*point at a step-N"):
        moetrain.load(tmp_path)


@pytest.mark.parametrize("device", ["nope", None])
def test_a_bad_device_is_named(run, device):
    with pytest.raises(ConfigError, match=f"--device {device!r} is not a device: use cpu, or cuda"):
        moetrain.load(run, device=device)


def test_a_model_larger_than_the_machines_memory_is_refused(run, monkeypatch, capsys):
    """eval, generate and load build the whole model in fp32: past the memory the kernel killed them."""
    import os

    monkeypatch.setattr(os, "sysconf", {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16}.__getitem__)  # 64 KiB
    with pytest.raises(
        ConfigError, match=r"is built whole in this machine's memory, in fp32: .* more than its 64.0 KiB"
    ):
        moetrain.load(run)
    assert main(["generate", str(run), "--prompt", "To be"]) == 2
    assert "more than its 64.0 KiB. Use a machine with more memory." in capsys.readouterr().err


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(run, tmp_path, capsys):
    """Ids past model.vocab_size have no embedding (eval ended in torch's IndexError): the
    checkpoint is refused naming both sizes, before its weights are read."""
    import shutil

    from tokenizers import Tokenizer

    copy = shutil.copytree(run, tmp_path / "run")
    step = copy / "checkpoints" / "step-0"
    tokenizer = Tokenizer.from_file(str(step / "tokenizer.json"))
    extra = [f"extra-{i}" for i in range(321 - tokenizer.get_vocab_size())]
    tokenizer.add_tokens(extra)
    tokenizer.save(str(step / "tokenizer.json"))
    (tmp_path / "a.txt").write_text(f"{extra[-1]} " * 3)  # id 320
    assert main(["eval", str(copy), "--text", str(tmp_path / "a.txt")]) == 2
    err = capsys.readouterr().err
    assert "has 321 tokens, more than the model's vocabulary (model.vocab_size=320)" in err and "Traceback" not in err


def test_logits_are_the_models_and_the_loss_their_cross_entropy(lm):
    ids = lm.encode(TEXT)[:SEQ]
    logits_TV = lm.logits(ids)
    assert logits_TV.shape == (SEQ, 320) and logits_TV.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(logits_TV, lm.model(torch.tensor([ids]))[0])
    text = lm.decode(ids[:10])
    assert torch.equal(lm.logits(text), lm.logits(lm.encode(text)))
    short = lm.encode(text)
    want = F.cross_entropy(lm.logits(short)[:-1], torch.tensor(short[1:])).item()
    assert lm.loss(text) == pytest.approx(want, rel=1e-6)
    with pytest.raises(DataError, match=f"more than the {SEQ} the model was trained on"):
        lm.logits(lm.encode(TEXT * 2))
    with pytest.raises(DataError, match="empty input"):
        lm.logits("")
    for bad in (320, -1):  # ids of another tokenizer: not an IndexError from the embedding
        with pytest.raises(DataError, match=f"token id {bad} is not in the model's vocabulary: ids run from 0 to 319"):
            lm.logits([5, bad])


def test_the_cache_gives_the_logits_of_the_full_forward(lm):
    """Prompt, then one token at a time, then a chunk after cached positions: within 1e-5 of
    the logits (|logits| ~ 10) of one forward over the whole sequence."""
    ids_1T = torch.tensor([lm.encode(TEXT)[:SEQ]])
    with torch.no_grad():
        full_1TV = lm.model(ids_1T)
        cache = lm.model.new_cache(SEQ)
        parts = [lm.model.decode(ids_1T[:, :20], cache)]
        parts += [lm.model.decode(ids_1T[:, t : t + 1], cache) for t in range(20, 30)]
        parts.append(lm.model.decode(ids_1T[:, 30:], cache))
    assert cache.length == SEQ
    torch.testing.assert_close(torch.cat(parts, dim=1), full_1TV, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        lm.model.decode(ids_1T[:, :1], cache)


@pytest.mark.parametrize("max_context", [SEQ, 16])
def test_greedy_with_the_cache_is_greedy_without(lm, max_context):
    """40 new tokens after 6: inside the context, and past a 16-token window (the cache starts
    again from the last 16 tokens at every step past it)."""
    prompt = lm.encode(TEXT)[:6]
    cached = generate_ids(lm.model, prompt, 40, max_context=max_context)
    recomputed = generate_ids(lm.model, prompt, 40, max_context=max_context, kv_cache=False)
    assert cached == recomputed and len(cached) == 40 and len(set(cached)) > 5


def test_top_k_1_and_a_tiny_top_p_are_greedy_and_a_seed_reproduces(lm):
    greedy = lm.generate("To be", max_new_tokens=20)
    assert lm.generate("To be", max_new_tokens=20, temperature=1.5, top_k=1, seed=3) == greedy
    assert lm.generate("To be", max_new_tokens=20, temperature=1.5, top_p=1e-6, seed=3) == greedy
    sampled = [lm.generate("To be", max_new_tokens=20, temperature=1.5, top_p=0.9, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_top_k_and_top_p_draw_only_from_their_sets():
    logits_V = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0]).log_softmax(0)
    g = torch.Generator().manual_seed(0)
    draws = lambda s: {s.pick(logits_V, g) for _ in range(300)}  # noqa: E731
    assert draws(Sampling(temperature=1.0, top_k=2)) == {0, 1}
    probs = logits_V.softmax(0)  # 0.46, 0.28, 0.17, …: top_p 0.7 needs the first two, 0.75 three
    assert probs[:2].sum() > 0.7 and probs[:2].sum() < 0.75
    assert draws(Sampling(temperature=1.0, top_p=0.7)) == {0, 1}
    assert draws(Sampling(temperature=1.0, top_p=0.75)) == {0, 1, 2}
    assert draws(Sampling(temperature=1.0)) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize(
    "sampling, name",
    [
        (Sampling(top_k=0), "top_k=0"),
        (Sampling(top_p=0.0), "top_p=0.0"),
        (Sampling(top_p=1.5), "top_p=1.5"),
        (Sampling(temperature=1e-40), "temperature=1e-40"),  # logits / it overflow: NaN probabilities
    ],
)
def test_meaningless_sampling_values_are_refused_by_name(lm, sampling, name):
    with pytest.raises(ConfigError, match=name):
        generate_ids(lm.model, [1, 2], 4, sampling)


@pytest.mark.parametrize("seed", [2**64, -1, 1.5])
def test_a_seed_a_generator_cannot_take_is_refused_by_name(lm, seed):
    with pytest.raises(ConfigError, match=rf"seed={seed!r} must be an integer from 0 to 2\*\*63 - 1"):
        lm.generate("To be", max_new_tokens=2, temperature=1.0, seed=seed)


def test_top_p_at_temperature_0_warns_that_it_does_nothing(lm):
    with pytest.warns(UserWarning, match=r"at temperature 0 \(greedy\) they do nothing") as caught:
        assert lm.generate("To be", max_new_tokens=4, top_p=0.5) == lm.generate("To be", max_new_tokens=4)
    assert caught[0].filename == __file__  # the line that asked for it


def test_a_prompt_that_is_not_one_string_is_refused(lm):
    for prompt in (["To be", "or not"], lm.encode("To be")):
        with pytest.raises(DataError, match="The prompt is a list: give one string"):
            lm.generate(prompt, max_new_tokens=2)


def test_moetrain_generate_takes_top_k_top_p_and_no_kv_cache(run, capsys):
    args = ["generate", str(run), "--prompt", "To be", "--max-new-tokens", "12", "--json"]
    outputs = []
    for extra in (["--temperature", "0.9", "--top-k", "20", "--top-p", "0.9"], ["--no-kv-cache"], []):
        assert main([*args, *extra]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert set(outputs[0]) == {"prompt", "completion", "token_ids"}
    assert outputs[1]["token_ids"] == outputs[2]["token_ids"]


def test_moetrain_generate_refuses_a_bad_top_p_or_top_k_in_one_line(capsys):
    out = subprocess.run(
        [sys.executable, "-m", "moetrain", "generate", "RUN", "--prompt", "x", "--top-p", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == "error: --top-p 0.0: must be in (0, 1] (leave it out to draw among every token)."
    assert main(["generate", "RUN", "--prompt", "x", "--top-k", "0"]) == 2
    assert "--top-k 0: must be ≥ 1" in capsys.readouterr().err
