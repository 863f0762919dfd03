"""The training loader: determinism, mixture weights, exact resume, data-parallel slicing."""

import json

import numpy as np
import pytest
import torch

from moetrain.data.config import DataConfig
from moetrain.data.loader import TokenLoader, val_batches
from moetrain.data.tokens import write_token_dir
from moetrain.errors import ConfigError, DataError

T = 8
VOCAB = 100_000  # ids are positions, so a source's windows are identified by their first id


def _source(tmp_path, name, offset, num_windows, val_windows=0):
    """A prepared dir whose token i is `offset + i`: the first id of a window tells which
    source (offset) and which window it is."""
    n = num_windows * T + 1
    splits = {"train": offset + np.arange(n)}
    if val_windows:
        splits["val"] = 50_000 + np.arange(val_windows * T + 1)
    write_token_dir(tmp_path / name, splits, vocab_size=VOCAB, eos_id=0)
    return str(tmp_path / name)


def _loader(sources, weights=None, *, m=4, seed=0, **kw):
    cfg = DataConfig(sources=sources, weights=weights, seq_len=T)
    return TokenLoader(cfg, micro_batch_size=m, seed=seed, **kw)


def _take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_batch_shapes_and_shifted_targets(tmp_path):
    x_BT, y_BT = _loader([_source(tmp_path, "a", 0, 50)]).next_batch()
    assert x_BT.shape == y_BT.shape == (4, T) and x_BT.dtype == y_BT.dtype == torch.int64
    assert torch.equal(x_BT[:, 1:], y_BT[:, :-1])
    assert torch.all(x_BT[:, 0] % T == 0)  # windows start at multiples of seq_len


def test_same_seed_same_batches_other_seed_other_batches(tmp_path):
    src = [_source(tmp_path, "a", 0, 50), _source(tmp_path, "b", 1000, 50)]
    _assert_same(_take(_loader(src, seed=3), 5), _take(_loader(src, seed=3), 5))
    a, b = _take(_loader(src, seed=3), 5), _take(_loader(src, seed=4), 5)
    assert not all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b))


def test_each_epoch_visits_every_window_once(tmp_path):
    loader = _loader([_source(tmp_path, "a", 0, 12)], m=4)
    starts = [int(x[r, 0]) // T for x, _ in _take(loader, 6) for r in range(4)]
    assert sorted(starts[:12]) == list(range(12)) and sorted(starts[12:]) == list(range(12))
    assert starts[:12] != starts[12:]  # a fresh permutation each epoch


def test_mixture_weights(tmp_path):
    src = [_source(tmp_path, "a", 0, 100), _source(tmp_path, "b", 10_000, 100)]
    loader = _loader(src, weights=[3.0, 1.0], m=100)
    firsts = torch.cat([x[:, 0] for x, _ in _take(loader, 40)])  # 4000 samples
    frac_a = (firsts < 10_000).float().mean().item()
    assert abs(frac_a - 0.75) < 0.03


def test_default_weights_are_proportional_to_size(tmp_path):
    src = [_source(tmp_path, "a", 0, 300), _source(tmp_path, "b", 10_000, 100)]
    firsts = torch.cat([x[:, 0] for x, _ in _take(_loader(src, m=100), 40)])
    assert abs((firsts < 10_000).float().mean().item() - 0.75) < 0.03


def test_exact_resume(tmp_path):
    src = [_source(tmp_path, "a", 0, 20), _source(tmp_path, "b", 1000, 7)]
    uninterrupted = _take(_loader(src, [1.0, 2.0], m=6), 12)  # crosses several epochs
    first = _loader(src, [1.0, 2.0], m=6)
    _take(first, 7)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = _loader(src, [1.0, 2.0], m=6)
    resumed.load_state_dict(state)
    _assert_same(_take(resumed, 5), uninterrupted[7:])


def test_resume_on_different_data_is_an_error(tmp_path):
    src = [_source(tmp_path, "a", 0, 20)]
    state = _loader(src, seed=0).state_dict()
    with pytest.raises(DataError, match="seed"):
        _loader(src, seed=1).load_state_dict(state)
    other = [_source(tmp_path, "c", 5, 20)]  # same size, different tokens
    with pytest.raises(DataError, match="sources"):
        _loader(other, seed=0).load_state_dict(state)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_ranks_slice_the_same_global_batch(tmp_path, dp_size):
    src = [_source(tmp_path, "a", 0, 9), _source(tmp_path, "b", 1000, 30)]
    single = _take(_loader(src, m=8), 10)
    ranks = [_take(_loader(src, m=8, dp_rank=r, dp_size=dp_size), 10) for r in range(dp_size)]
    for step in range(10):
        assert ranks[0][step][0].shape[0] == 8 // dp_size
        x = torch.cat([ranks[r][step][0] for r in range(dp_size)])
        y = torch.cat([ranks[r][step][1] for r in range(dp_size)])
        assert torch.equal(x, single[step][0]) and torch.equal(y, single[step][1])


def test_micro_batch_must_split_over_dp(tmp_path):
    with pytest.raises(ConfigError, match="multiple of 4"):
        _loader([_source(tmp_path, "a", 0, 9)], m=6, dp_size=4)


def test_out_of_vocab_id_names_file_and_numbers(tmp_path):
    # meta.json claims a 100-token vocabulary but the file holds id 150: a corrupt or mixed-up
    # directory that check_vocab (which trusts meta.json) cannot catch.
    write_token_dir(tmp_path / "bad", {"train": np.full(T * 4 + 1, 150)}, vocab_size=100, eos_id=0)
    loader = _loader([str(tmp_path / "bad")], vocab_size=100)
    with pytest.raises(DataError, match="token id 150 ≥ model.vocab_size 100") as e:
        loader.next_batch()
    assert "train.bin" in str(e.value) and "prepare-data" in str(e.value)


def test_vocab_bigger_than_model_fails_at_construction(tmp_path):
    with pytest.raises(DataError, match="model.vocab_size"):
        _loader([_source(tmp_path, "a", 0, 9)], vocab_size=1000)


def test_sources_from_different_tokenizers_are_refused(tmp_path):
    a, b = _source(tmp_path, "a", 0, 9), _source(tmp_path, "b", 1000, 9)
    for d, content in ((a, "{}"), (b, "{}")):
        (tmp_path / d / "tokenizer.json").write_text(content)
    for d in (a, b):  # point meta.json at the tokenizer files
        write_token_dir(d, {"train": np.arange(9 * T + 1)}, vocab_size=VOCAB, eos_id=0, tokenizer="tokenizer.json")
    assert _loader([a, b]).eos_id == 0  # the same tokenizer: fine
    (tmp_path / b / "tokenizer.json").write_text('{"another": 1}')
    with pytest.raises(DataError, match="tokenized differently") as e:
        _loader([a, b])
    assert "--tokenizer" in str(e.value)


def test_missing_source_directory(tmp_path):
    with pytest.raises(DataError, match="prepare-data"):
        _loader([str(tmp_path / "missing")])


def _windows(batches):
    """The val windows a rank's batches count (window index from the first token), and the
    row count of each batch."""
    batches = list(batches)
    counted = [int(x[r, 0]) // T - 50_000 // T for x, _, rows in batches for r in range(rows)]
    return counted, [x.shape[0] for x, _, _ in batches]


def test_val_batches_are_sequential_and_dp_independent(tmp_path):
    src = _source(tmp_path, "a", 0, 5, val_windows=10)
    batches = list(val_batches(src, seq_len=T, num_sequences=8, micro_batch_size=4))
    assert _windows(batches) == (list(range(8)), [4, 4])
    halves = [
        list(val_batches(src, seq_len=T, num_sequences=8, micro_batch_size=4, dp_rank=r, dp_size=2)) for r in range(2)
    ]
    for b in range(2):
        assert torch.equal(torch.cat([halves[0][b][0], halves[1][b][0]]), batches[b][0])


@pytest.mark.parametrize("num, m, dp", [(7, 4, 2), (9, 4, 4), (3, 8, 4), (10, 6, 2), (5, 2, 1)])
def test_val_batches_count_the_same_sequences_in_equal_shapes_on_every_rank(tmp_path, num, m, dp):
    """Whatever the micro-batch and dp: windows 0 … num-1, each counted once; in each batch all
    ranks have the same rows (an expert-parallel exchange needs it), stand-ins counting 0."""
    src = _source(tmp_path, "a", 0, 5, val_windows=10)
    ranks = [
        _windows(val_batches(src, seq_len=T, num_sequences=num, micro_batch_size=m, dp_rank=r, dp_size=dp))
        for r in range(dp)
    ]
    assert sorted(w for counted, _ in ranks for w in counted) == list(range(num))
    assert all(shapes == ranks[0][1] for _, shapes in ranks)


def test_val_batches_use_what_there_is(tmp_path):
    src = _source(tmp_path, "a", 0, 5, val_windows=10)
    assert _windows(val_batches(src, seq_len=T, num_sequences=99, micro_batch_size=4)) == (list(range(10)), [4, 4, 2])
    small = _source(tmp_path, "b", 0, 5, val_windows=3)  # fewer windows than one batch: no repeats
    assert _windows(val_batches(small, seq_len=T, num_sequences=5, micro_batch_size=4)) == ([0, 1, 2], [3])


def test_val_path(tmp_path):
    with_val = _source(tmp_path, "a", 0, 5, val_windows=2)
    without = _source(tmp_path, "b", 0, 5)
    assert DataConfig(sources=[with_val]).val_path() == with_val
    assert DataConfig(sources=[without]).val_path() is None
    assert DataConfig(sources=[without], val=with_val).val_path() == with_val


def test_synthetic_tokens_are_layout_free_and_resume_exactly():
    from moetrain.data.loader import SyntheticLoader

    def loader(dp_rank=0, dp_size=1, seed=3):
        return SyntheticLoader(
            seq_len=16, micro_batch_size=4, seed=seed, vocab_size=100, dp_rank=dp_rank, dp_size=dp_size
        )

    whole = loader()
    first, second = whole.next_batch(), whole.next_batch()
    assert first[0].shape == (4, 16) and first[0].dtype == torch.int64
    assert torch.equal(first[0][:, 1:], first[1][:, :-1])  # targets are the inputs shifted by one
    assert int(first[0].max()) < 100 and not torch.equal(first[0], second[0])
    # Two dp ranks get the halves of the same global micro-batches.
    halves = [loader(r, 2).next_batch()[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), first[0])
    # Resume from a state; another seed's state is refused with a message.
    resumed = loader()
    resumed.load_state_dict({**loader().state_dict(), "sample_index": 4})
    assert torch.equal(resumed.next_batch()[0], second[0])
    with pytest.raises(DataError, match=r"drawn with train.seed=3, not 4: resume it with --train.seed=3"):
        loader(seed=4).load_state_dict(whole.state_dict())
    with pytest.raises(DataError, match=r"that of a run on token data, not of a data.synthetic=true run"):
        loader().load_state_dict({"format": "moetrain-loader-v1"})
    assert not torch.equal(loader(seed=4).next_batch()[0], first[0])


def test_a_synthetic_runs_position_is_named_when_resumed_on_token_data(tmp_path):
    from moetrain.data.loader import SyntheticLoader

    state = SyntheticLoader(seq_len=T, micro_batch_size=4, seed=0, vocab_size=100).state_dict()
    with pytest.raises(DataError, match=r"a data.synthetic=true run: resume it with --data.synthetic=true"):
        _loader([_source(tmp_path, "a", 0, 20)]).load_state_dict(state)


def test_synthetic_data_refuses_document_masking():
    with pytest.raises(ConfigError, match="document_masking"):
        DataConfig(synthetic=True, document_masking=True).validate()


@pytest.mark.parametrize("field, value", [("seq_len", 0), ("weights", [-1.0])])
def test_a_loader_built_outside_a_run_config_checks_the_fields_domains(tmp_path, field, value):
    cfg = DataConfig(sources=[str(_source(tmp_path, "a", 0, 9))], **{field: value})
    with pytest.raises(ConfigError, match=f"data.{field}="):
        TokenLoader(cfg, micro_batch_size=2, seed=0)
