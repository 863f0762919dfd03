"""Reading token files: the format, and the DataError for every way a user can break it."""

import json

import numpy as np
import pytest

from moetrain.data.tokens import (
    check_vocab,
    dtype_for_vocab,
    load_tokenizer,
    open_source,
    write_token_dir,
)
from moetrain.errors import DataError


def _make_dir(tmp_path, train_N=None, val_N=None, vocab_size=1000):
    train_N = np.arange(100) % vocab_size if train_N is None else train_N
    val_N = np.arange(20) % vocab_size if val_N is None else val_N
    splits = {"train": train_N, "val": val_N}
    write_token_dir(tmp_path / "d", splits, vocab_size=vocab_size, eos_id=0)
    return tmp_path / "d"


def test_open_dir_and_bin_path_read_the_same_tokens(tmp_path):
    d = _make_dir(tmp_path, train_N=np.arange(7, 107))
    by_dir, by_bin = open_source(d), open_source(d / "train.bin")
    np.testing.assert_array_equal(by_dir.tokens_N, np.arange(7, 107))
    np.testing.assert_array_equal(by_bin.tokens_N, by_dir.tokens_N)
    assert by_bin.split == "train" and open_source(d / "val.bin").split == "val"
    assert by_dir.vocab_size == 1000 and by_dir.eos_id == 0 and by_dir.tokens_N.dtype == np.uint16
    np.testing.assert_array_equal(open_source(d, "val").tokens_N, np.arange(20))


def test_dtype_follows_vocab_size():
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32


def test_windows_are_non_overlapping_with_one_token_of_lookahead(tmp_path):
    tf = open_source(_make_dir(tmp_path, train_N=np.arange(25)))
    assert tf.num_windows(8) == 3  # 25 tokens: windows [0,9) [8,17) [16,25)
    np.testing.assert_array_equal(tf.window(2, 8), np.arange(16, 25))


def test_missing_directory_names_it_and_the_fix(tmp_path):
    with pytest.raises(DataError, match="prepare-data") as e:
        open_source(tmp_path / "nope")
    assert "nope" in str(e.value) and "make data" in str(e.value)


def test_directory_without_meta_is_incomplete(tmp_path):
    d = _make_dir(tmp_path)
    (d / "meta.json").unlink()
    with pytest.raises(DataError, match="meta.json"):
        open_source(d)


def test_invalid_meta_json(tmp_path):
    d = _make_dir(tmp_path)
    (d / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        open_source(d)
    (d / "meta.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DataError, match="format"):
        open_source(d)


def test_missing_split_lists_the_existing_ones(tmp_path):
    with pytest.raises(DataError, match="no split 'test'.*train, val"):
        open_source(_make_dir(tmp_path), "test")


def test_truncated_file(tmp_path):
    d = _make_dir(tmp_path)
    data = (d / "train.bin").read_bytes()
    (d / "train.bin").write_bytes(data[:-1])  # not a whole number of uint16
    with pytest.raises(DataError, match="truncated") as e:
        open_source(d)
    assert "train.bin" in str(e.value)
    (d / "train.bin").write_bytes(data[:-20])  # whole tokens, but fewer than meta.json says
    with pytest.raises(DataError, match="truncated"):
        open_source(d)


def test_empty_file(tmp_path):
    d = _make_dir(tmp_path, val_N=np.array([], dtype=np.int64))
    with pytest.raises(DataError, match="empty") as e:
        open_source(d, "val")
    assert "val.bin" in str(e.value)


def test_missing_bin_file(tmp_path):
    d = _make_dir(tmp_path)
    (d / "train.bin").unlink()
    with pytest.raises(DataError, match="missing"):
        open_source(d)


def test_too_few_tokens_for_one_sequence(tmp_path):
    d = _make_dir(tmp_path, train_N=np.arange(10))
    open_source(d, seq_len=9)  # exactly seq_len + 1 tokens is enough
    with pytest.raises(DataError, match=r"data\.seq_len \+ 1 = 11"):
        open_source(d, seq_len=10)


def test_bin_path_not_in_meta(tmp_path):
    d = _make_dir(tmp_path)
    (d / "other.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError, match="other.bin"):
        open_source(d / "other.bin")


def test_check_vocab_names_both_sizes_and_the_key(tmp_path):
    tf = open_source(_make_dir(tmp_path, vocab_size=5000))
    check_vocab(tf, 5000)
    with pytest.raises(DataError, match="model.vocab_size") as e:
        check_vocab(tf, 4096)
    assert "5000" in str(e.value) and "4096" in str(e.value)


def test_load_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models

    d = _make_dir(tmp_path)
    with pytest.raises(DataError, match="tokenizer.json"):
        load_tokenizer(d)
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.save(str(d / "tokenizer.json"))
    assert load_tokenizer(d).get_vocab_size() == 2
