"""The deterministic, resumable training data loader, and the validation batches.

A *sample* is a window of T+1 tokens (T inputs, and the same tokens shifted by one as targets)
starting at k*T in one source's train.bin, so the targets of different windows never overlap.
The order of samples is a pure function of (seed, sources, weights, T):

    sample g comes from source  s = choice(K, p=weights) drawn by rng([seed, g // BLOCK])
    and is that source's window  perm(seed, s, epoch = c // n)[c % n]

where c counts the samples already taken from source s and n is its number of windows: each
source is read as a sequence of independent random permutations, one per epoch. The whole
state is therefore the sample index g plus the K counters, and a checkpoint restores it exactly.

Data parallelism never changes what is trained on: every rank walks the same global sample
order and keeps only its rows [rank*B, (rank+1)*B) of each global micro-batch of M = B*dp
samples, so the global micro-batch is identical for any dp_size.

Legend: M samples in a global micro-batch, B = M // dp_size rows per rank, T seq_len,
K sources, n windows in one source.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moetrain.config import validate_tree
from moetrain.data.tokens import TokenFile, check_vocab, open_source
from moetrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    from moetrain.data.config import DataConfig

BLOCK = 1024
"""Samples whose sources are drawn together from one RNG: a block is generated once, and any
sample's source is found without replaying the samples before it."""
STATE_FORMAT = "moetrain-loader-v1"


class TokenLoader:
    """Yields this rank's share of each global micro-batch of `micro_batch_size` sequences; `seed`
    fixes the order, `vocab_size` (the model's) enables the out-of-vocabulary checks."""

    def __init__(
        self,
        cfg: DataConfig,
        *,
        micro_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        vocab_size: int | None = None,
    ):
        validate_tree(cfg, "data.")  # built outside a RunConfig too: its domains, then its rules
        _check_batch(micro_batch_size, dp_rank, dp_size)
        if seed < 0:
            raise ConfigError(f"The data seed must be a non-negative integer, got {seed}.")
        self.seq_len, self.micro_batch_size, self.vocab_size = cfg.seq_len, micro_batch_size, vocab_size
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.files: list[TokenFile] = [open_source(p, "train", seq_len=cfg.seq_len) for p in cfg.sources]
        _check_same_tokenizer(self.files)
        for tf in self.files:
            check_vocab(tf, vocab_size)
        self.num_windows_K = np.array([tf.num_windows(self.seq_len) for tf in self.files])
        weights_K = np.asarray(self.num_windows_K if cfg.weights is None else cfg.weights, dtype=np.float64)
        self.probs_K = weights_K / weights_K.sum()
        self._fingerprint = {
            "seed": seed,
            "seq_len": self.seq_len,
            "probs": [float(p) for p in self.probs_K],
            "sources": [tf.fingerprint() for tf in self.files],
        }
        self._sample_index = 0
        self._counters_K = [0] * len(self.files)
        self._block: tuple[int, np.ndarray] | None = None  # (block index, sources of its samples)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, permutation)

    @property
    def eos_id(self) -> int:
        """The id that ends every document (the same in all sources)."""
        return self.files[0].eos_id

    @property
    def tokenizer_path(self) -> Path | None:
        """The tokenizer.json the data was made with (the first source's; all share it)."""
        return self.files[0].tokenizer_path

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's `(inputs_BT, targets_BT)`, int64 CPU tensors, targets shifted by one."""
        rows = self.micro_batch_size // self.dp_size
        samples = [self._next_sample() for _ in range(self.micro_batch_size)]  # every rank advances through all M
        mine = samples[self.dp_rank * rows : (self.dp_rank + 1) * rows]
        windows = [self.files[source].window(window, self.seq_len) for source, window in mine]
        return _to_batch(windows, [self.files[source] for source, _ in mine], self.vocab_size)

    def state_dict(self) -> dict[str, Any]:
        """The position in the sample stream, as plain JSON types."""
        return {
            "format": STATE_FORMAT,
            "sample_index": self._sample_index,
            "counters": list(self._counters_K),
            "fingerprint": copy.deepcopy(self._fingerprint),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the loader that wrote `state` stopped. Refuses a state saved
        over different data, weights, seq_len or seed, which would silently change the order."""
        if isinstance(state, dict) and state.get("format") == SYNTHETIC_FORMAT:
            raise DataError(
                "This checkpoint's data position is that of a data.synthetic=true run: resume it with "
                "--data.synthetic=true, or start a new run on this data from its weights with --checkpoint.init_from."
            )
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise DataError(
                f"The data loader state in this checkpoint is not a {STATE_FORMAT} state "
                f"(got keys {sorted(state) if isinstance(state, dict) else type(state).__name__}). "
                "It was written by another version; start a new run from its weights with --checkpoint.init_from."
            )
        saved = state["fingerprint"]
        if saved != self._fingerprint:
            differ = [k for k in self._fingerprint if saved.get(k) != self._fingerprint[k]]
            raise DataError(
                f"The checkpoint's data loader ran over different data: {', '.join(differ)} "
                f"changed (checkpoint: {[saved.get(k) for k in differ]}, now: "
                f"{[self._fingerprint[k] for k in differ]}). Restore the original data.sources, "
                "data.weights, data.seq_len and seed to resume exactly, or start a new run."
            )
        counters = [int(c) for c in state["counters"]]
        assert len(counters) == len(self.files) and sum(counters) == state["sample_index"]
        self._sample_index, self._counters_K = int(state["sample_index"]), counters
        self._block, self._perms = None, {}

    # ---- the sample stream ---------------------------------------------------------------
    def _next_sample(self) -> tuple[int, int]:
        """(source, window) of sample `self._sample_index`; advances the stream by one."""
        g = self._sample_index
        block = g // BLOCK
        if self._block is None or self._block[0] != block:
            rng = np.random.default_rng([self.seed, block])
            self._block = (block, rng.choice(len(self.files), size=BLOCK, p=self.probs_K))
        source = int(self._block[1][g % BLOCK])
        c, n = self._counters_K[source], int(self.num_windows_K[source])
        epoch = c // n
        cached = self._perms.get(source)
        if cached is None or cached[0] != epoch:
            cached = self._perms[source] = (epoch, np.random.default_rng([self.seed, source, epoch]).permutation(n))
        self._counters_K[source] = c + 1
        self._sample_index = g + 1
        return source, int(cached[1][c % n])


def val_batches(
    path: str | os.PathLike,
    *,
    seq_len: int,
    num_sequences: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    vocab_size: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """The validation set: the first `num_sequences` windows of the val split of `path` (all of
    them when it holds fewer), in file order, the same set whatever the batch or the layout.

    Yields `(inputs_BT, targets_BT, rows)` for this rank: `rows` of its B rows count (B, or 0 for
    a stand-in row). Every rank gets the same B in each batch (an expert-parallel exchange needs
    equal token counts) and the same number of batches (so do FSDP's gathers):
    - global micro-batches of M = `micro_batch_size` windows, rank r taking rows [r·B, (r+1)·B);
    - of the R < M windows left, dp·⌊R/dp⌋ in one batch of ⌊R/dp⌋ rows per rank;
    - the last R mod dp windows one per rank, the ranks past them computing a stand-in row
      (window 0) that does not count.
    Opens and checks the file now, reads it lazily.
    """
    _check_batch(micro_batch_size, dp_rank, dp_size)
    if num_sequences < 1:
        raise ConfigError(f"The number of validation sequences must be >= 1, got {num_sequences}.")
    tf = open_source(path, "val", seq_len=seq_len)
    check_vocab(tf, vocab_size)
    num_sequences = min(num_sequences, tf.num_windows(seq_len))
    rows, (full, left) = micro_batch_size // dp_size, divmod(num_sequences, micro_batch_size)
    # (first window of this rank, its rows, the rows that count) of each batch.
    plan = [(b * micro_batch_size + dp_rank * rows, rows, rows) for b in range(full)]
    if left >= dp_size:
        rows = left // dp_size
        plan.append((full * micro_batch_size + dp_rank * rows, rows, rows))
    if stragglers := left % dp_size:
        plan.append((num_sequences - stragglers + dp_rank, 1, 1) if dp_rank < stragglers else (0, 1, 0))
    return (
        (*_to_batch([tf.window(j, seq_len) for j in range(first, first + n)], [tf] * n, vocab_size), counted)
        for first, n, counted in plan
    )


# ---- internals ---------------------------------------------------------------------------


def _check_batch(micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}).")
    if micro_batch_size < 1 or micro_batch_size % dp_size:
        raise ConfigError(
            f"The global micro-batch of {micro_batch_size} sequences does not split evenly over "
            f"{dp_size} data-parallel ranks: make the micro-batch size a positive multiple of "
            f"{dp_size}."
        )


def _check_same_tokenizer(files: list[TokenFile]) -> None:
    """Mixing ids of two tokenizers trains on garbage without any error: refuse it."""
    digests = {
        tf.path: hashlib.blake2b(tf.tokenizer_path.read_bytes(), digest_size=8).hexdigest()
        for tf in files
        if tf.tokenizer_path is not None and tf.tokenizer_path.is_file()
    }
    for what, values in (("tokenizer.json", digests), ("eos_id", {tf.path: tf.eos_id for tf in files})):
        if len(set(values.values())) > 1:
            first = next(iter(values))
            other = next(p for p, v in values.items() if v != values[first])
            raise DataError(
                f"data.sources were tokenized differently: '{first}' and '{other}' have "
                f"different {what}. Re-run prepare-data for the other sources with "
                f"--tokenizer {first.parent}/tokenizer.json so that all share one vocabulary."
            )


def _to_batch(
    windows: list[np.ndarray], files: list[TokenFile], vocab_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    windows_BT1 = np.stack(windows).astype(np.int64)
    if vocab_size is not None:
        max_B = windows_BT1.max(axis=1)
        if max_B.max() >= vocab_size:
            row = int(max_B.argmax())
            raise DataError(
                f"token id {int(max_B[row])} ≥ model.vocab_size {vocab_size} in "
                f"{files[row].path}: the data was tokenized with a bigger vocabulary; re-run "
                "prepare-data or set model.vocab_size."
            )
    tokens_BT1 = torch.from_numpy(windows_BT1)
    return tokens_BT1[:, :-1].contiguous(), tokens_BT1[:, 1:].contiguous()


SYNTHETIC_FORMAT = "moetrain-synthetic-v1"


class SyntheticLoader:
    """Uniformly random token ids (`data.synthetic=true`), with `TokenLoader`'s interface: each
    global micro-batch drawn from a generator seeded by (seed, its first sample), each dp rank
    taking its rows, so the stream does not depend on the layout and resumes exactly."""

    eos_id = None
    tokenizer_path = None

    def __init__(
        self, *, seq_len: int, micro_batch_size: int, seed: int, vocab_size: int, dp_rank: int = 0, dp_size: int = 1
    ):
        _check_batch(micro_batch_size, dp_rank, dp_size)
        self.seq_len, self.micro_batch_size, self.seed, self.vocab_size = seq_len, micro_batch_size, seed, vocab_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._sample_index = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self._sample_index)
        tokens_BT1 = torch.randint(0, self.vocab_size, (self.micro_batch_size, self.seq_len + 1), generator=g)
        self._sample_index += self.micro_batch_size
        rows = self.micro_batch_size // self.dp_size
        mine = tokens_BT1[self.dp_rank * rows : (self.dp_rank + 1) * rows]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {"format": SYNTHETIC_FORMAT, "sample_index": self._sample_index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != SYNTHETIC_FORMAT:
            raise DataError(
                "This checkpoint's data position is that of a run on token data, not of a data.synthetic=true "
                "run: resume it with its data.sources, or start a synthetic run from its weights with "
                "--checkpoint.init_from."
            )
        if state.get("seed") != self.seed:
            raise DataError(
                f"This checkpoint's synthetic tokens were drawn with train.seed={state.get('seed')}, not {self.seed}: "
                f"resume it with --train.seed={state.get('seed')}."
            )
        self._sample_index = state["sample_index"]
