"""The course's pictures are drawn from the library's numbers (scripts/draw_figures.py), and the
numbers they show say what the chapters say. The loss-parity figure trains six runs and is left to
the script; its claim (every layout equals one process) is tests/test_loss_parity.py's."""

import importlib.util
from pathlib import Path

import torch

from minipar.context_parallel import zigzag_positions
from minipar.model import get_config
from minipar.planning.estimate import held_bytes
from minipar.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _script():
    spec = importlib.util.spec_from_file_location("draw_figures_script", ROOT / "scripts" / "draw_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_diagrams_are_drawn_as_pngs_under_the_names_the_chapters_link(tmp_path):
    _script().main(["zero", "tp", "zigzag", "experts", "--out", str(tmp_path)])
    for name in ("03_zero_stages", "04_tp_column_row", "05_zigzag", "07_expert_all_to_all"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG, name
        chapter = next((ROOT / "docs").glob(f"{name[:2]}_*.md")).read_text()
        assert f"(img/{name}.png)" in chapter, name
        assert (ROOT / "docs" / "img" / f"{name}.png").exists(), name  # the committed picture
    assert "(img/09_loss_parity.png)" in (ROOT / "docs" / "09_4d.md").read_text()


def test_what_the_zero_figure_shows_is_the_16_psi_split_stage_by_stage():
    c = get_config("small")
    psi = sum(p.numel() for p in __import__("minipar.model", fromlist=["Llama"]).Llama(c, 0).parameters())
    held = [held_bytes(c, TrainConfig(model="small", dp=4, zero=s, precision="bf16-mixed")) for s in range(4)]
    # no ZeRO: 2 + 2 + 12 bytes a parameter (6 = the bf16 weight and its fp32 master), and DataParallel's flat
    # all-reduce buffers, 2 more (the footnote says so)
    assert held[0] == {"params": 6 * psi, "grads": 2 * psi + 2 * psi, "optimizer": 8 * psi}
    # stage 3 holds 1/4 of everything, up to the padding of each bucket to a multiple of 4
    assert 16 * psi / 4 <= sum(held[3].values()) < 16 * psi / 4 + 16 * 4 * 64


def test_zigzag_gives_every_rank_the_same_causal_work_and_contiguous_does_not():
    cp, s = 4, 16
    zig = [sum(int(q) + 1 for q in zigzag_positions(r, cp, s)) for r in range(cp)]
    contiguous = [sum(q + 1 for q in range(r * s // cp, (r + 1) * s // cp)) for r in range(cp)]
    assert zig == [34] * 4 and contiguous == [10, 26, 42, 58]  # the numbers the figure prints
    assert sorted(torch.cat([zigzag_positions(r, cp, s) for r in range(cp)]).tolist()) == list(range(s))
