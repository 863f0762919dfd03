"""Token files on disk: the format `moetrain prepare-data` writes and the checks on reading it.

A prepared directory holds

    meta.json       {"format": "moetrain-tokens-v1", "dtype", "vocab_size", "eos_id",
                     "tokenizer": "tokenizer.json", "splits": {"train": {"file", "num_tokens",
                     "num_documents"}, "val": {...}}, "sources", "skipped" (input files
                     not read, each "path (why)"), "seed", "val_frac"}
    train.bin       the token ids of the training documents, each followed by EOS, as a raw
    val.bin         little-endian array of `dtype` (numpy `tofile`), no header
    tokenizer.json  the Hugging Face `tokenizers` tokenizer that produced the ids

Reading memory-maps the .bin so that opening a terabyte of tokens costs nothing. Every problem a
user can cause (a missing directory, an interrupted run, a truncated copy, a vocabulary bigger
than the model's) raises `DataError` naming the file and the fix.

Legend: N tokens in a file, T tokens per sequence (seq_len).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.errors import DataError

FORMAT = "moetrain-tokens-v1"
META_FILE = "meta.json"
EOS_TOKEN = "<|endoftext|>"
PREPARE_HINT = (
    "Create it with `moetrain prepare-data INPUT... --out DIR` (or `make data` for the default "
    "corpus) and point data.sources / data.val at DIR"
)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFile:
    """One split of a prepared directory: a read-only memory map of its ids plus metadata."""

    path: Path
    """The .bin file."""
    split: str
    """The split name in meta.json ("train", "val")."""
    meta: dict[str, Any]
    """The directory's whole meta.json."""
    tokens_N: np.ndarray
    """The ids, memory-mapped (never read whole)."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_N.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def tokenizer_path(self) -> Path | None:
        """The tokenizer.json the ids came from, if the metadata names one."""
        name = self.meta.get("tokenizer")
        return self.path.parent / name if name else None

    def num_windows(self, seq_len: int) -> int:
        """Number of non-overlapping training windows: window k covers tokens
        [k*T, k*T + T] (T+1 tokens: T inputs and the T targets shifted by one)."""
        return (self.num_tokens - 1) // seq_len

    def window(self, index: int, seq_len: int) -> np.ndarray:
        """The `seq_len + 1` tokens of window `index` (a view into the memory map)."""
        start = index * seq_len
        return self.tokens_N[start : start + seq_len + 1]

    def fingerprint(self) -> dict[str, Any]:
        """A cheap content fingerprint (size plus a hash of the first and last 4096 ids), used
        to refuse resuming a data loader on different data."""
        h = hashlib.blake2b(digest_size=8)
        h.update(np.ascontiguousarray(self.tokens_N[:4096]).tobytes())
        h.update(np.ascontiguousarray(self.tokens_N[-4096:]).tobytes())
        return {"num_tokens": self.num_tokens, "vocab_size": self.vocab_size, "hash": h.hexdigest()}


def open_source(path: str | os.PathLike, split: str = "train", *, seq_len: int | None = None) -> TokenFile:
    """Open token data: a prepared directory (its `split`'s file) or a .bin file inside one
    (its metadata is the split of the directory's meta.json whose file name matches; `split` is
    then ignored). With `seq_len`, also require at least `seq_len + 1` tokens (one window)."""
    path = Path(path)
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative paths are read from the current directory, {Path.cwd()})"
        raise DataError(f"Token data '{path}' does not exist{where}. {PREPARE_HINT}.")
    if path.is_dir():
        directory, meta = path, read_meta(path)
        if split not in meta["splits"]:
            raise DataError(
                f"'{directory / META_FILE}' has no split '{split}' (it has: "
                f"{', '.join(sorted(meta['splits']))}). Re-run `moetrain prepare-data` into "
                "this directory, or name one of the existing splits."
            )
    else:
        if path.suffix != ".bin":
            raise DataError(
                f"'{path}' is neither a prepared directory nor a .bin token file. Tokenize text "
                f"first: `moetrain prepare-data {path} --out DIR`, then use DIR as the source."
            )
        directory, meta = path.parent, read_meta(path.parent)
        matches = [name for name, s in meta["splits"].items() if s["file"] == path.name]
        if not matches:
            raise DataError(
                f"'{directory / META_FILE}' describes no split stored in '{path.name}' (files: "
                f"{', '.join(s['file'] for s in meta['splits'].values())}). Use the prepared "
                "directory itself as the source, or re-run prepare-data."
            )
        split = matches[0]
    return _open_split(directory / meta["splits"][split]["file"], split, meta, seq_len)


def check_vocab(tf: TokenFile, model_vocab_size: int | None) -> None:
    """Raise `DataError` if the data's vocabulary is bigger than the model's embedding (None: no
    model to check against)."""
    if model_vocab_size is not None and tf.vocab_size > model_vocab_size:
        raise DataError(
            f"'{tf.path}' was tokenized with vocab_size {tf.vocab_size} (see its meta.json) but "
            f"model.vocab_size is {model_vocab_size}: ids up to {tf.vocab_size - 1} would index "
            f"past the embedding. Set model.vocab_size to at least {tf.vocab_size} "
            f"(--model.vocab_size={tf.vocab_size}) or re-run prepare-data with "
            f"--vocab-size {model_vocab_size}."
        )


def load_tokenizer(path: str | os.PathLike):
    """The `tokenizers.Tokenizer` of a prepared directory (or of a tokenizer.json file), set
    to encode text the way prepare-data did: a literal "<|endoftext|>" in the text is text, not
    EOS (`encode_special_tokens`), so `decode(encode(x)) == x`. Append `eos_id` yourself."""
    from tokenizers import Tokenizer  # imported lazily: reading tokens does not need it

    path = Path(path)
    if path.is_dir():
        name = read_meta(path).get("tokenizer") if (path / META_FILE).is_file() else None
        path = path / (name or "tokenizer.json")
    if not path.is_file():
        raise DataError(
            f"Tokenizer file '{path}' does not exist. `moetrain prepare-data` writes it next to "
            "the token files; re-run it, or copy the tokenizer.json the data was made with."
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a plain Exception
        raise DataError(f"'{path}' is not a valid Hugging Face tokenizers file ({e}). Re-run prepare-data.") from None
    tok.encode_special_tokens = True  # not stored in tokenizer.json
    return tok


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two tokenizer.json files hold the same tokenizer, however each file is formatted."""
    from tokenizers import Tokenizer

    return (
        a.read_bytes() == b.read_bytes() or Tokenizer.from_file(str(a)).to_str() == Tokenizer.from_file(str(b)).to_str()
    )


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """Read and validate `directory/meta.json`."""
    file = Path(directory) / META_FILE
    if not file.is_file():
        raise DataError(
            f"'{directory}' has no {META_FILE}: it was not written by `moetrain prepare-data`, "
            f"or a run into it was interrupted (meta.json is written last). {PREPARE_HINT}."
        )
    try:
        meta = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"'{file}' is not valid JSON ({e}). Re-run prepare-data.") from None
    problem = _meta_problem(meta)
    if problem:
        raise DataError(f"'{file}' is not valid token metadata: {problem}. Re-run prepare-data.")
    return meta


def write_meta(directory: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Write meta.json atomically (temporary name, then rename): it marks a directory complete."""
    file = Path(directory) / META_FILE
    tmp = file.with_name(f".{META_FILE}.partial")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, file)


def write_token_dir(
    directory: str | os.PathLike, splits: dict[str, Any], *, vocab_size: int, eos_id: int, **extra: Any
) -> dict[str, Any]:
    """Write in-memory ids as a prepared directory (`splits`: name -> 1-D ids); for tests and
    small tools. `prepare_data` streams instead. Returns the metadata."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    counts = {}
    for name, ids in splits.items():
        ids_N = np.asarray(ids).astype(dtype)
        ids_N.tofile(directory / f"{name}.bin")
        counts[name] = {"file": f"{name}.bin", "num_tokens": len(ids_N), "num_documents": int((ids_N == eos_id).sum())}
    meta = {"format": FORMAT, "dtype": dtype.name, "vocab_size": vocab_size, "eos_id": eos_id, "tokenizer": None}
    meta |= {"splits": counts, **extra}
    write_meta(directory, meta)
    return meta


# ---- internals ---------------------------------------------------------------------------


def _meta_problem(meta: Any) -> str | None:
    if not isinstance(meta, dict):
        return "the top level must be a JSON object"
    if meta.get("format") != FORMAT:
        return f"format is {meta.get('format')!r}, expected {FORMAT!r}"
    if meta.get("dtype") not in ("uint16", "uint32"):
        return f"dtype is {meta.get('dtype')!r}, expected 'uint16' or 'uint32'"
    for key in ("vocab_size", "eos_id"):
        if not isinstance(meta.get(key), int) or meta[key] < 0:
            return f"{key} is {meta.get(key)!r}, expected a non-negative integer"
    splits = meta.get("splits")
    if not isinstance(splits, dict) or not splits:
        return "'splits' must be a non-empty object"
    for name, s in splits.items():
        if not isinstance(s, dict) or not isinstance(s.get("file"), str):
            return f"splits.{name}.file is missing"
        if not isinstance(s.get("num_tokens"), int):
            return f"splits.{name}.num_tokens is missing"
    return None


def _open_split(file: Path, split: str, meta: dict[str, Any], seq_len: int | None) -> TokenFile:
    if not file.is_file():
        raise DataError(
            f"Token file '{file}' is missing although meta.json lists it. Re-run "
            f"`moetrain prepare-data … --out {file.parent}` (or `make data`)."
        )
    dtype = np.dtype(meta["dtype"])
    size = file.stat().st_size
    expected = meta["splits"][split]["num_tokens"]
    if size % dtype.itemsize or size // dtype.itemsize != expected:
        raise DataError(
            f"Token file '{file}' is truncated or was modified: it holds {size} bytes, meta.json "
            f"promises {expected} {dtype.name} tokens ({expected * dtype.itemsize} bytes). Copy it "
            "again completely, or re-run prepare-data."
        )
    if size == 0:
        raise DataError(
            f"Token file '{file}' is empty (split '{split}' received no documents). Give "
            "prepare-data more documents (and --val-frac > 0 for a val split), or use another "
            "split or directory."
        )
    tokens_N = np.memmap(file, dtype=dtype, mode="r", shape=(size // dtype.itemsize,))
    tf = TokenFile(path=file, split=split, meta=meta, tokens_N=tokens_N)
    if seq_len is not None and tf.num_tokens < seq_len + 1:
        raise DataError(
            f"Token file '{file}' holds {tf.num_tokens} tokens, fewer than one sequence needs "
            f"(data.seq_len + 1 = {seq_len + 1}). Lower data.seq_len or prepare more text."
        )
    return tf
