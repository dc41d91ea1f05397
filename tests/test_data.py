"""Data: a real tokenizer, a token file made once, a seeded order, dp ranks read disjoint rows."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from minipar.run import data
from minipar.run.batches import TokenData, documents, held_out
from minipar.run.data import EOT, DataError, default_corpus, find_files, prepare, read_tokenizer, text_pieces

ROOT = Path(__file__).resolve().parents[1]

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


# ----------------------------------------------------------------------------------------------
# Streaming, other tokenizers, token files, held-out documents
# ----------------------------------------------------------------------------------------------


def small_tokenizer(tmp_path, vocab=300, eot=True) -> Path:
    """A Hugging Face tokenizer.json made here (no download): a byte-level BPE on a few files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT] if eot else [], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([(STDLIB / n).read_text() for n in ("glob.py", "bisect.py")], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_a_file_in_pieces_encodes_to_the_ids_of_the_whole_file(tmp_path):
    tok = read_tokenizer(small_tokenizer(tmp_path))
    for name in ("argparse.py", "textwrap.py", "typing.py"):
        whole = tok.encode((STDLIB / name).read_text(), add_special_tokens=False).ids
        pieces = list(text_pieces(STDLIB / name, size=2000))
        assert len(pieces) > 5
        assert [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids] == whole, name


def test_a_given_tokenizer_encodes_the_corpus_file_by_file_and_gains_an_endoftext_if_it_has_none(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("shlex.py", "fnmatch.py"):
        (corpus / name).write_text((STDLIB / name).read_text())
    for eot in (True, False):
        path = small_tokenizer(tmp_path, eot=eot)
        folder = prepare(str(corpus), vocab_size=4096, cache_dir=tmp_path / f"cache{eot}", tokenizer=str(path))
        tok = read_tokenizer(folder / "tokenizer.json")
        assert tok.get_vocab_size() == 300 + (not eot) and tok.token_to_id(EOT) == (0 if eot else 300)
        expected = [i for f in sorted(corpus.iterdir()) for i in (*tok.encode(f.read_text()).ids, tok.token_to_id(EOT))]
        assert TokenData(folder, seq_len=16, seed=0).tokens.tolist() == expected


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_files_are_read_in_place_their_vocabulary_the_largest_id_plus_one(tmp_path, dtype):
    ids = [np.arange(1000) % 700, np.r_[np.arange(499) * 2, 1233]]  # largest id 1233
    for k, part in enumerate(ids):
        part.astype(dtype).tofile(tmp_path / f"part{k}.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    folder = prepare(str(tmp_path), vocab_size=4096, cache_dir=tmp_path / ".cache", token_dtype=dtype)
    assert not (folder / "tokens.bin").exists()  # not copied
    data = TokenData(folder, seq_len=10, seed=0)
    assert data.vocab_size == 1234 and data.num_windows == 99 + 49  # windows never cross from file to file
    x, y = data.fetch([99])  # the second file's first window
    assert x[0].tolist() == ids[1][:10].tolist() and y[0].tolist() == ids[1][1:11].tolist()


def test_token_ids_outside_the_tokenizers_vocabulary_are_refused_by_file(tmp_path):
    (np.arange(400) % 320).astype("uint16").tofile(tmp_path / "train.bin")
    with pytest.raises(DataError, match=r"train.bin holds token id 319, outside --tokenizer .*'s 300 ids"):
        prepare(str(tmp_path / "train.bin"), 4096, tmp_path / "cache", str(small_tokenizer(tmp_path)))


def test_held_out_documents_are_whole_drawn_by_the_seed_and_no_window_straddles(folder):
    docs = documents([TokenData(folder, 16, 0).tokens], eot=0)
    assert len(docs) == 3  # the three files, each ended by <|endoftext|> (id 0)
    picks = set()
    for seed in range(6):
        data = TokenData(folder, seq_len=16, seed=seed, val_fraction=0.34)
        held = set(np.flatnonzero(held_out(3, 0.34, seed)).tolist())
        assert len(held) == 1 == data.val_docs
        picks |= held
        for table, kind in ((data.windows, False), (data.val_windows, True)):
            for _, start in table:  # every token of a window lies in documents of its own kind
                first, last = (np.searchsorted(docs[:, 2], t, side="right") for t in (start, start + 16))
                assert all((d in held) == kind for d in range(first, last + 1))
        assert data.num_windows + len(data.val_windows) <= TokenData(folder, 16, seed).num_windows
    assert len(picks) > 1  # the seed chooses


def test_a_single_document_has_nothing_to_hold_out(tmp_path):
    (tmp_path / "one.txt").write_text((STDLIB / "shlex.py").read_text())
    folder = prepare(str(tmp_path / "one.txt"), vocab_size=300, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="the data is one document"):
        TokenData(folder, seq_len=16, seed=0, val_fraction=0.1)


def test_tokenising_a_few_megabytes_stays_within_a_bounded_memory(tmp_path):
    # Before streaming, this corpus (4.5 MB, one file) peaked at 1.46 GiB; now memory follows the
    # size of a piece, not of the corpus (docs/benchmarks.md measures 54 MB).
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f.read_text() for f in default_corpus()))
    # The child's own peak, VmHWM: ru_maxrss would count earlier children, and across exec Linux
    # carries the forking parent's resident size into the child's.
    child = ("import re, sys; from minipar.run.data import prepare; prepare(sys.argv[1], 300, sys.argv[2]); "
             "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    out = subprocess.run([sys.executable, "-c", child, str(text), str(tmp_path / "cache")], check=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True).stdout
    assert int(out.split()[-1]) < 350 * 2**10  # KiB


def test_a_cache_made_before_token_files_and_validation_is_read_alike(folder, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    meta = json.loads((old / "meta.json").read_text())
    for key in ("eot", "parts", "fingerprint"):  # what the cache's meta.json did not say before
        del meta[key]
    (old / "meta.json").write_text(json.dumps(meta))
    then, now = TokenData(old, 16, 1, val_fraction=0.34), TokenData(folder, 16, 1, val_fraction=0.34)
    assert np.array_equal(then.windows, now.windows) and np.array_equal(then.val_windows, now.val_windows)
    assert then.fingerprint == old.name  # a trained BPE's cache is named by the data's fingerprint


def test_a_token_file_rewritten_with_the_same_size_and_time_is_read_again(tmp_path):
    ids = tmp_path / "ids.bin"
    ids.write_bytes((np.arange(1000) % 100).astype("uint16").tobytes())
    stamp = ids.stat().st_mtime_ns
    first = json.loads((prepare(str(ids), 512, tmp_path / "cache") / "meta.json").read_text())
    ids.write_bytes((np.arange(1000) % 300).astype("uint16").tobytes())  # same size: new ids
    os.utime(ids, ns=(stamp, stamp))  # and the same time: only the contents tell
    again = json.loads((prepare(str(ids), 512, tmp_path / "cache") / "meta.json").read_text())
    assert (first["vocab_size"], again["vocab_size"]) == (100, 300)


def test_a_full_cache_disk_is_one_line_and_leaves_no_temporary_folder(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("some text to tokenise " * 200)

    def full(*args):
        yield np.arange(3)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(data, "encode_files", full)
    with pytest.raises(DataError, match=r"--cache-dir .*: cannot write the tokenised data \(No space left on device\)"):
        prepare(str(tmp_path / "a.txt"), 300, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_tokenizer_without_an_unknown_token_is_refused_before_tokenising(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"some": 0, "text": 1, EOT: 2}))  # no unknown token
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("some text some other text")
    with pytest.raises(DataError, match="tok.json cannot encode every text .*: its model has no unknown token"):
        prepare(str(tmp_path / "a.txt"), 300, tmp_path / "cache", tokenizer=str(tmp_path / "tok.json"))
    assert list((tmp_path / "cache").glob("*")) == []  # no .tmp-* left (nor the folder made)
