"""scripts/train.py with your own data: a Hugging Face tokenizer.json, nanoGPT-style .bin token
files, held-out documents with their validation loss, and a resume that keeps the run's token
ids when the data cache is gone."""

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from test_bad_inputs import tokenizer_json
from test_train import common, run

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def records(path: Path) -> tuple[dict, dict]:
    """({step: training loss}, {step: validation loss}) of a --log-json file."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return ({r["step"]: r["loss"] for r in rows if "loss" in r}, {r["step"]: r["val_loss"] for r in rows
                                                                   if "val_loss" in r})


@pytest.fixture(scope="module")
def tokenized_run(tmp_path_factory):
    """10 steps with a given tokenizer.json, 30% of the documents held out, saved at step 5."""
    tmp = tmp_path_factory.mktemp("own_data")
    (tmp / "corpus").mkdir()
    for name in ("argparse.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "colorsys.py"):
        shutil.copy(STDLIB / name, tmp / "corpus" / name)
    tokenizer_json(tmp / "tok.json", 300)
    argv = common(tmp, data=tmp / "corpus", tokenizer=tmp / "tok.json", val_fraction=0.3, eval_every=5, steps=10,
                  save_every=5, out=tmp / "a", log_json=tmp / "a.jsonl")
    return tmp, argv, run(argv)


def test_a_run_with_a_tokenizer_json_and_val_fraction_logs_the_validation_loss(tokenized_run):
    tmp, _, proc = tokenized_run
    assert "vocab 512 (the tokenizer's 300)," in proc.stdout  # the model keeps --vocab-size's 512
    assert "validation: 2 documents held out" in proc.stdout
    assert [line.split("|")[1].strip() for line in proc.stdout.splitlines() if "val loss" in line] == [
        f"val loss {v:.4f}" for v in records(tmp / "a.jsonl")[1].values()]
    train, val = records(tmp / "a.jsonl")
    assert sorted(train) == list(range(1, 11)) and sorted(val) == [5, 10]
    assert val[10] < val[5]  # it learns
    assert (tmp / "a" / "step_000005" / "tokenizer.json").exists()


def test_a_resume_encodes_with_the_checkpoints_tokenizer_when_the_cache_is_gone(tokenized_run):
    tmp, argv, _ = tokenized_run
    shutil.rmtree(tmp / "cache")  # without the checkpoint's tokenizer, a 512-id BPE would be trained
    resumed = [a for a in argv if not a.startswith(("--tokenizer", "--out", "--log-json"))]
    run(resumed + [f"--resume={tmp / 'a' / 'step_000005'}", f"--out={tmp / 'b'}", f"--log-json={tmp / 'b.jsonl'}"])
    (a_train, a_val), (b_train, b_val) = records(tmp / "a.jsonl"), records(tmp / "b.jsonl")
    assert sorted(b_train) == list(range(6, 11))
    for step in b_train:
        assert b_train[step] == pytest.approx(a_train[step], rel=1e-12)
    assert b_val[10] == pytest.approx(a_val[10], rel=1e-12)


@pytest.mark.integration
def test_a_bin_token_file_drives_a_training_run(tmp_path):
    from tokenizers import Tokenizer

    tokenizer_json(tmp_path / "tok.json", 400)
    ids = Tokenizer.from_file(str(tmp_path / "tok.json")).encode((STDLIB / "argparse.py").read_text()).ids
    np.asarray(ids, dtype=np.uint16).tofile(tmp_path / "train.bin")  # nanoGPT's format: the ids, nothing else
    proc = run(common(tmp_path, data=tmp_path / "train.bin", steps=20, out=tmp_path / "out",
                      log_json=tmp_path / "log.jsonl"))
    assert f"(the tokenizer's {max(ids) + 1})," in proc.stdout
    assert f"{(len(ids) - 1) // 32} windows of 32 tokens" in proc.stdout
    train, _ = records(tmp_path / "log.jsonl")
    assert sum(train[s] for s in range(16, 21)) < sum(train[s] for s in range(1, 6)) - 2.5  # 0.5 lower on average


def test_a_bin_file_of_the_texts_ids_trains_and_validates_exactly_like_the_text(tokenized_run):
    from tokenizers import Tokenizer

    tmp, argv, _ = tokenized_run
    tok = Tokenizer.from_file(str(tmp / "tok.json"))
    ids = [i for f in sorted((tmp / "corpus").iterdir()) for i in (*tok.encode(f.read_text()).ids, 0)]  # 0: EOT
    np.asarray(ids, dtype=np.uint16).tofile(tmp / "corpus.bin")
    swapped = [a for a in argv if not a.startswith(("--data", "--out", "--log-json"))]
    run(swapped + [f"--data={tmp / 'corpus.bin'}", f"--out={tmp / 'bin'}", f"--log-json={tmp / 'bin.jsonl'}"])
    assert records(tmp / "bin.jsonl") == records(tmp / "a.jsonl")  # documents end at the tokenizer's EOT id
