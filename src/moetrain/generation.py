"""Sampling a continuation from a model: greedy, or temperature with top-k and top-p (nucleus)
filtering, one token at a time, with a KV cache by default.

Legend: V vocabulary.

With the cache the prompt runs once and every new token after it alone, attending over the
cached keys and values (src/moetrain/model/kv_cache.py). A token is predicted from the last
`max_context` tokens (the run's data.seq_len), as in training; past that each step runs them
afresh, as without the cache: cached keys were computed with earlier tokens in view, so they
cannot be kept when those leave the window. Greedy decoding gives the same tokens either way.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moetrain.errors import ConfigError, DataError
from moetrain.model.kv_cache import KVCache
from moetrain.model.transformer import Transformer

MIN_TEMPERATURE = 1e-3
"""The lowest temperature above 0: logits divided by a much smaller one overflow to inf."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is picked from the model's logits."""

    temperature: float = 0.0
    """0: greedy, the most likely token (top_k and top_p then change nothing); ≥ MIN_TEMPERATURE:
    a draw from softmax(logits / temperature)."""
    top_k: int | None = None
    """Draw among the `top_k` most likely tokens only (None: all)."""
    top_p: float | None = None
    """Draw among the fewest most likely tokens whose probabilities sum to at least `top_p`
    (nucleus sampling; None or 1: all)."""

    def check(self) -> None:
        """Refuse values that mean nothing, naming the argument."""
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature={self.temperature} must be ≥ 0 (0 = greedy).")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"temperature={self.temperature}: give 0 (greedy) or at least {MIN_TEMPERATURE}.")
        integer = isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
        if self.top_k is not None and not (integer and self.top_k >= 1):
            raise ConfigError(f"top_k={self.top_k!r} must be an integer ≥ 1 (or None: every token).")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (or None: every token).")

    def pick(self, logits_V: torch.Tensor, generator: torch.Generator) -> int:
        """The next token id from fp32 logits (V,)."""
        if self.temperature <= 0:
            return int(logits_V.argmax())
        logits_V = logits_V / self.temperature
        if self.top_k is not None and self.top_k < logits_V.numel():
            kth = logits_V.topk(self.top_k).values[-1]
            logits_V = logits_V.masked_fill(logits_V < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1:
            probs_V, order_V = torch.softmax(logits_V, dim=-1).sort(descending=True)
            # Drop a token when the more likely ones already reach top_p: the most likely stays.
            drop_V = probs_V.cumsum(0) - probs_V >= self.top_p
            logits_V = logits_V.masked_fill(drop_V.scatter(0, order_V, drop_V), -math.inf)
        probs_V = torch.softmax(logits_V, dim=-1)
        return int(torch.multinomial(probs_V, 1, generator=generator))


@torch.no_grad()
def generate_ids(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    max_context: int | None = None,
    eos_id: int | None = None,
    kv_cache: bool = True,
) -> list[int]:
    """Up to `max_new_tokens` new token ids after `prompt_ids`, stopping before `eos_id`. Each
    token is predicted from the last `max_context` tokens (None: all of them); `kv_cache=False`
    recomputes the whole context for every token (module docstring). `seed` fixes the draws."""
    if not prompt_ids:
        raise DataError("The prompt encodes to no tokens: give a non-empty prompt.")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be ≥ 0.")
    if max_context is not None and max_context < 1:
        raise ConfigError(f"max_context={max_context} must be ≥ 1 (or None: no limit).")
    sampling.check()
    if not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise ConfigError(f"seed={seed!r} must be an integer from 0 to 2**63 - 1.")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    if kv_cache:
        longest = len(prompt_ids) + max_new_tokens
        next_logits = CachedContext(model, min(longest, max_context or longest))
    else:  # the whole forward of the last `max_context` tokens, every token

        def next_logits(ids: list[int]) -> torch.Tensor:
            context = ids[-max_context:] if max_context is not None else ids
            return model(torch.tensor([context], device=device))[0, -1].float()

    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        next_id = sampling.pick(next_logits(ids), generator)
        if next_id == eos_id:
            break
        ids.append(next_id)
    return ids[len(prompt_ids) :]


class CachedContext:
    """Next-token logits (V,) after `ids`, running only the tokens the KV cache does not hold
    yet: the prompt first, then one token a step. When the cache is full (the context has
    reached `window` tokens), a new cache is filled with the last `window` tokens."""

    def __init__(self, model: Transformer, window: int):
        self.model, self.window = model, window
        self.device = next(model.parameters()).device
        self.cache: KVCache | None = None
        self.seen = 0
        """Tokens of the sequence so far whose keys and values the cache holds."""

    def __call__(self, ids: list[int]) -> torch.Tensor:
        todo = len(ids) - self.seen
        if self.cache is None or todo > self.cache.max_len - self.cache.length:
            self.cache = self.model.new_cache(self.window)
            todo = min(len(ids), self.window)
        tokens_1T = torch.tensor([ids[len(ids) - todo :]], device=self.device)
        self.seen = len(ids)
        return self.model.decode(tokens_1T, self.cache)[0, -1].float()


def generate(
    model: Transformer,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    max_context: int | None = None,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    kv_cache: bool = True,
) -> tuple[str, list[int]]:
    """Sample a continuation of the text `prompt` (`generate_ids`; temperature 0 = greedy),
    stopping at the tokenizer's <|endoftext|>. Returns (text, new token ids)."""
    if not isinstance(prompt, str):
        raise DataError(f"The prompt is a {type(prompt).__name__}: give one string (a batch is one call each).")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    if temperature == 0 and (top_k is not None or top_p is not None):
        message = "top_k and top_p choose among tokens drawn at random: at temperature 0 (greedy) they do nothing"
        warnings.warn(message + "; give temperature=0.8, say.", stacklevel=3)  # the caller of LM.generate
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    ids = tokenizer.encode(prompt).ids
    new_ids = generate_ids(model, ids, max_new_tokens, sampling, seed, max_context, eos_id, kv_cache)
    return tokenizer.decode(new_ids), new_ids
