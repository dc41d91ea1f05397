"""Exercise 8.2, an answer: read off scripts/tools/plan.py for the variant, as the student does, here by
asking the planner's own functions about the four layouts (fits, then the fewest seconds)."""


def formula(v):  # a function of the variant (v.gpus, v.seq_len, v.global_batch)
    from minipar.layout import Layout
    from minipar.model import get_config
    from minipar.planning.estimate import peak_bytes
    from minipar.planning.planner import Cluster, step_time

    k = v.gpus // 8
    layouts = {"A": dict(dp=8 * k, zero=3), "B": dict(dp=4 * k, cp=2, zero=3), "C": dict(dp=k, tp=8, sp=True, zero=1),
               "D": dict(dp=2 * k, pp=4, zero=1)}
    c, timed = get_config("8b"), {}
    for letter, layout in layouts.items():
        cfg = Layout(model="8b", vocab_size=c.vocab_size, seq_len=v.seq_len, global_batch=v.global_batch,
                     micro_batch=1, dtype="bfloat16", **layout)
        if peak_bytes(c, cfg) <= Cluster(v.gpus).usable:
            timed[letter] = step_time(c, cfg, Cluster(v.gpus))["total"]
    return min(timed, key=timed.get)


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 'C'
