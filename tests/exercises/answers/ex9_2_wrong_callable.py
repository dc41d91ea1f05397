"""Exercise 9.2, wrong: the reference's formula as a function of the variant, which the checker would run: a
prediction is a value written out, and code that computes it is refused."""


def ANSWER(v):  # noqa: N802 - a function of the variant (v.seq_len, v.budget_mib)
    from minipar.layout import Layout
    from minipar.model import get_config
    from minipar.planning.estimate import peak_bytes
    from minipar.planning.traffic import bytes_sent

    layouts = {"A": dict(dp=16), "B": dict(dp=16, zero=3), "C": dict(dp=8, tp=2, sp=True),
               "D": dict(dp=4, tp=2, pp=2, sp=True), "E": dict(dp=2, tp=2, pp=2, cp=2, sp=True, zero=1),
               "F": dict(dp=1, tp=4, pp=2, cp=2, sp=True)}
    c, sends = get_config("small", vocab_size=256), {}
    for letter, layout in layouts.items():
        cfg = Layout(model="small", vocab_size=256, seq_len=v.seq_len, global_batch=16, micro_batch=1,
                     dtype="float64", **layout)
        if peak_bytes(c, cfg) <= v.budget_mib * 2**20:
            sends[letter] = max(sum(bytes_sent(c, cfg, r).values()) for r in range(cfg.pp))
    return min(sends, key=sends.get)
