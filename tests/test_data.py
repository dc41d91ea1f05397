"""Data: a real tokenizer, a token file made once, a seeded order, dp ranks read disjoint rows."""

import sysconfig
from pathlib import Path

import pytest
import torch

from minipar.batches import TokenData
from minipar.data import DataError, default_corpus, find_files, prepare, read_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "shlex.py", "fnmatch.py"):
        (corpus / name).write_text((STDLIB / name).read_text())
    return prepare(str(corpus), vocab_size=400, cache_dir=tmp / "cache")


def test_default_corpus_exists_without_network():
    files = default_corpus()
    assert len(files) > 100 and sum(f.stat().st_size for f in files) > 2_000_000


def test_tokenizer_is_trained_bpe_that_round_trips_text(folder):
    tok = read_tokenizer(folder / "tokenizer.json")
    assert tok.get_vocab_size() == 400
    text = "def wrap(text, width=70):\n    return TextWrapper(width=width).wrap(text)\n"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < 0.6 * len(text.encode())  # 143 merges learned: fewer tokens than bytes


def test_prepared_once_then_cached(folder):
    stamp = (folder / "tokens.bin").stat().st_mtime_ns
    again = prepare(str(folder.parent.parent / "corpus"), vocab_size=400, cache_dir=folder.parent)
    assert again == folder and (folder / "tokens.bin").stat().st_mtime_ns == stamp


def test_targets_are_inputs_shifted_by_one(folder):
    data = TokenData(folder, seq_len=16, seed=0)
    x, y = data.fetch([0, 5])
    assert x.shape == y.shape == (2, 16)
    assert (x[:, 1:] == y[:, :-1]).all()
    assert (x[1] == x.new_tensor(data.tokens[5 * 16 : 6 * 16].astype("int64"))).all()


def test_order_is_seeded_and_dp_ranks_read_disjoint_rows_of_one_global_batch(folder):
    data = TokenData(folder, seq_len=16, seed=3)
    assert TokenData(folder, seq_len=16, seed=3).window_ids(0, 32) == data.window_ids(0, 32)
    assert TokenData(folder, seq_len=16, seed=4).window_ids(0, 32) != data.window_ids(0, 32)
    full_x, _ = data.fetch(data.window_ids(8, 8))  # the global batch after 8 consumed windows
    parts = [data.rank_batch(8, 8, r, 4)[0] for r in range(4)]
    assert all(p.shape == (2, 16) for p in parts)
    assert (full_x == torch.cat(parts)).all()


def test_epochs_wrap_with_a_fresh_permutation(folder):
    data = TokenData(folder, seq_len=16, seed=0)
    n = data.num_windows
    first, second = data.window_ids(0, n), data.window_ids(n, n)
    assert sorted(first) == sorted(second) == list(range(n))  # every window once per epoch
    assert first != second


def test_missing_data_and_too_little_text_are_clear_errors(tmp_path, folder):
    with pytest.raises(DataError, match="no such file or directory"):
        find_files(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        find_files(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="fewer than one window"):
        TokenData(folder, seq_len=10**7, seed=0)


def test_a_file_that_is_not_text_is_refused_by_name_and_offset_not_skipped(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("plain text " * 100)
    (corpus / "blob.dat").write_bytes(b"ab" + bytes([0xFF, 0xFE, 0x00, 0x81]) * 50)
    with pytest.raises(DataError, match=r"blob.dat is not UTF-8 text \(byte 2 is 0xff\)"):
        prepare(str(corpus), vocab_size=300, cache_dir=tmp_path / "cache")
