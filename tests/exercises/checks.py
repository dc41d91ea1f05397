"""The checkers of the exercises in docs/exercises/, by number: chapter.exercise.

    problems = check("1.1", "docs/exercises/ex1_1_ring_all_reduce.py")   # [] when it passes

Each checker runs a student's file against the single-device computation (the implement
exercises, on 2-4 gloo ranks through tests/harness.py's `run_ranks` where they communicate) or
against the library's own figure (predict and explore), and returns what differs, as lines a
student can act on. A skeleton's NotImplementedError, or `ANSWER = None`, becomes one line, "not
implemented yet" or "not answered yet". A predict exercise (check_common.Predict) asks about a
variant drawn from a seed, which `asked` prints. The checkers live in check_common.py (what they share),
checks_collectives.py, checks_layers.py, checks_answers_0_3.py / checks_answers_4_9.py,
checks_fault_tolerance.py (chapter 10b's) and checks_capstone.py (the capstone's, 11.1).
"""

from __future__ import annotations

import checks_answers_0_3 as a03
import checks_answers_4_9 as a49
import checks_capstone as capstone
import checks_collectives as comm
import checks_fault_tolerance as ft
import checks_layers as layers
import checks_muon as muon
from check_common import EXERCISES_DIR, Predict

# number, chapter.exercise (10b.1: chapter 10b's first): (the student's file, its kind, what the student
# writes, its checker, roughly how long)
EXERCISES = {
    "0.1": ("ex0_1_count_activations.py", "implement", "count the bytes autograd keeps for backward",
            layers.check_activation_bytes, "20 min"),
    "0.2": ("ex0_2_predict_activations.py", "predict", "the small model's activations at your b x s tokens",
            a03.check_predict_small_activations, "10 min"),
    "0.3": ("ex0_3_explore_seq_len.py", "explore", "the sequence length at which activations outgrow the model states",
            a03.check_explore_seq_len, "10 min"),
    "1.1": ("ex1_1_ring_all_reduce.py", "implement", "a ring all-reduce from send/recv, and its bytes",
            comm.check_ring, "45 min"),
    "1.2": ("ex1_2_predict_ring_bytes.py", "predict", "bytes a rank sends: all-reduce, reduce-scatter, all-gather",
            a03.check_predict_ring_bytes, "10 min"),
    "1.3": ("ex1_3_explore_alpha_beta.py", "explore", "latency vs bandwidth: when the ring's time doubles",
            a03.check_explore_alpha_beta, "15 min"),
    "2.1": ("ex2_1_dp_hooks.py", "implement", "data-parallel gradient averaging with hooks",
            comm.check_dp_hooks, "20 min"),
    "2.2": ("ex2_2_bucketed_all_reduce.py", "implement", "a bucketed all-reduce, launched as buckets fill",
            comm.check_buckets, "40 min"),
    "2.3": ("ex2_3_explore_bucket_size.py", "explore", "bucket size vs all-reduces per step",
            a03.check_explore_bucket_size, "10 min"),
    "3.1": ("ex3_1_zero1.py", "implement", "a ZeRO-1 step: Adam on this rank's slice", comm.check_zero1, "30 min"),
    "3.2": ("ex3_2_predict_zero3_bytes.py", "predict", "what ZeRO-3 sends per step at your dp",
            a03.check_predict_zero3_bytes,
            "10 min"),
    "3.3": ("ex3_3_explore_zero3_dp.py", "explore", "the dp at which ZeRO-3 fits 8b on 80 GB",
            a03.check_explore_zero3_dp, "10 min"),
    "4.1": ("ex4_1_column_row.py", "implement", "column-parallel then row-parallel linear",
            layers.check_column_row, "30 min"),
    "4.2": ("ex4_2_explore_tp_bytes.py", "explore", "tp vs bytes per rank", a49.check_explore_tp_bytes, "10 min"),
    "4.3": ("ex4_3_predict_tp_weights.py", "predict", "the weights one rank holds at your tp",
            a49.check_predict_tp_weights, "10 min"),
    "4c.1": ("ex4c_1_owner_step.py", "implement", "Muon's step with one owner per matrix (two all-to-alls)",
             muon.check_owner_step, "40 min"),
    "4c.2": ("ex4c_2_predict_gather_bytes.py", "predict", "what Muon's gather adds under ZeRO-1 at your dp",
             muon.check_predict_gather_bytes, "10 min"),
    "5.1": ("ex5_1_zigzag.py", "implement", "zigzag chunks for context parallelism", layers.check_zigzag, "10 min"),
    "5.2": ("ex5_2_predict_causal_work.py", "predict", "the causal imbalance of a contiguous cut at your cp",
            a49.check_predict_causal_work, "10 min"),
    "5.3": ("ex5_3_explore_cp_bytes.py", "explore", "cp vs ring-attention bytes per rank", a49.check_explore_cp_bytes,
            "10 min"),
    "6.1": ("ex6_1_gpipe.py", "implement", "GPipe's action list", layers.check_gpipe, "10 min"),
    "6.2": ("ex6_2_predict_bubble.py", "predict", "GPipe's bubble at your p and m", a49.check_predict_bubble, "10 min"),
    "6.3": ("ex6_3_predict_activations.py", "predict", "your rank's activations, GPipe vs 1F1B",
            a49.check_predict_activations, "10 min"),
    "6.4": ("ex6_4_explore_microbatches.py", "explore", "micro-batches vs bubble", a49.check_explore_microbatches,
            "10 min"),
    "7.1": ("ex7_1_moe_all_to_all.py", "implement", "top-k routing with all-to-all", layers.check_moe_all_to_all,
            "45 min"),
    "7.2": ("ex7_2_predict_all_to_all.py", "predict", "the all-to-all bytes of a step at your ep",
            a49.check_predict_all_to_all,
            "15 min"),
    "7.3": ("ex7_3_explore_ep_bytes.py", "explore", "ep vs all-to-all bytes per rank", a49.check_explore_ep_bytes,
            "10 min"),
    "8.1": ("ex8_1_model_state_bytes.py", "implement", "model states per rank under ZeRO 0-3",
            layers.check_model_state_bytes, "15 min"),
    "8.2": ("ex8_2_explore_plan.py", "explore", "which layout the planner picks for 8b in your case",
            a49.check_explore_plan, "15 min"),
    "8.3": ("ex8_3_predict_compute_time.py", "predict", "the compute seconds of your 8b step",
            a49.check_predict_compute_time, "15 min"),
    "9.1": ("ex9_1_predict_mesh_groups.py", "predict", "your rank's groups in a 32-rank 4D mesh",
            a49.check_predict_mesh_groups, "10 min"),
    "9.2": ("ex9_2_explore_16_ranks.py", "explore", "the 16-rank layout that sends the least within your memory budget",
            a49.check_explore_16_ranks, "10 min"),
    "9.3": ("ex9_3_predict_cross_node.py", "predict", "which groups cross nodes, for your mesh and node size",
            a49.check_predict_cross_node,
            "10 min"),
    "10b.1": ("ex10b_1_predict_lost_gpu_hours.py", "predict", "GPU-hours lost to failures: checkpoint-restart vs "
              "replica groups", ft.check_predict_lost_gpu_hours, "10 min"),
    "10b.2": ("ex10b_2_commit_step.py", "implement", "a step committed only if every replica group can",
              ft.check_commit_step, "25 min"),
    "11.1": ("ex11_1_selective_recompute.py", "implement", "recompute the cheap ops, keep the matmuls (the capstone)",
             capstone.check_selective_recompute, "45 min"),
}


def check(number: str, path=None, run_ranks=None, seed: int | None = None) -> list[str]:
    """The problems of the student's file for exercise `number` ([] when it passes). `seed`: a predict
    exercise's variant, instead of the file's SEED (or the user name's)."""
    name, _, _, checker, _ = EXERCISES[number]
    try:
        if isinstance(checker, Predict):
            return checker(path or EXERCISES_DIR / name, run_ranks, seed)
        return checker(path or EXERCISES_DIR / name, run_ranks)
    except (TimeoutError, RuntimeError) as e:  # a hang, or a rank that died (the pool is rebuilt)
        return [str(e).splitlines()[0] + " (does every send have its recv, of the same size, on every rank?)"]


def asked(number: str, path=None, seed: int | None = None) -> str | None:
    """A predict exercise's variant and its question, for `make exercise` to print first; else None."""
    name, _, _, checker, _ = EXERCISES[number]
    return checker.asked(path or EXERCISES_DIR / name, seed) if isinstance(checker, Predict) else None
