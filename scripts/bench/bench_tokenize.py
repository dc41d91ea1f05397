"""Peak memory of tokenising one large text file (minipar.run.data.prepare), in a fresh child process.

    .venv/bin/python scripts/bench/bench_tokenize.py --mb 50                      # this checkout's minipar
    .venv/bin/python scripts/bench/bench_tokenize.py --mb 10 --code ../old-clone  # another checkout's

The corpus is the standard library's top-level modules, concatenated and repeated into a single
file of --mb megabytes (made once under --work). The child imports minipar from --code, trains the
BPE (--vocab-size) and writes the token file into a fresh cache; the parent reads the child's peak
resident set from getrusage(RUSAGE_CHILDREN) and prints it with the time taken.
"""

import argparse
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = "import sys; from minipar.run.data import prepare; prepare(sys.argv[1], int(sys.argv[2]), sys.argv[3])"


def corpus(work: Path, mb: int) -> Path:
    """One file of `mb` MB of Python source, the standard library's modules repeated."""
    path = work / f"stdlib_{mb}mb.txt"
    if not path.exists() or path.stat().st_size < mb * 2**20:
        modules = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        work.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            while out.tell() < mb * 2**20:
                for m in modules:
                    out.write(m.read_text(encoding="utf-8"))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=50, help="size of the corpus file")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--code", default=str(ROOT), help="the checkout whose minipar tokenises")
    p.add_argument("--work", default="/tmp/minipar-bench-tokenize", help="where the corpus and cache go")
    args = p.parse_args()
    text, cache = corpus(Path(args.work), args.mb), Path(args.work) / "cache"
    shutil.rmtree(cache, ignore_errors=True)  # tokenise afresh
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, str(text), str(args.vocab_size), str(cache)], check=True,
                   cwd=args.code, env={"PYTHONPATH": str(Path(args.code).resolve()), "PATH": "/usr/bin:/bin"})
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # Linux: KiB -> GiB
    tokens = sum(f.stat().st_size for f in cache.rglob("tokens.bin")) // 2
    print(f"{text.stat().st_size / 2**20:.1f} MB of text -> {tokens:,} tokens (vocab {args.vocab_size}) in "
          f"{seconds:.1f} s; peak resident memory {peak:.2f} GiB ({args.code})")


if __name__ == "__main__":
    main()
