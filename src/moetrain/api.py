"""The Python API: a trained checkpoint as an object that gives logits, losses and text.

    import moetrain

    lm = moetrain.load("runs/tiny")                # a run directory (its newest checkpoint) or a step-N one
    logits_TV = lm.logits("ROMEO.")                # next-token logits at every position, (T, V)
    print(lm.generate("ROMEO.", max_new_tokens=40, temperature=0.8, top_p=0.9))

Legend: T tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from moetrain.errors import DataError
from moetrain.generation import generate
from moetrain.inference import load_for_inference, windows_loss
from moetrain.model.transformer import Transformer
from moetrain.train.config import RunConfig
from moetrain.train.run_dir import resolve_checkpoint

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def load(path: str | Path, device: str = "cpu") -> LoadedModel:
    """A checkpoint, ready to use: `path` is a run directory (its newest complete checkpoint,
    as `moetrain generate` and `eval` take it) or a `checkpoints/step-N` directory. The model is
    in eval mode, fp32, on `device`. A missing, incomplete or damaged checkpoint raises
    `moetrain.errors.CheckpointError` naming the path and what to pass instead."""
    checkpoint = resolve_checkpoint(path)
    model, config, tokenizer = load_for_inference(checkpoint, device)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, checkpoint=checkpoint)


@dataclass(kw_only=True)
class LoadedModel:
    """A model with its tokenizer and run config (`load`)."""

    model: Transformer
    """The plain-PyTorch model (src/moetrain/model/transformer.py), in eval mode."""
    tokenizer: Tokenizer
    """Its Hugging Face `tokenizers.Tokenizer` (the checkpoint's tokenizer.json)."""
    config: RunConfig
    """The run's resolved config (the checkpoint's config.yaml)."""
    checkpoint: Path
    """The step-N directory loaded."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_context(self) -> int:
        """The sequence length the model was trained on (data.seq_len): the most tokens `logits`
        takes, and the context `generate` predicts each token from."""
        return self.config.data.seq_len

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no end-of-text token added)."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @torch.no_grad()
    def logits(self, text_or_ids: str | Sequence[int]) -> torch.Tensor:
        """Next-token logits (T, V), fp32 on the model's device: row t scores the token after
        the first t + 1 tokens. Takes text or token ids, at most `max_context` of them."""
        ids = self.encode(text_or_ids) if isinstance(text_or_ids, str) else [int(i) for i in text_or_ids]
        if not ids:
            raise DataError("logits of an empty input: give at least one token.")
        vocab = self.config.model.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise DataError(f"token id {bad[0]} is not in the model's vocabulary: ids run from 0 to {vocab - 1}.")
        if len(ids) > self.max_context:
            raise DataError(
                f"{len(ids)} tokens are more than the {self.max_context} the model was trained on "
                "(data.seq_len): pass at most that many, or use `loss` for a long text (it reads it in windows)."
            )
        return self.model(torch.tensor([ids], device=self.device))[0].float()

    def loss(self, text: str) -> float:
        """Mean next-token cross-entropy of `text`, read in windows of `max_context` tokens (as
        `moetrain eval` reads a file, without the end-of-text token)."""
        ids = self.encode(text)
        if len(ids) < 2:
            raise DataError(f"The text holds {len(ids)} token(s): the loss needs at least 2.")
        return windows_loss(self.model, self.config, np.asarray(ids, dtype=np.int64))["loss"]

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        kv_cache: bool = True,
    ) -> str:
        """The continuation of `prompt` (without it), up to `max_new_tokens` tokens or the
        end-of-text token, as `moetrain generate` samples it (src/moetrain/generation.py): greedy
        at temperature 0, else drawn among the `top_k` most likely and the fewest whose
        probabilities reach `top_p`, each from the last `max_context` tokens (`kv_cache=False`
        recomputes them for every token: slower, the same text). The same `seed`, the same text."""
        options = dict(top_k=top_k, top_p=top_p, kv_cache=kv_cache)
        return generate(
            self.model, self.tokenizer, prompt, max_new_tokens, temperature, seed, self.max_context, **options
        )[0]
