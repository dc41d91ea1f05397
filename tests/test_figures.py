"""The course's pictures are drawn from the library's numbers (scripts/tools/draw_figures.py), and the
numbers they show say what the chapters say. The loss-parity figure trains six runs and is left to
the script; its claim (every layout equals one process) is tests/test_loss_parity.py's. The Muon/AdamW
loss figure's function is run here on a tiny run of 3 steps (the figure itself: 300 steps, minutes)."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import torch
from test_train import CORPUS

from minipar.collectives import ring_bytes_sent
from minipar.context_parallel import zigzag_positions
from minipar.model import Llama, get_config
from minipar.planning.estimate import activation_bytes, held_bytes, layer_activation_bytes, replayed_bytes
from minipar.planning.planner import Cluster, plan
from minipar.planning.traffic import bytes_sent
from minipar.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _script():
    spec = importlib.util.spec_from_file_location("draw_figures_script", ROOT / "scripts" / "tools" / "draw_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_diagrams_are_drawn_as_pngs_under_the_names_the_chapters_link(tmp_path):
    _script().main(["memory", "ring", "buckets", "zero", "tp", "muon", "zigzag", "experts", "layouts", "zeropp",
                    "roofline", "mesh", "commit", "recompute", "--out", str(tmp_path)])
    for name in ("00_one_device_memory", "01_ring_bytes", "02_gradient_buckets", "03_zero_stages", "04_tp_column_row",
                 "04c_newton_schulz", "05_zigzag", "07_expert_all_to_all", "08_layouts_8b", "03c_zeropp_hops",
                 "08_roofline", "09_mesh_nodes", "10b_commit_timeline", "11_memory_per_layer"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG, name
        chapter = next((ROOT / "docs").glob(f"{name.split('_')[0]}_*.md")).read_text()
        assert f"(img/{name}.png)" in chapter, name
        assert (ROOT / "docs" / "img" / f"{name}.png").exists(), name  # the committed picture
    assert "(img/09_loss_parity.png)" in (ROOT / "docs" / "09_4d.md").read_text()
    assert "(img/04c_loss_muon_adamw.png)" in (ROOT / "docs" / "04c_muon.md").read_text()
    assert (ROOT / "docs" / "img" / "04c_loss_muon_adamw.png").exists()


def test_the_zero_figure_shows_stage_1_holding_every_gradient_at_the_end_of_backward_and_stage_2_not():
    c = get_config("small")
    psi = sum(p.numel() for p in Llama(c, 0).parameters())
    held = [_script().zero_held(s) for s in range(4)]  # what the figure draws: {moment: {kind: bytes}}
    end, after = "end of backward", "after reduce-scatter"

    def shard(nbytes_per_param):  # a 1/4 slice of every bucket, each padded to a multiple of 4
        return range(nbytes_per_param * psi // 4, nbytes_per_param * psi // 4 + nbytes_per_param * 4 * 64)

    # no ZeRO: 2 + 2 + 12 bytes a parameter (6 = the bf16 weight and its fp32 master), and DataParallel's flat
    # all-reduce buffers, 2 more (the footnote says so); the same at both moments
    for moment in (end, after):
        assert held[0][moment] == {"params": 6 * psi, "grads": 2 * psi + 2 * psi, "optimizer": 8 * psi}
    # stage 1 (the paper's P_os): every bf16 gradient at the end of backward, its slice after the reduce-scatter
    assert held[1][end]["grads"] == 2 * psi and held[1][after]["grads"] in shard(2)
    assert held[1][end]["params"] - 2 * psi in shard(4) and held[1][end]["optimizer"] in shard(8)
    # stage 2 (P_os+g) never holds every gradient: its slice at both moments, so at the end of backward it
    # holds 3/4 of 2 Psi less than stage 1 (what the earlier figure, drawn after the reduce-scatter, hid)
    assert held[2][end] == held[2][after] and held[2][end]["grads"] in shard(2)
    saved = sum(held[1][end].values()) - sum(held[2][end].values())
    assert 2 * psi * 3 // 4 - 2 * 4 * 64 < saved <= 2 * psi * 3 // 4
    # stage 3 (P_os+g+p) holds 1/4 of everything
    assert held[3][end] == held[3][after] and sum(held[3][end].values()) in shard(16)


def test_the_newton_schulz_figure_draws_muons_own_iteration_lifting_the_large_singular_values_near_1():
    from minipar.muon import newton_schulz

    built, after = _script().ns_spectra()
    assert list(after) == [0, 1, 3, 5]
    m_scaled = after[0]
    assert torch.allclose(m_scaled, built / built.norm(), rtol=1e-9)  # the matrix's own spectrum, scaled
    big = built >= 0.1  # those above a tenth of the largest: the chapter's [0.7, 1.2]
    assert after[5][big].min() >= 0.7 and after[5].max() <= 1.21  # "about": 1.202 here, rounded in bf16
    assert (after[1] < after[3]).all() and (after[3][~big] < after[5][~big]).all()  # each step lifts the small ones
    assert newton_schulz is _script().newton_schulz  # the library's iteration, not a copy


def test_zigzag_gives_every_rank_the_same_causal_work_and_contiguous_does_not():
    cp, s = 4, 16
    zig = [sum(int(q) + 1 for q in zigzag_positions(r, cp, s)) for r in range(cp)]
    contiguous = [sum(q + 1 for q in range(r * s // cp, (r + 1) * s // cp)) for r in range(cp)]
    assert zig == [34] * 4 and contiguous == [10, 26, 42, 58]  # the numbers the figure prints
    assert sorted(torch.cat([zigzag_positions(r, cp, s) for r in range(cp)]).tolist()) == list(range(s))


def test_the_one_device_figure_draws_the_estimators_bytes_and_only_1b_fits_in_80_gb():
    held = _script().one_device_memory()
    for name in ("1b", "8b", "70b"):
        c = get_config(name)
        cfg = TrainConfig(model=name, seq_len=4096, micro_batch=1, global_batch=1, precision="bf16-mixed")
        assert held[name] == {**held_bytes(c, cfg), "activations": activation_bytes(c, cfg)}
        psi = c.num_params()
        assert sum(held[name][k] for k in ("params", "grads", "optimizer")) == 16 * psi  # 2 + 2 + 12 a parameter
    assert [sum(h.values()) <= 80e9 for h in held.values()] == [True, False, False]
    assert round(sum(held["8b"].values()) / 2**30) == 146 and round(sum(held["70b"].values()) / 2**30) == 1174


def test_the_ring_figure_draws_ring_bytes_sent_2_n_minus_1_over_n_and_half_of_it():
    script = _script()
    curves, ns = script.ring_curves(), list(script.RING_N)
    for op, curve in curves.items():
        assert curve == [ring_bytes_sent(op, script.RING_PAYLOAD, n) / script.RING_PAYLOAD for n in ns], op
    assert curves["all_reduce"] == [2 * (n - 1) / n for n in ns]
    assert curves["all_gather"] == curves["reduce_scatter"] == [(n - 1) / n for n in ns]


def test_the_buckets_figure_draws_data_parallels_buckets_and_the_estimators_all_reduce_bytes():
    rows = _script().gradient_buckets()
    psi = sum(p.numel() for p in Llama(get_config("small"), 0).parameters())
    assert sum(r[1] for r in rows) == 4 * psi  # every float32 gradient, once
    assert rows[0][0] == "lm_head.weight .. lm_head.weight" and rows[-1][0].endswith("tok_emb.weight")
    assert all(r[1] >= 2**20 for r in rows[:-1])  # each closes once it reaches bucket_mb = 1
    cfg = TrainConfig(model="small", dp=4, dtype="float32", bucket_mb=1.0)
    count = ring_bytes_sent("all_reduce", 8, 4)  # train_step's count of real targets
    assert sum(r[2] for r in rows) + count == bytes_sent(get_config("small"), cfg)["dp/all_reduce"]


def test_the_layouts_figure_draws_what_the_planner_weighs_and_its_pick():
    script = _script()
    points, limit = script.layout_points(), script.PLANNED["cluster"].usable
    fits, too_big = plan("8b", Cluster(8), seq_len=8192, global_batch=1024)
    assert (sum(p[1] <= limit for p in points), sum(p[1] > limit for p in points)) == (len(fits), too_big)
    assert sorted(p[1] for p in points if p[1] <= limit) == sorted(ch.memory for ch in fits)
    best = min((p for p in points if p[1] <= limit), key=lambda p: p[2])
    assert best[0] == fits[0].flags() and (best[1], best[2]) == (fits[0].memory, fits[0].time["total"])


def test_the_zeropp_figure_draws_the_estimators_bytes_and_all_three_options_cut_the_cross_node_ones_4x():
    from minipar.layout import Layout
    from minipar.planning.estimate_zeropp import bucket_messages

    bars = _script().zeropp_bars()
    plain, every = bars["ZeRO-3"], bars["qwz,hpz,qgz"]
    c = get_config("8b")
    unit = 2 * c.dim * c.dim + 2 * c.dim * c.n_kv_heads * c.head_dim + 3 * c.dim * c.ffn_dim
    cfg = Layout(model="8b", dp=16, zero=3, ranks_per_node=8, precision="bf16-mixed")
    assert plain["inside a node"] + plain["across nodes"] == sum(b for _, b in bucket_messages(unit, cfg, 2, 2))
    assert bars["hpz"]["across nodes"] < plain["across nodes"] < bars["hpz"]["inside a node"] + 1e12
    assert plain["across nodes"] / every["across nodes"] > 4  # ZeRO++'s claim: 4x fewer cross-node bytes


def test_the_roofline_figure_draws_the_roofline_scripts_numbers_on_either_side_of_the_ridges():
    points, h100 = _script().roofline_points(), Cluster(8)
    hbm = dict(points["hbm"])
    ridge = h100.flops / h100.memory_bandwidth
    assert hbm["q T=1"] < 2 < ridge < hbm["q T=512"] < hbm["q T=4,096"] == 4096 / 3  # decode left, training right
    nvlink, ib = dict(points["nvlink"]), dict(points["infiniband"])
    assert set(ib) == {"1b tp 16", "8b tp 16", "70b tp 16"}  # tp 16 crosses nodes
    assert all(v < h100.flops / h100.inter_bandwidth for v in ib.values())  # all communication-bound
    assert nvlink["1b tp 8"] < h100.flops / h100.intra_bandwidth < nvlink["8b tp 8"]


def test_the_mesh_figure_keeps_tp_cp_and_dp_inside_a_node_and_sends_pp_across():
    from minipar.mesh import MeshLayout

    script = _script()
    layout, cells = MeshLayout(**script.MESH), script.mesh_cells()
    node = {rank: n for rank, n, _ in cells}
    assert sorted(node.values()) == [0] * 8 + [1] * 8
    for dim in ("tp", "cp", "dp"):
        assert all(len({node[r] for r in group}) == 1 for group in layout.groups(dim)), dim
    assert all(len({node[r] for r in group}) == 2 for group in layout.groups("pp"))


def test_the_commit_timeline_never_takes_the_survivor_back_and_heals_the_restarted_group_before_it_steps():
    segments = _script().commit_timeline(steps=8, kill=3)
    survivor = [(start, end, step) for group, start, end, what, step in segments
                if group == 0 and what in ("step", "redo")]
    assert [step for *_, step in survivor] == list(range(1, 9))  # every step committed once, in order
    in_flight = [(g, w) for g, *_, w, step in segments if step == 3][:2]
    assert in_flight == [(0, "not committed"), (1, "not committed")]
    assert all(a[1] <= b[0] for a, b in zip(survivor, survivor[1:]))
    restarted = [what for group, *_, what, _ in segments if group == 1]
    restarted = restarted[restarted.index("restart"):]
    assert restarted[:3] == ["restart", "heal", "step"]  # back, healed from group 0's state, then stepping
    alone = [end - start for start, end, step in survivor if 3 <= step and not any(
        g == 1 and w == "step" and s == step for g, *_, w, s in segments)]
    assert alone and all(t == 2 for t in alone)  # P = 1 of R = 2 groups: a step takes R / P as long
    ours = [what for group, *_, what, _ in segments if group == 0]
    assert ours[ours.index("not committed"):][:3] == ["not committed", "stall", "redo"]


def test_the_recompute_figure_draws_the_estimators_bytes_and_the_chapters_table():
    numbers = _script().recompute_bytes()
    c = get_config("70b")
    pick = TrainConfig(model="70b", tp=2, pp=8, cp=4, sp=True, zero=1, seq_len=8192, global_batch=1024, micro_batch=1,
                       dtype="bfloat16", vocab_size=c.vocab_size)
    flags = {"none": {}, "selective": dict(recompute_selective=True), "the MLPs": dict(recompute_mlp=True),
             "whole layers": dict(recompute=True)}
    assert [name.split(" (")[0] for name in numbers] == list(flags)
    chapter = (ROOT / "docs" / "11_capstone.md").read_text()
    for (name, v), mode in zip(numbers.items(), flags.values()):
        cfg = replace(pick, **mode)
        assert v["kept"] == layer_activation_bytes(c, cfg) and v["rank"] == activation_bytes(c, cfg), name
        assert v["replayed"] == (replayed_bytes(c, cfg) if "recompute_selective" in mode else 0), name
        assert f"{v['kept'] / 2**20:.1f} MiB" in chapter and f"{v['rank'] / 2**30:.1f} GiB" in chapter, name
    kept = [v["kept"] for v in numbers.values()]
    assert kept[3] < kept[1] < kept[2] < kept[0]  # selective keeps less than the MLPs' recompute, and redoes less:
    redone = [v["redone"] for v in numbers.values()]
    assert redone[0] == 0 < redone[1] < redone[2] < redone[3]


def test_the_muon_loss_figure_trains_one_run_under_each_optimizer_on_the_same_tokens(tmp_path):
    # the figure's function on a tiny run of 3 steps (the figure itself: 300 steps of the small model)
    run = ["--model", "tiny", "--data", CORPUS, "--vocab-size", "512", "--seq-len", "32", "--global-batch", "8",
           "--micro-batch", "4", "--steps", "3", "--no-wandb", "--cache-dir", str(tmp_path / "cache")]
    (tmp_path / "fig").mkdir()
    curves = _script().muon_loss(tmp_path / "fig", run)
    assert (tmp_path / "fig" / "04c_loss_muon_adamw.png").read_bytes()[:8] == PNG
    (tokens, adamw, no_muon), (same_tokens, muon, muon_lrs) = curves["AdamW"], curves["Muon"]
    assert tokens == same_tokens == [256, 512, 768]  # 8 sequences of 32 tokens a step
    assert adamw[0] == muon[0] and adamw[1] != muon[1]  # the same model and batch; the first steps differ
    assert no_muon == [None] * 3 and all(lr > 0 for lr in muon_lrs)  # Muon's param group, in the Muon run only
