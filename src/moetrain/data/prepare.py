"""`moetrain prepare-data INPUT... --out DIR`: tokenize raw text into a directory of token files.

Inputs are .txt/.rst/.md files and UTF-8 text files without an extension (one document each),
.jsonl files (one document per line, in field --text-key), .parquet files (one document per
row, column --text-key), Hugging Face `datasets` directories written by `save_to_disk` (one
document per row; a DatasetDict's splits one after the other), already-tokenized .npy files
(1-D uint16/uint32 ids, documents separated by the EOS id: copied as they are, not
re-tokenized; they need --tokenizer, the tokenizer that made them) and directories (walked for
all of these); --default-corpus adds the embedded corpus (`moetrain.data.corpus`). The result is
the format `moetrain.data.tokens` reads. Parquet and datasets directories need pyarrow
(`pip install 'moetrain[data]'`).

Everything streams, so memory stays flat however large the input: we pass over the documents
three times, holding at most one batch of them at once:
1. split: decide which whole documents are held out for validation (a stable hash of the seed
   and the document name), and count them for the progress bar;
2. tokenizer: unless --tokenizer is given, train a byte-level BPE on the training documents;
3. tokenize: `encode_batch` (Rust, all cores) one batch at a time — in --workers processes, each
   batch's result taken in input order, so the files are byte-identical whatever the count —
   appending ids + EOS to train.bin / val.bin under temporary names, renamed only when
   everything succeeded.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import dataclasses
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.data.corpus import SUMMARY as CORPUS_SUMMARY
from moetrain.data.corpus import default_corpus_documents
from moetrain.data.progress import Progress
from moetrain.data.tokens import EOS_TOKEN, FORMAT, META_FILE, dtype_for_vocab, write_meta
from moetrain.destinations import check_directory, check_overwrite, existing_entries
from moetrain.errors import ConfigError, DataError, MoetrainError, file_kind, require

TEXT_SUFFIXES = (".txt", ".rst", ".md")
READ_SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet", ".npy", ".arrow")
"""What prepare-data reads; .arrow: the record-batch stream files of a `datasets.save_to_disk` directory."""
READS = (
    "text files (.txt .rst .md, or UTF-8 text without an extension; one document each), .jsonl files (one "
    "document per line), .parquet files, token .npy files, `datasets` directories and directories of these"
)
"""What prepare-data reads, as its error messages say it."""
SNIFF_BYTES = 8192
"""Bytes read from a file without an extension to decide whether it is UTF-8 text."""
BATCH_DOCS = 256
"""Documents per `encode_batch` call: enough to keep every core busy."""
BATCH_BYTES = 4 << 20
"""...or this many bytes of text, whichever comes first, so long documents keep memory bounded."""
DEFAULT_CORPUS = "default-corpus"
OUTPUT_FILES = ("train.bin", "val.bin", META_FILE, "tokenizer.json")
"""What a run writes into --out (replaced there only with --force)."""

Document = tuple[str, "str | np.ndarray"]
"""(name, text) — or (name, token ids) from a .npy input; the name decides the split, so keep
it stable."""


def main(argv: list[str]) -> int:
    """Command-line entry point. User mistakes raise `MoetrainError` for the caller to print."""
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="moetrain prepare-data",
        description="Tokenize text files into train.bin / val.bin / meta.json / tokenizer.json.",
    )
    add = parser.add_argument
    add(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="text files (.txt .rst .md or no extension), .jsonl, .parquet, datasets directories "
        "(save_to_disk), tokenized .npy files, or directories holding them",
    )
    add("--out", required=True, metavar="DIR", help="output directory")
    add("--tokenizer", metavar="FILE", help="an existing Hugging Face tokenizers file (default: train a BPE)")
    add("--vocab-size", type=int, default=8192, help="vocabulary size of the trained BPE (default 8192)")
    add("--val-frac", type=float, default=0.02, help="fraction of documents held out for validation (default 0.02)")
    add("--text-key", default="text", help="text field of .jsonl records, column of .parquet/datasets")
    add("--seed", type=int, default=0, help="seed of the train/val split")
    add("--default-corpus", action="store_true", help=f"add the embedded corpus: {CORPUS_SUMMARY}")
    add("--eos-token", metavar="NAME", help=f"end-of-document token of --tokenizer (default {EOS_TOKEN})")
    add("--eos-id", type=int, metavar="N", help="the id that ends documents in .npy inputs (default: the tokenizer's)")
    add("--workers", type=int, default=1, metavar="N", help="tokenizer processes (default 1)")
    add("--force", action="store_true", help="replace the token files already in --out")
    add(
        "--skip-bad",
        action="store_true",
        help="leave out input files that are not UTF-8 (named on stderr and in meta.json's skipped) instead of "
        "stopping",
    )
    args = parser.parse_args(argv)
    if not args.force:
        check_overwrite(args.out, existing_entries(args.out, OUTPUT_FILES), "--out", "prepare-data")

    start = time.perf_counter()
    options = {k: v for k, v in vars(args).items() if k not in ("inputs", "out", "force")}  # named as the flags
    meta = prepare_data(args.inputs, args.out, **options)
    summary = {"out": str(args.out), "vocab_size": meta["vocab_size"]}
    for s, counts in meta["splits"].items():  # train, then val
        summary |= {f"{s}_tokens": counts["num_tokens"], f"{s}_documents": counts["num_documents"]}
    print(json.dumps(summary | {"seconds": round(time.perf_counter() - start, 2)}))
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
    eos_id: int | None = None,
    workers: int = 1,
    progress: bool = True,
    batch_docs: int = BATCH_DOCS,
    batch_bytes: int = BATCH_BYTES,
    skip_bad: bool = False,
) -> dict[str, Any]:
    """Tokenize `inputs` into the directory `out` and return its metadata (meta.json). Text
    inputs that are not UTF-8 stop it, all named at once, before any work; `skip_bad` leaves them
    out instead (meta.json's `skipped` lists them with what a directory held that is not read)."""
    _check_arguments(out, val_frac=val_frac, workers=workers, tokenizer=tokenizer, vocab_size=vocab_size, eos_id=eos_id)
    files, skipped = _input_files(inputs, default_corpus=default_corpus, progress=progress, skip_bad=skip_bad)
    if tokenizer is None and any(path.suffix == ".npy" for path, _ in files):
        raise ConfigError(
            "The .npy inputs are already tokenized: pass --tokenizer FILE, the tokenizer.json that "
            "made them (its vocabulary sizes the model; its EOS id, or --eos-id, separates documents)."
        )
    tok, eos_id = _external_tokenizer(tokenizer, eos_token, eos_id) if tokenizer is not None else (None, eos_id)

    def documents() -> Iterator[Document]:
        return iter_documents(files, text_key=text_key, default_corpus=default_corpus, eos_id=eos_id)

    split = _plan_split(documents(), seed=seed, val_frac=val_frac)

    if tok is None:  # trained on the training documents' texts, a batch at a time
        batches = _batches(documents(), batch_docs, batch_bytes)
        texts = ([text for pos, name, text in batch if not split.is_val(pos, name)] for batch in batches)
        tok = train_bpe((batch for batch in texts if batch), vocab_size=vocab_size, progress=progress)
        eos_id = tok.token_to_id(EOS_TOKEN)
    # A document that contains the text "<|endoftext|>" must not produce a real EOS id; the
    # flag lives on this in-memory tokenizer only (tokenizer.json does not store it).
    tok.encode_special_tokens = True
    vocab_size = tok.get_vocab_size()
    dtype = dtype_for_vocab(vocab_size)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    batches = _batches(documents(), batch_docs, batch_bytes)
    counts = _write_splits(tok, batches, split, out, dtype=dtype, eos_id=eos_id, progress=progress, workers=workers)
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer": "tokenizer.json",
        "splits": counts,
        "sources": [str(p) for p in inputs] + ([DEFAULT_CORPUS] if default_corpus else []),
        "skipped": skipped,
        "seed": seed,
        "val_frac": val_frac,
    }
    write_meta(out, meta)
    return meta


def _check_arguments(out, *, val_frac: float, workers: int, tokenizer, vocab_size: int, eos_id: int | None) -> None:
    """`prepare_data`'s arguments, before any work."""
    check_directory(out, "Output directory", "Pass --out a directory you can write")
    if not 0.0 <= val_frac < 1.0:
        raise ConfigError(f"--val-frac={val_frac} must be in [0, 1), for example 0.02.")
    if not 1 <= workers <= 256:
        raise ConfigError(f"--workers={workers} must be between 1 and 256 (processes that tokenize).")
    if tokenizer is None and not 257 <= vocab_size <= 2**32:
        raise ConfigError(
            f"--vocab-size={vocab_size} must be at least 257 (the 256 byte tokens plus "
            "<|endoftext|>); 8192 suits small models, 32768-131072 large ones."
        )
    if eos_id is not None and tokenizer is None:
        raise ConfigError(
            f"--eos-id={eos_id} names an id of an existing tokenizer: pass it with --tokenizer FILE "
            "(a trained BPE ends documents with its own <|endoftext|>)."
        )


def _input_files(inputs, *, default_corpus: bool, progress: bool, skip_bad: bool) -> tuple[list, list[str]]:
    """(the files of `inputs` prepare-data reads (`collect_files`), what it skips as "path
    (why)"); what it skips is said once. Text files that are not UTF-8 are refused all at once,
    or with `skip_bad` skipped."""
    skipped: list[str] = []
    files = collect_files(inputs, skipped)
    bad = {path: why for path, _ in files if (why := _utf8_problem(path))}
    if bad and not skip_bad:
        raise DataError(
            f"{len(bad)} input file(s) are not UTF-8: {_listed([f'{p} ({why})' for p, why in bad.items()])}. "
            "Convert them (e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8.txt`), or pass --skip-bad to leave "
            "them out (meta.json lists what was skipped)."
        )
    files = [(path, name) for path, name in files if path not in bad]
    skipped += [f"{p} ({why})" for p, why in bad.items()]
    shown = _listed(skipped)
    if not files and not default_corpus:
        raise DataError(
            f"prepare-data got no input documents: name {READS}, or pass --default-corpus for the embedded "
            "corpus." + (f" Skipped {len(skipped)} file(s): {shown}." if skipped else "")
        )
    if skipped and progress:
        print(f"prepare-data: skipped {len(skipped)} file(s) it does not read: {shown}", file=sys.stderr)
    return files, skipped


def _listed(items: list[str], at_most: int = 10) -> str:
    return "; ".join(items[:at_most]) + (f"; and {len(items) - at_most} more" if len(items) > at_most else "")


def _utf8_problem(path: Path) -> str | None:
    """Why a text or .jsonl input is not UTF-8 text, or None (and for other inputs), read in 1 MiB
    pieces."""
    if path.suffix in (".parquet", ".arrow", ".npy"):
        return None
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            try:
                decoder.decode(piece)
            except UnicodeDecodeError as e:
                return f"not UTF-8: {e.reason} at byte {offset + e.start}"
            offset += len(piece)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        return f"not UTF-8: {e.reason} at its end"
    return None


def collect_files(inputs: Iterable[str | os.PathLike], skipped: list[str] | None = None) -> list[tuple[Path, str]]:
    """Expand the inputs into `(file, document-name prefix)`; directories are walked in sorted
    order (hidden entries skipped; links to directories followed, each directory read once), and
    what they hold that is not read is appended to `skipped` as "path (why)". Raises `DataError`
    for a missing path or a named file that cannot be read."""
    files: list[tuple[Path, str]] = []
    skipped = [] if skipped is None else skipped
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            root_name, walked = path.resolve().name, set()
            for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                if os.path.realpath(dirpath) in walked:  # a link to a directory read already (a loop)
                    skipped.append(f"{dirpath} (a link to a directory read already)")
                    dirnames[:] = []
                    continue
                walked.add(os.path.realpath(dirpath))
                arrow = _dataset_files(Path(dirpath))
                if arrow is not None:  # a save_to_disk directory: its files in the dataset's order
                    prefix = f"{root_name}/{Path(dirpath).relative_to(path).as_posix()}".removesuffix("/.")
                    files += [(file, f"{prefix}/{file.name}") for file in arrow]
                    dirnames[:] = [] if (Path(dirpath) / "state.json").is_file() else dirnames
                    continue
                for name in sorted(n for n in filenames if not n.startswith(".")):
                    file = Path(dirpath) / name
                    if not file.is_file():  # reading a FIFO would wait forever
                        skipped.append(f"{file} ({file_kind(file)}, not a regular file)")
                    elif why := _unreadable(file):
                        skipped.append(f"{file} ({why})")
                    else:
                        files.append((file, f"{root_name}/{file.relative_to(path).as_posix()}"))
        elif path.is_file():
            if why := _unreadable(path):
                raise DataError(f"Input '{path}' is not read: {why}. prepare-data reads {READS}. Rename or convert it.")
            files.append((path, path.name))
        elif path.exists() or path.is_symlink():
            raise DataError(
                f"Input '{path}' is {file_kind(path)}, not a regular file: prepare-data reads {READS}. Name the "
                "file itself (write a stream to a file first)."
            )
        else:
            raise DataError(
                f"Input '{path}' does not exist. Check the path (relative paths are relative to "
                f"the current directory, {Path.cwd()})."
            )
    return files


def iter_documents(
    files: Iterable[tuple[Path, str]],
    *,
    text_key: str = "text",
    default_corpus: bool = False,
    eos_id: int | None = None,
) -> Iterator[Document]:
    """Stream `(name, text)` documents from `collect_files` output (then the default corpus),
    and `(name, ids)` from .npy token files (split at `eos_id`). A .jsonl file is read line by
    line, a .parquet file or a datasets .arrow file batch by batch; empty text documents are
    skipped (an empty token document is kept: its EOS is an input token)."""
    for path, name in files:
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path, name, text_key)
        elif path.suffix in (".parquet", ".arrow"):
            yield from _table_documents(path, name, text_key)
        elif path.suffix == ".npy":
            assert eos_id is not None, "prepare_data resolves the EOS id before reading .npy inputs"
            yield from _token_documents(path, name, eos_id)
        elif text := read_text(path):
            yield name, text
    if default_corpus:
        yield from default_corpus_documents()


def read_text(path: Path) -> str:
    """A text file as it is: newline="" keeps "\r\n", so the tokens reproduce the file exactly;
    `DataError` where it is not UTF-8."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(
            f"Input '{path}' is not UTF-8 ({e.reason} at byte {e.start}). Convert it, "
            f"e.g. `iconv -f latin1 -t utf-8 {path} > fixed.txt`."
        ) from None


def train_bpe(texts: Iterable[str | list[str]], *, vocab_size: int, progress: bool = True):
    """Train a byte-level BPE whose `decode(encode(x)) == x` for any string: the ByteLevel
    pre-tokenizer maps every byte to a symbol (all 256 are in the initial alphabet, so nothing
    is ever unknown) and the ByteLevel decoder maps them back. Its progress bar shows on a
    terminal only; elsewhere a line before and one after (the bar's redraws would fill a log)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress and sys.stderr.isatty(),
    )
    logged = progress and not sys.stderr.isatty()
    if logged:
        print(f"training a byte-level BPE of {vocab_size:,} tokens on the training documents", file=sys.stderr)
    start = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer)
    if logged:
        print(f"trained the BPE in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
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
        return self.overrides.get(pos, val_score(name, self.seed) < self.val_frac)


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
    batch, size = [], 0
    for pos, (name, text) in enumerate(documents):
        batch.append((pos, name, text))
        size += len(text)
        if len(batch) >= max_docs or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_splits(tok, batches, split: _Split, out: Path, *, dtype, eos_id: int, progress: bool, workers: int = 1):
    """The module docstring's third pass; token documents (.npy) are copied as they are, after a check
    that every id is in the vocabulary. Returns the `splits` entry of meta.json."""
    names = {"train": "train.bin", "val": "val.bin", "tokenizer": "tokenizer.json"}
    partial = {s: out / f".{f}.partial" for s, f in names.items()}
    counts = {s: {"file": names[s], "num_tokens": 0, "num_documents": 0} for s in ("train", "val")}
    bar = Progress(split.num_documents, progress)
    vocab_size = tok.get_vocab_size()
    pool = None
    try:
        tok.save(str(partial["tokenizer"]))
        if workers > 1:
            # spawn: a forked child would inherit the tokenizers library's thread pool state. An
            # executor, not a Pool: a worker that dies raises BrokenProcessPool here, not a hang.
            pool = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(tok.to_str(), tok.encode_special_tokens),
            )
            encoded = _in_order(pool, batches, depth=2 * workers)
        else:
            encoded = (_encode_batch(tok, batch) for batch in batches)
        with open(partial["train"], "wb") as f_train, open(partial["val"], "wb") as f_val:
            files = {"train": f_train, "val": f_val}
            for batch, ids_per_doc in encoded:
                pieces: dict[str, list[np.ndarray]] = {"train": [], "val": []}
                for (pos, name, is_text, _), ids in zip(batch, ids_per_doc, strict=True):
                    if not is_text and ids.shape[0] and int(ids.max()) >= vocab_size:
                        bad = int(np.flatnonzero(np.asarray(ids) >= vocab_size)[0])
                        raise DataError(
                            f"{name}: token {bad + 1} of the document is id {int(ids[bad])}, outside the "
                            f"tokenizer's vocabulary (0..{vocab_size - 1}). Pass the --tokenizer that made the file."
                        )
                    s = "val" if split.is_val(pos, name) else "train"
                    pieces[s] += [np.asarray(ids, dtype=dtype), np.array([eos_id], dtype=dtype)]
                    counts[s]["num_documents"] += 1
                for s, arrays in pieces.items():
                    if arrays:
                        ids_N = np.concatenate(arrays)
                        ids_N.tofile(files[s])
                        counts[s]["num_tokens"] += int(ids_N.shape[0])
                bar.update(len(batch), sum(nbytes for _, _, _, nbytes in batch))
    except BaseException:
        for file in partial.values():
            file.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    # Renaming is the commit. Drop the old meta.json first: a crash between the renames then
    # leaves a directory that reads as incomplete, not stale metadata beside new files.
    (out / META_FILE).unlink(missing_ok=True)
    for s, f in names.items():
        os.replace(partial[s], out / f)
    return counts


def _dataset_files(directory: Path) -> list[Path] | None:
    """The .arrow files of a `datasets` `save_to_disk` directory in the dataset's row order
    (state.json's `_data_files`), [] for a DatasetDict's root (its splits are subdirectories,
    walked next); None for any other directory."""
    state = directory / "state.json"
    if state.is_file() and (directory / "dataset_info.json").is_file():
        try:
            names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"'{state}' is not a datasets state file ({e}): re-save the dataset.") from None
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise DataError(f"datasets directory '{directory}' lacks {', '.join(missing)} (listed in state.json).")
        return [directory / n for n in names]
    if (directory / "dataset_dict.json").is_file():
        return []
    return None


def _unreadable(path: Path) -> str | None:
    """None when prepare-data reads `path`, else why not."""
    if path.suffix in READ_SUFFIXES:
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


def _encode(tok, docs: list) -> list:
    """Token ids of each text document, encoded in parallel by the Rust library (no special
    tokens); token documents (arrays) pass through."""
    texts = [d for d in docs if isinstance(d, str)]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets
    encoded = iter([e.ids for e in encode(texts, add_special_tokens=False)] if texts else [])
    return [next(encoded) if isinstance(d, str) else d for d in docs]


def _encode_batch(tok, batch: list[tuple[int, str, Any]]):
    """A batch of (position, name, document) → ([(position, name, is_text, bytes)], ids per
    document): what the writer needs, without the texts (which a worker need not send back)."""
    info = [
        (pos, name, isinstance(d, str), len(d.encode("utf-8")) if isinstance(d, str) else d.nbytes)
        for pos, name, d in batch
    ]
    return info, _encode(tok, [d for _, _, d in batch])


def _in_order(pool, batches, depth: int):
    """The workers' results in input order, at most `depth` batches in flight (mapping over the
    whole input would read it all ahead into the task queue)."""
    pending: collections.deque = collections.deque()
    try:
        for batch in batches:
            pending.append(pool.submit(_worker_encode, batch))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as e:
        raise ConfigError(
            f"prepare-data --workers: a tokenizer process died ({e}). Called from an interactive "
            "session or a script without `if __name__ == '__main__':`, spawned workers cannot start: "
            "use workers=1 there (the moetrain command works with any count)."
        ) from None


_WORKER_TOKENIZER = None


def _worker_init(tokenizer_json: str, encode_special_tokens: bool) -> None:
    global _WORKER_TOKENIZER
    os.environ["RAYON_NUM_THREADS"] = "1"  # one thread per worker process: --workers sets the parallelism
    from tokenizers import Tokenizer

    _WORKER_TOKENIZER = Tokenizer.from_str(tokenizer_json)
    _WORKER_TOKENIZER.encode_special_tokens = encode_special_tokens


def _worker_encode(batch):
    return _encode_batch(_WORKER_TOKENIZER, batch)


def _jsonl_documents(path: Path, name: str, text_key: str) -> Iterator[Document]:
    with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Windows tools write one) is no text
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
            if not isinstance(record, dict) or text_key not in record:
                keys = ", ".join(sorted(record)) if isinstance(record, dict) else "none"
                raise DataError(
                    f"{path}, line {line_number}: no field {text_key!r} (keys: {keys}). "
                    "Name the field holding the text with --text-key."
                )
            text = record[text_key]
            if text is not None and not isinstance(text, str):  # null: no text, as in a .parquet
                raise DataError(
                    f"{path}, line {line_number}: field {text_key!r} holds {type(text).__name__}, not text. "
                    "Name the field holding the text with --text-key."
                )
            if text:
                yield f"{name}:{line_number}", text


def _table_documents(path: Path, name: str, text_key: str) -> Iterator[Document]:
    """Rows of a .parquet file or of a datasets .arrow stream, column `text_key`, a record batch
    at a time; documents named file:row (from 1)."""
    pa = require("pyarrow", f"prepare-data reading '{path}'")
    try:
        if path.suffix == ".parquet":
            pq = require("pyarrow.parquet", f"prepare-data reading '{path}'")
            table = pq.ParquetFile(path)
            columns = table.schema_arrow.names
            batches = table.iter_batches(batch_size=1024, columns=[text_key]) if text_key in columns else None
        else:
            reader = pa.ipc.open_stream(pa.memory_map(str(path)))
            columns = reader.schema.names
            batches = reader if text_key in columns else None
    except pa.ArrowException as e:
        raise DataError(f"Input '{path}' cannot be read as {path.suffix[1:]} ({e}).") from None
    if batches is None:
        raise DataError(
            f"Input '{path}' has no column {text_key!r} (columns: {', '.join(columns)}). Name the "
            "column holding the text with --text-key."
        )
    texts = (text for batch in batches for text in batch.column(text_key).to_pylist())
    for row, text in enumerate(texts, start=1):
        if text is not None and not isinstance(text, str):
            raise DataError(
                f"{path}, row {row}: column {text_key!r} holds {type(text).__name__}, not text. "
                "Name the text column with --text-key."
            )
        if text:
            yield f"{name}:{row}", text


def _token_documents(path: Path, name: str, eos_id: int) -> Iterator[Document]:
    """An already-tokenized 1-D .npy file as documents ending at each `eos_id` (the EOS itself
    not included: the writer appends it back); tokens after the last EOS make a last document.
    Named file:index (from 1)."""
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise DataError(f"Input '{path}' is not a .npy token file ({e}).") from None
    if ids.ndim != 1 or ids.dtype not in (np.uint16, np.uint32):
        raise DataError(
            f"Input '{path}' holds {ids.dtype} ids of shape {tuple(ids.shape)}: prepare-data reads 1-D "
            "uint16 or uint32 token files (documents separated by the EOS id). Convert it, e.g. "
            "np.save(path, ids.astype(np.uint32).ravel())."
        )
    ends = np.flatnonzero(ids == eos_id)
    start = 0
    for k, end in enumerate(ends, start=1):
        yield f"{name}:{k}", ids[start:end]
        start = int(end) + 1
    if start < ids.shape[0]:
        yield f"{name}:{len(ends) + 1}", ids[start:]


def _external_tokenizer(tokenizer: str | os.PathLike, eos_token: str | None, eos_id: int | None):
    """(the --tokenizer file's tokenizer, the id that ends documents: --eos-id, else the id of
    --eos-token (default <|endoftext|>))."""
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    if not path.is_file():
        inside = f" (its {path / 'tokenizer.json'}?)" if (path / "tokenizer.json").is_file() else ""
        raise DataError(f"--tokenizer '{path}' is {file_kind(path)}. Give a tokenizer.json file{inside}.")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a plain Exception
        raise DataError(
            f"--tokenizer '{path}' is not a Hugging Face tokenizers file ({e}). Give the "
            "tokenizer.json of a `tokenizers` tokenizer, or leave --tokenizer out to train one."
        ) from None
    vocab = tok.get_vocab_size()
    if eos_id is not None:
        if not 0 <= eos_id < vocab:
            raise ConfigError(f"--eos-id={eos_id} is not an id of '{tokenizer}' (its vocabulary: 0..{vocab - 1}).")
        return tok, eos_id
    eos_token = eos_token or EOS_TOKEN
    found = tok.token_to_id(eos_token)
    if found is None:
        raise DataError(
            f"Tokenizer '{tokenizer}' has no token {eos_token!r} to end documents with. Name its "
            "end-of-document token with --eos-token NAME (for example --eos-token '</s>'), or its id with --eos-id."
        )
    return tok, found


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except MoetrainError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
