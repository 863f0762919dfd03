"""Using a checkpoint: loading it for inference, loss on raw text (`eval`), sampling (`generate`).

Legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from moetrain.config import load_yaml
from moetrain.errors import CheckpointError, DataError
from moetrain.model.transformer import Transformer
from moetrain.train import checkpoint as ckpt
from moetrain.train.config import RunConfig


def load_for_inference(checkpoint: str | Path, device: str = "cpu") -> tuple[Transformer, RunConfig, object]:
    """(model in eval mode, its run config, its HF tokenizer) from a run or step-N directory."""
    from tokenizers import Tokenizer

    path = ckpt.resolve_checkpoint(checkpoint)
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise CheckpointError(f"Checkpoint '{path}' has no config.yaml; it was not written by moetrain train.")
    cfg = RunConfig.from_dict(load_yaml(config_file))
    model = cfg.model.build(device="meta")
    model.to_empty(device=device)
    model.init_weights()  # buffers that are not saved (RoPE tables) need their values
    ckpt.load_model(path, model)
    model.eval()
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(f"Checkpoint '{path}' has no tokenizer.json to encode text with.")
    return model, cfg, Tokenizer.from_file(str(tokenizer_file))


@torch.no_grad()
def text_loss(model: Transformer, cfg: RunConfig, tokenizer, files: list[str]) -> dict:
    """Mean next-token loss over the files (each one document followed by EOS), read in
    non-overlapping windows of the training sequence length."""
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for name in files:
        p = Path(name)
        if not p.is_file():
            raise DataError(f"Text file '{p}' does not exist.")
        ids.extend(tokenizer.encode(p.read_text(encoding="utf-8", errors="replace")).ids)
        if eos_id is not None:
            ids.append(eos_id)
    if len(ids) < 2:
        raise DataError(f"The text files {files} hold fewer than 2 tokens: nothing to evaluate.")
    device = next(model.parameters()).device
    seq = cfg.data.seq_len
    tokens = torch.tensor(ids, dtype=torch.long)
    total_loss, total_tokens = 0.0, 0
    for start in range(0, len(ids) - 1, seq):
        window = tokens[start : start + seq + 1]
        inputs_BT, targets_BT = window[:-1].unsqueeze(0).to(device), window[1:].unsqueeze(0).to(device)
        logits_BTV = model(inputs_BT)
        loss = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten(), reduction="sum")
        total_loss += loss.item()
        total_tokens += targets_BT.numel()
    mean = total_loss / total_tokens
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": total_tokens}


@torch.no_grad()
def generate(
    model: Transformer,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    max_context: int | None = None,
) -> tuple[str, list[int]]:
    """Sample a continuation; temperature 0 = greedy. Returns (text, new token ids)."""
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise DataError("The prompt encodes to no tokens: give a non-empty --prompt.")
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    generator = torch.Generator(device=device).manual_seed(seed)
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        context = ids + new_ids
        if max_context is not None:
            context = context[-max_context:]
        logits_V = model(torch.tensor([context], device=device))[0, -1].float()
        if temperature <= 0:
            next_id = int(logits_V.argmax())
        else:
            probs_V = torch.softmax(logits_V / temperature, dim=-1)
            next_id = int(torch.multinomial(probs_V, 1, generator=generator))
        if next_id == eos_id:
            break
        new_ids.append(next_id)
    return tokenizer.decode(new_ids), new_ids
