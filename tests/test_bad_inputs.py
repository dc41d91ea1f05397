"""Bad input costs one line, before any process group: a table of command lines, each refused by
cli.main with exit 2 and exactly one `minipar: error: ...` line naming what is wrong, and a table
of edge cases that are fine and pass the same checks.

Everything runs in this process. `cli.launch` (run/launch.py's), which would start the process group, is replaced
by one that raises `Started`: a bad row that slipped through the checks fails its test instead."""

import json
import math
import os
import shutil
import sysconfig
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from minipar.mesh import Groups
from minipar.model import Llama, get_config
from minipar.ops import cli, run_folder
from minipar.ops.command_line import parse_args
from minipar.run import checkpoint, launch
from minipar.run.data import data_key

CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"  # ~100 KB of UTF-8 text
STEP = "step_000004"


def base(t: Path) -> list[str]:
    """A command line that passes every check: tests/test_train.py's tiny run, one rank."""
    return [f"--data={CORPUS}", "--model=tiny", "--vocab-size=512", f"--cache-dir={t}/cache", "--seq-len=32",
            "--global-batch=8", "--micro-batch=4", "--lr=0.01", "--warmup=4", "--steps=20", f"--out={t}/out",
            "--no-wandb"]


def saved_copy(t: Path, name: str, state, digest: bool = True) -> str:
    """The checkpoint at t/run, copied with another train_state.json (its files' checksums kept;
    digest: the state's own checksum made anew, as a run that saved it would have, else kept)."""
    folder = t / name / STEP
    shutil.copytree(t / "run" / STEP, folder)
    sums = json.loads((folder / "train_state.json").read_text())["sha256"]
    new = state(dict(sums))
    if digest and "sha256" in new:
        new["sha256"]["train_state"] = checkpoint.state_digest({k: v for k, v in new.items() if k != "sha256"})
    (folder / "train_state.json").write_text(json.dumps(new))
    return str(folder)


def saved_tensors(t: Path, name: str, weights: dict, optimizer: dict, state: dict) -> None:
    """A checkpoint at t/name/step_000004 with these tensors and valid checksums."""
    checkpoint.save(t / name, 4, weights, optimizer, [], state)


def damaged_checkpoints(t: Path, cfg, weights: dict) -> None:
    """Checkpoints that verify (their checksums match) but hold what no run of this model saved."""
    model_config = asdict(get_config("tiny", vocab_size=512))
    state = {"step": 4, "consumed": 32, "config": asdict(cfg), "data_key": data_key(cfg.data, cfg.vocab_size),
             "model_config": model_config}
    saved_tensors(t, "nan_weight", {**weights, "norm.weight": torch.full_like(weights["norm.weight"], math.nan)},
                  {}, state)
    saved_tensors(t, "wrong_shape", {**weights, "norm.weight": weights["norm.weight"][:-1]}, {}, state)
    saved_tensors(t, "extra_tensor", {**weights, "stray.weight": torch.zeros(2)}, {}, state)
    adamw = {f"{n}/{slot}": torch.zeros_like(w) for n, w in weights.items() for slot in ("exp_avg", "exp_avg_sq")}
    adamw |= {f"{n}/step": torch.tensor(4.0) for n in weights}
    saved_tensors(t, "adamw", weights, adamw, state)  # whole: the rows below each change one thing
    for name, changed in (
            ("no_adam_key", {"layers.0.attn.wq.weight/exp_avg_sq": None}),
            ("no_exp_avg", {"layers.0.attn.wq.weight/exp_avg": None}),
            ("adam_shape", {"norm.weight/exp_avg": torch.zeros(31, dtype=weights["norm.weight"].dtype)}),
            ("adam_nan", {"norm.weight/exp_avg_sq": torch.full_like(weights["norm.weight"], math.nan)}),
            ("adam_step_shape", {"norm.weight/step": torch.tensor([4.0, 4.0])}),
            ("adam_unknown", {"norm.weight/momentum": torch.zeros_like(weights["norm.weight"])}),
            ("adam_partial", {f"norm.weight/{slot}": None for slot in ("exp_avg", "exp_avg_sq", "step")}),
            ("adam_steps_differ", {"norm.weight/step": torch.tensor(3.0)})):
        edited = {k: v for k, v in (adamw | changed).items() if v is not None}
        saved_tensors(t, name, weights, edited, state)
    saved_tensors(t, "new_knob", weights, {}, {**state, "model_config": {**model_config, "new_knob": 1}})
    saved_tensors(t, "no_model", weights, {}, {**state, "model_config": {**model_config, "dim": 0}})
    saved_tensors(t, "imported", weights, {}, {**state, "config": {**asdict(cfg), "model": "imported"}})


@pytest.fixture(scope="module")
def t(tmp_path_factory):
    """Data files good and bad, plain files and folders in the way, and a checkpoint at step 4 with
    copies that differ in one setting each."""
    t = tmp_path_factory.mktemp("inputs")
    text = CORPUS.read_bytes()
    (t / "empty.txt").write_bytes(b"")
    (t / "one_byte.txt").write_bytes(b"x")
    (t / "binary.dat").write_bytes(bytes(range(256)) * 4)  # bytes 0-127 are ASCII; 128 (0x80) is not UTF-8
    (t / "bad_middle.txt").write_bytes(text[:5000] + b"\xff" + text[5000:])
    (t / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text)
    for name, files in (("mixed", {"a.txt": text, "b.dat": b"\x89PNG\r\n\x1a\n\x00\xff"}),
                        ("clean", {"a.txt": text, "pkg/__init__.py": b"", "pkg/b.py": text[:2000]})):
        for rel, data in files.items():
            (t / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (t / name / rel).write_bytes(data)
    (t / "no_files").mkdir()
    (t / "odd.bin").write_bytes(b"abc")  # 3 bytes: no whole number of uint16 ids
    (t / "ids.bin").write_bytes((np.arange(3001) % 310).astype("uint16").tobytes())  # ids 0-309
    (t / "few.bin").write_bytes(np.arange(32, dtype="uint16").tobytes())
    (t / "kinds").mkdir()
    (t / "kinds" / "a.txt").write_bytes(text)
    (t / "kinds" / "b.bin").write_bytes(b"\x00\x01")
    (t / "broken_link").mkdir()
    (t / "broken_link" / "a.txt").write_bytes(text)
    (t / "broken_link" / "gone.txt").symlink_to(t / "nowhere.txt")
    tokenizer_json(t / "tok.json", 300)
    tokenizer_json(t / "tok2.json", 320)
    (t / "tok_indented.json").write_text(json.dumps(json.loads((t / "tok.json").read_text()), indent=4))
    (t / "a_folder").mkdir()
    (t / "a_file").write_text("not a folder")
    (t / "read_only").mkdir(mode=0o500)
    (t / "traced" / "traces" / "steps_2-3").mkdir(parents=True)  # an --out whose steps 2-3 were profiled
    for name in ("traces_file", "traces_link", "traces_fifo"):  # an --out whose traces is no folder
        (t / name).mkdir()
    (t / "traces_file" / "traces").write_text("a file of the user's")
    (t / "traces_link" / "traces").symlink_to(t / "nowhere")
    os.mkfifo(t / "traces_fifo" / "traces")
    for name, text in (("unknown_key", "dpp = 2"), ("wrong_type", 'steps = "ten"'), ("bool_for_int", "dp = true"),
                       ("bad_choice", 'model = "huge"'), ("table", "[layout]\ndp = 2"), ("not_toml", "steps = "),
                       ("nested", 'config = "other.toml"'), ("bad_range", "min-lr-ratio = 2"),
                       ("good", "lr = 1\nsp = false")):
        (t / f"{name}.toml").write_text(text + "\n")
    cfg = parse_args(base(t))
    weights, optimizer, hyper = checkpoint.gather_full(Llama(get_config("tiny", vocab_size=512)), {}, [],
                                                       Groups())
    key = data_key(cfg.data, cfg.vocab_size)  # names the corpus's files, sizes and times
    checkpoint.save(t / "run", 4, weights, optimizer, hyper, {"step": 4, "consumed": 32, "config": asdict(cfg),
                                                              "data_key": key})

    def changed(**settings):
        return lambda sums: {"step": 4, "consumed": 32, "config": {**asdict(cfg), **settings}, "sha256": sums}
    saved_copy(t, "other_model", changed(model="small"))
    saved_copy(t, "other_vocab", changed(vocab_size=1024))
    saved_copy(t, "other_files", lambda sums: {"step": 4, "consumed": 32, "config": asdict(cfg), "sha256": sums,
                                               "data_key": "a corpus whose files have changed"})
    saved_copy(t, "empty_state", lambda sums: {})
    checkpoint.save(t / "tok_run", 4, weights, optimizer, hyper, {"step": 4, "consumed": 32, "config": asdict(cfg),
                                                                  "data_key": key}, tokenizer=t / "tok.json")
    saved_copy(t, "no_step", lambda sums: {"sha256": sums})
    good = dict(step=4, consumed=32, config=asdict(cfg), data_key=key)
    saved_copy(t, "hand_edited", lambda sums: {**good, "step": -5, "sha256": sums}, digest=False)
    saved_copy(t, "step_minus_5", lambda sums: {**good, "step": -5, "sha256": sums})
    saved_copy(t, "step_6", lambda sums: {**good, "step": 6, "sha256": sums})
    saved_copy(t, "consumed_float", lambda sums: {**good, "consumed": 1e12, "sha256": sums})
    damaged_checkpoints(t, cfg, weights)
    shutil.copytree(t / "run" / STEP, t / "not_json" / STEP)
    (t / "not_json" / STEP / "train_state.json").write_text("{not JSON")
    os.mkfifo(t / "fifo")  # reading it would block until someone writes
    (t / "loop").symlink_to(t / "loop")  # resolves to itself
    (t / "me").mkdir()
    (t / "me" / "a.txt").write_bytes(CORPUS.read_bytes())
    (t / "me" / "me").symlink_to(t / "me")  # a folder holding a link to itself: me/me/me/...
    word_level_tokenizer(t / "no_unk.json")
    return t


def word_level_tokenizer(path: Path) -> None:
    """A tokenizer.json whose model has no unknown token: it fails on the first word it lacks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["def", "class", "return", "<|endoftext|>"])}))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def tokenizer_json(path: Path, vocab: int) -> None:
    """A Hugging Face tokenizer.json made here, with no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS.read_text()], trainer)
    tok.save(str(path))


def main(t, extra, world, monkeypatch):
    """cli.main(base + extra) as rank 0 of `world` ranks; returns its exit code."""
    monkeypatch.chdir(t)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)

    def run(cfg, resume, interrupt, extras=()):
        raise Started
    monkeypatch.setattr(cli, "launch_watched", run)
    return cli.main(base(t) + [a.format(t=t) for a in extra])


class Started(Exception):
    """The checks passed: the run would start its process group now."""


RUN = f"--resume={{t}}/run/{STEP}"
BAD = [  # (extra flags, after the good ones; world size; a fragment of the one line)
    # data that is not there, or not text
    (["--data={t}/missing.txt"], 1, "no such file or directory"),
    (["--data="], 1, "--data is empty"),
    (["--data={t}/no_files"], 1, "the folder holds no files"),
    (["--data={t}/empty.txt"], 1, "holds 0 bytes of text, fewer than one window of --seq-len 32"),
    (["--data={t}/one_byte.txt"], 1, "holds 1 bytes of text, fewer than one window"),
    (["--data={t}/binary.dat"], 1, "binary.dat is not UTF-8 text (byte 128 is 0x80)"),
    (["--data={t}/bad_middle.txt"], 1, "bad_middle.txt is not UTF-8 text (byte 5000 is 0xff)"),
    (["--data={t}/mixed"], 1, "b.dat is not UTF-8 text (byte 0 is 0x89)"),
    (["--data={t}/broken_link"], 1, "gone.txt is not a file (a broken link?)"),
    # token files and tokenizers
    (["--data={t}/odd.bin"], 1, "odd.bin is 3 bytes, not a whole number of uint16 ids: check --token-dtype"),
    (["--data={t}/ids.bin", "--token-dtype=uint32"], 1, "ids.bin is 6002 bytes, not a whole number of uint32 ids"),
    (["--data={t}/ids.bin", "--tokenizer={t}/tok.json"], 1, "ids.bin holds token id 309, outside --tokenizer"),
    (["--data={t}/kinds"], 1, "mixes .bin token files with text files"),
    (["--data={t}/few.bin"], 1, "holds 32 token ids, fewer than one window of --seq-len 32 + 1"),
    (["--tokenizer={t}/tok.json", "--vocab-size=290"], 1, "tok.json has 300 tokens, more than the model's "
     "vocabulary of 290: pass --vocab-size 300 or more"),
    (["--data={t}/ids.bin", "--vocab-size=300"], 1, "ids.bin holds token ids up to 309, more than the model's "
     "vocabulary of 300: pass --vocab-size 310 or more"),
    (["--tokenizer={t}/tok.json", "--bpe-vocab=300"], 1, "with --tokenizer leave it out"),
    (["--token-dtype=int8"], 1, "argument --token-dtype: invalid choice: 'int8'"),
    (["--tokenizer="], 1, "--tokenizer is empty"),
    (["--tokenizer={t}/missing.json"], 1, "missing.json: cannot load it as a Hugging Face tokenizer.json"),
    (["--tokenizer={t}/a_file"], 1, "a_file: cannot load it as a Hugging Face tokenizer.json"),
    # validation
    (["--val-fraction=1"], 1, "--val-fraction 1.0: give a fraction of the documents, from 0 to below 1"),
    (["--val-fraction=-0.1"], 1, "--val-fraction -0.1:"),
    (["--val-fraction=nan"], 1, "--val-fraction nan:"),
    (["--eval-every=5"], 1, "--eval-every 5: give 0 (at the end) or more steps, with --val-fraction above 0"),
    (["--val-fraction=0.1", "--eval-every=-1"], 1, "--eval-every -1:"),
    (["--eval-batches=0"], 1, "--eval-batches 0: give 1 or more"),
    # numbers out of range
    (["--seq-len=10000000"], 1, "--seq-len 10000000: give 1 to --model tiny's max_seq_len, 128"),
    (["--seq-len=129"], 1, "--seq-len 129: give 1 to --model tiny's max_seq_len, 128"),
    (["--seq-len=0"], 1, "--seq-len 0:"),
    (["--lr=-1"], 1, "--lr -1.0: give a learning rate above 0"),
    (["--lr=0"], 1, "--lr 0.0: give a learning rate above 0"),
    (["--lr=nan"], 1, "--lr nan: give a learning rate above 0"),
    (["--lr=inf"], 1, "--lr inf: give a learning rate above 0"),
    (["--min-lr-ratio=-0.1"], 1, "--min-lr-ratio -0.1: give a fraction of --lr from 0 to 1"),
    (["--min-lr-ratio=1.5"], 1, "--min-lr-ratio 1.5:"),
    (["--grad-clip=-1"], 1, "--grad-clip -1.0: give 0 (off) or more"),
    (["--grad-clip=nan"], 1, "--grad-clip nan:"),
    (["--warmup=-1"], 1, "--warmup -1: give 0 or more steps"),
    (["--weight-decay=-0.1"], 1, "--weight-decay -0.1:"),
    (["--bucket-mb=0"], 1, "--bucket-mb 0.0: give a size above 0"),
    (["--save-every=-1"], 1, "--save-every -1:"),
    (["--log-every=0"], 1, "--log-every 0: give 1 or more steps"),
    (["--vocab-size=100"], 1, "--vocab-size 100 cannot hold a byte-level BPE (the 256 bytes and <|endoftext|>)"),
    (["--bpe-vocab=256"], 1, "--bpe-vocab 256: give 257"),
    (["--bpe-vocab=1024"], 1, "--bpe-vocab 1024 does not fit in the model's vocabulary of 512: pass a smaller"),
    # model shapes the preset cannot take
    (["--n-layers=0"], 1, "--n-layers 0: give 1 to 1024"),
    (["--dim=30"], 1, "model dim 30 is not divisible by n_heads 4 (--model tiny)"),
    (["--n-kv-heads=3"], 1, "n_heads 4 is not divisible by n_kv_heads 3"),
    (["--dim=36", "--n-kv-heads=4"], 1, "head_dim 9 must be even"),
    (["--ffn-dim=66", "--tp=4"], 4, "--model tiny"),
    (["--max-seq-len=16"], 1, "--seq-len 32: give 1 to --model tiny's max_seq_len, 16"),
    # a --config file that is not a run's settings
    (["--config={t}/missing.toml"], 1, "missing.toml: cannot read it (No such file or directory)"),
    (["--config="], 1, "--config is empty"),
    (["--config={t}/not_toml.toml"], 1, "not_toml.toml is not TOML"),
    (["--config={t}/unknown_key.toml"], 1, "unknown_key.toml: unknown key 'dpp'"),
    (["--config={t}/nested.toml"], 1, "unknown key 'config'"),
    (["--config={t}/wrong_type.toml"], 1, 'wrong_type.toml: steps = "ten" should be an integer'),
    (["--config={t}/bool_for_int.toml"], 1, "bool_for_int.toml: dp = true should be an integer"),
    (["--config={t}/bad_choice.toml"], 1, 'bad_choice.toml: model = "huge" is not one of tiny, small'),
    (["--config={t}/table.toml"], 1, "unknown key 'layout'"),
    (["--config={t}/bad_range.toml"], 1, "--min-lr-ratio 2.0: give a fraction of --lr from 0 to 1"),
    (["--aux-loss-coef=-1"], 1, "--aux-loss-coef -1.0:"),
    (["--capacity-factor=nan"], 1, "--capacity-factor nan:"),
    (["--timeout=0"], 1, "--timeout 0.0: give the seconds an operation may wait"),
    (["--seed=-1"], 1, "--seed -1: give 0 to 2**32 - 1"),
    (["--steps=0"], 1, "--steps 0: give 1 or more"),
    (["--max-bad-steps=0"], 1, "--max-bad-steps 0:"),
    (["--virtual-stages=2"], 1, "--virtual-stages 2: give 1, or more with --pp > 1"),
    (["--pp=2", "--micro-batch=2", "--pp-layers=2,1"], 2, "--pp-layers 2,1: give 2 counts of 1 or more, one per "
     "pipeline stage (--pp x chunks per rank), adding up to the model's 2 layers"),
    (["--pp=2", "--micro-batch=2", "--pp-layers=one,1"], 2, "--pp-layers one,1: give whole numbers separated by "
     "commas"),
    (["--pp=2", "--virtual-stages=0", "--micro-batch=2"], 2, "--virtual-stages 0:"),
    # flags argparse cannot read
    (["--dtype=bad"], 1, "argument --dtype: invalid choice: 'bad'"),
    (["--steps=ten"], 1, "argument --steps: invalid int value: 'ten'"),
    (["--no-such-flag"], 1, "unrecognized arguments: --no-such-flag"),
    # layouts that cannot run
    (["--dp=2"], 1, "= 2 ranks, but the world has 1: launch with torchrun --nproc-per-node 2"),
    (["--tp=3"], 3, "does not divide the model's 4 attention heads"),
    (["--global-batch=6"], 1, "--global-batch 6 is not divisible by --dp 1 x --micro-batch 4"),
    (["--cp=2", "--seq-len=30"], 2, "not divisible by 2 x --cp = 4"),
    (["--cp=2", "--tp=2", "--cp-attention=ulysses"], 4, "2 query heads and 1 kv heads must both divide by --cp 2"),
    (["--cp-attention=ulysse"], 1, "argument --cp-attention: invalid choice: 'ulysse'"),
    (["--pp=4", "--micro-batch=2"], 4, "pipeline stages"),
    (["--zero=4"], 1, "--zero 4: choose 0, 1, 2 or 3"),
    (["--offload"], 1, "--offload needs --zero 1 or 2"),
    (["--zeropp=qwz"], 1, "--zeropp qwz needs --zero 3"),
    (["--recompute", "--recompute-mlp"], 1, "--recompute, --recompute-selective, --recompute-mlp: each chooses what "
     "backward redoes; give one"),
    (["--zero=3", "--pp=2", "--micro-batch=2"], 2, "--zero 3 with --pp: every micro-batch would gather each layer"),
    (["--tie-embeddings", "--pp=2", "--micro-batch=2"], 2, "tied embeddings with --pp above 1: the embedding and the "
     "LM head share one weight, which pipeline stages would split; use --pp 1 or --no-tie-embeddings (--model tiny)"),
    (["--cp=2", "--tp=4", "--sp", "--seq-len=36"], 8, "--sp: each rank's 18 tokens (--seq-len 36 / --cp 2) do not "
     "split over --tp 4: choose a --seq-len divisible by 8"),
    (["--zero=3", "--zeropp=qwz,fast"], 1, "--zeropp qwz,fast: choose any of qwz, hpz, qgz"),
    (["--zero=3", "--dp=2", "--micro-batch=2", "--zeropp=hpz,qgz"], 2, "--zeropp hpz,qgz splits the dp ranks by node, "
     "and this run has one node"),
    (["--model=tiny-moe", "--dp=2", "--micro-batch=4", "--ep=4"], 2, "--ep 4"),
    # every count has a bound that says why (a config file's steps = 1e20 ran until killed)
    (["--steps=100000000000000000000"], 1, ": give 1 or more, at most 2**38 (steps x --global-batch"),
    (["--save-every=100000000000000000000"], 1, ": give 0 or more steps, at most 2**38"),
    (["--log-every=100000000000000000000"], 1, ": give 1 or more steps, at most 2**38"),
    # a flag that would change nothing here is refused, as --sp without --tp is
    (["--cp-attention=ulysses"], 1, "--cp-attention ulysses acts only with --cp 2 or more, which this run has not"),
    (["--schedule=zbv"], 1, "--schedule zbv acts only with --pp 2 or more"),
    (["--aux-loss-coef=0.05"], 1, "--aux-loss-coef 0.05 acts only with a model with experts"),
    (["--capacity-factor=1.25"], 1, "--capacity-factor 1.25 acts only with a model with experts"),
    (["--zero=3", "--zeropp=qwz"], 1, "--zeropp qwz acts only with --dp 2 or more"),
    (["--pp-layers=1,1"], 1, "--pp-layers 1,1 acts only with --pp 2 or more"),
    (["--tp-overlap"], 1, "--tp-overlap acts only with --tp 2 or more"),
    (["--allow-config-change"], 1, "--allow-config-change acts only with --resume, which this run has not"),
    (["--token-dtype=uint32"], 1, "--token-dtype uint32 acts only with .bin token files as --data"),
    (["--eval-batches=2"], 1, "--eval-batches 2 acts only with --val-fraction above 0"),
    (["--data={t}/ids.bin", "--bpe-vocab=300"], 1, "--bpe-vocab 300 acts only with a BPE trained on text --data"),
    # --profile-steps: steps this run takes, traced into a folder of its own
    (["--profile-steps=2:30"], 1, "--profile-steps 2:30: give steps A <= B from 1 to --steps 20 (a step outside"),
    ([RUN, "--profile-steps=3:5"], 1, "--profile-steps 3:5: this run resumes after step 4: give steps it runs, "
     "from 5"),
    (["--out={t}/traced", "--profile-steps=2:3"], 1, "{t}/traced/traces/steps_2-3 exists (an earlier run's traces) "
     "and nothing is written over it"),
    # a traces that is no folder: found after the last profiled step, it ended the run there, unsaved
    (["--out={t}/traces_file", "--profile-steps=2:3"], 1, "--profile-steps 2:3: {t}/traces_file/traces is not a "
     "folder, and the traces go into it"),
    (["--out={t}/traces_link", "--profile-steps=2:3"], 1, "{t}/traces_link/traces is not a folder"),
    (["--out={t}/traces_fifo", "--profile-steps=2:3"], 1, "{t}/traces_fifo/traces is not a folder"),
    # places the run cannot write
    (["--out="], 1, "--out is empty"),
    (["--out={t}/a_file"], 1, "a_file is a file: give a folder"),
    (["--out={t}/a_file/run"], 1, "cannot write in"),
    (["--out=/proc/minipar"], 1, "--out /proc/minipar: cannot write in /proc"),
    (["--log-json={t}/a_folder"], 1, "a_folder is a folder: give a file"),
    (["--log-json={t}/missing/log.jsonl"], 1, "cannot write in"),
    (["--cache-dir={t}/a_file"], 1, "--cache-dir"),
    (["--cache-dir="], 1, "--cache-dir is empty"),
    (["--out={t}/run"], 1, "already holds checkpoints"),
    # checkpoints that do not belong to this run
    (["--resume={t}/missing"], 1, "no such folder"),
    (["--resume="], 1, "--resume is empty"),
    ([f"--resume={{t}}/other_model/{STEP}"], 1, "--model tiny differs from the checkpoint's small"),
    ([f"--resume={{t}}/other_model/{STEP}", "--allow-config-change"], 1, "pass --model small to continue it"),
    ([f"--resume={{t}}/other_vocab/{STEP}"], 1, "--vocab-size 512 differs from the checkpoint's 1024"),
    ([RUN, "--dim=64"], 1, "--dim 64 differs from the checkpoint's 32 ("),
    ([RUN, "--dim=64", "--allow-config-change"], 1, "pass --dim 32 to continue it"),
    ([RUN, "--bpe-vocab=300"], 1, "--bpe-vocab 300 differs from the checkpoint's 512"),
    ([f"--resume={{t}}/empty_state/{STEP}"], 1, "is corrupt"),
    # a file given as --resume (a log, the checkpoint's own train_state.json), or a train_state.json that is no JSON
    (["--resume={t}/a_file"], 1, "--resume {t}/a_file is not a folder: give a folder"),
    ([f"--resume={{t}}/run/{STEP}/train_state.json"], 1, f"--resume {{t}}/run/{STEP}/train_state.json is not a folder"),
    ([f"--resume={{t}}/not_json/{STEP}"], 1, "is corrupt (train_state.json: JSONDecodeError("),
    (["--resume={t}/not_json"], 1, "--resume {t}/not_json: no step_* checkpoint in it verifies (newest: checkpoint"),
    ([f"--resume={{t}}/no_step/{STEP}"], 1, "is corrupt: its train_state.json has no step"),
    ([RUN, "--steps=4"], 1, "nothing to do: the checkpoint"),
    ([RUN, "--global-batch=16"], 1, "--global-batch 16 differs from the checkpoint's 8"),
    ([RUN, "--seed=1"], 1, "--seed 1 differs from the checkpoint's 0"),
    ([RUN, "--seq-len=16"], 1, "--seq-len 16 differs from the checkpoint's 32"),
    ([RUN, "--lr=0.02"], 1, "--lr 0.02 differs from the checkpoint's 0.01"),
    ([RUN, "--warmup=8"], 1, "--warmup 8 differs"),
    ([RUN, "--data={t}/clean"], 1, "or --allow-config-change to accept the change"),
    ([f"--resume={{t}}/other_files/{STEP}"], 1, "sizes or times changed (or the run moved machines"),
    ([f"--resume={{t}}/tok_run/{STEP}", "--tokenizer={t}/tok2.json"], 1, "tok2.json is not the tokenizer of"),
    ([f"--resume={{t}}/tok_run/{STEP}", "--tokenizer={t}/tok2.json", "--allow-config-change"], 1,
     "(its 320 ids do not fit the weights' 300)"),
    ([RUN, "--val-fraction=0.2"], 1, "--val-fraction 0.2 differs from the checkpoint's 0.0"),
    ([RUN, "--precision=bf16-mixed"], 1, "precision bf16-mixed differs from the checkpoint's fp32 ("),
    ([RUN, "--dtype=float64"], 1, "precision float64 differs from the checkpoint's fp32 ("),
    # checkpoints that verify but cannot be trusted: refused before any process group (issue 23)
    ([f"--resume={{t}}/hand_edited/{STEP}"], 1, "train_state.json does not match its checksum (edited by hand?)"),
    ([f"--resume={{t}}/step_minus_5/{STEP}"], 1, "has no step, or one that is not a whole number >= 0"),
    ([f"--resume={{t}}/step_6/{STEP}"], 1, "has step 6 in the folder of step 4"),
    ([f"--resume={{t}}/consumed_float/{STEP}"], 1, "a windows-consumed count that is not a whole number >= 4"),
    ([f"--resume={{t}}/nan_weight/{STEP}"], 1, "norm.weight in model.safetensors is not finite"),
    ([f"--resume={{t}}/wrong_shape/{STEP}"], 1, "norm.weight in model.safetensors has shape (31,), its model (32,)"),
    ([f"--resume={{t}}/extra_tensor/{STEP}"], 1, "does not hold its model's parameters (has unknown ['stray.weight'])"),
    ([f"--resume={{t}}/no_adam_key/{STEP}"], 1, "optimizer.safetensors lacks layers.0.attn.wq.weight/exp_avg_sq"),
    ([f"--resume={{t}}/no_exp_avg/{STEP}"], 1, "optimizer.safetensors lacks layers.0.attn.wq.weight/exp_avg (it "
     "has ['exp_avg_sq', 'step'])"),
    ([f"--resume={{t}}/adam_shape/{STEP}"], 1, "norm.weight/exp_avg in optimizer.safetensors has shape (31,), its "
     "model (32,)"),
    ([f"--resume={{t}}/adam_nan/{STEP}"], 1, "norm.weight/exp_avg_sq in optimizer.safetensors is not finite"),
    ([f"--resume={{t}}/adam_step_shape/{STEP}"], 1, "norm.weight/step in optimizer.safetensors has shape (2,), its "
     "model ()"),
    ([f"--resume={{t}}/adam_unknown/{STEP}"], 1, "optimizer.safetensors holds 'norm.weight/momentum', no AdamW state"),
    # a ZeRO bucket flattens several parameters' state: one without any was a KeyError mid-load
    ([f"--resume={{t}}/adam_partial/{STEP}", "--dp=2", "--micro-batch=2", "--zero=1"], 2,
     "optimizer.safetensors holds AdamW state for 20 of the 21 parameters, none for norm.weight (a run saves it"),
    ([f"--resume={{t}}/adam_partial/{STEP}"], 1, "holds AdamW state for 20 of the 21 parameters"),
    ([f"--resume={{t}}/adam_steps_differ/{STEP}", "--dp=2", "--micro-batch=2", "--zero=1"], 2,
     "AdamW step counts differ (norm.weight at 3, layers.0.attn.wk.weight at 4), and a ZeRO bucket keeps one count"),
    ([f"--resume={{t}}/new_knob/{STEP}"], 1, "its model_config has settings this minipar does not know (['new_knob'])"),
    ([f"--resume={{t}}/no_model/{STEP}"], 1, "its model_config is no model (dim 0 is not a size of 1 or more)"),
    ([f"--init-from={{t}}/nan_weight/{STEP}"], 1, "norm.weight in model.safetensors is not finite"),
    ([f"--resume={{t}}/imported/{STEP}"], 1, f"holds imported weights (--model imported), not a run to continue: "
     f"start from them with --init-from {{t}}/imported/{STEP}"),
    # numbers that used to end in a traceback or a hang
    (["--ep=0"], 1, "--ep 0: give 1 or more"),
    (["--model=tiny-moe", "--ep=0"], 1, "--ep 0: give 1 or more"),
    (["--dp=0"], 1, "--dp 0: give 1 or more"),
    (["--timeout=1e15"], 1, "--timeout 1000000000000000.0: give the seconds an operation may wait, 1 to 1e+07"),
    (["--timeout=1e-6"], 1, "--timeout 1e-06: give the seconds"),
    (["--global-batch=4611686018427387904"], 1, "--global-batch 4611686018427387904: give 1 to 16777216 sequences"),
    (["--dim=1073741824"], 1, "--dim 1073741824: give 1 to 1048576"),
    (["--n-layers=100000"], 1, "--n-layers 100000: give 1 to 1024"),
    (["--config={t}/fifo"], 1, "--config {t}/fifo is not a regular file: give a TOML file"),
    (["--tokenizer={t}/fifo"], 1, "--tokenizer {t}/fifo is not a regular file"),
    (["--data={t}/loop"], 1, "--data {t}/loop is a symlink loop"),  # not "no such file or directory"
    (["--data={t}/me"], 1, "--data: {t}/me/me links back to {t}/me, a folder it is in"),  # not me/me/.../me
    (["--config={t}/loop"], 1, "--config {t}/loop is a symlink loop"),
    (["--tokenizer={t}/no_unk.json"], 1, "no_unk.json cannot encode every text (WordLevel error: Missing [UNK] token"),
]


@pytest.mark.parametrize("extra,world,fragment", BAD, ids=[" ".join(row[0]) for row in BAD])
def test_bad_input_is_one_line_exit_2_and_no_process_group(t, extra, world, fragment, monkeypatch, capsys):
    assert main(t, extra, world, monkeypatch) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("minipar: error: "), err
    assert fragment.format(t=t) in lines[0], lines[0]
    assert not dist.is_initialized()


def test_a_preset_vocabulary_too_small_for_a_bpe_is_one_line(t, monkeypatch, capsys):
    monkeypatch.setattr(cli, "launch_watched", lambda *started: pytest.fail("the checks passed"))
    assert cli.main([a for a in base(t) if not a.startswith("--vocab-size")]) == 2  # tiny's vocabulary: 256
    assert capsys.readouterr().err == ("minipar: error: --model tiny's vocabulary 256 cannot hold a byte-level BPE "
                                       "(the 256 bytes and <|endoftext|>): pass --vocab-size 257 or more\n")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_cache_dir_that_cannot_be_written_is_one_line(t, monkeypatch, capsys):
    assert main(t, ["--cache-dir={t}/read_only/cache"], 1, monkeypatch) == 2
    assert "cannot write in" in capsys.readouterr().err


def test_an_error_of_another_rank_alone_is_printed_by_it_with_its_rank(t, monkeypatch, capsys):
    # Under torchrun, rank 0 speaks first; a rank whose error is its own (its node's data is
    # missing) speaks after a pause, naming itself, while rank 0 waits in init_process_group.
    pauses = []
    monkeypatch.setattr(cli.time, "sleep", pauses.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli, "launch_watched", lambda *started: pytest.fail("the checks passed"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(t)
    assert cli.main(base(t) + ["--dp=2", f"--data={t}/missing.txt"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("minipar: error: rank 1: --data "), lines
    assert pauses == [2.0] and not dist.is_initialized()


def test_an_error_every_rank_finds_is_left_to_rank_0(t, monkeypatch, capsys):
    # Rank 1 exiting at once would get rank 0 stopped by torchrun before its line is out (CI saw
    # it): rank 1 says nothing and waits for torchrun to end it.
    pauses = []
    monkeypatch.setattr(cli.time, "sleep", pauses.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(t)
    assert cli.main(base(t) + ["--dp=4"]) == 2
    assert capsys.readouterr().err == "" and pauses == [30.0]


GOOD = [  # edge cases that are fine
    (["--lr=1e-9"], 1),
    (["--min-lr-ratio=0"], 1),
    (["--min-lr-ratio=1"], 1),
    (["--grad-clip=0", "--warmup=0", "--save-every=0", "--weight-decay=0"], 1),
    (["--seq-len=128"], 1),  # the model's max_seq_len
    (["--vocab-size=257", "--log-every=1", "--seed=4294967295"], 1),
    (["--dim=64", "--n-layers=3", "--n-heads=8", "--n-kv-heads=4", "--ffn-dim=96", "--max-seq-len=64"], 1),
    (["--vocab-size=100000", "--bpe-vocab=300"], 1),  # a BPE smaller than the model's vocabulary
    (["--config={t}/good.toml"], 1),
    (["--config={t}/bad_range.toml", "--min-lr-ratio=0.5"], 1),  # the command line overrides the file
    (["--model=tiny-moe", "--aux-loss-coef=0", "--capacity-factor=0"], 1),
    (["--cp-attention=ring", "--schedule=1f1b", "--aux-loss-coef=0.01"], 1),  # the defaults named: the effective config
    (["--data={t}/clean"], 1),  # a folder of text files, one of them empty
    (["--data={t}/bom.txt"], 1),  # UTF-8 with a byte-order mark
    (["--out={t}/a_folder", "--log-json={t}/a_folder/log.jsonl"], 1),  # an empty folder that exists
    (["--out={t}/new/deeper/out"], 1),
    (["--model=small", "--pp=2", "--virtual-stages=2", "--schedule=interleaved", "--micro-batch=1"], 2),
    ([RUN, "--out={t}/resumed_a"], 1),
    ([RUN, "--out={t}/resumed_b", "--steps=100"], 1),  # more steps: the usual way to continue
    ([RUN, "--out={t}/resumed_c", "--lr=0.02", "--warmup=8", "--allow-config-change"], 1),
    ([RUN, "--out={t}/resumed_d", "--dp=2", "--micro-batch=2", "--zero=1"], 2),  # another layout
    ([RUN, "--out={t}/resumed_e", "--tp=2", "--pp=2", "--micro-batch=2"], 4),
    ([RUN, "--out={t}/resumed_h", "--dim=32", "--max-seq-len=256"], 1),  # the same shape; a longer RoPE reach
    (["--resume={t}/run", "--out={t}/resumed_f"], 1),  # an --out folder: its newest checkpoint
    ([f"--resume={{t}}/other_files/{STEP}", "--out={t}/resumed_g", "--allow-config-change"], 1),
    (["--data={t}/ids.bin"], 1),  # token ids, uint16: the vocabulary is the largest id + 1
    (["--data={t}/ids.bin", "--bpe-vocab=512", "--token-dtype=uint16"], 1),  # the defaults named: an effective config
    (["--eval-batches=4", "--no-allow-config-change"], 1),  # the same, with text
    (["--resume=auto", "--out={t}/auto_fresh", "--allow-config-change"], 1),  # auto: a restart may resume
    (["--data={t}/ids.bin", "--tokenizer={t}/tok2.json"], 1),  # ids below the tokenizer's 320
    (["--tokenizer={t}/tok.json", "--val-fraction=0.1", "--eval-every=5", "--eval-batches=2"], 1),
    ([f"--resume={{t}}/tok_run/{STEP}", "--tokenizer={t}/tok.json", "--out={t}/resumed_h"], 1),  # the same one
    ([f"--resume={{t}}/tok_run/{STEP}", "--out={t}/resumed_i"], 1),  # the checkpoint's tokenizer
    ([f"--resume={{t}}/tok_run/{STEP}", "--tokenizer={t}/tok_indented.json", "--out={t}/resumed_j"], 1),
    ([f"--resume={{t}}/adamw/{STEP}", "--out={t}/resumed_k", "--dp=2", "--micro-batch=2", "--zero=1"], 2),
    ([f"--resume={{t}}/adamw/{STEP}", "--out={t}/resumed_l", "--dp=2", "--micro-batch=2", "--zero=3"], 2),
    ([f"--resume={{t}}/adam_steps_differ/{STEP}", "--out={t}/resumed_m"], 1),  # no bucket: each keeps its own count
    ([RUN, "--out={t}/resumed_n", "--precision=fp32"], 1),  # the checkpoint's precision, named
    ([RUN, "--out={t}/resumed_o", "--precision=bf16-mixed", "--allow-config-change"], 1),  # said on stdout
]


@pytest.mark.parametrize("extra,world", GOOD, ids=[" ".join(row[0]) for row in GOOD])
def test_edge_cases_that_are_fine_pass_every_check(t, extra, world, monkeypatch, capsys):
    with pytest.raises(Started):
        main(t, extra, world, monkeypatch)
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
@pytest.mark.parametrize("name", ["a.txt", "ids.bin"])
def test_a_file_that_cannot_be_read_is_named(t, name, tmp_path, monkeypatch, capsys):
    (tmp_path / name).write_bytes(b"\x00\x01" * 100)
    (tmp_path / name).chmod(0)
    assert main(t, [f"--data={tmp_path / name}"], 1, monkeypatch) == 2
    assert f"cannot read {tmp_path / name} (Permission denied)" in capsys.readouterr().err


def two_checkpoints_newest_corrupt(t: Path, name: str) -> Path:
    """--out with step_000004 (the fixture's) and a step_000008 with one byte of its weights flipped."""
    out = t / name
    shutil.copytree(t / "run" / STEP, out / STEP)
    state = json.loads((out / STEP / "train_state.json").read_text())
    weights = load_file(out / STEP / "model.safetensors")
    checkpoint.save(out, 8, weights, {}, [], {k: v for k, v in state.items() if k != "sha256"} | {"step": 8,
                                                                                                     "consumed": 64})
    data = bytearray((out / "step_000008" / "model.safetensors").read_bytes())
    data[-7] ^= 0x01  # inside the tensor data: only the checksum can tell
    (out / "step_000008" / "model.safetensors").write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("resume", ["auto", "the folder"])
def test_a_corrupt_newest_checkpoint_is_set_aside_by_name_and_the_run_resumes_from_the_one_before(
        t, resume, monkeypatch, capsys):
    out = two_checkpoints_newest_corrupt(t, f"corrupt_newest_{resume.split()[-1]}")
    started = []
    monkeypatch.setattr(cli, "launch_watched", lambda cfg, path, interrupt, extras=(): started.append(path) or 0)
    monkeypatch.chdir(t)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = [a for a in base(t) if not a.startswith("--out")] + [f"--out={out}", "--resume=" + (
        "auto" if resume == "auto" else str(out))]
    assert cli.main(argv) == 0
    assert started == [out / STEP]  # resumed from step_000004
    said = capsys.readouterr().out.splitlines()
    note = [line for line in said if "step_000008" in line]
    assert note == [f"minipar: checkpoint {out / 'step_000008'} is corrupt: model.safetensors does not match its "
                    f"checksum: moved it aside to step_000008.corrupt, resuming from an earlier one"], said
    assert sorted(p.name for p in out.iterdir()) == ["run_id", STEP, "step_000008.corrupt"]  # kept, out of the way
    assert (out / "step_000008.corrupt" / "model.safetensors").exists()


def test_a_run_that_saved_over_a_set_aside_step_sets_the_next_one_aside_by_another_name(t):
    out = two_checkpoints_newest_corrupt(t, "set_aside_twice")
    first = run_folder.set_aside(out / "step_000008")
    shutil.copytree(first, out / "step_000008")
    assert run_folder.set_aside(out / "step_000008").name == "step_000008.corrupt-2" and first.exists()
    assert [p.name for p in checkpoint.checkpoints(out)] == [STEP]


def test_train_state_is_covered_by_the_checkpoints_checksum(t):
    state = json.loads((t / "run" / STEP / "train_state.json").read_text())
    assert state["sha256"]["train_state"] == checkpoint.state_digest({k: v for k, v in state.items() if k != "sha256"})
    assert checkpoint.verify(t / "run" / STEP)["step"] == 4


@pytest.mark.parametrize("shared", ["static", "c10d"])
def test_restarts_with_a_rendezvous_store_kept_across_attempts_are_refused(t, shared, monkeypatch, capsys):
    # What torchrun tells its workers: static (--master-port) keeps its store even when told not
    # to share it; c10d keeps it unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    if shared == "static":
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    else:
        monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert main(t, [], 1, monkeypatch) == 2
    line = capsys.readouterr().err.splitlines()
    assert len(line) == 1 and "minipar: error: torchrun --max-restarts 3 with " in line[0], line
    assert ("static rendezvous (--master-port)" if shared == "static" else
            "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") in line[0]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # c10d, opted out: what restarts need
    with pytest.raises(Started):
        main(t, [], 1, monkeypatch)


def test_a_rank_that_never_starts_is_named_within_the_timeout(t):
    # A world of 2 whose rank 1 never comes: rank 0 gives up at the rendezvous after --timeout,
    # in one line that names it, and exits 4 (the process-group start obeys --timeout).
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    argv = [a for a in base(t) if not a.startswith("--out")] + [f"--out={t}/lonely", "--dp=2", "--timeout=2"]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(Path(launch.__file__).parents[2] / "scripts" / "train.py"), *argv],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 4 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"minipar: error: rank 0: the process group did not start within --timeout 2 s: the 2 "
                               f"ranks did not all reach the rendezvous at 127.0.0.1:{port}"), lines[0]
    assert time.monotonic() - t0 < 200  # bounded: without the timeout it would wait forever


# `python scripts/train.py --nproc-per-node N ...`: the command line checked once, in this process, then torchrun's
# agent started in it; a mistake is one line and exit 2 instead of torchrun's failure report.


def launcher(t: Path, *args: str):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    script = Path(launch.__file__).parents[2] / "scripts" / "train.py"
    return subprocess.run([sys.executable, str(script), "--nproc-per-node", "2", *base(t), *args], cwd=t,
                          env={**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}, capture_output=True,
                          text=True, timeout=600)


def test_train_py_with_nproc_per_node_refuses_a_bad_layout_in_one_line_and_starts_no_worker(tmp_path):
    proc = launcher(tmp_path, "--tp=3")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("minipar: error: "), proc.stderr
    assert "--tp 3 does not divide" in lines[0] and proc.stdout == "", (lines[0], proc.stdout)  # no worker said a word


def test_train_py_with_nproc_per_node_runs_the_workers_under_torchruns_agent(tmp_path):
    proc = launcher(tmp_path, "--dp=2", "--steps=2", "--warmup=1", "--log-every=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(line.split()[:2] == ["step", "2/2"] for line in proc.stdout.splitlines()), proc.stdout[-3000:]
    assert (tmp_path / "out" / "step_000002").is_dir()  # the workers ran the whole run and saved it
    assert not (tmp_path / "out" / ".lock").exists()  # rank 0 of the workers took --out's lock, and gave it back
