"""`moetrain prepare-data`: tokenize raw text into a directory of token files.

    moetrain prepare-data INPUT... --out DIR [--tokenizer tokenizer.json] [--vocab-size 8192]
                          [--val-frac 0.02] [--text-key text] [--seed 0] [--default-corpus]

Inputs are .txt/.rst/.md files (one document each), .jsonl files (one document per line, in
field --text-key) and directories (walked for those extensions); --default-corpus adds the
embedded corpus (`moetrain.data.corpus`). The result is the format `moetrain.data.tokens` reads.

Everything streams, so memory stays flat however large the input: we pass over the documents
three times, holding at most one batch of them at once:
1. split: decide which whole documents are held out for validation (a stable hash of the seed
   and the document name), and count them for the progress bar;
2. tokenizer: unless --tokenizer is given, train a byte-level BPE on the training documents;
3. tokenize: `encode_batch` (Rust, all cores) one batch at a time, appending ids + EOS to
   train.bin / val.bin under temporary names, renamed only when everything succeeded.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from moetrain.data.corpus import default_corpus_documents
from moetrain.data.tokens import EOS_TOKEN, FORMAT, META_FILE, dtype_for_vocab, write_meta
from moetrain.errors import ConfigError, DataError, MoetrainError

TEXT_SUFFIXES = (".txt", ".rst", ".md")
JSONL_SUFFIX = ".jsonl"
SNIFF_BYTES = 8192
"""Bytes read from a file without an extension to decide whether it is UTF-8 text."""
BATCH_DOCS = 256
"""Documents per `encode_batch` call: enough to keep every core busy."""
BATCH_BYTES = 4 << 20
"""...or this many bytes of text, whichever comes first, so long documents keep memory bounded."""
DEFAULT_CORPUS = "default-corpus"

Document = tuple[str, str]  # (name, text); the name decides the split, so keep it stable


def main(argv: list[str]) -> int:
    """Command-line entry point. User mistakes raise `MoetrainError` for the caller to print."""
    parser = argparse.ArgumentParser(
        prog="moetrain prepare-data",
        description="Tokenize text files into train.bin / val.bin / meta.json / tokenizer.json.",
    )
    parser.add_argument(
        "inputs", nargs="*", metavar="INPUT", help="text files (.txt .rst .md), .jsonl files or directories"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--tokenizer", metavar="FILE", help="an existing Hugging Face tokenizers file (default: train a BPE)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=8192, help="vocabulary size of the trained BPE (default 8192)"
    )
    parser.add_argument(
        "--val-frac", type=float, default=0.02, help="fraction of documents held out for validation (default 0.02)"
    )
    parser.add_argument("--text-key", default="text", help="text field of .jsonl records")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument(
        "--default-corpus", action="store_true", help="add the embedded corpus (Shakespeare, KJV Bible, Python docs)"
    )
    parser.add_argument(
        "--eos-token", metavar="NAME", help=f"end-of-document token of --tokenizer (default {EOS_TOKEN})"
    )
    args = parser.parse_args(argv)

    start = time.perf_counter()
    meta = prepare_data(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_frac=args.val_frac,
        text_key=args.text_key,
        seed=args.seed,
        default_corpus=args.default_corpus,
        eos_token=args.eos_token,
    )
    splits = meta["splits"]
    summary = {
        "out": str(args.out),
        "vocab_size": meta["vocab_size"],
        "train_tokens": splits["train"]["num_tokens"],
        "train_documents": splits["train"]["num_documents"],
        "val_tokens": splits["val"]["num_tokens"],
        "val_documents": splits["val"]["num_documents"],
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(summary))
    return 0


def prepare_data(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    vocab_size: int = 8192,
    val_frac: float = 0.02,
    text_key: str = "text",
    seed: int = 0,
    default_corpus: bool = False,
    eos_token: str | None = None,
    progress: bool = True,
    batch_docs: int = BATCH_DOCS,
    batch_bytes: int = BATCH_BYTES,
) -> dict[str, Any]:
    """Tokenize `inputs` into the directory `out` and return its metadata (meta.json)."""
    if not 0.0 <= val_frac < 1.0:
        raise ConfigError(f"--val-frac={val_frac} must be in [0, 1), for example 0.02.")
    if tokenizer is None and not 257 <= vocab_size <= 2**32:
        raise ConfigError(
            f"--vocab-size={vocab_size} must be at least 257 (the 256 byte tokens plus "
            "<|endoftext|>); 8192 suits small models, 32768-131072 large ones."
        )
    skipped: list[str] = []
    files = collect_files(inputs, skipped)
    shown = "; ".join(skipped[:10]) + (f"; and {len(skipped) - 10} more" if len(skipped) > 10 else "")
    if not files and not default_corpus:
        raise DataError(
            "prepare-data got no input documents: name text files (.txt .rst .md, or UTF-8 text "
            "without an extension), .jsonl files or directories holding them, or pass "
            "--default-corpus for the embedded corpus."
            + (f" Skipped {len(skipped)} file(s): {shown}." if skipped else "")
        )
    if skipped and progress:
        print(f"prepare-data: skipped {len(skipped)} file(s) it does not read: {shown}", file=sys.stderr)

    def documents() -> Iterator[Document]:
        return iter_documents(files, text_key=text_key, default_corpus=default_corpus)

    split = _plan_split(documents(), seed=seed, val_frac=val_frac)

    if tokenizer is None:

        def train_texts() -> Iterator[list[str]]:
            for batch in _batches(documents(), batch_docs, batch_bytes):
                texts = [text for pos, name, text in batch if not split.is_val(pos, name)]
                if texts:
                    yield texts

        tok = train_bpe(train_texts(), vocab_size=vocab_size, progress=progress)
        eos_token = EOS_TOKEN
    else:
        tok = _load_external_tokenizer(Path(tokenizer))
        eos_token = eos_token or EOS_TOKEN
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise DataError(
            f"Tokenizer '{tokenizer}' has no token {eos_token!r} to end documents with. Name its "
            "end-of-document token with --eos-token NAME (for example --eos-token '</s>')."
        )
    # A document that contains the text "<|endoftext|>" must not produce a real EOS id; the
    # flag lives on this in-memory tokenizer only (tokenizer.json does not store it).
    tok.encode_special_tokens = True
    vocab_size = tok.get_vocab_size()
    dtype = dtype_for_vocab(vocab_size)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts = _write_splits(
        tok,
        _batches(documents(), batch_docs, batch_bytes),
        split,
        out,
        dtype=dtype,
        eos_id=eos_id,
        progress=progress,
    )
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer": "tokenizer.json",
        "splits": counts,
        "sources": [str(p) for p in inputs] + ([DEFAULT_CORPUS] if default_corpus else []),
        "seed": seed,
        "val_frac": val_frac,
    }
    write_meta(out, meta)
    return meta


def collect_files(inputs: Iterable[str | os.PathLike], skipped: list[str] | None = None) -> list[tuple[Path, str]]:
    """Expand the inputs into `(file, document-name prefix)`; directories are walked in sorted
    order (hidden entries skipped). Read: .txt .rst .md files and UTF-8 text files without an
    extension (one document each), .jsonl files (one per line). Files of a directory that are
    not read are appended to `skipped` as "path (why)". Raises `DataError` for a missing path or
    a named file that cannot be read."""
    files: list[tuple[Path, str]] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            root_name = path.resolve().name
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    file = Path(dirpath) / name
                    if name.startswith("."):
                        continue
                    why = _unreadable(file)
                    if why is None:
                        files.append((file, f"{root_name}/{file.relative_to(path).as_posix()}"))
                    elif skipped is not None:
                        skipped.append(f"{file} ({why})")
        elif path.is_file():
            why = _unreadable(path)
            if why is not None:
                raise DataError(
                    f"Input '{path}' is not read: {why}. prepare-data reads {', '.join(TEXT_SUFFIXES)} "
                    f"files and UTF-8 text files without an extension (one document each) and "
                    f"{JSONL_SUFFIX} files (one document per line). Rename or convert it."
                )
            files.append((path, path.name))
        else:
            raise DataError(
                f"Input '{path}' does not exist. Check the path (relative paths are relative to "
                f"the current directory, {Path.cwd()})."
            )
    return files


def iter_documents(
    files: Iterable[tuple[Path, str]], *, text_key: str = "text", default_corpus: bool = False
) -> Iterator[Document]:
    """Stream `(name, text)` documents from `collect_files` output (then the default corpus).
    A .jsonl file is read line by line; empty documents are skipped."""
    for path, name in files:
        if path.suffix == JSONL_SUFFIX:
            yield from _jsonl_documents(path, name, text_key)
        else:
            try:
                # newline="" keeps "\r\n" as it is: the tokens reproduce the file exactly.
                with open(path, encoding="utf-8", newline="") as f:
                    text = f.read()
            except UnicodeDecodeError as e:
                raise DataError(
                    f"Input '{path}' is not UTF-8 ({e.reason} at byte {e.start}). Convert it, "
                    f"e.g. `iconv -f latin1 -t utf-8 {path} > fixed.txt`."
                ) from None
            if text:
                yield name, text
    if default_corpus:
        yield from default_corpus_documents()


def train_bpe(texts: Iterable[str | list[str]], *, vocab_size: int, progress: bool = True):
    """Train a byte-level BPE whose `decode(encode(x)) == x` for any string: the ByteLevel
    pre-tokenizer maps every byte to a symbol (all 256 are in the initial alphabet, so nothing
    is ever unknown) and the ByteLevel decoder maps them back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def val_score(name: str, seed: int) -> float:
    """A stable pseudo-random number in [0, 1) for a document; it goes to val when below
    --val-frac. Independent of the Python hash seed, the platform and the document order."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


# ---- internals ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Split:
    """Which documents are validation documents: those whose `val_score` is below `val_frac`,
    except for at most one position overridden to keep both splits non-empty. Nothing grows
    with the number of documents."""

    num_documents: int
    seed: int
    val_frac: float
    overrides: dict[int, bool]  # position in the document stream -> is_val

    def is_val(self, pos: int, name: str) -> bool:
        forced = self.overrides.get(pos)
        return forced if forced is not None else val_score(name, self.seed) < self.val_frac


def _plan_split(documents: Iterator[Document], *, seed: int, val_frac: float) -> _Split:
    """Read every document once to count them and find the overrides."""
    num = num_val = 0
    lowest = (2.0, -1)  # (score, position) of the most val-like document
    highest_val = (-1.0, -1)  # ...and of the least val-like val document
    for pos, (name, _) in enumerate(documents):
        num, score = pos + 1, val_score(name, seed)
        if score < val_frac:
            num_val += 1
            highest_val = max(highest_val, (score, pos))
        lowest = min(lowest, (score, pos))
    if num == 0:
        raise DataError(
            "The inputs of prepare-data hold no non-empty documents (empty files, or .jsonl "
            "lines with empty text). Check the inputs and --text-key."
        )
    overrides = {}
    if num >= 2 and val_frac > 0 and num_val == 0:
        overrides[lowest[1]] = True  # a val split needs at least one document...
    elif num >= 2 and num_val == num:
        overrides[highest_val[1]] = False  # ...and so does train
    return _Split(num, seed, val_frac, overrides)


def _batches(documents: Iterator[Document], max_docs: int, max_bytes: int):
    """Group `(position, name, text)` into lists of at most `max_docs` docs / ~`max_bytes`."""
    batch: list[tuple[int, str, str]] = []
    size = 0
    for pos, (name, text) in enumerate(documents):
        batch.append((pos, name, text))
        size += len(text)
        if len(batch) >= max_docs or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_splits(tok, batches, split: _Split, out: Path, *, dtype, eos_id: int, progress: bool):
    """Encode each batch and append its documents' ids + EOS to train.bin / val.bin, written
    under temporary names and renamed (with tokenizer.json) only once all went well. Returns
    the `splits` entry of meta.json."""
    names = {"train": "train.bin", "val": "val.bin", "tokenizer": "tokenizer.json"}
    partial = {s: out / f".{f}.partial" for s, f in names.items()}
    counts = {s: {"file": names[s], "num_tokens": 0, "num_documents": 0} for s in ("train", "val")}
    bar = tqdm(
        total=split.num_documents,
        unit="doc",
        desc="tokenizing",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    num_bytes = 0
    try:
        tok.save(str(partial["tokenizer"]))
        with open(partial["train"], "wb") as f_train, open(partial["val"], "wb") as f_val:
            files = {"train": f_train, "val": f_val}
            for batch in batches:
                ids_per_doc = _encode(tok, [text for _, _, text in batch])
                pieces: dict[str, list[np.ndarray]] = {"train": [], "val": []}
                for (pos, name, _), ids in zip(batch, ids_per_doc, strict=True):
                    s = "val" if split.is_val(pos, name) else "train"
                    pieces[s] += [np.asarray(ids, dtype=dtype), np.array([eos_id], dtype=dtype)]
                    counts[s]["num_documents"] += 1
                for s, arrays in pieces.items():
                    if arrays:
                        ids_N = np.concatenate(arrays)
                        ids_N.tofile(files[s])
                        counts[s]["num_tokens"] += int(ids_N.shape[0])
                num_bytes += sum(len(text.encode("utf-8")) for _, _, text in batch)
                bar.set_postfix_str(f"{num_bytes / 1e6:.1f} MB", refresh=False)
                bar.update(len(batch))
    except BaseException:
        for file in partial.values():
            file.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    # Renaming is the commit. Drop the old meta.json first: a crash between the renames then
    # leaves a directory that reads as incomplete, not stale metadata beside new files.
    (out / META_FILE).unlink(missing_ok=True)
    for s, f in names.items():
        os.replace(partial[s], out / f)
    return counts


def _unreadable(path: Path) -> str | None:
    """None when prepare-data reads `path`, else why not."""
    if path.suffix in TEXT_SUFFIXES or path.suffix == JSONL_SUFFIX:
        return None
    if path.suffix:
        return f"extension {path.suffix} is not read"
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        return "no extension and binary content"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not just a character cut at the end of the sample
            return f"no extension and not UTF-8 text (byte {e.start})"
    return None


def _encode(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, encoded in parallel by the Rust library (no special tokens)."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def _jsonl_documents(path: Path, name: str, text_key: str) -> Iterator[Document]:
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}, line {line_number}: invalid JSON ({e.msg} at column {e.colno}). "
                    "Each line of a .jsonl input must be one JSON object; fix or delete the line."
                ) from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(sorted(record)) if isinstance(record, dict) else "none"
                raise DataError(
                    f"{path}, line {line_number}: no string field {text_key!r} (keys: {keys}). "
                    "Name the field holding the text with --text-key."
                )
            if text:
                yield f"{name}:{line_number}", text


def _load_external_tokenizer(path: Path):
    from tokenizers import Tokenizer

    if not path.is_file():
        raise DataError(f"--tokenizer '{path}' does not exist. Give a tokenizer.json file.")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a plain Exception
        raise DataError(
            f"--tokenizer '{path}' is not a Hugging Face tokenizers file ({e}). Give the "
            "tokenizer.json of a `tokenizers` tokenizer, or leave --tokenizer out to train one."
        ) from None


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except MoetrainError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
