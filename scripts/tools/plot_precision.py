"""The fp32 and bf16-mixed loss curves of one run, side by side (chapter 3b shows
docs/img/03_fp32_vs_bf16_loss.png).

    .venv/bin/python scripts/tools/plot_precision.py                 # 300 steps: runs/03_fp32_vs_bf16_loss.png
    .venv/bin/python scripts/tools/plot_precision.py --steps 100 --out /tmp/curves.png

--out must be a new file (one that exists is refused: nothing is drawn over); copy it into
docs/img/ to update the course's.

Runs scripts/train.py twice on its built-in data (the Python standard library's text), the same
seed, model and batches, once with `--precision fp32` and once with `--precision bf16-mixed`, reads
the two JSON logs and plots the losses, with their relative difference below. Chapter:
docs/03b_mixed_precision.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from minipar.ops.args import refusals  # noqa: E402
from minipar.run.paths import InputError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--model", "tiny", "--vocab-size", "512", "--seq-len", "64", "--global-batch", "8", "--micro-batch", "8",
       "--lr", "3e-3", "--warmup", "10", "--log-every", "50", "--no-wandb"]


def losses(precision: str, steps: int, folder: Path) -> list[float]:
    """The per-step losses of scripts/train.py in `precision`, from its JSON log."""
    log = folder / f"{precision}.jsonl"
    argv = [sys.executable, str(ROOT / "scripts" / "train.py"), *RUN, "--precision", precision,
            "--steps", str(steps), "--out", str(folder / precision), "--log-json", str(log),
            "--cache-dir", str(folder / "cache")]
    done = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"scripts/train.py --precision {precision} failed:\n{done.stderr[-2000:]}")
    return [json.loads(line)["loss"] for line in log.read_text().splitlines() if "loss" in json.loads(line)]


def plot(fp32: list[float], mixed: list[float], out: Path) -> None:
    steps = range(1, len(fp32) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(3, 1))
    top.plot(steps, fp32, label="fp32", linewidth=1.2)
    top.plot(steps, mixed, label="bf16-mixed (fp32 masters)", linewidth=1.2, linestyle="--")
    top.set_ylabel("training loss")
    top.set_title("tiny Llama on one CPU process: fp32 and bf16-mixed")
    top.legend()
    bottom.plot(steps, [(b - a) / a for a, b in zip(fp32, mixed)], color="gray", linewidth=0.8)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel("(bf16 - fp32) / fp32")
    bottom.set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
    fig.savefig(tmp, dpi=110, format="png")
    try:
        os.link(tmp, out)  # unlike a rename, a link never replaces a file made there meanwhile
    finally:
        tmp.unlink()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "03_fp32_vs_bf16_loss.png", help="a new file")
    args = parser.parse_args(argv)
    with refusals():
        if os.path.lexists(args.out.expanduser()):
            raise InputError(f"--out {args.out} exists: nothing is drawn over it; give a new file (or move it away)")
    with tempfile.TemporaryDirectory() as tmp:
        fp32, mixed = (losses(p, args.steps, Path(tmp)) for p in ("fp32", "bf16-mixed"))
    plot(fp32, mixed, args.out)
    worst = max(abs(b - a) / a for a, b in zip(fp32, mixed))
    print(f"{args.out}: {len(fp32)} steps, final loss fp32 {fp32[-1]:.4f}, bf16-mixed {mixed[-1]:.4f}; "
          f"largest relative difference {worst:.3%}")


if __name__ == "__main__":
    main()
