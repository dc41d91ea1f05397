"""Data, from files to token files: the corpus, the tokenizer, and one pass that tokenises.

The default corpus is the Python standard library's own source (the top-level modules of the
running interpreter's `Lib/`): several megabytes of real text that exists on every machine that
can run minipar, with no download. `--data PATH` takes your own text file or folder instead, or
token files in nanoGPT's format (`.bin`: a bare array of uint16 or uint32 ids, `--token-dtype`),
which are read where they lie. A file that cannot be read, is not UTF-8 text, or is not a whole
number of ids is refused by name before any process group starts (ops/preflight.check_data),
never skipped.

Preparation runs once per corpus and tokenizer (cached under a key of the files' names, sizes and
times, and the tokenizer), streaming, so memory stays bounded whatever the corpus's size:

    text files --(pieces of ~64K characters)---> a BPE trained from that iterator, or --tokenizer
               --(a few pieces per encode)------> tokens.bin (uint16/uint32, appended to)
                                                  each file's ids, then <|endoftext|>
    .bin files --(scanned in blocks: the id count, the largest id)--> read in place

The tokenizer goes into each checkpoint, so a resumed run encodes with the same ids even when the
cache is gone. batches.py cuts the token files into documents, held-out documents and windows.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import shutil
import sysconfig
from itertools import chain, islice
from pathlib import Path

import numpy as np

from minipar.run.paths import InputError, regular_file, regular_if_present

EOT = "<|endoftext|>"
DEFAULT_CACHE = Path.home() / ".cache" / "minipar"
PIECE = 1 << 16  # characters per piece of text: memory follows this, not the corpus
BLOCK = 1 << 24  # ids per block when a token file is scanned
CUT = re.compile(r".*\S(?= )", re.S)  # the longest prefix that ends on a non-space before a space


class DataError(ValueError):
    """Missing or unusable data; the message says what to do."""


def default_corpus() -> list[Path]:
    """The top-level modules of the Python standard library, in a fixed order."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def find_files(path: str | None) -> list[Path]:
    """The corpus's files, in a fixed order. A folder is walked recursively (hidden names left
    out); a folder that cannot be listed or an entry that is no file (a broken link) is named."""
    if path is None:
        return default_corpus()
    p = Path(path).expanduser()
    if not p.is_dir():  # a file, or what regular_file names: missing, a loop, a FIFO
        try:
            return [regular_file(p, f"--data {path}")]
        except InputError as e:
            raise DataError(str(e)) from None
    files, seen = [], {str(p): {os.path.realpath(p)}}  # each folder walked: the real folders above it

    def refuse(e: OSError):
        raise DataError(f"--data: cannot read the folder {e.filename} ({e.strerror})")
    for folder, dirs, names in os.walk(p, onerror=refuse, followlinks=True):  # as rglob did
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for d in dirs:  # a link back to a folder above it would be walked forever
            real = os.path.realpath(Path(folder) / d)
            if real in seen[folder]:
                raise DataError(f"--data: {Path(folder) / d} links back to {real}, a folder it is in (a symlink "
                                f"loop): remove the link")
            seen[os.path.join(folder, d)] = seen[folder] | {real}
        for f in (Path(folder) / n for n in names if not n.startswith(".")):
            if not f.is_file():
                raise DataError(f"--data: {f} is not a file (a broken link?): remove it or point it at one")
            files.append(f)
    if not files:
        raise DataError(f"--data {path}: the folder holds no files")
    return sorted(files)


def are_token_files(path: str | None, files: list[Path]) -> bool:
    """Whether --data is nanoGPT-style .bin token files (all of them) rather than text."""
    kinds = {f.suffix == ".bin" for f in files}
    if len(kinds) > 1:
        raise DataError(f"--data {path} mixes .bin token files with text files: give a folder of one kind")
    return kinds == {True}


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


def corpus_key(files: list[Path], tag) -> str:
    """A hash of the files' names, sizes and times, and `tag` (what turns them into ids)."""
    h = hashlib.sha256(f"v1 vocab={tag}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def data_key(data: str | None, vocab_size: int, token_dtype: str = "uint16") -> str:
    """The corpus's fingerprint: checkpoints keep it, so a resume sees changed data. (For text
    trained on with its own BPE it is also the name of the cache folder.)"""
    files = find_files(data)
    return corpus_key(files, f"{vocab_size} {token_dtype}" if are_token_files(data, files) else vocab_size)


def content_hash(files: list[Path], whole: int = 1 << 24, blocks: int = 64, block: int = 1 << 16) -> str:
    """What the files hold, for the cache (corpus_key sees only names, sizes and times: a file
    rewritten with the same size and time would reuse stale ids). A file up to `whole` bytes is
    hashed whole; a larger one by `blocks` blocks spread evenly over it, its first and last
    among them (a change that touches none of them goes unseen)."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            if size <= whole:
                h.update(fh.read())
                continue
            for i in range(blocks):
                fh.seek((size - block) * i // (blocks - 1))
                h.update(fh.read(block))
    return h.hexdigest()[:16]


def cached(out: Path, files: list[Path]) -> bool:
    """Whether the cache folder `out` holds the tokens of these files as they are now. A stale one
    (a file rewritten in place, or a cache from before contents were kept) is removed."""
    if not (out / "meta.json").exists():
        return False
    if json.loads((out / "meta.json").read_text()).get("content") == content_hash(files):
        return True
    shutil.rmtree(out, ignore_errors=True)  # ours to rebuild: the same name, new contents
    return False


def file_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()[:16]


def read_tokenizer(path: str | Path, separator: bool = False):
    """A Hugging Face tokenizer.json. separator: give it <|endoftext|> (one more id) if it has none,
    since text documents are joined with it."""
    from tokenizers import Tokenizer

    if Path(path).expanduser().exists() and not Path(path).expanduser().is_file():  # a FIFO would block forever
        raise DataError(f"--tokenizer {path} is not a regular file: give a tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(regular_if_present(path, f"--tokenizer {path}")))  # a FIFO would block
    except InputError:
        raise
    except Exception as e:  # tokenizers raises a bare Exception: a missing file, bad JSON
        raise DataError(f"--tokenizer {path}: cannot load it as a Hugging Face tokenizer.json "
                        f"({str(e).splitlines()[0][:200]})") from None
    if separator and tok.token_to_id(EOT) is None:
        tok.add_special_tokens([EOT])
    return tok


def check_encodes(tok, path) -> None:
    """Refuse a tokenizer that cannot encode any text (a word-level model with no unknown token
    fails on the first word it lacks, halfway through tokenising): one probe with rare characters."""
    try:
        tok.encode("minipar-probe \u2603\u00e9\u4e2d\U0001f600 \x00q", add_special_tokens=False)
    except Exception as e:  # tokenizers raises a bare Exception
        raise DataError(f"--tokenizer {path} cannot encode every text ({str(e).splitlines()[0][:120]}): its model "
                        f"has no unknown token; give one that has, or a byte-level BPE") from None


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE (GPT-2's scheme) trained on the corpus itself, with HF tokenizers, from
    an iterator of texts: it counts words as they come, never holding the corpus."""
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


def text_pieces(f: Path, size: int = PIECE):
    """A text file in pieces of about `size` characters, each cut just before a space that follows
    a non-space. Pre-tokenizers of the GPT-2 family (ours, GPT-2's, Llama 3's) split there anyway,
    so the pieces encode to exactly the file's ids; text with no such space for `size` characters
    is cut where it stands. Bytes are read in blocks and decoded as they come."""
    decoder, carry = codecs.getincrementaldecoder("utf-8")(), ""
    try:
        with open(f, "rb") as fh:
            while block := fh.read(size):
                carry += decoder.decode(block)
                if len(carry) >= size:
                    cut = CUT.match(carry)
                    end = cut.end() if cut else len(carry)
                    yield carry[:end]
                    carry = carry[end:]
            carry += decoder.decode(b"", final=True)
    except (UnicodeDecodeError, OSError):
        check_text(f)  # raises DataError, naming the file (and its first bad byte)
        raise
    if carry:
        yield carry


def encode_files(tok, files: list[Path], eot: int, batch: int = 16):
    """Each file's ids, then <|endoftext|>, as numpy arrays of a few pieces' worth at a time."""
    for f in files:
        pieces = text_pieces(f)
        while chunk := list(islice(pieces, batch)):
            for enc in tok.encode_batch(chunk, add_special_tokens=False):
                yield np.asarray(enc.ids, dtype=np.int64)
        yield np.array([eot], dtype=np.int64)


def prepare(data: str | None, vocab_size: int, cache_dir: str | Path = DEFAULT_CACHE, tokenizer: str | None = None,
            token_dtype: str = "uint16") -> Path:
    """Tokenise the corpus once; return the folder with meta.json, tokenizer.json and tokens.bin
    (token files: meta.json, and tokenizer.json if given; the ids stay where they are). One process
    per machine calls it (launch.load_data: local rank 0) while the others wait; the folder is built
    under a temporary name and renamed into place, so an interrupted run leaves no half-written cache."""
    files, cache = find_files(data), Path(cache_dir).expanduser()
    fingerprint = data_key(data, vocab_size, token_dtype)
    if are_token_files(data, files):
        out = cache / corpus_key(files, f"bin {token_dtype} {file_hash(tokenizer) if tokenizer else '-'}")
        if cached(out, files):
            return out
        tok = read_tokenizer(tokenizer) if tokenizer else None
        meta = scan_token_files(files, token_dtype, tok, tokenizer)
        return publish(out, meta | {"fingerprint": fingerprint, "source": data, "content": content_hash(files)}, tok)
    out = cache / corpus_key(files, vocab_size)  # the BPE trained on this corpus
    if tokenizer is not None and not same_bytes(out / "tokenizer.json", tokenizer):  # else: that very tokenizer
        out = cache / corpus_key(files, f"tokenizer {file_hash(tokenizer)}")
    if cached(out, files):
        return out
    corpus = chain.from_iterable(map(text_pieces, files))  # pieces of text, file after file, as they are read
    tok = read_tokenizer(tokenizer, separator=True) if tokenizer else train_tokenizer(corpus, vocab_size)
    dtype, eot = np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32, tok.token_to_id(EOT)
    check_encodes(tok, tokenizer)
    tmp, count = building(out), 0
    try:
        with open(tmp / "tokens.bin", "wb") as sink:  # appended to: the ids are never all in memory
            for ids in encode_files(tok, files, eot):
                sink.write(ids.astype(dtype).tobytes())
                count += len(ids)
    except OSError as e:  # a full disk: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"--cache-dir {cache}: cannot write the tokenised data ({e.strerror or e}); free space or "
                        f"choose another --cache-dir") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta = {"num_tokens": count, "vocab_size": tok.get_vocab_size(), "dtype": np.dtype(dtype).name,
            "parts": ["tokens.bin"], "eot": eot, "files": len(files), "source": data or "python-stdlib",
            "fingerprint": fingerprint, "content": content_hash(files)}
    return publish(out, meta, tok)


def scan_token_files(files: list[Path], dtype: str, tok, tokenizer: str | None) -> dict:
    """What meta.json says of token files, read through memory maps a block at a time. Ids outside
    the tokenizer's vocabulary are refused; without one, the vocabulary is the largest id + 1."""
    parts, count, top = [], 0, (-1, "")
    for f in files:
        size, width = f.stat().st_size, np.dtype(dtype).itemsize
        if size % width:
            raise DataError(f"--data: {f} is {size} bytes, not a whole number of {dtype} ids: check --token-dtype")
        try:
            ids = np.memmap(f, dtype=dtype, mode="r") if size else np.empty(0, dtype)
        except OSError as e:
            raise DataError(f"--data: cannot read {f} ({e.strerror})") from None
        for a in range(0, len(ids), BLOCK):
            top = max(top, (int(ids[a:a + BLOCK].max()), str(f)))
        parts += [str(f.resolve())] if size else []
        count += len(ids)
    vocab = tok.get_vocab_size() if tok else top[0] + 1
    if top[0] >= vocab:
        raise DataError(f"--data: {top[1]} holds token id {top[0]}, outside --tokenizer {tokenizer}'s {vocab} ids: "
                        f"check --token-dtype, or give the data's own tokenizer")
    return {"num_tokens": count, "vocab_size": vocab, "dtype": dtype, "parts": parts,
            "eot": tok.token_to_id(EOT) if tok else None, "files": len(files)}


def same_bytes(a: Path, b: str | Path) -> bool:
    return a.exists() and a.read_bytes() == Path(b).expanduser().read_bytes()


def building(out: Path) -> Path:
    """A fresh temporary folder beside `out` (a plain mkdir: the mode follows the umask)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{os.getpid()}-{out.name}"
    tmp.mkdir(exist_ok=True)
    return tmp


def publish(out: Path, meta: dict, tok=None) -> Path:
    """Write meta.json (and the tokenizer) into the temporary folder, then rename it into place.
    A full disk is one line naming --cache-dir, and leaves nothing half-written."""
    tmp = building(out)
    try:
        if tok is not None:
            tok.save(str(tmp / "tokenizer.json"))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.rename(tmp, out)
    except OSError as e:
        if not (out / "meta.json").exists():  # else another process finished first: keep theirs
            raise DataError(f"--cache-dir {out.parent}: cannot write the tokenised data ({e.strerror or e}); free "
                            f"space or choose another --cache-dir") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
    return out
