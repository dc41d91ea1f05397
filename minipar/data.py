"""Data: text -> a trained BPE tokenizer -> one memory-mapped file of tokens -> batches.

The default corpus is the Python standard library's own source (the top-level modules of the
running interpreter's `Lib/`): several megabytes of real text that exists on every machine that
can run minipar, with no download. `--data PATH` takes your own text file or directory instead;
every file in it must be UTF-8 text, and one that is not is refused by name before any process
group starts (check_data), never skipped.

Preparation runs once per corpus (cached under a key of the files' names, sizes and times):

    texts --(train byte-level BPE, HF tokenizers)--> tokenizer.json
          --(encode, join with <|endoftext|>)-----> tokens.bin  (uint16/uint32, memory-mapped)

Batches. The token stream is cut into windows of seq_len + 1 tokens; a window gives the input
(its first seq_len tokens) and the target (the same, shifted by one). The windows are shuffled
by a permutation drawn from the seed, one per epoch. A run is a walk through that fixed order:
optimizer step t uses the next `global_batch` windows, and data-parallel rank r takes rows
[r*G/dp, (r+1)*G/dp) of them. The only state is how many windows were consumed, which the
checkpoint stores, so a resumed run reads exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOT = "<|endoftext|>"
DEFAULT_CACHE = Path.home() / ".cache" / "minipar"


class DataError(ValueError):
    """Missing or unusable data; the message says what to do."""


def default_corpus() -> list[Path]:
    """The top-level modules of the Python standard library, in a fixed order."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def find_files(path: str | None) -> list[Path]:
    if path is None:
        return default_corpus()
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"--data {path}: no such file or directory (give a text file or a folder of them)")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    if not files:
        raise DataError(f"--data {path}: the folder holds no files")
    return files


def check_text(f: Path, chunk: int = 1 << 20) -> int:
    """The size of a file that is UTF-8 text, read in chunks. Anything else is refused, naming the
    file and the offset of its first bad byte: one binary file in a folder is a mistake to fix,
    not something to skip silently."""
    decoder, pos, block = codecs.getincrementaldecoder("utf-8")(), 0, b""
    try:
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                decoder.decode(block)
                pos += len(block)
            decoder.decode(b"", final=True)  # a character cut off at the end
        return pos
    except UnicodeDecodeError as e:  # e.object: the bytes the decoder held back, then this block
        at = pos - (len(e.object) - len(block)) + e.start
        raise DataError(f"--data: {f} is not UTF-8 text (byte {at} is {e.object[e.start]:#04x}): "
                        f"convert or remove it") from None
    except OSError as e:
        raise DataError(f"--data: cannot read {f} ({e.strerror})") from None


def check_data(path: str | None, seq_len: int, vocab_size: int, cache_dir: str | Path) -> None:
    """Before any process group: every file is UTF-8 text and there is enough of it for one window
    of seq_len + 1 tokens (byte-level BPE makes at most one token per byte, plus one <|endoftext|>
    per file). The standard library, and a corpus tokenised before, are not read again."""
    files = find_files(path)
    if path is None or (Path(cache_dir).expanduser() / corpus_key(files, vocab_size) / "meta.json").exists():
        return
    size = sum(check_text(f) for f in files)
    if size + len(files) <= seq_len:
        raise DataError(f"--data {path} holds {size} bytes of text, fewer than one window of --seq-len {seq_len} "
                        f"+ 1 tokens: give more text or a shorter --seq-len")


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            check_text(f)  # raises DataError, naming the file and its first bad byte
            raise
    return texts


def corpus_key(files: list[Path], vocab_size: int) -> str:
    h = hashlib.sha256(f"v1 vocab={vocab_size}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def data_key(data: str | None, vocab_size: int) -> str:
    """The name of the corpus's cache folder: checkpoints keep it, so a resume sees changed data."""
    return corpus_key(find_files(data), vocab_size)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme) trained on the corpus itself, with HF tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def prepare(data: str | None, vocab_size: int, cache_dir: str | Path = DEFAULT_CACHE) -> Path:
    """Tokenise the corpus once; return the folder with tokenizer.json, tokens.bin, meta.json.

    Call it on one process per machine (train.py uses local rank 0) while the others wait. The
    folder is built under a temporary name and renamed into place, so an interrupted run never
    leaves a half-written cache behind.
    """
    files = find_files(data)
    out = Path(cache_dir).expanduser() / corpus_key(files, vocab_size)
    if (out / "meta.json").exists():
        return out
    texts = read_texts(files)
    tok = train_tokenizer(texts, vocab_size)
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    dtype = np.uint16 if tok.get_vocab_size() < 2**16 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{os.getpid()}-{out.name}"  # a plain mkdir: the mode follows the umask
    tmp.mkdir(exist_ok=True)
    np.asarray(ids, dtype=dtype).tofile(tmp / "tokens.bin")
    tok.save(str(tmp / "tokenizer.json"))
    meta = {"num_tokens": len(ids), "vocab_size": tok.get_vocab_size(), "dtype": np.dtype(dtype).name,
            "files": len(files), "source": data or "python-stdlib"}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        os.rename(tmp, out)
    except OSError:  # another process finished first: keep theirs
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return out


@dataclass
class TokenData:
    """Windows of a token file in a seeded order. See the module docstring."""

    folder: Path
    seq_len: int
    seed: int

    def __post_init__(self):
        meta = json.loads((self.folder / "meta.json").read_text())
        self.vocab_size = meta["vocab_size"]
        self.tokens = np.memmap(self.folder / "tokens.bin", dtype=meta["dtype"], mode="r")
        self.num_windows = (len(self.tokens) - 1) // self.seq_len
        if self.num_windows < 1:
            raise DataError(
                f"the corpus has {len(self.tokens)} tokens, fewer than one window of --seq-len "
                f"{self.seq_len} + 1: use more text or a shorter sequence"
            )
        self._perms: dict[int, torch.Tensor] = {}

    def window_ids(self, start: int, count: int) -> list[int]:
        """Indices of windows start, start+1, ... of the run's order (epochs wrap around)."""
        ids = []
        for k in range(start, start + count):
            epoch, i = divmod(k, self.num_windows)
            if epoch not in self._perms:
                g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._perms = {epoch: torch.randperm(self.num_windows, generator=g)}
            ids.append(int(self._perms[epoch][i]))
        return ids

    def fetch(self, window_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [len(window_ids), seq_len] int64."""
        s = self.seq_len
        rows = np.stack([self.tokens[w * s : w * s + s + 1] for w in window_ids]).astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

    def rank_batch(self, consumed: int, global_batch: int, dp_rank: int, dp: int):
        """This data-parallel rank's rows of the global batch that starts after `consumed` windows."""
        per_rank = global_batch // dp
        ids = self.window_ids(consumed, global_batch)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return self.fetch(ids)


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))
