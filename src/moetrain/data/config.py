"""Configuration of the training data."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from moetrain.config import Config, non_negative, positive
from moetrain.errors import ConfigError

if TYPE_CHECKING:
    from moetrain.data.loader import SyntheticLoader, TokenLoader


@dataclasses.dataclass(kw_only=True)
class DataConfig(Config):
    sources: list[str] = dataclasses.field(default_factory=lambda: ["data/default"])
    """Training token sources: directories written by `moetrain prepare-data` (their train.bin is
    read) or .bin token files inside such a directory (described by its meta.json)."""
    weights: list[float] | None = non_negative(None, at_most=10**15)
    """Mixture weights, one per source (normalized). None: proportional to each source's size."""
    val: str | None = None
    """Validation tokens (a prepared directory or a .bin). None: the first source directory's
    val.bin when it exists, else no validation."""
    seq_len: int = positive(256, at_most=2**27)
    """Tokens per training sequence."""
    document_masking: bool = False
    """Attend only within a document (documents are separated by the EOS token)."""
    synthetic: bool = False
    """Uniformly random token ids instead of `sources` (for benchmarks: nothing to prepare, no
    validation set). The losses mean nothing; throughput and memory do."""

    def validate(self) -> None:
        if self.synthetic and self.document_masking:
            raise ConfigError(
                "data.document_masking=true needs real documents, but data.synthetic=true draws random "
                "token ids: turn one of them off."
            )
        if not self.sources:
            raise ConfigError("data.sources is empty: name at least one prepared data directory.")
        if any(not source.strip() for source in self.sources) or (self.val is not None and not self.val.strip()):
            raise ConfigError(
                f"data.sources={self.sources} / data.val={self.val!r}: an empty name is no directory; name the "
                "directories `moetrain prepare-data` wrote (or leave data.val out)."
            )
        if self.weights is not None:
            if len(self.weights) != len(self.sources):
                raise ConfigError(
                    f"data.weights has {len(self.weights)} entries but data.sources has "
                    f"{len(self.sources)}: give one weight per source."
                )
            if sum(self.weights) <= 0:
                raise ConfigError(f"data.weights={self.weights} must have a positive sum.")

    def build(
        self, *, micro_batch_size: int, seed: int, vocab_size: int, dp_rank: int = 0, dp_size: int = 1
    ) -> TokenLoader | SyntheticLoader:
        """The training loader of data-parallel rank `dp_rank` of `dp_size`: each global
        micro-batch of `micro_batch_size` sequences, this rank's rows of it."""
        from moetrain.data.loader import SyntheticLoader, TokenLoader

        kw = dict(micro_batch_size=micro_batch_size, seed=seed, vocab_size=vocab_size, dp_rank=dp_rank, dp_size=dp_size)
        return SyntheticLoader(seq_len=self.seq_len, **kw) if self.synthetic else TokenLoader(self, **kw)

    def val_path(self) -> str | None:
        """Where validation tokens come from (None: no validation): `val`, else the first source
        when it is a prepared directory with a non-empty val split; never with synthetic data."""
        from moetrain.data.tokens import META_FILE, read_meta

        if self.synthetic or self.val is not None:
            return None if self.synthetic else self.val
        if not self.sources or not os.path.isfile(os.path.join(first := self.sources[0], META_FILE)):
            return None
        val = read_meta(first)["splits"].get("val")
        return first if val and val["num_tokens"] > 0 else None
