"""Using a checkpoint: loading it for inference, loss on raw text or prepared tokens (`eval`).
Sampling is src/moetrain/generation.py; the Python API over both, src/moetrain/api.py.

Legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moetrain.config import load_yaml
from moetrain.data.progress import Progress
from moetrain.data.tokens import load_tokenizer
from moetrain.errors import CheckpointError, ConfigError, DataError, file_kind
from moetrain.model.counting import count_params
from moetrain.model.transformer import Transformer
from moetrain.plan.hardware import refuse_unless_it_fits
from moetrain.train.checkpoint_io import load_model
from moetrain.train.config import RunConfig
from moetrain.train.run_dir import resolve_checkpoint


def load_for_inference(checkpoint: str | Path, device: str = "cpu") -> tuple[Transformer, RunConfig, object]:
    """(model in eval mode, its run config, its HF tokenizer) from a run or step-N directory."""
    device = _device(device)
    path = resolve_checkpoint(checkpoint)
    cfg, tokenizer = checkpoint_config(path), checkpoint_tokenizer(path, "to encode text with")
    if tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise CheckpointError(
            f"Checkpoint '{path}': its tokenizer.json has {tokenizer.get_vocab_size():,} tokens, more than the "
            f"model's vocabulary (model.vocab_size={cfg.model.vocab_size:,}): ids past it have no embedding. Put the "
            "tokenizer the model was trained with in its place."
        )
    fix = "Use a machine with more memory" + " (--device cpu: its RAM)" * (device != "cpu") + "."
    refuse_unless_it_fits(count_params(cfg.model).total, device, f"The model of '{path}'", fix)
    model = cfg.model.build(device="meta")
    model.to_empty(device=device)
    model.init_weights()  # buffers that are not saved (RoPE tables) need their values
    load_model(path, model)
    model.eval()
    return model, cfg, tokenizer


def checkpoint_config(path: Path) -> RunConfig:
    """The run config of the checkpoint directory `path` (its config.yaml)."""
    if not (path / "config.yaml").is_file():
        raise CheckpointError(f"Checkpoint '{path}' has no config.yaml; it was not written by moetrain train.")
    return RunConfig.from_dict(load_yaml(path / "config.yaml", RunConfig))


def checkpoint_tokenizer(path: Path, purpose: str):
    """The tokenizer of the checkpoint directory `path`, encoding text as training read it
    (`load_tokenizer`); `purpose` says in the error what it was for."""
    if not (path / "tokenizer.json").is_file():
        if checkpoint_config(path).data.synthetic:
            raise CheckpointError(
                f"Checkpoint '{path}' is of a run on synthetic tokens (data.synthetic=true): its ids stand for no "
                f"text, so it has no tokenizer.json {purpose}. A model trained on text (moetrain prepare-data) has one."
            )
        raise CheckpointError(
            f"Checkpoint '{path}' has no tokenizer.json {purpose}: copy the model's own tokenizer.json into it."
        )
    return load_tokenizer(path / "tokenizer.json")


def _device(name: str) -> str:
    """`name` if torch knows the device and this machine has it, else a `ConfigError` saying so."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):  # TypeError: not a string (None, say)
        raise ConfigError(f"--device {name!r} is not a device: use cpu, or cuda (cuda:N) on a GPU machine.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this machine has no CUDA device; use --device cpu.")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: moetrain runs on cpu or cuda.")
    return name


@torch.no_grad()
def text_loss(model: Transformer, cfg: RunConfig, tokenizer, files: list[str], text_key: str = "text") -> dict:
    """Mean next-token loss over the files (a text file is one document, a .jsonl file one per
    line in field `text_key`; each followed by EOS), read in non-overlapping windows of the
    training sequence length."""
    from moetrain.data.prepare import iter_documents, read_text

    eos_id = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for name in files:
        p = Path(name)
        if not p.is_file():
            raise DataError(f"Text file '{p}' is {file_kind(p)}: pass text or .jsonl files.")
        if p.suffix == ".jsonl":
            texts = [text for _, text in iter_documents([(p, p.name)], text_key=text_key)]
        else:
            texts = [read_text(p)]  # as prepare-data reads it: the ids of `eval --data` of its tokens
        for text in texts:
            ids.extend(tokenizer.encode(text).ids)
            if eos_id is not None:
                ids.append(eos_id)
    if len(ids) < 2:
        raise DataError(f"The text files {files} hold fewer than 2 tokens: nothing to evaluate.")
    return windows_loss(model, cfg, np.asarray(ids, dtype=np.int64), progress=True)


def token_loss(
    model: Transformer, cfg: RunConfig, tokenizer, data_dir: str, split: str = "val", tokens: int | None = None
) -> dict:
    """Mean next-token loss over a prepared token directory's `split` (what `moetrain
    prepare-data` wrote, e.g. the data a run trained on): its ids as they are, in windows of the
    training sequence length; with `tokens`, the first tokens // seq_len whole windows only (at
    least one), the windows a run's val_loss reads for train.eval_tokens = `tokens`. The
    directory must have been tokenized with the checkpoint's tokenizer."""
    from moetrain.data.tokens import open_source

    tf = open_source(data_dir, split, seq_len=1)
    theirs = tf.tokenizer_path
    if theirs is not None and theirs.is_file():
        from tokenizers import Tokenizer

        if Tokenizer.from_file(str(theirs)).to_str() != tokenizer.to_str():
            raise DataError(
                f"'{data_dir}' was tokenized with another tokenizer ({theirs}) than the checkpoint's: its ids mean "
                "other text. Evaluate its text with --text, or prepare it again with the checkpoint's tokenizer "
                "(`moetrain prepare-data … --tokenizer CHECKPOINT/tokenizer.json`)."
            )
    if tf.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"'{data_dir}' holds ids up to {tf.vocab_size - 1}, beyond the model's vocabulary ({cfg.model.vocab_size})."
        )
    windows = None if tokens is None else max(1, tokens // cfg.data.seq_len)
    return windows_loss(model, cfg, tf.tokens_N, windows, progress=True)


@torch.no_grad()
def windows_loss(
    model: Transformer, cfg: RunConfig, tokens_N: np.ndarray, windows: int | None = None, progress: bool = False
) -> dict:
    """Mean next-token loss, perplexity and token count over non-overlapping windows of the
    training sequence length (the last may be shorter), all of them or the first `windows`;
    `tokens_N`: ids (N,), may be a memory map: each window is read as it is evaluated. With
    `progress`, the windows done on stderr (`Progress`)."""
    device = next(model.parameters()).device
    seq = cfg.data.seq_len
    total_loss, total_tokens = 0.0, 0
    starts = range(0, len(tokens_N) - 1, seq)[:windows]
    bar = Progress(len(starts), progress, "evaluating", "windows")
    for start in starts:
        window = torch.from_numpy(np.asarray(tokens_N[start : start + seq + 1], dtype=np.int64))
        inputs_BT, targets_BT = window[:-1].unsqueeze(0).to(device), window[1:].unsqueeze(0).to(device)
        logits_BTV = model(inputs_BT)
        loss = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten(), reduction="sum")
        total_loss += loss.item()
        total_tokens += targets_BT.numel()
        bar.update(1)
    bar.close()
    mean = total_loss / total_tokens
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": total_tokens}
